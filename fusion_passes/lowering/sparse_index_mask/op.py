"""The canonical op ``fusion_passes::sparse_index_mask``: DeepSeek V3.2's index mask from its scores.

Unfused (transformers' DeepseekV32 indexer and attention, traced): ``topk(index_scores, k)`` (a
radix sort of each row on CUDA) and the scatter of its indices into a mask of ones: 2 kernels per
layer with stock Inductor, the sort alone 21.7 us per layer at batch 1 and 1040 cached tokens on
one H200.
Fused:
    mask = sparse_index_mask(index_scores, k)     # bool, True outside each row's top k
one kernel, no indices (and the zero fill of its small work buffer where a row is split over
several programs: a decode step's few rows on a GPU with SMs to spare). The math (and the order it gives equal scores) lives in ``reference``.

And ``fusion_passes::sparse_attention_mask``: the additive mask SDPA makes of the model's
``attention_mask & ~index_mask`` (0 kept, -inf dropped, [B, 1, S, T]), written by the same kernel's
last pass instead of the bool mask, so the elementwise kernel that combines and converts the two
masks goes:
    mask = sparse_attention_mask(index_scores, k, attention_mask, dtype, fill)    # fill: -inf, or cuDNN's -65504
or, for the causal mask of a decode step over a full static cache, from its first position alone
(the kernel compares each position with it; no mask is read or built):
    mask = sparse_attention_mask(index_scores, k, None, dtype, fill, causal_first=first)
"""

from __future__ import annotations

import torch

from fusion_passes.lowering.common.direct_launch import register_launcher
from fusion_passes.lowering.common.ops import op_from_reference
from fusion_passes.lowering.sparse_index_mask.reference import (
    check_sparse_attention_mask_args,
    check_sparse_index_mask_args,
    sparse_attention_mask_reference,
    sparse_index_mask_reference,
)

sparse_index_mask = op_from_reference("sparse_index_mask", sparse_index_mask_reference, check=check_sparse_index_mask_args)


@sparse_index_mask.register_kernel("cuda")
@register_launcher(torch.ops.fusion_passes.sparse_index_mask.default)
def _sparse_index_mask_cuda(index_scores, k, wrap=None):
    from fusion_passes.lowering.sparse_index_mask.triton import sparse_index_mask_triton

    return sparse_index_mask_triton(index_scores, k, wrap=wrap)


@sparse_index_mask.register_fake
def _sparse_index_mask_fake(index_scores, k):
    check_sparse_index_mask_args(index_scores, k)
    return torch.empty(index_scores.shape, dtype=torch.bool, device=index_scores.device)


sparse_attention_mask = op_from_reference(
    "sparse_attention_mask", sparse_attention_mask_reference, check=check_sparse_attention_mask_args
)


@sparse_attention_mask.register_kernel("cuda")
@register_launcher(torch.ops.fusion_passes.sparse_attention_mask.default)
def _sparse_attention_mask_cuda(index_scores, k, attention_mask, dtype, fill, causal_first=None, wrap=None):
    from fusion_passes.lowering.sparse_index_mask.triton import sparse_index_mask_triton

    return sparse_index_mask_triton(index_scores, k, attention_mask, dtype, fill, causal_first=causal_first, wrap=wrap)


@sparse_attention_mask.register_fake
def _sparse_attention_mask_fake(index_scores, k, attention_mask, dtype, fill, causal_first=None):
    check_sparse_attention_mask_args(index_scores, k, attention_mask, dtype, fill, causal_first)
    b, s, t = index_scores.shape
    return torch.empty((b, 1, s, t), dtype=dtype, device=index_scores.device)
