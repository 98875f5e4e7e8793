"""The canonical op ``fusion_passes::moe_sort_by_expert``: a MoE layer's dispatch prep.

Unfused (transformers' grouped_mm experts, traced): sort of the flat expert ids, histc (a fill and
a histogram kernel), cumsum, and the inverse permutation's scatter: 4 kernels per MoE layer with
stock Inductor (its sort kernel takes the scatter; 10 from 1024 pairs, 27 from 8192).
Fused:
    sorted_ids, perm, offsets, inv_perm = moe_sort_by_expert(expert_ids, num_experts)
one kernel. And ``moe_sort_gather``: the same, with the gather of each pair's hidden state into the
sorted order that the first grouped GEMM reads (``hidden_states[perm // top_k]``, a sentinel's row
zero), Inductor's kernel after the sort:
    sorted_ids, perm, offsets, inv_perm, gathered = moe_sort_gather(expert_ids, num_experts, hidden_states, top_k)
The math (and why a stable sort may stand in for the model's unstable one) lives in ``reference``.
"""

from __future__ import annotations

import torch

from fusion_passes.lowering.common.direct_launch import register_launcher
from fusion_passes.lowering.common.ops import op_from_reference
from fusion_passes.lowering.moe_sort_by_expert.reference import (
    check_moe_sort_by_expert_args,
    check_moe_sort_gather_args,
    moe_sort_by_expert_reference,
    moe_sort_gather_reference,
)

moe_sort_by_expert = op_from_reference(
    "moe_sort_by_expert", moe_sort_by_expert_reference, check=check_moe_sort_by_expert_args
)


@moe_sort_by_expert.register_kernel("cuda")
@register_launcher(torch.ops.fusion_passes.moe_sort_by_expert.default)
def _moe_sort_by_expert_cuda(expert_ids, num_experts, wrap=None):
    from fusion_passes.lowering.moe_sort_by_expert.triton import moe_sort_by_expert_triton

    return moe_sort_by_expert_triton(expert_ids, num_experts, wrap=wrap)


@moe_sort_by_expert.register_fake
def _moe_sort_by_expert_fake(expert_ids, num_experts):
    check_moe_sort_by_expert_args(expert_ids, num_experts)
    s, device = expert_ids.shape[0], expert_ids.device
    return (
        torch.empty(s, dtype=expert_ids.dtype, device=device),
        torch.empty(s, dtype=torch.int64, device=device),
        torch.empty(num_experts, dtype=torch.int32, device=device),
        torch.empty(s, dtype=torch.int64, device=device),
    )


moe_sort_gather = op_from_reference("moe_sort_gather", moe_sort_gather_reference, check=check_moe_sort_gather_args)


@moe_sort_gather.register_kernel("cuda")
@register_launcher(torch.ops.fusion_passes.moe_sort_gather.default)
def _moe_sort_gather_cuda(expert_ids, num_experts, hidden_states, top_k, wrap=None):
    from fusion_passes.lowering.moe_sort_by_expert.triton import moe_sort_gather_triton

    return moe_sort_gather_triton(expert_ids, num_experts, hidden_states, top_k, wrap=wrap)


@moe_sort_gather.register_fake
def _moe_sort_gather_fake(expert_ids, num_experts, hidden_states, top_k):
    check_moe_sort_gather_args(expert_ids, num_experts, hidden_states, top_k)
    sorted_ids, perm, offsets, inv_perm = _moe_sort_by_expert_fake(expert_ids, num_experts)
    gathered = hidden_states.new_empty((expert_ids.shape[0], hidden_states.shape[1]))
    return sorted_ids, perm, offsets, inv_perm, gathered
