"""Plain-torch reference of RMSNorm (+ residual add) + FP8 quantization: the single statement of
its math, composed of the norm's reference and the quantization's.

Unfused: y = rms_norm(x) (or add_rms_norm), rounded to x.dtype as the model produces it; then an
    amax reduction over y and a scale-and-cast pass writing float8_e4m3fn codes.
Fused:   one pass; the math is the same, in this order:

    y         = rms_norm_reference(x, ...) / add_rms_norm_reference(x, residual, ...)   in x.dtype
    q, scales = quant_fp8_reference(y, quant)                  (common/fp8.py: static, per_token,
                                                                per_group, UE8M0 scales)
"""

from __future__ import annotations

import torch

from fusion_passes.lowering.common.fp8 import QuantFP8, quant_fp8_reference
from fusion_passes.lowering.rms_norm.reference import (
    RMSNormForm,
    add_rms_norm_reference,
    rms_norm_reference,
)


def rms_norm_quant_fp8_reference(
    x: torch.Tensor, weight: torch.Tensor, norm: RMSNormForm, quant: QuantFP8
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference RMSNorm + FP8 quantization: returns (codes, scales)."""
    return quant_fp8_reference(rms_norm_reference(x, weight, *norm), quant)


def add_rms_norm_quant_fp8_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, norm: RMSNormForm, quant: QuantFP8
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference residual add + RMSNorm + FP8 quantization: returns (codes, scales,
    new_residual = x + residual)."""
    y, new_residual = add_rms_norm_reference(x, residual, weight, *norm)
    return (*quant_fp8_reference(y, quant), new_residual)
