"""A MoE layer's dispatch prep: the (token, expert) pairs sorted by expert for the grouped GEMMs.

transformers' grouped_mm experts (``grouped_mm_experts_forward``: Qwen3 / Qwen 3.5-MoE,
MiniMax-M2, DeepSeek V3 / V3.2 and every model with ``@use_experts_implementation``) trace, for
the flat expert ids of the top-k routing:

    expert_ids_g, perm = sort(expert_ids)
    offsets  = cumsum(histc(expert_ids_g.int(), bins=E, min=0, max=E - 1), dtype=int32)
    inv_perm = empty_like(perm); inv_perm[perm] = arange(S)

(on the CPU histc reads ``expert_ids_g.float()``: it has no integer CPU kernel). The gathers by
perm, the sentinel mask and the grouped GEMMs around it stay the model's.

Unfused: Inductor's sort (with the scatter), histc's fill and histogram kernels and a cumsum: 4
         kernels per MoE layer at decode sizes with stock Inductor.
Fused:   sorted_ids, perm, offsets, inv_perm = fusion_passes.moe_sort_by_expert(expert_ids, E)
         one kernel (a stable sort: see the op's reference for why it may replace the model's).

Not fused: a histc over other bounds (the ids' bins would not be the experts), one expert (histc
over [0, 0], its default, bins the ids' own range; the pattern's histc has explicit bounds), a
descending sort, and on a GPU whose launch table says so, a sort of more pairs than the kernel was
measured to win at (a prefill's), which is left to Inductor.
"""

from __future__ import annotations

from typing import Any

import torch

from fusion_passes.fusion import Fusion, Spelling
from fusion_passes.numerics import compare
from fusion_passes.lowering.moe_sort_by_expert.reference import (
    check_moe_sort_by_expert_args,
    check_moe_sort_gather_args,
)

# The sentinel the expert count is traced with (a pattern argument): an odd count no example's
# other sizes use.
NUM_EXPERTS_SENTINEL = 61


def _sort_and_offsets(expert_ids, num_experts):
    # As transformers writes it, device branch included: histc counts the int32 ids on CUDA, and
    # float32 ids on the CPU (no integer histc there). The matcher re-traces each candidate on the
    # graph's own values, so each device gets its own branch.
    expert_ids_g, perm = torch.sort(expert_ids)
    device = expert_ids.device
    histc_input = expert_ids_g.float() if device.type in ("cpu", "mps") else expert_ids_g.int()
    tokens_per_expert = torch.histc(histc_input, bins=num_experts, min=0, max=num_experts - 1)
    offsets = torch.cumsum(tokens_per_expert, dim=0, dtype=torch.int32)
    return expert_ids_g, perm, offsets


def transformers_grouped_mm_dispatch(expert_ids, num_experts):
    expert_ids_g, perm, offsets = _sort_and_offsets(expert_ids, num_experts)
    inv_perm = torch.empty_like(perm)
    inv_perm[perm] = torch.arange(perm.size(0), device=expert_ids.device)
    return expert_ids_g, perm, offsets, inv_perm


def transformers_grouped_mm_dispatch_sort(expert_ids, num_experts):
    # The same without the inverse permutation's scatter, which stays the model's: with dynamic
    # shapes its arange takes its size from the token count (4 * s0), not from the ids the pattern
    # sees, and the whole spelling does not match.
    return _sort_and_offsets(expert_ids, num_experts)


def _fused(expert_ids, num_experts):
    return torch.ops.fusion_passes.moe_sort_by_expert(expert_ids, num_experts)


def _fused_sort(expert_ids, num_experts):
    sorted_ids, perm, offsets, _ = torch.ops.fusion_passes.moe_sort_by_expert(expert_ids, num_experts)
    return sorted_ids, perm, offsets


def _check(values: dict[str, Any]) -> str | None:
    expert_ids, num_experts = values["expert_ids"], values["num_experts"]
    try:
        check_moe_sort_by_expert_args(expert_ids, num_experts)
    except ValueError as e:
        return str(e).removeprefix("moe_sort_by_expert: ")
    from fusion_passes.lowering.launch_tables import moe_sort_refusal

    return moe_sort_refusal(expert_ids)


def dispatch_outputs_agree(actual: tuple, expected: tuple) -> str | None:
    """verify=True's comparison of the dispatch prep's outputs: the fused op's stable sort may
    order a run of equal ids otherwise than the model's unstable one, so perm is checked to sort
    the ids (recovered from the original's outputs), inv_perm to invert it, and the outputs in
    sorted order (the gathered rows, the sentinel mask) per pair; the sorted ids and the offsets
    are equal. Outputs, by the spellings' tuple lengths: (sorted_ids, perm, offsets[, inv_perm]
    [, gathered, sentinel])."""
    inverse = len(expected) in (4, 6)
    (sorted_a, perm_a, offsets_a), (sorted_e, perm_e, offsets_e) = actual[:3], expected[:3]
    if not (torch.equal(sorted_a, sorted_e) and torch.equal(offsets_a, offsets_e)):
        return "the sorted ids or the offsets differ from the original's"
    pairs = torch.arange(perm_e.numel(), device=perm_e.device)
    ids = torch.empty_like(sorted_e)
    ids[perm_e] = sorted_e  # each pair's id, from the original's sort
    if not torch.equal(perm_a.sort().values, pairs) or not torch.equal(ids[perm_a], sorted_a):
        return "perm is not a permutation that sorts the ids"
    if inverse and not torch.equal(actual[3][perm_a], pairs):
        return "inv_perm is not perm's inverse"
    position_a, position_e = perm_a.argsort(), perm_e.argsort()  # each pair's place in sorted order
    start = 4 if inverse else 3
    for a, e in zip(actual[start:], expected[start:], strict=True):
        a, e = a[position_a], e[position_e]  # per pair, in the pairs' own order
        same = compare(a, e).ok if e.dtype.is_floating_point else torch.equal(a, e)
        if not same:
            return "an output in sorted order differs from the original's for some pair"
    return None


def _examples():
    # 3 tokens x top-4 pairs, traced on the meta device: the CUDA branch (the matcher's first pass
    # ignores dtypes and devices, its re-trace of each candidate takes the graph's own branch).
    yield torch.empty(12, dtype=torch.int64, device="meta"), NUM_EXPERTS_SENTINEL


MOE_SORT_BY_EXPERT = Fusion(
    name="moe_sort_by_expert",
    summary="MoE dispatch prep (sort by expert, histc + cumsum offsets, inverse permutation) -> one kernel",
    doc=__doc__.split("\n\n", 1)[1],
    # The whole dispatch first: where it matches, the scatter goes too.
    spellings=(
        Spelling("transformers_grouped_mm_dispatch", transformers_grouped_mm_dispatch, _fused),
        Spelling("transformers_grouped_mm_dispatch_sort", transformers_grouped_mm_dispatch_sort, _fused_sort),
    ),
    example_inputs=_examples,
    scalars={"num_experts": NUM_EXPERTS_SENTINEL},
    check=_check,
    candidate_ops=("aten.histc.default",),
    verify_outputs=dispatch_outputs_agree,
    builtin=True,
)


# top_k's sentinel (a pattern argument): no example size (15 pairs of 3 tokens, hidden size 16)
TOP_K_SENTINEL = 5


def _sorted_and_gathered(expert_ids, hidden_states, num_experts, top_k, inverse: bool):
    # transformers' grouped_mm_experts_forward after the sort (moe_sort_by_expert's op by now):
    #     selected_hidden_states_g = hidden_states[perm // num_top_k]
    #     sentinel_mask = (expert_ids_g >= self.num_experts).unsqueeze(-1)
    #     selected_hidden_states_g.masked_fill_(sentinel_mask, 0.0)
    sorted_ids, perm, offsets, inv_perm = torch.ops.fusion_passes.moe_sort_by_expert(expert_ids, num_experts)
    selected = hidden_states[perm // top_k]
    sentinel = (sorted_ids >= num_experts).unsqueeze(-1)
    # masked_fill(sentinel, 0.0), in the form Inductor's constant folding leaves it (its
    # scalar_tensor(0.0) becomes full([], 0.0) before the post-grad passes)
    zero = torch.full([], 0.0, dtype=selected.dtype, device=selected.device)
    selected = torch.where(sentinel, zero, selected)
    return (sorted_ids, perm, offsets, inv_perm, selected, sentinel) if inverse else (sorted_ids, perm, offsets, selected, sentinel)


def transformers_dispatch_gather(expert_ids, hidden_states, num_experts, top_k):
    return _sorted_and_gathered(expert_ids, hidden_states, num_experts, top_k, inverse=True)


def transformers_dispatch_gather_sort(expert_ids, hidden_states, num_experts, top_k):
    # the sort-only form of moe_sort_by_expert (its inverse permutation left to the model)
    return _sorted_and_gathered(expert_ids, hidden_states, num_experts, top_k, inverse=False)


def _fused_gather(expert_ids, hidden_states, num_experts, top_k, inverse: bool):
    sorted_ids, perm, offsets, inv_perm, gathered = torch.ops.fusion_passes.moe_sort_gather(
        expert_ids, num_experts, hidden_states, top_k
    )
    sentinel = (sorted_ids >= num_experts).unsqueeze(-1)  # the later masked_fills' mask, a pointwise op
    return (sorted_ids, perm, offsets, inv_perm, gathered, sentinel) if inverse else (sorted_ids, perm, offsets, gathered, sentinel)


def _gather_check(values: dict[str, Any]) -> str | None:
    try:
        check_moe_sort_gather_args(values["expert_ids"], values["num_experts"], values["hidden_states"], values["top_k"])
    except ValueError as e:
        return str(e).removeprefix("moe_sort_gather: ")
    return None


def _gather_examples():
    # 3 tokens x top-5 pairs, hidden size 16, on the meta device (as the sort's)
    meta = {"device": "meta"}
    yield torch.empty(15, dtype=torch.int64, **meta), torch.empty(3, 16, dtype=torch.bfloat16, **meta), \
        NUM_EXPERTS_SENTINEL, TOP_K_SENTINEL  # fmt: skip


MOE_SORT_GATHER = Fusion(
    name="moe_sort_gather",
    summary="moe_sort_by_expert + the gather of each pair's hidden state into the sorted order (and the "
    "sentinels' zero rows) -> one kernel",
    doc="""The first grouped GEMM's input, gathered after the sort in a kernel of its own.

    Unfused: sorted_ids, perm, offsets, inv_perm = fusion_passes.moe_sort_by_expert(expert_ids, E)
             selected = hidden_states[perm // top_k].masked_fill((sorted_ids >= E)[:, None], 0)
             (transformers' grouped_mm experts: Inductor's gather kernel after the sort, one a MoE layer)
    Fused:   sorted_ids, perm, offsets, inv_perm, selected = fusion_passes.moe_sort_gather(expert_ids, E,
                                                                                        hidden_states, top_k)
             the sort's kernel with copy programs that rank their pairs again (no program waits on
             another) and move the rows: bit-equal, one launch fewer a MoE layer

    Needs moe_sort_by_expert's op (its launch table's refusals stand: a prefill's sort stays
    Inductor's, and with it the gather).""",
    spellings=(
        Spelling("transformers_dispatch_gather", transformers_dispatch_gather,
                 lambda *a: _fused_gather(*a, inverse=True)),
        Spelling("transformers_dispatch_gather_sort", transformers_dispatch_gather_sort,
                 lambda *a: _fused_gather(*a, inverse=False)),
    ),  # fmt: skip
    example_inputs=_gather_examples,
    scalars={"num_experts": NUM_EXPERTS_SENTINEL, "top_k": TOP_K_SENTINEL},
    check=_gather_check,
    requires=("moe_sort_by_expert",),
    verify_outputs=dispatch_outputs_agree,
    opt_in="not yet timed on a GPU: Inductor's gather kernel it removes takes 1.4 us per MoE layer on one H200 "
    "(DeepSeek V3.2, batch 1)",
    builtin=True,
)

FUSIONS = (MOE_SORT_BY_EXPERT, MOE_SORT_GATHER)
