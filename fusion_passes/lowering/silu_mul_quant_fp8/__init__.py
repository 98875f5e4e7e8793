"""silu_mul_quant_fp8"""
