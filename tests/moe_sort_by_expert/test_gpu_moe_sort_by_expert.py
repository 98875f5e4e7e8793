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
