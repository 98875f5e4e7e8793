"""Cached decode steps of tiny GQA models (StaticCache, fullgraph, bf16) with the GQA rewrite alone:
every attention layer's repeat_kv gone, and the steps' outputs and caches bit-equal to stock
Inductor's over several steps (on the CPU the flash kernel takes grouped heads as they are, so
the rewrite changes no bit); with every default fusion, within bf16's tolerance of eager."""

from __future__ import annotations

import pytest
import torch

import fusion_passes
from fusion_passes.models import build_model
from fusion_passes.models.decode import DecodeStep
from fusion_passes.numerics import compare, tolerance

STEPS = 3


def _run(step, fn):
    step.restore()
    with torch.no_grad():
        outs = [fn(*step.inputs(i)).clone() for i in range(STEPS)]
    return outs, [t.clone() for t in step.cache_tensors()]


def _step(name):
    built = build_model(name, size="tiny", dtype=torch.bfloat16, layers=2)
    layers = sum(1 for n, _ in built.module.named_modules() if n.endswith("self_attn"))
    return DecodeStep(built.module, batch=2, context=6, steps=STEPS), layers


def test_decode_step_bit_equal_to_stock_inductor():
    step, layers = _step("qwen3")
    report = fusion_passes.Report()
    torch._dynamo.reset()
    ours = torch.compile(step, backend=fusion_passes.backend(["gqa_decode_attention"], report=report), fullgraph=True,
                         dynamic=False)  # fmt: skip
    stock = torch.compile(step, backend="inductor", fullgraph=True, dynamic=False)
    (outs, cache), (want, want_cache) = _run(step, ours), _run(step, stock)
    assert report.final()["gqa_decode_attention"] == layers == 2
    before, after = report.ops_before(), report.ops_after()
    for op in ("aten.clone.default", "aten.expand.default"):
        assert before[op] - after[op] == 2 * layers
    assert all(torch.equal(a, b) for a, b in zip(outs, want, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(cache, want_cache, strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["minimax-m2", "qwen3.5-moe", "qwen3-next"])
def test_decode_step_with_every_default_fusion(name):
    step, layers = _step(name)
    report = fusion_passes.Report()
    torch._dynamo.reset()
    ours = torch.compile(step, backend=fusion_passes.backend(report=report), fullgraph=True, dynamic=False)
    (outs, cache), (want, want_cache) = _run(step, ours), _run(step, step)
    assert report.final()["gqa_decode_attention"] == layers
    bound = tolerance(torch.bfloat16).rel_norm
    assert all(compare(a, e).rel_norm <= bound for a, e in zip(outs, want, strict=True))
    for a, e in zip(cache, want_cache, strict=True):  # keys, values, states (and integer lengths)
        assert compare(a, e).rel_norm <= bound if a.is_floating_point() else torch.equal(a, e)
