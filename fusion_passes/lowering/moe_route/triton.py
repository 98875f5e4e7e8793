"""One Triton kernel for a MoE layer's top-k routing: scores, top-k, gather and renormalisation.

Unfused (stock Inductor on transformers' routers): a softmax (or sigmoid + bias) kernel, torch's
top-k (a radix select, and a bitonic sort where the router asks for sorted ids: Qwen3 / 3.5-MoE),
and a renormalisation kernel: 3-4 kernels per MoE layer, the sort alone 4.0 us at batch 1 inside a
CUDA graph (measured on one H200).
Fused: one program per token holds its E scores in registers (fp32), then k times takes the
largest choice score (ties: the lowest id), records its score and id and masks it out; the k
weights are renormalised by their sum and stored with the ids.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from fusion_passes.lowering.moe_route.reference import check_moe_route_args, check_moe_route_grouped_args


@triton.jit
def _route_topk_kernel(
    logits_ptr,  # *logits.dtype [T, E] (row stride stride_t; E contiguous)
    bias_ptr,  # *bias.dtype [E] (read when HAS_BIAS)
    weights_ptr,  # *fp32 [T, TOP_K] contiguous
    ids_ptr,  # *int64 [T, TOP_K] contiguous
    stride_t,
    E,
    TOP_K: tl.constexpr,
    BLOCK_K: tl.constexpr,  # next_power_of_2(TOP_K)
    BLOCK_E: tl.constexpr,
    SOFTMAX: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    RENORMALIZE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    em = e < E
    x = tl.load(logits_ptr + t * stride_t + e, mask=em, other=float("-inf")).to(tl.float32)
    if SOFTMAX:
        ex = tl.exp(x - tl.max(x, axis=0))
        ex = tl.where(em, ex, 0.0)
        scores = ex / tl.sum(ex, axis=0)
    else:
        scores = 1.0 / (1.0 + tl.exp(-x))
    choice = scores
    if HAS_BIAS:
        choice = scores + tl.load(bias_ptr + e, mask=em, other=0.0).to(tl.float32)
    choice = tl.where(em, choice, float("-inf"))
    ks = tl.arange(0, BLOCK_K)
    weights = tl.zeros((BLOCK_K,), dtype=tl.float32)
    ids = tl.zeros((BLOCK_K,), dtype=tl.int32)
    for k in tl.static_range(TOP_K):
        best = tl.max(choice, axis=0)
        pick = tl.min(tl.where(choice == best, e, BLOCK_E), axis=0)
        w = tl.sum(tl.where(e == pick, scores, 0.0), axis=0)
        weights = tl.where(ks == k, w, weights)
        ids = tl.where(ks == k, pick, ids)
        choice = tl.where(e == pick, float("-inf"), choice)
    if RENORMALIZE:
        weights = weights / tl.sum(weights, axis=0)
    tl.store(weights_ptr + t * TOP_K + ks, weights, mask=ks < TOP_K)
    tl.store(ids_ptr + t * TOP_K + ks, ids.to(tl.int64), mask=ks < TOP_K)


def _outputs(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The logits with contiguous rows, and the (weights fp32, ids int64) [T, top_k] to fill."""
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    tokens = logits.shape[0]
    weights = torch.empty((tokens, top_k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((tokens, top_k), dtype=torch.int64, device=logits.device)
    return logits, weights, ids


def moe_route_triton(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    top_k: int,
    softmax: bool,
    renormalize: bool,
    *,
    wrap: Callable | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, ids) as ``moe_route_reference``."""
    check_moe_route_args(logits, bias, top_k, softmax)
    tokens, experts = logits.shape
    logits, weights, ids = _outputs(logits, top_k)
    kernel = wrap(_route_topk_kernel) if wrap is not None else _route_topk_kernel
    if tokens:
        kernel[(tokens,)](
            logits, bias, weights, ids, logits.stride(0), experts,  # bias None: a constant, never read
            TOP_K=top_k, BLOCK_K=triton.next_power_of_2(top_k), BLOCK_E=triton.next_power_of_2(experts),
            SOFTMAX=softmax, HAS_BIAS=bias is not None,
            RENORMALIZE=renormalize, num_warps=1 if experts <= 256 else 4,
        )
    return weights, ids


@triton.jit
def _route_grouped_topk_kernel(
    logits_ptr,  # *logits.dtype [T, E] (row stride stride_t; E contiguous)
    bias_ptr,  # *bias.dtype [E]
    weights_ptr,  # *fp32 [T, TOP_K] contiguous
    ids_ptr,  # *int64 [T, TOP_K] contiguous
    stride_t,
    scale,  # routed_scaling_factor
    G: tl.constexpr,  # groups
    EG: tl.constexpr,  # experts per group
    TOP_K: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_EG: tl.constexpr,
    BLOCK_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
):
    # Inductor passes Python floats as fp64: the model multiplies in fp32.
    scale = tl.cast(scale, tl.float32)
    t = tl.program_id(0).to(tl.int64)
    gs = tl.arange(0, BLOCK_G)
    js = tl.arange(0, BLOCK_EG)
    m = (gs[:, None] < G) & (js[None, :] < EG)
    e = gs[:, None] * EG + js[None, :]  # expert ids, [group, member]
    x = tl.load(logits_ptr + t * stride_t + e, mask=m, other=0.0).to(tl.float32)
    scores = 1.0 / (1.0 + tl.exp(-x))
    choice = scores + tl.load(bias_ptr + e, mask=m, other=0.0).to(tl.float32)
    choice = tl.where(m, choice, float("-inf"))
    # each group's two largest choice scores, summed (the first of equal maxima taken once)
    top1 = tl.max(choice, axis=1)
    first = tl.min(tl.where(choice == top1[:, None], js[None, :], BLOCK_EG), axis=1)
    top2 = tl.max(tl.where(js[None, :] == first[:, None], float("-inf"), choice), axis=1)
    group_scores = tl.where(gs < G, top1 + top2, float("-inf"))
    kept = gs < 0
    for _ in tl.static_range(TOPK_GROUP):
        best = tl.max(group_scores, axis=0)
        pick = tl.min(tl.where(group_scores == best, gs, BLOCK_G), axis=0)
        kept = kept | (gs == pick)
        group_scores = tl.where(gs == pick, float("-inf"), group_scores)
    choice = tl.where(kept[:, None] & m, choice, float("-inf"))
    ks = tl.arange(0, BLOCK_K)
    weights = tl.zeros((BLOCK_K,), dtype=tl.float32)
    ids = tl.zeros((BLOCK_K,), dtype=tl.int32)
    for k in tl.static_range(TOP_K):
        best = tl.max(tl.max(choice, axis=1), axis=0)
        pick = tl.min(tl.min(tl.where((choice == best) & m, e, G * EG), axis=1), axis=0)
        # padded lanes (member >= EG) alias the next group's ids: masked out
        hit = (e == pick) & m
        w = tl.sum(tl.sum(tl.where(hit, scores, 0.0), axis=1), axis=0)
        weights = tl.where(ks == k, w, weights)
        ids = tl.where(ks == k, pick, ids)
        choice = tl.where(hit, float("-inf"), choice)
    if RENORMALIZE:
        weights = weights / (tl.sum(weights, axis=0) + 1e-20)
    weights = weights * scale
    tl.store(weights_ptr + t * TOP_K + ks, weights, mask=ks < TOP_K)
    tl.store(ids_ptr + t * TOP_K + ks, ids.to(tl.int64), mask=ks < TOP_K)


def moe_route_grouped_triton(
    logits: torch.Tensor,
    bias: torch.Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    renormalize: bool,
    scale: float,
    *,
    wrap: Callable | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, ids) as ``moe_route_grouped_reference``."""
    check_moe_route_grouped_args(logits, bias, top_k, n_group, topk_group)
    tokens, experts = logits.shape
    logits, weights, ids = _outputs(logits, top_k)
    kernel = wrap(_route_grouped_topk_kernel) if wrap is not None else _route_grouped_topk_kernel
    if tokens:
        group = experts // n_group
        kernel[(tokens,)](
            logits, bias, weights, ids, logits.stride(0), scale,
            G=n_group, EG=group, TOP_K=top_k, TOPK_GROUP=topk_group,
            BLOCK_G=triton.next_power_of_2(n_group), BLOCK_EG=triton.next_power_of_2(group),
            BLOCK_K=triton.next_power_of_2(top_k), RENORMALIZE=renormalize,
            num_warps=1 if experts <= 256 else 4,
        )
    return weights, ids
