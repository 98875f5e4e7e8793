"""The canonical ops ``fusion_passes::rms_norm_quant_fp8`` and ``fusion_passes::add_rms_norm_quant_fp8``.

Unfused (what FP8 serving runs after each norm):
    y, r = add_rms_norm(x, residual, ...); scale = amax(|y|) / 448 (per token or per group of G);
    q = fp8_e4m3fn(clamp(y / scale, -448, 448))       (or with a given static scale)
Fused:
    q, scale, r = add_rms_norm_quant_fp8(x, residual, weight, eps, weight_offset,
                                         cast_before_weight, scheme, scale, group_size, scale_ue8m0)

The math lives in ``rms_norm_quant_fp8_reference``; this module only registers the ops: the
reference is the implementation on every device, and CUDA tensors go to the Triton kernel of
``rms_norm_quant_fp8_triton``. The static scheme returns a copy of its scale: a custom op's
outputs may not alias its inputs.
"""

from __future__ import annotations

import torch

from fusion_passes.lowering.common.direct_launch import register_launcher
from fusion_passes.lowering.rms_norm_quant_fp8.reference import (
    FP8_DTYPE,
    add_rms_norm_quant_fp8_reference,
    check_quant_args,
    rms_norm_quant_fp8_reference,
)
from fusion_passes.lowering.rms_norm.reference import check_rms_norm_args


def own_scales(scales: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """The scales as a new contiguous tensor: the static scheme hands back the given scale."""
    return scales.clone() if scales is scale else scales.contiguous()


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
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm + FP8 quantization: returns (codes, scales); see rms_norm_quant_fp8_reference."""
    check_rms_norm_args(x, weight, weight_offset, cast_before_weight)
    check_quant_args(x, scheme, scale, group_size, scale_ue8m0)
    q, scales = rms_norm_quant_fp8_reference(
        x, weight, eps, weight_offset, cast_before_weight, scheme, scale, group_size, scale_ue8m0
    )
    return q.contiguous(), own_scales(scales, scale)


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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Residual add + RMSNorm + FP8 quantization: returns (codes, scales, new_residual)."""
    check_rms_norm_args(x, weight, weight_offset, cast_before_weight, residual)
    check_quant_args(x, scheme, scale, group_size, scale_ue8m0)
    q, scales, new_residual = add_rms_norm_quant_fp8_reference(
        x, residual, weight, eps, weight_offset, cast_before_weight, scheme, scale, group_size, scale_ue8m0
    )
    return q.contiguous(), own_scales(scales, scale), new_residual.contiguous()


# The CUDA kernels double as direct launchers (`wrap` given when Inductor inlines the launch).
@rms_norm_quant_fp8.register_kernel("cuda")
@register_launcher(torch.ops.fusion_passes.rms_norm_quant_fp8.default)
def _rms_norm_quant_fp8_cuda(
    x,
    weight,
    eps,
    weight_offset,
    cast_before_weight,
    scheme,
    scale=None,
    group_size=128,
    scale_ue8m0=False,
    *,
    wrap=None,
):
    from fusion_passes.lowering.rms_norm_quant_fp8.triton import rms_norm_quant_fp8_triton

    q, scales, _ = rms_norm_quant_fp8_triton(
        x, weight, eps, weight_offset, cast_before_weight, scheme, scale, group_size, scale_ue8m0, wrap=wrap
    )
    return q, own_scales(scales, scale)


@add_rms_norm_quant_fp8.register_kernel("cuda")
@register_launcher(torch.ops.fusion_passes.add_rms_norm_quant_fp8.default)
def _add_rms_norm_quant_fp8_cuda(
    x,
    residual,
    weight,
    eps,
    weight_offset,
    cast_before_weight,
    scheme,
    scale=None,
    group_size=128,
    scale_ue8m0=False,
    *,
    wrap=None,
):
    from fusion_passes.lowering.rms_norm_quant_fp8.triton import rms_norm_quant_fp8_triton

    q, scales, new_residual = rms_norm_quant_fp8_triton(
        x,
        weight,
        eps,
        weight_offset,
        cast_before_weight,
        scheme,
        scale,
        group_size,
        scale_ue8m0,
        residual,
        wrap=wrap,
    )
    return q, own_scales(scales, scale), new_residual


def fake_quant_outputs(x, scheme, scale, group_size):
    """Empty (codes, scales) of the shapes and dtypes the ops return, contiguous."""
    q = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
    if scheme == "static":
        return q, torch.empty_like(scale, memory_format=torch.contiguous_format)
    groups = x.shape[-1] // group_size if scheme == "per_group" else 1
    return q, x.new_empty((*x.shape[:-1], groups), dtype=torch.float32)


@rms_norm_quant_fp8.register_fake
def _rms_norm_quant_fp8_fake(
    x,
    weight,
    eps,
    weight_offset,
    cast_before_weight,
    scheme,
    scale=None,
    group_size=128,
    scale_ue8m0=False,
):
    return fake_quant_outputs(x, scheme, scale, group_size)


@add_rms_norm_quant_fp8.register_fake
def _add_rms_norm_quant_fp8_fake(
    x,
    residual,
    weight,
    eps,
    weight_offset,
    cast_before_weight,
    scheme,
    scale=None,
    group_size=128,
    scale_ue8m0=False,
):
    q, scales = fake_quant_outputs(x, scheme, scale, group_size)
    return q, scales, torch.empty_like(x, memory_format=torch.contiguous_format)
