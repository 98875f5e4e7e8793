"""transformers' MoE blocks (grouped_mm experts; Qwen 3.5-MoE's softmax router, MiniMax-M2's
sigmoid + bias, DeepSeek V3's group-limited one) compiled with moe_route_sort (opt-in): the
route's op and the sort of its ids become one op (match counts, ops before / after) and the
block's output is bit-equal to the two ops' (on the CPU both run the same references), past the
one-launch token bound too; with moe_route_sort_gather, the route and moe_sort_gather's op (the
hidden states gathered for the first grouped GEMM) likewise. A model that reads the route's ids
beside the sort keeps two ops, and moe_route_sort leaves moe_sort_gather's sites alone."""

from __future__ import annotations

import pytest
import torch

import fusion_passes
from _moe_blocks import EXPERTS, HIDDEN, TOP_K, moe_block
from fusion_passes.lowering.moe_route_sort.triton import ROUTE_SORT_MAX_TOKENS
from fusion_passes.numerics import compare, tolerance

ROUTES = {"qwen3.5-moe": ("moe_route_softmax", "moe_route_sort"),
          "minimax-m2": ("moe_route_sigmoid_bias", "moe_route_sort_sigmoid_bias"),
          "deepseek-v3": ("moe_route_grouped", "moe_route_sort_grouped")}  # fmt: skip
# (the fold's family name, its op, the sort it folds) without and with the gather
FOLDS = {False: ("moe_route_sort", "fusion_passes.moe_route_sort.default", "moe_sort_by_expert"),
         True: ("moe_route_sort_gather", "fusion_passes.moe_route_sort_gather.default", "moe_sort_gather")}  # fmt: skip
ROUTE_OPS = ("fusion_passes.moe_route.default", "fusion_passes.moe_route_grouped.default")
SORT_OP, FUSED_OP = "fusion_passes.moe_sort_by_expert.default", "fusion_passes.moe_route_sort.default"


def _run(fn, x, fusions):
    report = fusion_passes.Report()
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=fusion_passes.backend(fusions, report=report), fullgraph=True)
    with torch.no_grad():
        return compiled(x), report


@pytest.mark.parametrize("gather", [False, True], ids=["sort", "sort_gather"])
@pytest.mark.parametrize("model", list(ROUTES))
@pytest.mark.parametrize("tokens", [1, 6, ROUTE_SORT_MAX_TOKENS + 4])
def test_route_and_dispatch_fold_bit_equal_to_the_two_ops(model, tokens, gather):
    block = moe_block(model)
    x = torch.randn(1, tokens, HIDDEN, dtype=torch.bfloat16)
    route, fold = ROUTES[model]
    family, fused_op, sort = FOLDS[gather]
    fold = fold.replace("moe_route_sort", family)
    two_ops, _ = _run(block, x, [route, sort])
    out, report = _run(block, x, [fold])
    assert report.final()[fold] == 1 and report.final()[route] == 0 and report.final()[sort] == 0
    before, after = report.ops_before(), report.ops_after()
    assert (before["aten.histc.default"], after["aten.histc.default"]) == (1, 0)
    assert before["aten.topk.default"] >= 1 and after["aten.topk.default"] == 0
    assert sum(after[op] for op in ROUTE_OPS) == 0 and after[SORT_OP] == 0 and after[fused_op] == 1
    assert after["fusion_passes.moe_sort_gather.default"] == 0
    assert torch.equal(out, two_ops)
    with torch.no_grad():
        eager = block(x)
    assert compare(out, eager).rel_norm < tolerance(torch.bfloat16).rel_norm


def _router_then_dispatch_keeping_ids(logits):
    """A dispatch that also returns the route's ids (a load-balancing statistic, say): the ids are
    read outside the sort, so the route stays its own op."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    weights, ids = torch.topk(probs, TOP_K, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    flat = ids.reshape(-1)
    sorted_ids, perm = torch.sort(flat)
    offsets = torch.cumsum(torch.histc(sorted_ids.float(), bins=EXPERTS, min=0, max=EXPERTS - 1), 0, dtype=torch.int32)
    return weights.to(logits.dtype), sorted_ids, perm, offsets, torch.bincount(flat, minlength=EXPERTS)


def test_ids_read_beside_the_sort_keep_two_ops():
    logits = torch.randn(5, EXPERTS, dtype=torch.bfloat16)
    (weights, *rest), report = _run(_router_then_dispatch_keeping_ids, logits, ["moe_route_sort"])
    assert report.final()["moe_route_sort"] == 0
    assert report.final()["moe_route_softmax"] == 1 and report.final()["moe_sort_by_expert"] == 1
    before, after = report.ops_before(), report.ops_after()
    assert (before["aten.topk.default"], after["aten.topk.default"]) == (1, 0)
    assert (before["aten.histc.default"], after["aten.histc.default"]) == (1, 0)
    assert after["fusion_passes.moe_route.default"] == 1 and after[SORT_OP] == 1 and after[FUSED_OP] == 0
    (miss,) = [m for m in report.near_misses if m.fusion == "moe_route_sort"]
    assert miss.spelling.startswith("softmax_route_then_dispatch")
    expected = _router_then_dispatch_keeping_ids(logits)
    assert torch.equal(weights, expected[0]) and all(torch.equal(a, e) for a, e in zip(rest[2:], expected[3:]))


def test_the_gather_form_keeps_its_own_op():
    """With moe_sort_gather on, the sort gathers the hidden states: that fold comes first and
    this one finds no moe_sort_by_expert op."""
    block = moe_block("qwen3.5-moe")
    x = torch.randn(1, 3, HIDDEN, dtype=torch.bfloat16)
    _, report = _run(block, x, ["moe_route_sort", "moe_sort_gather"])
    assert report.final()["moe_sort_gather"] == 1 and report.final()["moe_route_sort"] == 0
    before, after = report.ops_before(), report.ops_after()
    assert (before["aten.histc.default"], after["aten.histc.default"]) == (1, 0)
    assert after["fusion_passes.moe_route.default"] == 1
    assert after["fusion_passes.moe_sort_gather.default"] == 1 and after[FUSED_OP] == 0


@pytest.mark.parametrize("gather", [False, True], ids=["sort", "sort_gather"])
def test_dynamic_token_counts_fold(gather):
    """With dynamic shapes the inverse permutation's length is read off the flat ids (a second
    reader of them): the fold reads it off the router's logits instead, and folds; every token
    count then takes the one graph, bit-equal to the two ops'."""
    block = moe_block("minimax-m2")  # (DeepSeek V3's grouped route itself is not fused with dynamic shapes)
    family, fused_op, sort = FOLDS[gather]
    outs = {}
    for fusions in (["moe_route_sigmoid_bias", sort], [f"{family}_sigmoid_bias"]):
        report = fusion_passes.Report()
        torch._dynamo.reset()
        compiled = torch.compile(block, backend=fusion_passes.backend(fusions, report=report), fullgraph=True,
                                 dynamic=True)  # fmt: skip
        inputs = [torch.randn(1, t, HIDDEN, generator=torch.Generator().manual_seed(t)).bfloat16() for t in (3, 5, 9)]
        with torch.no_grad():
            outs[len(fusions)] = [compiled(x) for x in inputs]
    before, after = report.ops_before(), report.ops_after()
    assert report.final()[f"{family}_sigmoid_bias"] == 1 and after[fused_op] == 1
    assert (before["aten.histc.default"], after["aten.histc.default"]) == (1, 0)
    assert (before["aten.topk.default"], after["aten.topk.default"]) == (1, 0)
    assert sum(after[op] for op in ROUTE_OPS) == 0 and after[SORT_OP] == 0
    assert after["aten.sym_size.int"] >= 1  # the graph is dynamic
    assert all(torch.equal(a, b) for a, b in zip(outs[1], outs[2], strict=True))
