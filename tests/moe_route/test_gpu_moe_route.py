"""CUDA: MoE decode steps (tiny widths, StaticCache, fullgraph) with every default fusion: each
MoE layer's router one kernel (its top-k and sort kernels gone), fewer kernels than stock
Inductor, the outputs over several steps within stock Inductor's own error against eager (twice
it, or bf16's rounding where that is 0), in both launch modes, and a CUDA-graph replay. Skipped
without a GPU (run on the GPU machine)."""

from __future__ import annotations

import re

import pytest
import torch
from _gpu_decode import assert_graph_replay_matches, compile_step

import fusion_passes
from fusion_passes.kernels import count_kernels
from fusion_passes.models import build_model
from fusion_passes.models.decode import DecodeStep
from fusion_passes.numerics import compare

pytestmark = pytest.mark.gpu
STEPS = 4
LAYERS = 2


def _error(step, fn, expected) -> float:
    step.restore()
    with torch.no_grad():
        outs = [fn(*step.inputs(i)).clone() for i in range(STEPS)]
    return max(compare(a, e).rel_norm for a, e in zip(outs, expected, strict=True))


@pytest.mark.parametrize(
    ("model", "route", "router_topks"),
    [("qwen3-moe", "moe_route_softmax", 1), ("minimax-m2", "moe_route_sigmoid_bias", 1),
     # the tiny config keeps one group of two: the one-hot group mask's form
     ("deepseek-v3.2", "moe_route_grouped_one_group", 3)],
)  # fmt: skip
@pytest.mark.parametrize("launch", ["direct", "dispatch"])
def test_decode_step_routes_in_one_kernel(model, route, router_topks, launch):
    torch._dynamo.reset()
    built = build_model(model, size="tiny", dtype=torch.bfloat16, layers=LAYERS, device="cuda")
    step = DecodeStep(built.module, batch=3, context=8, steps=STEPS)
    moe_layers = sum(1 for m in built.module.modules() if type(m).__name__.endswith("Experts"))
    report = fusion_passes.Report()
    fusions = [f.name for f in fusion_passes.registry.get_fusions("all")]
    fusions += ["moe_route_grouped"] if route.startswith("moe_route_grouped") else []
    ours, codes = compile_step(step, fusion_passes.backend(fusions, report=report, launch=launch))
    stock, stock_codes = compile_step(step, "inductor")
    assert report.final()[route] == moe_layers and report.final()["moe_sort_by_expert"] == moe_layers
    before, after = report.ops_before(), report.ops_after()
    # the router's top-ks gone, and DeepSeek V3.2's indexer top-ks (which sparse_index_mask_all or
    # sparse_index_mask_topk take)
    indexer = sum(report.final().get(f"sparse_index_mask_{form}", 0) for form in ("all", "topk"))
    routed = router_topks * moe_layers + indexer
    assert before["aten.topk.default"] - after["aten.topk.default"] == routed
    op = "moe_route_grouped" if route.startswith("moe_route_grouped") else "moe_route"
    assert after[f"fusion_passes.{op}.default"] == moe_layers
    step.restore()
    with torch.no_grad():
        expected = [step(*step.inputs(i)).clone() for i in range(STEPS)]
    assert _error(step, ours, expected) <= 2 * max(_error(step, stock, expected), 4e-3)
    if launch == "direct":
        (code,) = codes
        kernel = "_route_grouped_topk_kernel" if route.startswith("moe_route_grouped") else "_route_topk_kernel"
        assert len(re.findall(rf"{kernel}_\d+\.run\(", code)) == moe_layers
        assert sum(count_kernels(codes).values()) < sum(count_kernels(stock_codes).values())
    assert_graph_replay_matches(step, ours)
