"""One Triton launch for a MoE layer's routing and dispatch prep at decode (moe_route_sort).

Unfused (the moe_route and moe_sort_by_expert kernels): the route's kernel (a program per token)
writes the ids; the sort's kernel (programs ranking 16 pairs each, and programs counting 64
experts' offsets each) reads them: 2 launches per MoE layer, the second waiting on the first.
Fused: the sort's programs, each first routing every token itself from the logits (the scores of
T tokens x E experts in registers, [T, groups, experts per group]; the ungrouped route is one
group), so no program waits on another:
    weights, ids       the route's (moe_route_triton's math), stored by program 0
    rank[i]            = #{j : e[j] < e[i]} + #{j < i : e[j] == e[i]}    over the flat pairs
    sorted_ids[rank[i]] = e[i];  perm[rank[i]] = i;  inv_perm[i] = rank[i]
    offsets[x]         = #{j : e[j] <= x}
    gathered[rank[i]]  = hidden_states[i // k]       (moe_route_sort_gather: copy programs, each
                                                      ranking its pairs again, as moe_sort_gather's)
Every program repeats the route: O(programs x T x E) work, a few microseconds' worth at up to
ROUTE_SORT_MAX_TOKENS tokens. More tokens take the two kernels.

Store addresses here derive from loaded values and program ids only, never from a value a
@triton.jit helper returns after taking pointers: Inductor's analysis of a direct launch takes
such a value as derived from every argument of the call (see moe_sort_by_expert/triton.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from fusion_passes.lowering.moe_route.triton import moe_route_grouped_triton, moe_route_triton
from fusion_passes.lowering.moe_route_sort.reference import check_moe_route_sort_args, check_moe_route_sort_gather_args
from fusion_passes.lowering.moe_sort_by_expert.triton import (
    COPY_COLUMNS,
    COPY_PAIRS,
    moe_sort_by_expert_triton,
    moe_sort_gather_triton,
    sort_tiles,
)

# The most tokens one launch routes in every program: 16 x 256 experts is 4096 fp32 scores (32 a
# thread at 4 warps), twice (scores and choice scores). Not timed on a GPU.
ROUTE_SORT_MAX_TOKENS = 16


@triton.jit
def _route_tokens(
    x,  # fp32 [BLOCK_T, BLOCK_G, BLOCK_EG] logits, -inf where masked
    bias,  # fp32 [BLOCK_G, BLOCK_EG] correction bias (0 without)
    e,  # [BLOCK_G, BLOCK_EG] expert ids
    m,  # [BLOCK_T, BLOCK_G, BLOCK_EG] valid (token, expert)
    scale,
    G: tl.constexpr, TOP_K: tl.constexpr, TOPK_GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_EG: tl.constexpr, BLOCK_K: tl.constexpr, SOFTMAX: tl.constexpr, GROUPED: tl.constexpr,
    RENORMALIZE: tl.constexpr,
):  # fmt: skip
    """(weights fp32, ids int32) [BLOCK_T, BLOCK_K] of every token: moe_route_triton's and
    moe_route_grouped_triton's math with a token axis (ties: the lowest group, then expert, id)."""
    if SOFTMAX:
        # (padded tokens, all -inf: a max of 0 and a sum of 1, so their rows hold no NaN)
        xmax = tl.max(tl.max(x, axis=2), axis=1)
        xmax = tl.where(xmax == float("-inf"), 0.0, xmax)
        ex = tl.where(m, tl.exp(x - xmax[:, None, None]), 0.0)
        total = tl.sum(tl.sum(ex, axis=2), axis=1)
        scores = ex / tl.where(total > 0.0, total, 1.0)[:, None, None]
    else:
        scores = 1.0 / (1.0 + tl.exp(-x))
    choice = tl.where(m, scores + bias[None, :, :], float("-inf"))
    if GROUPED:
        gs = tl.arange(0, BLOCK_G)[None, :]
        js = tl.arange(0, BLOCK_EG)[None, None, :]
        # each group's two largest choice scores, summed (the first of equal maxima taken once)
        top1 = tl.max(choice, axis=2)
        first = tl.min(tl.where(choice == top1[:, :, None], js, BLOCK_EG), axis=2)
        top2 = tl.max(tl.where(js == first[:, :, None], float("-inf"), choice), axis=2)
        group_scores = tl.where(gs < G, top1 + top2, float("-inf"))
        kept = group_scores != group_scores  # all False (no group score is NaN)
        for _ in tl.static_range(TOPK_GROUP):
            best = tl.max(group_scores, axis=1)
            pick = tl.min(tl.where(group_scores == best[:, None], gs, BLOCK_G), axis=1)
            kept = kept | (gs == pick[:, None])
            group_scores = tl.where(gs == pick[:, None], float("-inf"), group_scores)
        choice = tl.where(kept[:, :, None] & m, choice, float("-inf"))
    ks = tl.arange(0, BLOCK_K)[None, :]
    weights = tl.zeros(ks.shape, dtype=tl.float32) + tl.zeros((x.shape[0], 1), dtype=tl.float32)
    ids = tl.zeros(weights.shape, dtype=tl.int32)
    none = G * BLOCK_EG  # past every expert id
    for k in tl.static_range(TOP_K):
        best = tl.max(tl.max(choice, axis=2), axis=1)
        pick = tl.min(tl.min(tl.where((choice == best[:, None, None]) & m, e[None, :, :], none), axis=2), axis=1)
        hit = (e[None, :, :] == pick[:, None, None]) & m  # padded lanes alias the next group's ids
        w = tl.sum(tl.sum(tl.where(hit, scores, 0.0), axis=2), axis=1)
        weights = tl.where(ks == k, w[:, None], weights)
        ids = tl.where(ks == k, pick[:, None], ids)
        choice = tl.where(hit, float("-inf"), choice)
    if RENORMALIZE:
        total = tl.sum(weights, axis=1)
        if GROUPED:
            total = total + 1e-20
        weights = weights / total[:, None]
    if GROUPED:
        weights = weights * scale
    return weights, ids


@triton.jit
def _rank(ids_f, pair_f, valid_f, i):
    """(e[i], rank[i]) of the pairs i among the flat pairs (ids_f, pair_f, valid_f): the stable
    order by expert, rank[i] = #{j : e[j] < e[i]} + #{j < i : e[j] == e[i]}."""
    mine = (pair_f[None, :] == i[:, None]) & valid_f[None, :]
    ei = tl.sum(tl.where(mine, ids_f[None, :], 0), axis=1)
    before = (ids_f[None, :] < ei[:, None]) | ((ids_f[None, :] == ei[:, None]) & (pair_f[None, :] < i[:, None]))
    return ei, tl.sum((before & valid_f[None, :]).to(tl.int32), axis=1)


@triton.jit
def _route_sort_kernel(
    logits_ptr,  # *logits.dtype [T, E] (row stride stride_t; E contiguous)
    bias_ptr,  # *bias.dtype [E] (read when HAS_BIAS)
    weights_ptr,  # *fp32 [T, TOP_K]
    ids_ptr,  # *int64 [T, TOP_K]
    sorted_ptr,  # *int64 [S]
    perm_ptr,  # *int64 [S]
    inv_perm_ptr,  # *int64 [S]
    offsets_ptr,  # *int32 [NUM_EXPERTS]
    x_ptr,  # *[T, H] hidden states (row stride stride_x, H contiguous; read when GATHER)
    out_ptr,  # *x.dtype [S, H] contiguous: the rows in sorted order (when GATHER)
    stride_t,
    T,  # tokens
    num_experts,  # the offsets' length
    rank_programs,  # cdiv(T * TOP_K, BLOCK_I): the programs that rank pairs
    count_programs,  # cdiv(num_experts, BLOCK_X): then the programs that count offsets; then copies
    H, stride_x,
    h_blocks,  # cdiv(H, BLOCK_H)
    scale,  # the grouped route's routed_scaling_factor
    G: tl.constexpr,  # groups (1: the ungrouped route)
    EG: tl.constexpr,  # experts per group
    TOP_K: tl.constexpr, TOPK_GROUP: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_EG: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_I: tl.constexpr,  # pairs a rank program ranks
    BLOCK_X: tl.constexpr,  # experts a count program counts
    SOFTMAX: tl.constexpr, HAS_BIAS: tl.constexpr, GROUPED: tl.constexpr, RENORMALIZE: tl.constexpr,
    GATHER: tl.constexpr,  # copy programs after the counting ones (moe_route_sort_gather)
    BLOCK_P: tl.constexpr,  # pairs a copy program moves
    BLOCK_H: tl.constexpr,  # columns a copy program moves
):  # fmt: skip
    scale = tl.cast(scale, tl.float32)  # Inductor passes Python floats as fp64
    pid = tl.program_id(0)
    ts = tl.arange(0, BLOCK_T)
    gs = tl.arange(0, BLOCK_G)
    js = tl.arange(0, BLOCK_EG)
    e = gs[:, None] * EG + js[None, :]
    em = (gs[:, None] < G) & (js[None, :] < EG)
    m = (ts < T)[:, None, None] & em[None, :, :]
    x = tl.load(logits_ptr + ts.to(tl.int64)[:, None, None] * stride_t + e[None, :, :], mask=m, other=float("-inf"))
    bias = tl.zeros(e.shape, dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + e, mask=em, other=0.0).to(tl.float32)
    weights, ids = _route_tokens(x.to(tl.float32), bias, e, m, scale, G, TOP_K, TOPK_GROUP, BLOCK_G, BLOCK_EG,
                                 BLOCK_K, SOFTMAX, GROUPED, RENORMALIZE)  # fmt: skip
    ks = tl.arange(0, BLOCK_K)
    pair = ts[:, None] * TOP_K + ks[None, :]
    valid = (ts[:, None] < T) & (ks[None, :] < TOP_K)
    if pid == 0:
        tl.store(weights_ptr + pair, weights, mask=valid)
        tl.store(ids_ptr + pair, ids.to(tl.int64), mask=valid)
    # the flat pairs: [BLOCK_T * BLOCK_K] in one order for the three
    ids_f = tl.reshape(ids, (BLOCK_T * BLOCK_K,))
    pair_f = tl.reshape(pair, (BLOCK_T * BLOCK_K,))
    valid_f = tl.reshape(valid.to(tl.int32), (BLOCK_T * BLOCK_K,)) != 0
    if pid < rank_programs:
        i = pid * BLOCK_I + tl.arange(0, BLOCK_I)
        ei, rank = _rank(ids_f, pair_f, valid_f, i)
        mi = i < T * TOP_K
        tl.store(sorted_ptr + rank, ei.to(tl.int64), mask=mi)
        tl.store(perm_ptr + rank, i.to(tl.int64), mask=mi)
        tl.store(inv_perm_ptr + i, rank.to(tl.int64), mask=mi)
    elif pid < rank_programs + count_programs:
        xs = (pid - rank_programs) * BLOCK_X + tl.arange(0, BLOCK_X)
        counted = (ids_f[None, :] <= xs[:, None]) & valid_f[None, :]
        tl.store(offsets_ptr + xs, tl.sum(counted.to(tl.int32), axis=1), mask=xs < num_experts)
    elif GATHER:  # a copy program: its pairs' rows of hidden states to their sorted places
        c = pid - rank_programs - count_programs
        i = (c // h_blocks) * BLOCK_P + tl.arange(0, BLOCK_P)
        h = (c % h_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)
        _, rank = _rank(ids_f, pair_f, valid_f, i)
        m2 = (i < T * TOP_K)[:, None] & (h < H)[None, :]
        rows = tl.load(x_ptr + (i // TOP_K).to(tl.int64)[:, None] * stride_x + h[None, :], mask=m2)
        tl.store(out_ptr + rank.to(tl.int64)[:, None] * H + h[None, :], rows, mask=m2)


def moe_route_sort_triton(
    logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, softmax: bool, renormalize: bool, n_group: int,
    topk_group: int, scale: float, num_experts: int, hidden_states: torch.Tensor | None = None, *,
    wrap: Callable | None = None,
) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """(weights, ids, sorted_ids, perm, offsets, inv_perm) as ``moe_route_sort_reference``, and
    with ``hidden_states`` the gathered rows as ``moe_route_sort_gather_reference``: one launch up
    to ROUTE_SORT_MAX_TOKENS tokens, else the route's kernel and the sort's."""
    gather = hidden_states is not None
    if gather:
        check_moe_route_sort_gather_args(logits, bias, top_k, softmax, n_group, topk_group, scale, num_experts,
                                         hidden_states)  # fmt: skip
    else:
        check_moe_route_sort_args(logits, bias, top_k, softmax, n_group, topk_group, scale, num_experts)
    tokens, experts = logits.shape
    if not (isinstance(tokens, int) and 0 < tokens <= ROUTE_SORT_MAX_TOKENS):
        if n_group:
            weights, ids = moe_route_grouped_triton(logits, bias, top_k, n_group, topk_group, renormalize, scale,
                                                    wrap=wrap)  # fmt: skip
        else:
            weights, ids = moe_route_triton(logits, bias, top_k, softmax, renormalize, wrap=wrap)
        if gather:
            return (weights, ids, *moe_sort_gather_triton(ids.view(-1), num_experts, hidden_states, top_k, wrap=wrap))
        return (weights, ids, *moe_sort_by_expert_triton(ids.view(-1), num_experts, wrap=wrap))
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    device, pairs = logits.device, tokens * top_k
    weights = torch.empty((tokens, top_k), dtype=torch.float32, device=device)
    ids = torch.empty((tokens, top_k), dtype=torch.int64, device=device)
    sorted_ids, perm, inv_perm = (torch.empty(pairs, dtype=torch.int64, device=device) for _ in range(3))
    offsets = torch.empty(num_experts, dtype=torch.int32, device=device)
    groups = n_group or 1
    # the sort's tiles and the copies as moe_sort_by_expert_triton's and moe_sort_gather_triton's (every
    # program holds all the pairs: no tile over them)
    block_i, _, block_x = sort_tiles(pairs, num_experts)
    block_p, block_h = COPY_PAIRS, COPY_COLUMNS
    rank_programs, count_programs = triton.cdiv(pairs, block_i), triton.cdiv(num_experts, block_x)
    x, gathered, hidden, h_blocks, copy_programs = None, None, 0, 1, 0
    if gather:
        x = hidden_states if hidden_states.stride(1) == 1 else hidden_states.contiguous()
        hidden = x.shape[1]
        gathered = torch.empty((pairs, hidden), dtype=x.dtype, device=device)
        h_blocks = triton.cdiv(hidden, block_h)
        copy_programs = triton.cdiv(pairs, block_p) * h_blocks
    block_t, block_e = triton.next_power_of_2(tokens), triton.next_power_of_2(experts)
    kernel = wrap(_route_sort_kernel) if wrap is not None else _route_sort_kernel
    kernel[(rank_programs + count_programs + copy_programs,)](
        logits, bias, weights, ids, sorted_ids, perm, inv_perm, offsets, x, gathered, logits.stride(0), tokens,
        num_experts, rank_programs, count_programs, hidden, x.stride(0) if gather else 0, h_blocks, scale,
        G=groups, EG=experts // groups, TOP_K=top_k, TOPK_GROUP=topk_group or 1, BLOCK_T=block_t,
        BLOCK_G=triton.next_power_of_2(groups), BLOCK_EG=triton.next_power_of_2(experts // groups),
        BLOCK_K=triton.next_power_of_2(top_k), BLOCK_I=block_i, BLOCK_X=block_x, SOFTMAX=softmax,
        HAS_BIAS=bias is not None, GROUPED=n_group > 0, RENORMALIZE=renormalize, GATHER=gather, BLOCK_P=block_p,
        BLOCK_H=block_h,
        # the scores' tile a thread's 32: 1 warp for a token of 256 experts, 4 for 16 tokens
        num_warps=max(1, min(8, triton.next_power_of_2(block_t * block_e // 1024))),
    )  # fmt: skip
    outputs = (weights, ids, sorted_ids, perm, offsets, inv_perm)
    return (*outputs, gathered) if gather else outputs
