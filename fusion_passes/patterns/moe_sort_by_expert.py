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
from fusion_passes.lowering.moe_sort_by_expert.reference import check_moe_sort_by_expert_args

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
    builtin=True,
)

FUSIONS = (MOE_SORT_BY_EXPERT,)
