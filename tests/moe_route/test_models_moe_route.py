"""Cached decode steps of the built-in MoE models (tiny widths, StaticCache, fullgraph, bf16) with
every default fusion: each MoE layer's router and dispatch fused (Qwen3-MoE, Qwen 3.5-MoE: softmax
routing; MiniMax-M2: sigmoid + bias; DeepSeek V3.2's group-limited routing is left to Inductor),
the outputs over several steps within bf16's tolerance of eager's. Not bit-equal to stock
Inductor: the router's softmax sums its scores in another order, and equal scores come out in
expert-id order, where torch.topk's order is its own."""

from __future__ import annotations

import pytest
import torch
from _rewrites import defaults_without

import fusion_passes
from fusion_passes.models import build_model
from fusion_passes.models.decode import DecodeStep
from fusion_passes.numerics import compare, tolerance

STEPS = 3
ROUTE = {"qwen3-moe": "moe_route_softmax", "qwen3.5-moe": "moe_route_softmax", "minimax-m2": "moe_route_sigmoid_bias",
         "deepseek-v3.2": None}  # fmt: skip


def _run(step, fn):
    step.restore()
    with torch.no_grad():
        return [fn(*step.inputs(i)) for i in range(STEPS)]



def _defaults_but_the_index_mask() -> list[str]:
    """The defaults without DeepSeek V3.2's live index mask kernel: this tiny model's indexer
    scores tie at the k-th place in some steps (6 cached tokens, top 4), where the kernel keeps
    the lowest positions as CUDA's top-k does and the CPU's top-k keeps others, so the steps
    attend to other tokens than eager's on the CPU. These tests are the routers'. (Without the
    fusions that start from its op too, which would enable it again.)"""
    return defaults_without("sparse_index_mask_topk")

@pytest.mark.parametrize("name", ["qwen3-moe", pytest.param("minimax-m2", marks=pytest.mark.slow),
                                  pytest.param("qwen3.5-moe", marks=pytest.mark.slow),
                                  pytest.param("deepseek-v3.2", marks=pytest.mark.slow)])  # fmt: skip
def test_decode_step_routes_every_moe_layer(name):
    built = build_model(name, size="tiny", dtype=torch.bfloat16, layers=2)
    step = DecodeStep(built.module, batch=2, context=6, steps=STEPS)
    moe_layers = sum(1 for m in built.module.modules() if type(m).__name__.endswith("Experts"))
    report = fusion_passes.Report()
    torch._dynamo.reset()
    backend = fusion_passes.backend(_defaults_but_the_index_mask(), report=report)
    compiled = torch.compile(step, backend=backend, fullgraph=True, dynamic=False)
    outs = _run(step, compiled)
    expected = _run(step, step)
    final = report.final()
    assert final["moe_sort_by_expert"] == moe_layers
    routes = {f: final[f] for f in ("moe_route_softmax", "moe_route_softmax_unnormalized", "moe_route_sigmoid_bias")}
    want = {f: (moe_layers if f == ROUTE[name] else 0) for f in routes}
    assert routes == want
    before, after = report.ops_before(), report.ops_after()
    assert after["fusion_passes.moe_route.default"] == sum(want.values())
    # DeepSeek V3.2's group-limited router is moe_route_grouped's (a default): its three top-ks go too
    grouped = final["moe_route_grouped"] + final["moe_route_grouped_one_group"]
    assert grouped == (moe_layers if name == "deepseek-v3.2" else 0)
    assert before["aten.topk.default"] - after["aten.topk.default"] == sum(want.values()) + 3 * grouped
    if ROUTE[name] is None and not grouped:  # a router no route fusion takes is a near miss
        assert {m.fusion for m in report.near_misses} >= {"moe_route_softmax"}
    bound = tolerance(torch.bfloat16).rel_norm
    assert all(compare(a, e).rel_norm <= bound for a, e in zip(outs, expected, strict=True))


@pytest.mark.slow
def test_deepseek_decode_step_with_group_limited_routing():
    """DeepSeek V3.2 (tiny: 2 groups of 2 experts, 1 kept: the one-hot group mask's form) with the
    default moe_route_grouped (named too): every MoE layer's router one op, outputs
    within bf16's tolerance of eager's."""
    built = build_model("deepseek-v3.2", size="tiny", dtype=torch.bfloat16, layers=2)
    step = DecodeStep(built.module, batch=2, context=6, steps=STEPS)
    moe_layers = sum(1 for m in built.module.modules() if type(m).__name__.endswith("Experts"))
    report = fusion_passes.Report()
    fusions = _defaults_but_the_index_mask() + ["moe_route_grouped"]
    torch._dynamo.reset()
    compiled = torch.compile(step, backend=fusion_passes.backend(fusions, report=report), fullgraph=True, dynamic=False)
    outs = _run(step, compiled)
    expected = _run(step, step)
    final = report.final()
    assert (final["moe_route_grouped_one_group"], final["moe_route_grouped"]) == (moe_layers, 0)
    assert final["moe_sort_by_expert"] == moe_layers
    assert not [m for m in report.near_misses if m.fusion.startswith("moe_route")]
    bound = tolerance(torch.bfloat16).rel_norm
    assert all(compare(a, e).rel_norm <= bound for a, e in zip(outs, expected, strict=True))
