"""A MoE layer's routing and its dispatch prep in one launch at decode.

After the moe_route and moe_sort_by_expert fusions, transformers' grouped_mm experts (Qwen3 /
Qwen 3.5-MoE, Qwen3-Next, MiniMax-M2, DeepSeek V3 / V3.2) hold, per MoE layer:

    weights, ids = fusion_passes.moe_route(logits, bias, k, softmax, renormalize)
                   (or fusion_passes.moe_route_grouped(logits, bias, k, n_group, topk_group, True, scale))
    sorted_ids, perm, offsets, inv_perm = fusion_passes.moe_sort_by_expert(ids.reshape(-1), E)
                                          (its sort-only form: inv_perm left to the model)

Unfused: the route's kernel, then the sort's reading its ids: 2 launches per MoE layer.
Fused:   weights, ids, sorted_ids, perm, offsets, inv_perm = fusion_passes.moe_route_sort(logits,
             bias, k, softmax, renormalize, n_group, topk_group, scale, E)
         one launch up to ROUTE_SORT_MAX_TOKENS tokens (each of the sort's programs routes every
         token again), the two kernels beyond: the outputs bit-equal to the two ops' either way.

Not a site: route ids read by anything else than the sort (the pattern's ids are its own), a
sort the launch table left to Inductor (a prefill's: no moe_sort_by_expert op), the gather form
(moe_sort_gather), which stays two launches.
"""

from __future__ import annotations

from typing import Any

import torch

from fusion_passes.fusion import DEFAULT_SCALAR_SENTINEL, Fusion, Spelling
from fusion_passes.lowering.moe_route_sort.reference import check_moe_route_sort_args
from fusion_passes.patterns.moe_route import GROUPS_SENTINEL, TOP_K_SENTINEL
from fusion_passes.patterns.moe_sort_by_expert import NUM_EXPERTS_SENTINEL

# The kept groups' sentinel: not moe_route's 3, which is also the sort's inv_perm output index here
# (getitem(sort, 3) would be taken for the argument).
KEPT_GROUPS_SENTINEL = 6

_SCALARS = {"top_k": TOP_K_SENTINEL, "num_experts": NUM_EXPERTS_SENTINEL}
_GROUPED_SCALARS = {**_SCALARS, "n_group": GROUPS_SENTINEL, "topk_group": KEPT_GROUPS_SENTINEL,
                    "routed_scaling_factor": DEFAULT_SCALAR_SENTINEL}  # fmt: skip
# The route op's call per form: (bias given, softmax, renormalize); "grouped" is moe_route_grouped.
_ROUTES = {"softmax": (False, True, True), "softmax_unnormalized": (False, True, False), "sigmoid_bias": (True, False, True)}


def _sorted(weights, ids, num_experts, inverse: bool):
    sorted_ids, perm, offsets, inv_perm = torch.ops.fusion_passes.moe_sort_by_expert.default(ids.reshape(-1), num_experts)
    return (weights, sorted_ids, perm, offsets, inv_perm) if inverse else (weights, sorted_ids, perm, offsets)


def _fused(outputs, inverse: bool):
    weights, _, sorted_ids, perm, offsets, inv_perm = outputs
    return (weights, sorted_ids, perm, offsets, inv_perm) if inverse else (weights, sorted_ids, perm, offsets)


def _spellings(route: str, inverse: bool) -> Spelling:
    """The route op of form ``route`` and the sort of its ids (with or without inv_perm)."""
    name = f"{route}_route_then_dispatch{'' if inverse else '_sort'}"
    if route == "grouped":

        def pattern(router_logits, e_score_correction_bias, top_k, n_group, topk_group, routed_scaling_factor,
                    num_experts):  # fmt: skip
            weights, ids = torch.ops.fusion_passes.moe_route_grouped.default(
                router_logits, e_score_correction_bias, top_k, n_group, topk_group, True, routed_scaling_factor
            )
            return _sorted(weights, ids, num_experts, inverse)

        def replacement(router_logits, e_score_correction_bias, top_k, n_group, topk_group, routed_scaling_factor,
                        num_experts):  # fmt: skip
            return _fused(torch.ops.fusion_passes.moe_route_sort.default(
                router_logits, e_score_correction_bias, top_k, False, True, n_group, topk_group,
                routed_scaling_factor, num_experts), inverse)  # fmt: skip

        return Spelling(name, pattern, replacement)
    has_bias, softmax, renormalize = _ROUTES[route]
    if has_bias:

        def pattern(router_logits, e_score_correction_bias, top_k, num_experts):
            weights, ids = torch.ops.fusion_passes.moe_route.default(
                router_logits, e_score_correction_bias, top_k, softmax, renormalize
            )
            return _sorted(weights, ids, num_experts, inverse)

        def replacement(router_logits, e_score_correction_bias, top_k, num_experts):
            return _fused(torch.ops.fusion_passes.moe_route_sort.default(
                router_logits, e_score_correction_bias, top_k, softmax, renormalize, 0, 0, 1.0, num_experts
            ), inverse)  # fmt: skip

        return Spelling(name, pattern, replacement)

    def pattern(router_logits, top_k, num_experts):
        weights, ids = torch.ops.fusion_passes.moe_route.default(router_logits, None, top_k, softmax, renormalize)
        return _sorted(weights, ids, num_experts, inverse)

    def replacement(router_logits, top_k, num_experts):
        return _fused(torch.ops.fusion_passes.moe_route_sort.default(
            router_logits, None, top_k, softmax, renormalize, 0, 0, 1.0, num_experts
        ), inverse)  # fmt: skip

    return Spelling(name, pattern, replacement)


def _check(values: dict[str, Any]) -> str | None:
    grouped = "n_group" in values
    try:
        check_moe_route_sort_args(
            values["router_logits"], values.get("e_score_correction_bias"), values["top_k"], False if grouped else
            values.get("e_score_correction_bias") is None, values.get("n_group", 0), values.get("topk_group", 0),
            values.get("routed_scaling_factor", 1.0), values["num_experts"],
        )  # fmt: skip
    except ValueError as e:
        return str(e).removeprefix("moe_route_sort: ")
    return None


def _sorts_route_ids(route_op, biased: bool | None):
    """A near-miss candidate: a moe_sort_by_expert op of the ids of a ``route_op`` call (with a
    correction bias or without, where ``biased`` says: the softmax and sigmoid forms share the op)."""

    def candidate(node) -> bool:
        flat = node.args[0] if node.args else None
        if getattr(flat, "target", None) not in (torch.ops.aten.reshape.default, torch.ops.aten.view.default):
            return False
        route = getattr(flat.args[0], "args", (None,))[0]
        if getattr(route, "target", None) is not route_op:
            return False
        return biased is None or (route.args[1] is not None) == biased

    return candidate


def _examples(route: str):
    """Meta tensors (the patterns call only canonical ops, which carry the shapes): 2 tokens of 42
    router logits in 7 groups of 6, and the scalars' sentinels, in the patterns' argument order (no
    size is a sentinel: 3 tokens would be topk_group's)."""

    def example_inputs():
        logits, bias = torch.empty(2, 42, device="meta"), torch.empty(42, device="meta")
        if route == "grouped":
            yield (logits, bias, TOP_K_SENTINEL, GROUPS_SENTINEL, KEPT_GROUPS_SENTINEL, DEFAULT_SCALAR_SENTINEL,
                   NUM_EXPERTS_SENTINEL)  # fmt: skip
        elif _ROUTES[route][0]:
            yield logits, bias, TOP_K_SENTINEL, NUM_EXPERTS_SENTINEL
        else:
            yield logits, TOP_K_SENTINEL, NUM_EXPERTS_SENTINEL

    return example_inputs


_OPT_IN = ("not yet timed on a GPU (bench_moe_sort_by_expert --regions route_sort decides it): it saves the "
           "route's launch, but each of the sort's programs routes every token again; the two kernels took 4.3 "
           "(DeepSeek's grouped route) and 1.8 us (the sort) at 1 token inside a CUDA graph on one H200")  # fmt: skip


def _fusion(name: str, routes: tuple[str, ...], route_op, requires: tuple[str, ...], summary: str) -> Fusion:
    return Fusion(
        name=name,
        summary=summary,
        doc=__doc__.split("\n\n", 1)[1],
        spellings=tuple(_spellings(route, inverse) for route in routes for inverse in (True, False)),
        example_inputs=_examples(routes[0]),
        scalars=_GROUPED_SCALARS if routes == ("grouped",) else _SCALARS,
        check=_check,
        requires=requires + ("moe_sort_by_expert",),
        candidate_ops=("fusion_passes.moe_sort_by_expert.default",),
        candidate=_sorts_route_ids(route_op, None if routes == ("grouped",) else _ROUTES[routes[0]][0]),
        opt_in=_OPT_IN,
        builtin=True,
    )


MOE_ROUTE_SORT_SIGMOID_BIAS = _fusion(
    "moe_route_sort_sigmoid_bias", ("sigmoid_bias",), torch.ops.fusion_passes.moe_route.default,
    ("moe_route_sigmoid_bias",), "moe_route_sort for MiniMax-M2's sigmoid + bias route",
)  # fmt: skip
MOE_ROUTE_SORT_GROUPED = _fusion(
    "moe_route_sort_grouped", ("grouped",), torch.ops.fusion_passes.moe_route_grouped.default,
    ("moe_route_grouped",), "moe_route_sort for DeepSeek V3 / V3.2's group-limited route",
)  # fmt: skip
MOE_ROUTE_SORT = _fusion(
    "moe_route_sort", ("softmax", "softmax_unnormalized"), torch.ops.fusion_passes.moe_route.default,
    ("moe_route_softmax", "moe_route_softmax_unnormalized", "moe_route_sort_sigmoid_bias", "moe_route_sort_grouped"),
    "MoE routing + dispatch prep (the route's top-k and the sort by expert, offsets, inverse permutation) -> one "
    "launch at decode",
)  # fmt: skip

FUSIONS = (MOE_ROUTE_SORT_SIGMOID_BIAS, MOE_ROUTE_SORT_GROUPED, MOE_ROUTE_SORT)
