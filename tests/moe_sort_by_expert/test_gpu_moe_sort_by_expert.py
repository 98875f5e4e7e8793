"""CUDA: MoE decode steps (tiny widths, StaticCache, fullgraph) with moe_sort_by_expert: one
dispatch kernel per MoE layer in place of the sort / histc / cumsum / scatter kernels, fewer
kernels than stock Inductor, the outputs bit-equal to stock Inductor's over several steps (the
stable order changes no row the grouped GEMMs compute), in both launch modes, and a CUDA-graph
replay. Skipped without a GPU (run on the GPU machine)."""

from __future__ import annotations

import re

import pytest
import torch
from _gpu_decode import assert_graph_replay_matches, compile_step

import fusion_passes
from fusion_passes.kernels import count_kernels
from fusion_passes.models import build_model
from fusion_passes.models.decode import DecodeStep

pytestmark = pytest.mark.gpu
STEPS = 4
LAYERS = 2


def _outputs(step, fn):
    step.restore()
    with torch.no_grad():
        return [fn(*step.inputs(i)).clone() for i in range(STEPS)]


@pytest.mark.parametrize("model", ["minimax-m2", "qwen3-moe"])
@pytest.mark.parametrize("launch", ["direct", "dispatch"])
def test_decode_step_dispatch_is_one_kernel_and_bit_equal_to_stock(model, launch):
    torch._dynamo.reset()
    built = build_model(model, size="tiny", dtype=torch.bfloat16, layers=LAYERS, device="cuda")
    step = DecodeStep(built.module, batch=3, context=8, steps=STEPS)
    report = fusion_passes.Report()
    ours, codes = compile_step(step, fusion_passes.backend(["moe_sort_by_expert"], report=report, launch=launch))
    stock, stock_codes = compile_step(step, "inductor")
    assert report.final() == {"moe_sort_by_expert": LAYERS}
    before, after = report.ops_before(), report.ops_after()
    for op in ("aten.sort.default", "aten.histc.default", "aten.cumsum.default"):
        assert (before[op], after[op]) == (LAYERS, 0), op
    assert torch.equal(torch.stack(_outputs(step, ours)), torch.stack(_outputs(step, stock)))
    if launch == "direct":
        (code,) = codes
        assert len(re.findall(r"_sort_pairs_by_expert_kernel_\d+\.run\(", code)) == LAYERS
        assert sum(count_kernels(codes).values()) < sum(count_kernels(stock_codes).values())
    assert_graph_replay_matches(step, ours)


@pytest.mark.parametrize("model", ["qwen3-moe", "deepseek-v3.2"])
def test_decode_step_with_the_gather_and_the_router_gemm(model):
    """moe_sort_gather (and, for DeepSeek V3.2's fp32 router, router_logits) on top of the defaults:
    one _sort_gather_kernel per MoE layer and no _sort_pairs_by_expert_kernel; the gather changes
    no value (outputs bit-equal to the defaults' over several steps without the router GEMM, within
    bf16's tolerance with it, whose logits may differ in their last bits); a CUDA-graph replay."""
    from fusion_passes.numerics import compare, tolerance

    torch._dynamo.reset()
    built = build_model(model, size="tiny", dtype=torch.bfloat16, layers=LAYERS, device="cuda")
    step = DecodeStep(built.module, batch=3, context=8, steps=STEPS)
    moe_layers = sum(1 for m in built.module.modules() if type(m).__name__.endswith("Experts"))
    defaults, _ = compile_step(step, fusion_passes.backend("all"))
    report = fusion_passes.Report()
    gathered, (code,) = compile_step(step, fusion_passes.backend(["all", "moe_sort_gather"], report=report))
    assert report.final()["moe_sort_gather"] == moe_layers and not report.errors
    assert len(re.findall(r"_sort_gather_kernel_\d+\.run\(", code)) == moe_layers
    assert "_sort_pairs_by_expert_kernel" not in code
    assert torch.equal(torch.stack(_outputs(step, gathered)), torch.stack(_outputs(step, defaults)))
    assert_graph_replay_matches(step, gathered)
    if model == "deepseek-v3.2":
        report = fusion_passes.Report()
        routed, (code,) = compile_step(step, fusion_passes.backend(["all", "moe_sort_gather", "router_logits"], report=report))
        assert report.final()["router_logits"] == moe_layers
        assert len(re.findall(r"_router_gemm_kernel_\d+\.run\(", code)) == moe_layers
        for a, b in zip(_outputs(step, routed), _outputs(step, defaults), strict=True):
            assert compare(a, b).rel_norm <= tolerance(torch.bfloat16).rel_norm
        assert_graph_replay_matches(step, routed)
