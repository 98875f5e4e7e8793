"""The canonical op ``fusion_passes::moe_route_sort``: a MoE layer's top-k routing (moe_route or
moe_route_grouped) and the dispatch prep of its ids (moe_sort_by_expert) in one launch.

Unfused (after the moe_route and moe_sort_by_expert fusions): the route's kernel writes the ids;
the sort's kernel reads them back: 2 launches per MoE layer at decode.
Fused:
    weights, ids, sorted_ids, perm, offsets, inv_perm = moe_route_sort(logits, bias, top_k,
        softmax, renormalize, n_group, topk_group, scale, num_experts)
one launch at decode sizes: each program routes every token again (the T x E scores fit its
registers) and takes its share of the sort's ranks or the offsets. ``moe_route_sort_gather``: the
same and moe_sort_gather's rows (hidden_states[perm // k]), copied by programs that rank their
pairs again. The math lives in ``reference``.
"""

from __future__ import annotations

import torch

from fusion_passes.lowering.common.direct_launch import register_launcher
from fusion_passes.lowering.common.ops import op_from_reference
from fusion_passes.lowering.moe_route_sort.reference import (
    check_moe_route_sort_args,
    check_moe_route_sort_gather_args,
    moe_route_sort_gather_reference,
    moe_route_sort_reference,
)

moe_route_sort = op_from_reference("moe_route_sort", moe_route_sort_reference, check=check_moe_route_sort_args)


@moe_route_sort.register_kernel("cuda")
@register_launcher(torch.ops.fusion_passes.moe_route_sort.default)
def _moe_route_sort_cuda(*args, wrap=None):
    from fusion_passes.lowering.moe_route_sort.triton import moe_route_sort_triton

    return moe_route_sort_triton(*args, wrap=wrap)


@moe_route_sort.register_fake
def _moe_route_sort_fake(logits, bias, top_k, softmax, renormalize, n_group, topk_group, scale, num_experts):
    check_moe_route_sort_args(logits, bias, top_k, softmax, n_group, topk_group, scale, num_experts)
    tokens, device = logits.shape[0], logits.device
    pairs = tokens * top_k
    return (
        torch.empty((tokens, top_k), dtype=torch.float32, device=device),
        torch.empty((tokens, top_k), dtype=torch.int64, device=device),
        torch.empty(pairs, dtype=torch.int64, device=device),
        torch.empty(pairs, dtype=torch.int64, device=device),
        torch.empty(num_experts, dtype=torch.int32, device=device),
        torch.empty(pairs, dtype=torch.int64, device=device),
    )


moe_route_sort_gather = op_from_reference(
    "moe_route_sort_gather", moe_route_sort_gather_reference, check=check_moe_route_sort_gather_args
)


@moe_route_sort_gather.register_kernel("cuda")
@register_launcher(torch.ops.fusion_passes.moe_route_sort_gather.default)
def _moe_route_sort_gather_cuda(*args, wrap=None):
    from fusion_passes.lowering.moe_route_sort.triton import moe_route_sort_triton

    return moe_route_sort_triton(*args, wrap=wrap)


@moe_route_sort_gather.register_fake
def _moe_route_sort_gather_fake(logits, bias, top_k, softmax, renormalize, n_group, topk_group, scale, num_experts,
                                hidden_states):  # fmt: skip
    check_moe_route_sort_gather_args(logits, bias, top_k, softmax, n_group, topk_group, scale, num_experts,
                                     hidden_states)  # fmt: skip
    outputs = _moe_route_sort_fake(logits, bias, top_k, softmax, renormalize, n_group, topk_group, scale, num_experts)
    pairs = logits.shape[0] * top_k
    return (*outputs, torch.empty((pairs, hidden_states.shape[1]), dtype=hidden_states.dtype, device=logits.device))
