"""The canonical ops ``fusion_passes::moe_route`` and ``moe_route_grouped``: a MoE layer's top-k
routing (group-limited, DeepSeek V3's, for the second).

Unfused (transformers' routers, traced): softmax (or sigmoid + correction bias), torch's top-k
(and its sort where the router asks for sorted ids), the gather of the selected scores and their
renormalisation: 3-4 kernels per MoE layer.
Fused:
    weights, ids = moe_route(logits, bias, top_k, softmax, renormalize)
    weights, ids = moe_route_grouped(logits, bias, top_k, n_group, topk_group, renormalize, scale)
one kernel each. The math (and the order of equal scores) lives in ``reference``.
"""

from __future__ import annotations

import torch

from fusion_passes.lowering.common.direct_launch import register_launcher
from fusion_passes.lowering.common.ops import op_from_reference
from fusion_passes.lowering.moe_route.reference import (
    check_moe_route_args,
    check_moe_route_grouped_args,
    moe_route_grouped_reference,
    moe_route_reference,
)

moe_route = op_from_reference("moe_route", moe_route_reference, check=check_moe_route_args)


@moe_route.register_kernel("cuda")
@register_launcher(torch.ops.fusion_passes.moe_route.default)
def _moe_route_cuda(logits, bias, top_k, softmax, renormalize, wrap=None):
    from fusion_passes.lowering.moe_route.triton import moe_route_triton

    return moe_route_triton(logits, bias, top_k, softmax, renormalize, wrap=wrap)


@moe_route.register_fake
def _moe_route_fake(logits, bias, top_k, softmax, renormalize):
    check_moe_route_args(logits, bias, top_k, softmax)
    tokens = logits.shape[0]
    return (
        torch.empty((tokens, top_k), dtype=torch.float32, device=logits.device),
        torch.empty((tokens, top_k), dtype=torch.int64, device=logits.device),
    )


moe_route_grouped = op_from_reference(
    "moe_route_grouped", moe_route_grouped_reference, check=check_moe_route_grouped_args
)


@moe_route_grouped.register_kernel("cuda")
@register_launcher(torch.ops.fusion_passes.moe_route_grouped.default)
def _moe_route_grouped_cuda(logits, bias, top_k, n_group, topk_group, renormalize, scale, wrap=None):
    from fusion_passes.lowering.moe_route.triton import moe_route_grouped_triton

    return moe_route_grouped_triton(logits, bias, top_k, n_group, topk_group, renormalize, scale, wrap=wrap)


@moe_route_grouped.register_fake
def _moe_route_grouped_fake(logits, bias, top_k, n_group, topk_group, renormalize, scale):
    check_moe_route_grouped_args(logits, bias, top_k, n_group, topk_group)
    return _moe_route_fake(logits, bias, top_k, False, renormalize)
