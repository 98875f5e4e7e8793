"""WHAT a fusion becomes: the canonical fused ops (torch.library), each with a plain-torch
reference that runs on any device and a Triton kernel that runs on CUDA."""

from fusion_passes.lowering.rms_norm import add_rms_norm, rms_norm

__all__ = ["add_rms_norm", "rms_norm"]
