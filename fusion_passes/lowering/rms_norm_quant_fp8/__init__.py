"""rms_norm_quant_fp8"""
