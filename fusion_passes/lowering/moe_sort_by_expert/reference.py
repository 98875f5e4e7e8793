"""Plain-torch reference of a MoE layer's dispatch prep: the single statement of its math.

A grouped-GEMM MoE layer (transformers' ``grouped_mm`` experts: Qwen3 / Qwen 3.5-MoE, MiniMax-M2,
DeepSeek V3 / V3.2, ...) orders its S = tokens x top_k (token, expert) pairs by expert before the
grouped GEMMs and restores the order after them. For the flat expert ids e [S] of E experts:

    sorted_ids, perm = sort(e)                     stable: equal ids keep their order
    counts[x]  = #{j : e[j] == x}, x in [0, E)     ids outside [0, E) (expert-parallel sentinels)
                                                   are sorted but not counted, as histc drops them
    offsets    = cumsum(counts)                    int32, the grouped GEMM's group ends
    inv_perm   = argsort(perm):  inv_perm[perm[i]] = i

transformers writes the sort unstable (``torch.sort``), which leaves the order of equal ids to the
implementation; the stable order is one it may return, and everything after the sort reads the
pairs of one expert as a group (the grouped GEMM computes each row alone) and puts them back
through inv_perm, so the layer's output does not depend on it.
"""

from __future__ import annotations

import torch

INDEX_DTYPES = (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8)


def check_moe_sort_by_expert_args(expert_ids: torch.Tensor, num_experts: int) -> None:
    """Raise a one-line ValueError for arguments the op does not define."""
    if expert_ids.dim() != 1:
        raise ValueError(f"moe_sort_by_expert: flat expert ids [S] expected, got {tuple(expert_ids.shape)}")
    if expert_ids.dtype not in INDEX_DTYPES:
        raise ValueError(f"moe_sort_by_expert: expert ids are {expert_ids.dtype}; an integer dtype is expected")
    if num_experts < 1:
        raise ValueError(f"moe_sort_by_expert: num_experts must be positive, got {num_experts}")


def moe_sort_by_expert_reference(
    expert_ids: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_ids, perm, offsets, inv_perm) as in the module docstring: sorted_ids in
    expert_ids.dtype, perm and inv_perm int64, offsets int32 [num_experts]."""
    sorted_ids, perm = torch.sort(expert_ids, stable=True)
    experts = torch.arange(num_experts, device=expert_ids.device)
    # offsets[x] = #{j : 0 <= e[j] <= x}: the cumulative count, sentinels excluded.
    ids = expert_ids.to(torch.int64)
    offsets = ((ids[None, :] >= 0) & (ids[None, :] <= experts[:, None])).sum(1).to(torch.int32)
    inv_perm = torch.empty_like(perm)
    inv_perm[perm] = torch.arange(perm.numel(), device=perm.device)
    return sorted_ids, perm, offsets, inv_perm


def check_moe_sort_gather_args(expert_ids: torch.Tensor, num_experts: int, hidden_states: torch.Tensor,
                               top_k: int) -> None:  # fmt: skip
    """Raise a one-line ValueError for arguments moe_sort_gather does not define."""
    check_moe_sort_by_expert_args(expert_ids, num_experts)
    if hidden_states.dim() != 2:
        raise ValueError(f"moe_sort_gather: hidden states [T, H] expected, got {tuple(hidden_states.shape)}")
    if top_k < 1 or hidden_states.shape[0] * top_k != expert_ids.shape[0]:
        raise ValueError(
            f"moe_sort_gather: {expert_ids.shape[0]} pairs are not {hidden_states.shape[0]} tokens x top_k {top_k}"
        )


def moe_sort_gather_reference(
    expert_ids: torch.Tensor, num_experts: int, hidden_states: torch.Tensor, top_k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """moe_sort_by_expert's four outputs, and the hidden states in the sorted pairs' order, an
    expert-parallel sentinel's row (id >= num_experts) zero, as transformers' grouped_mm experts
    prepare them for the first grouped GEMM:

        gathered = hidden_states[perm // top_k].masked_fill((sorted_ids >= num_experts)[:, None], 0)
    """
    sorted_ids, perm, offsets, inv_perm = moe_sort_by_expert_reference(expert_ids, num_experts)
    gathered = hidden_states[perm // top_k].masked_fill((sorted_ids >= num_experts).unsqueeze(-1), 0.0)
    return sorted_ids, perm, offsets, inv_perm, gathered
