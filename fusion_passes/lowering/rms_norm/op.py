"""The canonical ops ``fusion_passes::rms_norm`` and ``fusion_passes::add_rms_norm``.

Unfused (what Inductor would otherwise emit around a norm):
    r = x + residual; h = f32(r); n = h * rsqrt(mean(h^2) + eps); y = weight-scale(n)
Fused:
    y, r = add_rms_norm(x, residual, weight, eps, weight_offset, cast_before_weight)

The math lives in ``rms_norm_reference``; this module only registers the ops: the reference is the
implementation on every device, and CUDA tensors go to the Triton kernel of ``rms_norm_triton``.
"""

from __future__ import annotations

import torch

from fusion_passes.lowering.common.direct_launch import register_launcher
from fusion_passes.lowering.rms_norm.reference import (
    add_rms_norm_reference,
    check_rms_norm_args,
    rms_norm_reference,
)


@torch.library.custom_op("fusion_passes::rms_norm", mutates_args=())
def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    weight_offset: float = 0.0,
    cast_before_weight: bool = False,
) -> torch.Tensor:
    """RMSNorm over the last dim; see ``rms_norm_reference`` for the two rounding forms."""
    check_rms_norm_args(x, weight, weight_offset, cast_before_weight)
    # Outputs are contiguous whatever x's strides, as the fake kernel promises Inductor.
    return rms_norm_reference(x, weight, eps, weight_offset, cast_before_weight).contiguous()


@torch.library.custom_op("fusion_passes::add_rms_norm", mutates_args=())
def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    weight_offset: float = 0.0,
    cast_before_weight: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add + RMSNorm: returns (normed, new_residual = x + residual)."""
    check_rms_norm_args(x, weight, weight_offset, cast_before_weight, residual)
    out, new_residual = add_rms_norm_reference(
        x, residual, weight, eps, weight_offset, cast_before_weight
    )
    return out.contiguous(), new_residual.contiguous()


# The CUDA kernels double as direct launchers (`wrap` given when Inductor inlines the launch).
@rms_norm.register_kernel("cuda")
@register_launcher(torch.ops.fusion_passes.rms_norm.default)
def _rms_norm_cuda(x, weight, *norm, wrap=None):
    from fusion_passes.lowering.rms_norm.triton import rms_norm_triton

    return rms_norm_triton(x, weight, *norm, wrap=wrap)[0]


@add_rms_norm.register_kernel("cuda")
@register_launcher(torch.ops.fusion_passes.add_rms_norm.default)
def _add_rms_norm_cuda(x, residual, weight, *norm, wrap=None):
    from fusion_passes.lowering.rms_norm.triton import rms_norm_triton

    return rms_norm_triton(x, weight, *norm, residual=residual, wrap=wrap)


@rms_norm.register_fake
def _rms_norm_fake(x, weight, *norm):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@add_rms_norm.register_fake
def _add_rms_norm_fake(x, residual, weight, *norm):
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    return out, torch.empty_like(x, memory_format=torch.contiguous_format)
