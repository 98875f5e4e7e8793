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

The gather form (moe_route_sort_gather, with moe_sort_gather's op): the same and the hidden states
in the sorted pairs' order for the first grouped GEMM, copied by programs that rank their pairs
again (3 launches -> 1).

With dynamic shapes the inverse permutation's length is read off the flat ids: that size is read
off the router's logits instead (tokens x top_k, the same value) before the patterns run.

Not a site: route ids read by anything else than the sort (the pattern's ids are its own), a
sort the launch table left to Inductor (a prefill's: no moe_sort_by_expert op).
"""

from __future__ import annotations

import operator
from typing import Any

import torch

from fusion_passes.fusion import DEFAULT_SCALAR_SENTINEL, Fusion, Spelling
from fusion_passes.lowering.moe_route_sort.reference import check_moe_route_sort_args, check_moe_route_sort_gather_args
from fusion_passes.patterns.moe_route import GROUPS_SENTINEL, TOP_K_SENTINEL
from fusion_passes.patterns.moe_sort_by_expert import NUM_EXPERTS_SENTINEL

# The kept groups' sentinel: not moe_route's 3, which is also the sort's inv_perm output index here
# (getitem(sort, 3) would be taken for the argument).
KEPT_GROUPS_SENTINEL = 6

_SCALARS = {"top_k": TOP_K_SENTINEL, "num_experts": NUM_EXPERTS_SENTINEL}
_GROUPED_SCALARS = {**_SCALARS, "n_group": GROUPS_SENTINEL, "topk_group": KEPT_GROUPS_SENTINEL,
                    "routed_scaling_factor": DEFAULT_SCALAR_SENTINEL}  # fmt: skip
_MOE_ROUTE, _MOE_ROUTE_GROUPED = torch.ops.fusion_passes.moe_route.default, torch.ops.fusion_passes.moe_route_grouped.default
_SORT_OPS = (torch.ops.fusion_passes.moe_sort_by_expert.default, torch.ops.fusion_passes.moe_sort_gather.default)
# The route op's call per form: (bias given, softmax, renormalize); "grouped" is moe_route_grouped.
_ROUTES = {"softmax": (False, True, True), "softmax_unnormalized": (False, True, False), "sigmoid_bias": (True, False, True)}


def _sorted(weights, ids, num_experts, inverse: bool, hidden_states=None, top_k=None):
    """moe_sort_by_expert's op on the route's ids (or moe_sort_gather's, with ``hidden_states``)
    and the outputs the graph reads: inv_perm where ``inverse``."""
    if hidden_states is None:
        sorted_ids, perm, offsets, inv_perm = torch.ops.fusion_passes.moe_sort_by_expert.default(
            ids.reshape(-1), num_experts
        )
        gathered = ()
    else:
        sorted_ids, perm, offsets, inv_perm, rows = torch.ops.fusion_passes.moe_sort_gather.default(
            ids.reshape(-1), num_experts, hidden_states, top_k
        )
        gathered = (rows,)
    return (weights, sorted_ids, perm, offsets) + ((inv_perm,) if inverse else ()) + gathered


def _fused(route_args, num_experts, inverse: bool, hidden_states=None):
    """The fused op on the route's arguments (moe_route_sort's order up to num_experts), as _sorted's
    outputs."""
    if hidden_states is None:
        weights, _, sorted_ids, perm, offsets, inv_perm = torch.ops.fusion_passes.moe_route_sort.default(
            *route_args, num_experts
        )
        gathered = ()
    else:
        weights, _, sorted_ids, perm, offsets, inv_perm, rows = torch.ops.fusion_passes.moe_route_sort_gather.default(
            *route_args, num_experts, hidden_states
        )
        gathered = (rows,)
    return (weights, sorted_ids, perm, offsets) + ((inv_perm,) if inverse else ()) + gathered


def _spellings(route: str, inverse: bool, gather: bool) -> Spelling:
    """The route op of form ``route`` and the sort of its ids (with or without inv_perm; with the
    gather of the hidden states where ``gather``)."""
    name = f"{route}_route_then_dispatch{'' if inverse else '_sort'}{'_gather' if gather else ''}"
    if route == "grouped":
        def grouped_route(router_logits, e_score_correction_bias, top_k, n_group, topk_group, routed_scaling_factor):
            return torch.ops.fusion_passes.moe_route_grouped.default(
                router_logits, e_score_correction_bias, top_k, n_group, topk_group, True, routed_scaling_factor
            )

        if gather:

            def pattern(router_logits, e_score_correction_bias, hidden_states, top_k, n_group, topk_group,
                        routed_scaling_factor, num_experts):  # fmt: skip
                weights, ids = grouped_route(router_logits, e_score_correction_bias, top_k, n_group, topk_group,
                                             routed_scaling_factor)  # fmt: skip
                return _sorted(weights, ids, num_experts, inverse, hidden_states, top_k)

            def replacement(router_logits, e_score_correction_bias, hidden_states, top_k, n_group, topk_group,
                            routed_scaling_factor, num_experts):  # fmt: skip
                args = (router_logits, e_score_correction_bias, top_k, False, True, n_group, topk_group,
                        routed_scaling_factor)  # fmt: skip
                return _fused(args, num_experts, inverse, hidden_states)

            return Spelling(name, pattern, replacement)

        def pattern(router_logits, e_score_correction_bias, top_k, n_group, topk_group, routed_scaling_factor,
                    num_experts):  # fmt: skip
            weights, ids = grouped_route(router_logits, e_score_correction_bias, top_k, n_group, topk_group,
                                         routed_scaling_factor)  # fmt: skip
            return _sorted(weights, ids, num_experts, inverse)

        def replacement(router_logits, e_score_correction_bias, top_k, n_group, topk_group, routed_scaling_factor,
                        num_experts):  # fmt: skip
            args = (router_logits, e_score_correction_bias, top_k, False, True, n_group, topk_group,
                    routed_scaling_factor)  # fmt: skip
            return _fused(args, num_experts, inverse)

        return Spelling(name, pattern, replacement)
    has_bias, softmax, renormalize = _ROUTES[route]
    if has_bias and gather:

        def pattern(router_logits, e_score_correction_bias, hidden_states, top_k, num_experts):
            weights, ids = torch.ops.fusion_passes.moe_route.default(
                router_logits, e_score_correction_bias, top_k, softmax, renormalize
            )
            return _sorted(weights, ids, num_experts, inverse, hidden_states, top_k)

        def replacement(router_logits, e_score_correction_bias, hidden_states, top_k, num_experts):
            args = (router_logits, e_score_correction_bias, top_k, softmax, renormalize, 0, 0, 1.0)
            return _fused(args, num_experts, inverse, hidden_states)

    elif has_bias:

        def pattern(router_logits, e_score_correction_bias, top_k, num_experts):
            weights, ids = torch.ops.fusion_passes.moe_route.default(
                router_logits, e_score_correction_bias, top_k, softmax, renormalize
            )
            return _sorted(weights, ids, num_experts, inverse)

        def replacement(router_logits, e_score_correction_bias, top_k, num_experts):
            return _fused((router_logits, e_score_correction_bias, top_k, softmax, renormalize, 0, 0, 1.0),
                          num_experts, inverse)  # fmt: skip

    elif gather:

        def pattern(router_logits, hidden_states, top_k, num_experts):
            weights, ids = torch.ops.fusion_passes.moe_route.default(router_logits, None, top_k, softmax, renormalize)
            return _sorted(weights, ids, num_experts, inverse, hidden_states, top_k)

        def replacement(router_logits, hidden_states, top_k, num_experts):
            args = (router_logits, None, top_k, softmax, renormalize, 0, 0, 1.0)
            return _fused(args, num_experts, inverse, hidden_states)

    else:

        def pattern(router_logits, top_k, num_experts):
            weights, ids = torch.ops.fusion_passes.moe_route.default(router_logits, None, top_k, softmax, renormalize)
            return _sorted(weights, ids, num_experts, inverse)

        def replacement(router_logits, top_k, num_experts):
            return _fused((router_logits, None, top_k, softmax, renormalize, 0, 0, 1.0), num_experts, inverse)

    return Spelling(name, pattern, replacement)


def _check(values: dict[str, Any]) -> str | None:
    grouped = "n_group" in values
    bias = values.get("e_score_correction_bias")
    route = (values["router_logits"], bias, values["top_k"], False if grouped else bias is None,
             values.get("n_group", 0), values.get("topk_group", 0), values.get("routed_scaling_factor", 1.0),
             values["num_experts"])  # fmt: skip
    try:
        if "hidden_states" in values:
            check_moe_route_sort_gather_args(*route, values["hidden_states"])
        else:
            check_moe_route_sort_args(*route)
    except ValueError as e:
        return str(e).split(": ", 1)[1]
    return None


def _sorts_route_ids(sort_op, route_op, biased: bool | None):
    """A near-miss candidate: a ``sort_op`` call on the ids of a ``route_op`` call (with a correction
    bias or without, where ``biased`` says: the softmax and sigmoid forms share the op)."""

    def candidate(node) -> bool:
        flat = node.args[0] if node.args else None
        if node.target is not sort_op or getattr(flat, "target", None) not in (
            torch.ops.aten.reshape.default, torch.ops.aten.view.default,
        ):  # fmt: skip
            return False
        route = getattr(flat.args[0], "args", (None,))[0]
        if getattr(route, "target", None) is not route_op:
            return False
        return biased is None or (route.args[1] is not None) == biased

    return candidate


def pair_count_from_the_logits(graph: torch.fx.Graph) -> int:
    """With dynamic shapes transformers' inverse permutation takes its length from the flat ids
    (``arange(perm.size(0))`` traces as ``sym_size(ids.reshape(-1), 0)``): a second reader of the
    ids, which keeps the route's op and the sort's apart. That size is tokens x top_k, read here
    off the router's logits instead (the same value). Returns the sizes moved."""
    moved = 0
    for sort in [n for op in _SORT_OPS for n in graph.find_nodes(op="call_function", target=op)]:
        flat = sort.args[0]
        if getattr(flat, "target", None) not in (torch.ops.aten.reshape.default, torch.ops.aten.view.default):
            continue
        ids = flat.args[0]
        route = ids.args[0] if getattr(ids, "target", None) is operator.getitem and ids.args[1] == 1 else None
        if getattr(route, "target", None) not in (_MOE_ROUTE, _MOE_ROUTE_GROUPED):
            continue
        logits, top_k = route.args[0], route.args[2]
        for size in [u for u in flat.users if u.target is torch.ops.aten.sym_size.int and u.args[1] == 0]:
            with graph.inserting_before(size):
                tokens = graph.call_function(torch.ops.aten.sym_size.int, (logits, 0))
                tokens.meta["val"] = logits.meta["val"].shape[0]
                pairs = graph.call_function(operator.mul, (tokens, top_k))
                pairs.meta["val"] = size.meta["val"]  # tokens x top_k: the flat ids' length
            size.replace_all_uses_with(pairs)
            graph.erase_node(size)
            moved += 1
    return moved


def _examples(route: str, gather: bool):
    """Meta tensors (the patterns call only canonical ops, which carry the shapes): 2 tokens of 42
    router logits in 7 groups of 6, and the scalars' sentinels, in the patterns' argument order (no
    size is a sentinel: 3 tokens would be topk_group's); with the gather, 2 rows of 16 hidden
    states. The tensors first, then the scalars: the matcher takes the example's leading values for
    the pattern's arguments that are not scalars, in order."""

    def example_inputs():
        logits, bias = torch.empty(2, 42, device="meta"), torch.empty(42, device="meta")
        hidden = (torch.empty(2, 16, dtype=torch.bfloat16, device="meta"),) if gather else ()
        if route == "grouped":
            yield (logits, bias, *hidden, TOP_K_SENTINEL, GROUPS_SENTINEL, KEPT_GROUPS_SENTINEL,
                   DEFAULT_SCALAR_SENTINEL, NUM_EXPERTS_SENTINEL)  # fmt: skip
        elif _ROUTES[route][0]:
            yield logits, bias, *hidden, TOP_K_SENTINEL, NUM_EXPERTS_SENTINEL
        else:
            yield logits, *hidden, TOP_K_SENTINEL, NUM_EXPERTS_SENTINEL

    return example_inputs


_OPT_IN = ("not yet timed on a GPU (bench_moe_sort_by_expert --regions route_sort decides it): it saves the "
           "route's launch, but each of the sort's programs routes every token again; the two kernels took 4.3 "
           "(DeepSeek's grouped route) and 1.8 us (the sort) at 1 token inside a CUDA graph on one H200")  # fmt: skip


def _fusion(name: str, routes: tuple[str, ...], route_op, requires: tuple[str, ...], summary: str,
            gather: bool = False) -> Fusion:  # fmt: skip
    grouped = routes == ("grouped",)
    sort_op = torch.ops.fusion_passes.moe_sort_gather.default if gather else torch.ops.fusion_passes.moe_sort_by_expert.default
    return Fusion(
        name=name,
        summary=summary,
        doc=__doc__.split("\n\n", 1)[1],
        spellings=tuple(_spellings(route, inverse, gather) for route in routes for inverse in (True, False)),
        example_inputs=_examples(routes[0], gather),
        scalars=_GROUPED_SCALARS if grouped else _SCALARS,
        check=_check,
        requires=requires + ("moe_sort_gather" if gather else "moe_sort_by_expert",),
        candidate_ops=("fusion_passes.moe_sort_gather.default" if gather else "fusion_passes.moe_sort_by_expert.default",),
        candidate=_sorts_route_ids(sort_op, route_op, None if grouped else _ROUTES[routes[0]][0]),
        canonicalize=pair_count_from_the_logits,
        opt_in=_OPT_IN,
        builtin=True,
    )


_SOFTMAX_ROUTES = ("moe_route_softmax", "moe_route_softmax_unnormalized")
FUSIONS = (
    _fusion("moe_route_sort_sigmoid_bias", ("sigmoid_bias",), _MOE_ROUTE, ("moe_route_sigmoid_bias",),
            "moe_route_sort for MiniMax-M2's sigmoid + bias route"),
    _fusion("moe_route_sort_grouped", ("grouped",), _MOE_ROUTE_GROUPED, ("moe_route_grouped",),
            "moe_route_sort for DeepSeek V3 / V3.2's group-limited route"),
    _fusion("moe_route_sort", ("softmax", "softmax_unnormalized"), _MOE_ROUTE,
            (*_SOFTMAX_ROUTES, "moe_route_sort_sigmoid_bias", "moe_route_sort_grouped"),
            "MoE routing + dispatch prep (the route's top-k and the sort by expert, offsets, inverse permutation) "
            "-> one launch at decode"),
    _fusion("moe_route_sort_gather_sigmoid_bias", ("sigmoid_bias",), _MOE_ROUTE, ("moe_route_sigmoid_bias",),
            "moe_route_sort_gather for MiniMax-M2's sigmoid + bias route", gather=True),
    _fusion("moe_route_sort_gather_grouped", ("grouped",), _MOE_ROUTE_GROUPED, ("moe_route_grouped",),
            "moe_route_sort_gather for DeepSeek V3 / V3.2's group-limited route", gather=True),
    _fusion("moe_route_sort_gather", ("softmax", "softmax_unnormalized"), _MOE_ROUTE,
            (*_SOFTMAX_ROUTES, "moe_route_sort_gather_sigmoid_bias", "moe_route_sort_gather_grouped"),
            "MoE routing + dispatch prep + the gather of the hidden states for the first grouped GEMM (moe_sort_gather's "
            "op) -> one launch at decode", gather=True),
)  # fmt: skip
