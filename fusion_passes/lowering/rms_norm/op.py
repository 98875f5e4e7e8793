"""The canonical ops ``fusion_passes::rms_norm`` and ``fusion_passes::add_rms_norm``.

Unfused (what Inductor would otherwise emit around a norm):
    r = x + residual; h = f32(r); n = h * rsqrt(mean(h^2) + eps); y = weight-scale(n)
Fused:
    y, r = add_rms_norm(x, residual, weight, eps, weight_offset, cast_before_weight)

The math lives in ``reference``; this module only registers the ops (``op_from_reference``: the
reference's signature is the op's schema and its implementation on every device), and CUDA
tensors go to the Triton kernel of ``triton``.
"""

from __future__ import annotations

import torch

from fusion_passes.lowering.common.direct_launch import register_launcher
from fusion_passes.lowering.common.ops import op_from_reference
from fusion_passes.lowering.rms_norm.reference import (
    add_rms_norm_reference,
    check_rms_norm_args,
    rms_norm_reference,
)


# RMSNorm over the last dim, and residual add + RMSNorm returning (normed, new_residual = x +
# residual): see rms_norm_reference for the two rounding forms. Outputs are contiguous whatever x's
# strides, as the fake kernels promise Inductor.
rms_norm = op_from_reference(
    "rms_norm", rms_norm_reference, check=check_rms_norm_args, lower_back=True
)
add_rms_norm = op_from_reference(
    "add_rms_norm", add_rms_norm_reference, check=check_rms_norm_args, lower_back=True
)


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
