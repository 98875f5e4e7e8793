"""Plain-torch reference of a MoE layer's routing followed by its dispatch prep: the single
statement of the math of ``moe_route_sort``, from the two ops it chains.

    weights, ids = moe_route(logits, bias, top_k, softmax, renormalize)             n_group == 0
                   moe_route_grouped(logits, bias, top_k, n_group, topk_group,
                                     renormalize, scale)                             n_group >= 1
    sorted_ids, perm, offsets, inv_perm = moe_sort_by_expert(ids.reshape(-1), num_experts)

(moe_route/reference.py and moe_sort_by_expert/reference.py state each; the order of equal scores
and of equal ids is theirs.) Returns (weights fp32 [T, k], ids int64 [T, k], sorted_ids int64 [S],
perm int64 [S], offsets int32 [num_experts], inv_perm int64 [S]), S = T * k.

``moe_route_sort_gather_reference``: the same with moe_sort_gather's last output, the hidden states
in the sorted pairs' order (hidden_states[perm // k]) for the first grouped GEMM.
"""

from __future__ import annotations

import torch

from fusion_passes.lowering.moe_route.reference import (
    check_moe_route_args,
    check_moe_route_grouped_args,
    moe_route_grouped_reference,
    moe_route_reference,
)
from fusion_passes.lowering.moe_sort_by_expert.reference import (
    check_moe_sort_gather_args,
    moe_sort_by_expert_reference,
    moe_sort_gather_reference,
)


def check_moe_route_sort_args(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    top_k: int,
    softmax: bool,
    n_group: int,
    topk_group: int,
    scale: float,
    num_experts: int,
) -> None:
    """Raise a one-line ValueError for arguments the op does not define: the route's, and sorted
    ids every one of which is a counted expert (no expert-parallel sentinels: the ids are the
    route's own)."""
    try:
        if n_group:
            if softmax:
                raise ValueError("moe_route_grouped: group-limited routing scores with sigmoid, not softmax")
            if bias is None:
                raise ValueError("moe_route_grouped: group-limited routing needs the correction bias")
            check_moe_route_grouped_args(logits, bias, top_k, n_group, topk_group)
        else:
            check_moe_route_args(logits, bias, top_k, softmax)
            if scale != 1.0:
                raise ValueError(f"moe_route: the ungrouped route does not scale its weights (scale {scale})")
    except ValueError as e:
        raise ValueError(f"moe_route_sort: {str(e).split(': ', 1)[1]}") from None
    if num_experts < logits.shape[1]:
        raise ValueError(f"moe_route_sort: {num_experts} experts counted, {logits.shape[1]} routed to")


def moe_route_sort_reference(
    logits: torch.Tensor,  # [T, E] router logits
    bias: torch.Tensor | None,  # [E] correction bias (sigmoid scoring), or None
    top_k: int,
    softmax: bool,
    renormalize: bool,
    n_group: int,  # 0: the ungrouped route (moe_route); else moe_route_grouped's groups
    topk_group: int,
    scale: float,  # the grouped route's routed_scaling_factor (1.0 ungrouped)
    num_experts: int,  # the dispatch's offsets' length (the experts the grouped GEMMs hold)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weights, ids, sorted_ids, perm, offsets, inv_perm); see the module doc."""
    if n_group:
        weights, ids = moe_route_grouped_reference(logits, bias, top_k, n_group, topk_group, renormalize, scale)
    else:
        weights, ids = moe_route_reference(logits, bias, top_k, softmax, renormalize)
    return (weights, ids, *moe_sort_by_expert_reference(ids.reshape(-1), num_experts))


def check_moe_route_sort_gather_args(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    top_k: int,
    softmax: bool,
    n_group: int,
    topk_group: int,
    scale: float,
    num_experts: int,
    hidden_states: torch.Tensor,
) -> None:
    """moe_route_sort's checks, and a row of hidden states per routed token."""
    check_moe_route_sort_args(logits, bias, top_k, softmax, n_group, topk_group, scale, num_experts)
    if hidden_states.dim() != 2 or hidden_states.shape[0] != logits.shape[0]:
        raise ValueError(
            f"moe_route_sort_gather: hidden states [{logits.shape[0]}, H] expected, got {tuple(hidden_states.shape)}"
        )
    pairs = torch.empty(logits.shape[0] * top_k, dtype=torch.int64, device="meta")
    try:
        check_moe_sort_gather_args(pairs, num_experts, hidden_states, top_k)
    except ValueError as e:
        raise ValueError(f"moe_route_sort_gather: {str(e).split(': ', 1)[1]}") from None


def moe_route_sort_gather_reference(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    top_k: int,
    softmax: bool,
    renormalize: bool,
    n_group: int,
    topk_group: int,
    scale: float,
    num_experts: int,
    hidden_states: torch.Tensor,  # [T, H]: the tokens' rows the grouped GEMMs read, pair by pair
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weights, ids, sorted_ids, perm, offsets, inv_perm, gathered); see the module doc."""
    weights, ids, *_ = moe_route_sort_reference(
        logits, bias, top_k, softmax, renormalize, n_group, topk_group, scale, num_experts
    )
    return (weights, ids, *moe_sort_gather_reference(ids.reshape(-1), num_experts, hidden_states, top_k))
