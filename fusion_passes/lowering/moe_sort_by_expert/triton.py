"""One Triton kernel for a MoE layer's dispatch prep: the stable sort of the flat expert ids, the
inverse permutation and the grouped GEMM's offsets. (Named without "moe": the decode benchmark
classes kernels by name, and this one replaces kernels of its "other" class.)

Unfused (stock Inductor on transformers' grouped_mm experts): Inductor's sort kernel (which also
scatters the inverse permutation), histc's fill and histogram kernels and a cumsum: 4 kernels,
5.9 us at batch 1 inside a CUDA graph (256 experts, top-8; measured on one H200).
Fused: the rank of each pair is a count, so no program waits on another:
    rank[i]    = #{j : e[j] < e[i]} + #{j < i : e[j] == e[i]}        (the stable order)
    sorted_ids[rank[i]] = e[i];  perm[rank[i]] = i;  inv_perm[i] = rank[i]
    offsets[x] = #{j : 0 <= e[j] <= x}
The first programs each rank BLOCK_I pairs against all S; the others each count BLOCK_E experts'
offsets. The work is O(S^2 + E S) compares spread over the grid: at decode sizes (S = tokens x
top_k up to a few thousand) one wave; beyond that the launch table leaves the sort to Inductor.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from fusion_passes.lowering.moe_sort_by_expert.reference import (
    check_moe_sort_by_expert_args,
    check_moe_sort_gather_args,
)


@triton.jit
def _ranked_pairs(
    ids_ptr, i, S, E, sorted_ptr, perm_ptr, inv_perm_ptr, x_ptr, out_ptr, h, H, stride_x, top_k,
    BLOCK_J: tl.constexpr, COPY: tl.constexpr,
):  # fmt: skip
    """Rank the pairs i (their stable order by expert):
        rank[i] = #{j : e[j] < e[i]} + #{j < i : e[j] == e[i]}
    then, COPY off: sorted_ids[rank[i]] = e[i]; perm[rank[i]] = i; inv_perm[i] = rank[i]; COPY on:
    the hidden states' columns h of each pair's token to its sorted row, zero for a sentinel
    (id >= E). The stores are made here, not by the caller: Inductor's analysis of a direct launch
    takes a value a @triton.jit helper returns as derived from every argument of the call, so
    ranks returned from here would mark the ids written (a copy of them per launch)."""
    mi = i < S
    ei = tl.load(ids_ptr + i, mask=mi, other=0).to(tl.int64)
    rank = tl.zeros(i.shape, dtype=tl.int32)
    # A while loop: Triton's interpreter (the CPU tests) cannot bound a for loop by an argument.
    j0 = 0
    while j0 < S:
        j = j0 + tl.arange(0, BLOCK_J)
        mj = j < S
        ej = tl.load(ids_ptr + j, mask=mj, other=0).to(tl.int64)
        before = (ej[None, :] < ei[:, None]) | ((ej[None, :] == ei[:, None]) & (j[None, :] < i[:, None]))
        rank += tl.sum((before & mj[None, :]).to(tl.int32), axis=1)
        j0 += BLOCK_J
    if COPY:
        tokens = (i // top_k).to(tl.int64)
        m = (mi & (ei < E))[:, None] & (h[None, :] < H)
        rows = tl.load(x_ptr + tokens[:, None] * stride_x + h[None, :], mask=m, other=0.0)
        tl.store(out_ptr + rank[:, None].to(tl.int64) * H + h[None, :], rows, mask=mi[:, None] & (h[None, :] < H))
    else:
        tl.store(sorted_ptr + rank, ei.to(sorted_ptr.dtype.element_ty), mask=mi)
        tl.store(perm_ptr + rank, i.to(tl.int64), mask=mi)
        tl.store(inv_perm_ptr + i, rank.to(tl.int64), mask=mi)


@triton.jit
def _expert_offsets(ids_ptr, offsets_ptr, x, S, E, BLOCK_J: tl.constexpr):
    """offsets[x] = #{j : 0 <= e[j] <= x} for the experts x."""
    count = tl.zeros(x.shape, dtype=tl.int32)
    j0 = 0
    while j0 < S:
        j = j0 + tl.arange(0, BLOCK_J)
        ej = tl.load(ids_ptr + j, mask=j < S, other=-1).to(tl.int64)
        counted = (ej[None, :] >= 0) & (ej[None, :] <= x[:, None])
        count += tl.sum(counted.to(tl.int32), axis=1)
        j0 += BLOCK_J
    tl.store(offsets_ptr + x, count, mask=x < E)


@triton.jit
def _sort_pairs_by_expert_kernel(
    ids_ptr,  # *int [S]: the flat expert ids (any integer dtype)
    sorted_ptr,  # *ids.dtype [S]
    perm_ptr,  # *int64 [S]
    inv_perm_ptr,  # *int64 [S]
    offsets_ptr,  # *int32 [E]
    S,  # pairs (runtime: one compile serves every batch)
    E,  # experts
    rank_programs,  # cdiv(S, BLOCK_I): the programs that rank, the rest count (runtime, as S)
    BLOCK_I: tl.constexpr,
    BLOCK_J: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    pid = tl.program_id(0)
    if pid < rank_programs:
        i = pid * BLOCK_I + tl.arange(0, BLOCK_I)
        _ranked_pairs(ids_ptr, i, S, E, sorted_ptr, perm_ptr, inv_perm_ptr, ids_ptr, ids_ptr, i, 0, 0, 1, BLOCK_J, False)
    else:
        x = (pid - rank_programs) * BLOCK_E + tl.arange(0, BLOCK_E)
        _expert_offsets(ids_ptr, offsets_ptr, x, S, E, BLOCK_J)


def _sort_outputs(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_ids, perm, offsets, inv_perm) to fill, for the flat ids."""
    s, device = ids.numel(), ids.device
    sorted_ids = torch.empty(s, dtype=ids.dtype, device=device)
    perm = torch.empty(s, dtype=torch.int64, device=device)
    inv_perm = torch.empty(s, dtype=torch.int64, device=device)
    return sorted_ids, perm, torch.empty(num_experts, dtype=torch.int32, device=device), inv_perm


# The gather's copy programs: 4 pairs x 512 columns each (DeepSeek V3's 7168: 14 programs per 4
# pairs, each moving 4 KiB of bf16).
COPY_PAIRS, COPY_COLUMNS = 4, 512


def sort_tiles(s, num_experts: int) -> tuple[int, int, int]:
    """(BLOCK_I, BLOCK_J, BLOCK_E) of the sort's programs. 16 pairs ranked per program: batch 64 x
    top-8 (512 pairs) is 32 programs beside the offsets' 4; tiles of 16 x 128 compares (16 per
    thread at 4 warps). A symbolic pair count (dynamic shapes) takes the widest tile: no guard on
    its size."""
    block_j = min(128, max(16, triton.next_power_of_2(s))) if isinstance(s, int) else 128
    return 16, block_j, min(64, max(16, triton.next_power_of_2(num_experts)))


def moe_sort_by_expert_triton(
    expert_ids: torch.Tensor, num_experts: int, *, wrap: Callable | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_ids, perm, offsets, inv_perm) as ``moe_sort_by_expert_reference``."""
    check_moe_sort_by_expert_args(expert_ids, num_experts)
    ids = expert_ids.contiguous()
    s = ids.numel()
    sorted_ids, perm, offsets, inv_perm = _sort_outputs(ids, num_experts)
    block_i, block_j, block_e = sort_tiles(s, num_experts)
    rank_programs = triton.cdiv(s, block_i)
    kernel = wrap(_sort_pairs_by_expert_kernel) if wrap is not None else _sort_pairs_by_expert_kernel
    kernel[(rank_programs + triton.cdiv(num_experts, block_e),)](
        ids, sorted_ids, perm, inv_perm, offsets, s, num_experts, rank_programs,
        BLOCK_I=block_i, BLOCK_J=block_j, BLOCK_E=block_e, num_warps=4,
    )
    return sorted_ids, perm, offsets, inv_perm


@triton.jit
def _sort_gather_kernel(
    ids_ptr,  # *int [S]: the flat expert ids (any integer dtype)
    sorted_ptr,  # *ids.dtype [S]
    perm_ptr,  # *int64 [S]
    inv_perm_ptr,  # *int64 [S]
    offsets_ptr,  # *int32 [E]
    x_ptr,  # *[T, H] hidden states (row stride stride_x, H contiguous)
    out_ptr,  # *x.dtype [S, H] contiguous: the gathered rows
    S,
    E,
    H,
    stride_x,
    top_k,
    rank_programs,  # cdiv(S, BLOCK_I)
    count_programs,  # cdiv(E, BLOCK_E)
    h_blocks,  # cdiv(H, BLOCK_H)
    BLOCK_I: tl.constexpr,
    BLOCK_J: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """_sort_pairs_by_expert_kernel's programs, then copy programs: each ranks BLOCK_P pairs again
    (no program waits on another) and moves their hidden states' BLOCK_H columns to their sorted
    rows, zero for a sentinel (id >= E)."""
    pid = tl.program_id(0)
    if pid < rank_programs:
        i = pid * BLOCK_I + tl.arange(0, BLOCK_I)
        _ranked_pairs(ids_ptr, i, S, E, sorted_ptr, perm_ptr, inv_perm_ptr, x_ptr, out_ptr, i, 0, 0, 1, BLOCK_J, False)
    elif pid < rank_programs + count_programs:
        x = (pid - rank_programs) * BLOCK_E + tl.arange(0, BLOCK_E)
        _expert_offsets(ids_ptr, offsets_ptr, x, S, E, BLOCK_J)
    else:
        c = pid - rank_programs - count_programs
        i = (c // h_blocks) * BLOCK_P + tl.arange(0, BLOCK_P)
        h = (c % h_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)
        _ranked_pairs(ids_ptr, i, S, E, sorted_ptr, perm_ptr, inv_perm_ptr, x_ptr, out_ptr, h, H, stride_x, top_k,
                      BLOCK_J, True)  # fmt: skip


def moe_sort_gather_triton(
    expert_ids: torch.Tensor, num_experts: int, hidden_states: torch.Tensor, top_k: int, *, wrap: Callable | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_ids, perm, offsets, inv_perm, gathered) as ``moe_sort_gather_reference``."""
    check_moe_sort_gather_args(expert_ids, num_experts, hidden_states, top_k)
    ids = expert_ids.contiguous()
    x = hidden_states if hidden_states.stride(1) == 1 else hidden_states.contiguous()
    s, hidden = ids.numel(), x.shape[1]
    sorted_ids, perm, offsets, inv_perm = _sort_outputs(ids, num_experts)
    gathered = torch.empty((s, hidden), dtype=x.dtype, device=ids.device)
    # the sort's tiles as moe_sort_by_expert_triton's, then the copies
    block_i, block_j, block_e = sort_tiles(s, num_experts)
    block_p, block_h = COPY_PAIRS, COPY_COLUMNS
    rank_programs, count_programs = triton.cdiv(s, block_i), triton.cdiv(num_experts, block_e)
    h_blocks = triton.cdiv(hidden, block_h)
    copy_programs = triton.cdiv(s, block_p) * h_blocks
    kernel = wrap(_sort_gather_kernel) if wrap is not None else _sort_gather_kernel
    kernel[(rank_programs + count_programs + copy_programs,)](
        ids, sorted_ids, perm, inv_perm, offsets, x, gathered, s, num_experts, hidden, x.stride(0), top_k,
        rank_programs, count_programs, h_blocks,
        BLOCK_I=block_i, BLOCK_J=block_j, BLOCK_E=block_e, BLOCK_P=block_p, BLOCK_H=block_h, num_warps=4,
    )  # fmt: skip
    return sorted_ids, perm, offsets, inv_perm, gathered
