"""The canonical op ``fusion_passes::sparse_index_scores``: DeepSeek V3.2's indexer scores.

Unfused (transformers' DeepseekV32Indexer, traced): the key cache transposed and upcast to fp32
(a copy of the cache every layer), an fp32 GEMM of the query heads against it, scale and relu,
and a GEMM that sums the heads with their weights.
Fused:
    index_scores = sparse_index_scores(q, k, weights, scale, weights_scale, keep)   # fp32 [B, S, T]
one kernel reading the cache as it is; the weights' upcast and scale, and the attention mask's
masked_fill of the scores, in its loads and store. The math lives in ``reference``.
"""

from __future__ import annotations

import torch

from fusion_passes.lowering.common.direct_launch import register_launcher
from fusion_passes.lowering.common.ops import op_from_reference
from fusion_passes.lowering.sparse_index_scores.reference import (
    check_sparse_index_scores_args,
    sparse_index_scores_reference,
)

sparse_index_scores = op_from_reference(
    "sparse_index_scores", sparse_index_scores_reference, check=check_sparse_index_scores_args
)


@sparse_index_scores.register_kernel("cuda")
@register_launcher(torch.ops.fusion_passes.sparse_index_scores.default)
def _sparse_index_scores_cuda(q, k, weights, scale, weights_scale=1.0, keep=None, causal_first=None, wrap=None):
    from fusion_passes.lowering.sparse_index_scores.triton import sparse_index_scores_triton

    return sparse_index_scores_triton(q, k, weights, scale, weights_scale, keep, causal_first, wrap=wrap)


@sparse_index_scores.register_fake
def _sparse_index_scores_fake(q, k, weights, scale, weights_scale=1.0, keep=None, causal_first=None):
    check_sparse_index_scores_args(q, k, weights, keep, causal_first)
    return torch.empty((q.shape[0], q.shape[1], k.shape[1]), dtype=torch.float32, device=q.device)
