"""Prefills of the built-in linear-attention models (tiny widths, bf16, fullgraph): with the
chunked-rule fusion every Gated DeltaNet layer's rule is one op (3 of the 4 layers are GDN), the
recurrent states the prefill writes into the StaticCache within bf16's tolerance of eager's (the
layers' inputs come from Inductor's kernels: not bit-equal), the output as close to eager's as
stock Inductor's (the tiny MoE model's routing flips put stock Inductor itself at 0.024 against
bf16's 0.02); a forward without a cache fuses too."""

from __future__ import annotations

import functools

import pytest
import torch

import fusion_passes
from transformers.models.qwen3_5 import modeling_qwen3_5
from fusion_passes.models import build_model
from fusion_passes.models.decode import DecodeStep
from fusion_passes.numerics import compare, tolerance

FUSED = "fusion_passes.chunk_gated_delta_rule.default"
SOLVE = "aten.linalg_solve_triangular.default"
PROMPT = 70  # two chunks of 64, the second padded


@functools.cache
def _step(name: str) -> DecodeStep:
    built = build_model(name, size="tiny", dtype=torch.bfloat16, layers=4)
    return DecodeStep(built.module, batch=2, context=PROMPT, steps=1)


def _recurrent_states(step) -> list[int]:
    ids = {
        id(t)
        for layer in step.cache.layers
        for t in getattr(layer, "recurrent_states", {}).values()
        if t is not None
    }
    return [i for i, t in enumerate(step.cache_tensors()) if id(t) in ids]


def _prefill(step, fn):
    step.restore()
    with torch.no_grad():
        out = fn(step.prompt, torch.arange(step.context))
    return out, [t.clone() for t in step.cache_tensors()]


@pytest.mark.parametrize(
    "name, export_path",
    [
        # the defaults' prefill of tiny Qwen 3.5 runs in CI (gated_delta_step's model tests)
        pytest.param("qwen3.5", False, marks=pytest.mark.slow),
        pytest.param("qwen3-next", False, marks=pytest.mark.slow),
        pytest.param("qwen3.5-moe", False, marks=pytest.mark.slow),
        # the form torch.compile traces under torch <= 2.11 (is_exporting() read as True)
        pytest.param("qwen3.5", True, marks=pytest.mark.slow),
    ],
)
def test_prefill_fuses_every_gdn_layer(name, export_path, monkeypatch):
    step = _step(name)
    report = fusion_passes.Report()
    backend = fusion_passes.backend(["chunk_gated_delta_rule"], report=report)

    def compiled(backend):
        torch._dynamo.reset()
        with monkeypatch.context() as patched:
            if export_path:
                patched.setattr(modeling_qwen3_5, "is_torchdynamo_exporting", lambda: True)
            return _prefill(step, torch.compile(step, backend=backend, fullgraph=True, dynamic=False))

    out, cache = compiled(backend)
    expected, expected_cache = _prefill(step, step)
    stock, stock_cache = compiled("inductor")
    assert report.final()["chunk_gated_delta_rule"] == 3 and not report.errors
    before, after = report.ops_before(), report.ops_after()
    assert (before.get(SOLVE, 0), after.get(SOLVE, 0)) == ((0, 0) if export_path else (6, 0))
    assert (before[FUSED], after[FUSED]) == (0, 3)
    scatters = before["aten.slice_scatter.default"] - after["aten.slice_scatter.default"]
    assert scatters >= (3 * 63 if export_path else 0)  # the forward substitution's 63 row writes a layer
    states = _recurrent_states(step)
    assert len(states) == 3
    bound = tolerance(torch.bfloat16).rel_norm
    for ours, theirs in ((cache, expected_cache), (stock_cache, expected_cache)):
        assert all(compare(ours[i], theirs[i]).rel_norm <= bound for i in states)
    error, stock_error = compare(out, expected).rel_norm, compare(stock, expected).rel_norm
    assert error <= max(bound, 1.25 * stock_error)


@pytest.mark.slow
def test_forward_without_cache_fuses():
    built = build_model("qwen3.5", size="tiny", dtype=torch.bfloat16, layers=4)
    ids = torch.randint(0, 256, (2, PROMPT), generator=torch.Generator().manual_seed(0))
    report = fusion_passes.Report()
    torch._dynamo.reset()
    compiled = torch.compile(
        built.module, backend=fusion_passes.backend(["chunk_gated_delta_rule"], report=report)
    )
    with torch.no_grad():
        out, expected = compiled(ids), built.module(ids)
    assert report.final()["chunk_gated_delta_rule"] == 3
    before, after = report.ops_before(), report.ops_after()
    assert (before[SOLVE], after[SOLVE]) == (6, 0) and (before[FUSED], after[FUSED]) == (0, 3)
    assert compare(out, expected).rel_norm <= tolerance(torch.bfloat16).rel_norm
