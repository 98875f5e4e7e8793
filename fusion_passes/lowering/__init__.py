"""WHAT a fusion becomes: the canonical fused ops (torch.library), each with a plain-torch
reference that runs on any device and a Triton kernel that runs on CUDA."""

from fusion_passes.lowering.rms_norm import add_rms_norm, rms_norm
from fusion_passes.lowering.rms_norm_quant_fp8 import add_rms_norm_quant_fp8, rms_norm_quant_fp8

__all__ = ["add_rms_norm", "add_rms_norm_quant_fp8", "rms_norm", "rms_norm_quant_fp8"]
