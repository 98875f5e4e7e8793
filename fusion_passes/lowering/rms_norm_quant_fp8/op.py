"""The canonical ops ``fusion_passes::rms_norm_quant_fp8`` and ``fusion_passes::add_rms_norm_quant_fp8``.

Unfused (what FP8 serving runs after each norm):
    y, r = add_rms_norm(x, residual, ...); scale = amax(|y|) / 448 (per token or per group of G);
    q = fp8_e4m3fn(clamp(y / scale, -448, 448))       (or with a given static scale)
Fused:
    q, scale, r = add_rms_norm_quant_fp8(x, residual, weight, *norm, *quant)
    with norm = (eps, weight_offset, cast_before_weight)             rms_norm.reference.RMSNormForm
         quant = QuantFP8's fields (scheme, scale, group_size, ...)    common.fp8.QuantFP8

The math lives in ``reference``; this module only registers the ops: the reference is the
implementation on every device, and CUDA tensors go to the Triton kernel of ``triton``. The
static scheme returns a copy of its scale: a custom op's outputs may not alias its inputs.
"""

from __future__ import annotations

import torch

from fusion_passes.lowering.common.direct_launch import register_launcher
from fusion_passes.lowering.common.fp8 import FP8_MAX, MIN_SCALE, QuantFP8
from fusion_passes.lowering.rms_norm.reference import RMSNormForm, check_rms_norm_args
from fusion_passes.lowering.rms_norm_quant_fp8.reference import (
    add_rms_norm_quant_fp8_reference,
    rms_norm_quant_fp8_reference,
)


@torch.library.custom_op("fusion_passes::rms_norm_quant_fp8", mutates_args=())
def rms_norm_quant_fp8(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    weight_offset: float,
    cast_before_weight: bool,
    scheme: str,
    scale: torch.Tensor | None = None,
    group_size: int = 128,
    scale_ue8m0: bool = False,
    floor_site: str = "scale",
    floor: float = MIN_SCALE,
    apply: str = "divide",
    pow2: str = "none",
    saturate: bool = True,
    fp8_max: float = FP8_MAX,
    scale_math: str = "fp32",
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm + FP8 quantization: returns (codes, scales); see rms_norm_quant_fp8_reference."""
    norm = RMSNormForm(eps, weight_offset, cast_before_weight)
    quant = QuantFP8(scheme, scale, group_size, scale_ue8m0, floor_site, floor, apply, pow2, saturate, fp8_max,
                     scale_math)  # fmt: skip
    check_rms_norm_args(x, weight, weight_offset, cast_before_weight)
    q, scales = rms_norm_quant_fp8_reference(x, weight, norm, quant)
    return q.contiguous(), quant.own(scales)


@torch.library.custom_op("fusion_passes::add_rms_norm_quant_fp8", mutates_args=())
def add_rms_norm_quant_fp8(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    weight_offset: float,
    cast_before_weight: bool,
    scheme: str,
    scale: torch.Tensor | None = None,
    group_size: int = 128,
    scale_ue8m0: bool = False,
    floor_site: str = "scale",
    floor: float = MIN_SCALE,
    apply: str = "divide",
    pow2: str = "none",
    saturate: bool = True,
    fp8_max: float = FP8_MAX,
    scale_math: str = "fp32",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Residual add + RMSNorm + FP8 quantization: returns (codes, scales, new_residual)."""
    norm = RMSNormForm(eps, weight_offset, cast_before_weight)
    quant = QuantFP8(scheme, scale, group_size, scale_ue8m0, floor_site, floor, apply, pow2, saturate, fp8_max,
                     scale_math)  # fmt: skip
    check_rms_norm_args(x, weight, weight_offset, cast_before_weight, residual)
    q, scales, new_residual = add_rms_norm_quant_fp8_reference(x, residual, weight, norm, quant)
    return q.contiguous(), quant.own(scales), new_residual.contiguous()


# The CUDA kernels double as direct launchers (`wrap` given when Inductor inlines the launch).
@rms_norm_quant_fp8.register_kernel("cuda")
@register_launcher(torch.ops.fusion_passes.rms_norm_quant_fp8.default)
def _rms_norm_quant_fp8_cuda(x, weight, eps, weight_offset, cast_before_weight, *quant, wrap=None):
    from fusion_passes.lowering.rms_norm_quant_fp8.triton import rms_norm_quant_fp8_triton

    quant = QuantFP8(*quant)
    q, scales, _ = rms_norm_quant_fp8_triton(
        x, weight, RMSNormForm(eps, weight_offset, cast_before_weight), quant, wrap=wrap
    )
    return q, quant.own(scales)


@add_rms_norm_quant_fp8.register_kernel("cuda")
@register_launcher(torch.ops.fusion_passes.add_rms_norm_quant_fp8.default)
def _add_rms_norm_quant_fp8_cuda(x, residual, weight, eps, weight_offset, cast_before_weight, *quant, wrap=None):
    from fusion_passes.lowering.rms_norm_quant_fp8.triton import rms_norm_quant_fp8_triton

    quant = QuantFP8(*quant)
    q, scales, new_residual = rms_norm_quant_fp8_triton(
        x, weight, RMSNormForm(eps, weight_offset, cast_before_weight), quant, residual, wrap=wrap
    )
    return q, quant.own(scales), new_residual


@rms_norm_quant_fp8.register_fake
def _rms_norm_quant_fp8_fake(x, weight, eps, weight_offset, cast_before_weight, *quant):
    return QuantFP8(*quant).fake_outputs(x)


@add_rms_norm_quant_fp8.register_fake
def _add_rms_norm_quant_fp8_fake(x, residual, weight, eps, weight_offset, cast_before_weight, *quant):
    q, scales = QuantFP8(*quant).fake_outputs(x)
    return q, scales, torch.empty_like(x, memory_format=torch.contiguous_format)
