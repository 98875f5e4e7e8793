"""Cached decode steps of the built-in MoE models (tiny widths, StaticCache, fullgraph, bf16) with
moe_sort_by_expert: every MoE layer's dispatch prep fused, and the outputs and cache contents over
several steps bit-equal to stock Inductor's (the dispatch changes no value: the stable order it
returns for tied expert ids only reorders rows that the grouped GEMMs compute alone and that the
inverse permutation puts back) and within bf16's tolerance of eager's."""

from __future__ import annotations

import pytest
import torch

import fusion_passes
from fusion_passes.models import build_model
from fusion_passes.models.decode import DecodeStep
from fusion_passes.numerics import compare, tolerance

STEPS = 3
LAYERS = 2


def _run(step, fn):
    step.restore()
    with torch.no_grad():
        outs = [fn(*step.inputs(i)) for i in range(STEPS)]
    return outs, [t.clone() for t in step.cache_tensors()]


def _moe_layers(module) -> int:
    return sum(1 for m in module.modules() if type(m).__name__.endswith("Experts"))


@pytest.mark.parametrize("name", ["qwen3-moe", pytest.param("minimax-m2", marks=pytest.mark.slow),
                                  pytest.param("deepseek-v3.2", marks=pytest.mark.slow),
                                  pytest.param("qwen3.5-moe", marks=pytest.mark.slow)])  # fmt: skip
def test_decode_step_fuses_every_moe_dispatch(name):
    built = build_model(name, size="tiny", dtype=torch.bfloat16, layers=LAYERS)
    step = DecodeStep(built.module, batch=2, context=6, steps=STEPS)
    moe_layers = _moe_layers(built.module)
    assert moe_layers >= 1
    report = fusion_passes.Report()
    torch._dynamo.reset()
    ours = torch.compile(step, backend=fusion_passes.backend(["moe_sort_by_expert"], report=report),
                         fullgraph=True, dynamic=False)  # fmt: skip
    outs, cache = _run(step, ours)
    torch._dynamo.reset()
    stock_outs, stock_cache = _run(step, torch.compile(step, fullgraph=True, dynamic=False))
    expected_outs, _ = _run(step, step)
    assert report.final() == {"moe_sort_by_expert": moe_layers}
    before, after = report.ops_before(), report.ops_after()
    for op in ("aten.sort.default", "aten.histc.default", "aten.cumsum.default"):
        assert (before[op], after[op]) == (moe_layers, 0), op
    assert after["fusion_passes.moe_sort_by_expert.default"] == moe_layers
    assert all(torch.equal(a, e) for a, e in zip(outs, stock_outs, strict=True))
    assert all(torch.equal(a, e) for a, e in zip(cache, stock_cache, strict=True))
    bound = tolerance(torch.bfloat16).rel_norm
    assert all(compare(a, e).rel_norm <= bound for a, e in zip(outs, expected_outs, strict=True))


@pytest.mark.slow  # two whole-model compiles
@pytest.mark.parametrize("name", ["qwen3-moe", "deepseek-v3.2"])
def test_decode_step_gathers_in_the_sort(name):
    """moe_sort_gather on top of the defaults: every MoE layer's sort op takes its gather, and the
    outputs and caches over several steps equal the defaults' bit for bit."""
    from _rewrites import decode_steps

    built = build_model(name, size="tiny", dtype=torch.bfloat16, layers=LAYERS)
    step = DecodeStep(built.module, batch=2, context=6, steps=STEPS)
    moe_layers = _moe_layers(built.module)
    defaults, _ = decode_steps(step, "all", steps=STEPS)
    gathered, report = decode_steps(step, ["all", "moe_sort_gather"], steps=STEPS)
    assert report.final()["moe_sort_gather"] == moe_layers and report.final()["moe_sort_by_expert"] == 0
    assert report.ops_after()["fusion_passes.moe_sort_gather.default"] == moe_layers
    assert "fusion_passes.moe_sort_by_expert.default" not in report.ops_after()
    assert all(torch.equal(a, b) for a, b in zip(gathered, defaults, strict=True))
