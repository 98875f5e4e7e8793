"""FP8 activation quantization: the canonical op ``fusion_passes::quant_fp8``."""
