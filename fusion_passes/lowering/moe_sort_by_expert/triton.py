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

from fusion_passes.lowering.moe_sort_by_expert.reference import check_moe_sort_by_expert_args


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
        mi = i < S
        ei = tl.load(ids_ptr + i, mask=mi, other=0).to(tl.int64)
        rank = tl.zeros((BLOCK_I,), dtype=tl.int32)
        # A while loop: Triton's interpreter (the CPU tests) cannot bound a for loop by an argument.
        j0 = 0
        while j0 < S:
            j = j0 + tl.arange(0, BLOCK_J)
            mj = j < S
            ej = tl.load(ids_ptr + j, mask=mj, other=0).to(tl.int64)
            before = (ej[None, :] < ei[:, None]) | ((ej[None, :] == ei[:, None]) & (j[None, :] < i[:, None]))
            rank += tl.sum((before & mj[None, :]).to(tl.int32), axis=1)
            j0 += BLOCK_J
        tl.store(sorted_ptr + rank, ei.to(sorted_ptr.dtype.element_ty), mask=mi)
        tl.store(perm_ptr + rank, i.to(tl.int64), mask=mi)
        tl.store(inv_perm_ptr + i, rank.to(tl.int64), mask=mi)
    else:
        x = (pid - rank_programs) * BLOCK_E + tl.arange(0, BLOCK_E)
        count = tl.zeros((BLOCK_E,), dtype=tl.int32)
        j0 = 0
        while j0 < S:
            j = j0 + tl.arange(0, BLOCK_J)
            ej = tl.load(ids_ptr + j, mask=j < S, other=-1).to(tl.int64)
            counted = (ej[None, :] >= 0) & (ej[None, :] <= x[:, None])
            count += tl.sum(counted.to(tl.int32), axis=1)
            j0 += BLOCK_J
        tl.store(offsets_ptr + x, count, mask=x < E)


def moe_sort_by_expert_triton(
    expert_ids: torch.Tensor, num_experts: int, *, wrap: Callable | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_ids, perm, offsets, inv_perm) as ``moe_sort_by_expert_reference``."""
    check_moe_sort_by_expert_args(expert_ids, num_experts)
    ids = expert_ids.contiguous()
    s = ids.numel()
    device = ids.device
    sorted_ids = torch.empty(s, dtype=ids.dtype, device=device)
    perm = torch.empty(s, dtype=torch.int64, device=device)
    inv_perm = torch.empty(s, dtype=torch.int64, device=device)
    offsets = torch.empty(num_experts, dtype=torch.int32, device=device)
    # 16 pairs ranked per program: batch 64 x top-8 (512 pairs) is 32 programs beside the
    # offsets' 4; tiles of 16 x 128 compares (16 per thread at 4 warps).
    block_i = 16
    # A symbolic pair count (dynamic shapes) takes the widest tile: no guard on its size.
    block_j = min(128, max(16, triton.next_power_of_2(s))) if isinstance(s, int) else 128
    block_e = min(64, max(16, triton.next_power_of_2(num_experts)))
    rank_programs = triton.cdiv(s, block_i)
    kernel = wrap(_sort_pairs_by_expert_kernel) if wrap is not None else _sort_pairs_by_expert_kernel
    kernel[(rank_programs + triton.cdiv(num_experts, block_e),)](
        ids, sorted_ids, perm, inv_perm, offsets, s, num_experts, rank_programs,
        BLOCK_I=block_i, BLOCK_J=block_j, BLOCK_E=block_e, num_warps=4,
    )
    return sorted_ids, perm, offsets, inv_perm
