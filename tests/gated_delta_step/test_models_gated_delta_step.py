"""Cached decode steps of the built-in linear-attention models (tiny widths, StaticCache,
fullgraph, bf16): every Gated DeltaNet layer's conv and recurrent step fused (3 of the 4 layers
are GDN), the outputs and the cache's conv and recurrent states after several steps within bf16's
tolerance of eager's (the layers' inputs come from Inductor's kernels: not bit-equal); a prefill
through the same cache leaves the layers to Inductor (the chunked rule is not this pattern)."""

from __future__ import annotations

import functools

import pytest
import torch

import fusion_passes
from fusion_passes.models import build_model
from fusion_passes.models.decode import DecodeStep
from fusion_passes.numerics import compare, tolerance
from fusion_passes.registry import get_fusions

STEPS = 3


@functools.cache
def _step(name: str) -> DecodeStep:
    built = build_model(name, size="tiny", dtype=torch.bfloat16, layers=4)
    return DecodeStep(built.module, batch=2, context=6, steps=STEPS)


def _run(step, fn):
    step.restore()
    with torch.no_grad():
        outs = [fn(*step.inputs(i)) for i in range(STEPS)]
    return outs, [t.clone() for t in step.cache_tensors()]


def _states(step) -> list[int]:
    """Indices of the cache tensors that are linear-attention states (conv and recurrent)."""
    ids = set()
    for layer in step.cache.layers:
        for states in (getattr(layer, "conv_states", {}), getattr(layer, "recurrent_states", {})):
            ids |= {id(t) for t in states.values() if t is not None}
    return [i for i, t in enumerate(step.cache_tensors()) if id(t) in ids]


@pytest.mark.parametrize("name", ["qwen3.5", pytest.param("qwen3-next", marks=pytest.mark.slow),
                                  pytest.param("qwen3.5-moe", marks=pytest.mark.slow)])  # fmt: skip
def test_decode_step_fuses_every_gdn_layer(name):
    step = _step(name)
    report = fusion_passes.Report()
    torch._dynamo.reset()
    compiled = torch.compile(step, backend=fusion_passes.backend(report=report), fullgraph=True, dynamic=False)
    outs, cache = _run(step, compiled)
    expected_outs, expected_cache = _run(step, step)
    assert report.final()["causal_conv1d_update"] == 3 and report.final()["gated_delta_step"] == 3
    before, after = report.ops_before(), report.ops_after()
    assert before["aten.convolution.default"] == 3 and after["aten.convolution.default"] == 0
    assert after["fusion_passes.gated_delta_step.default"] == 3
    states = _states(step)
    assert len(states) == 6  # a conv and a recurrent state per GDN layer
    bound = tolerance(torch.bfloat16).rel_norm
    assert all(compare(cache[i], expected_cache[i]).rel_norm <= bound for i in states)
    assert all(compare(a, e).rel_norm <= bound for a, e in zip(outs, expected_outs, strict=True))


@pytest.mark.parametrize(
    "conv", ["causal_conv1d_after_state", pytest.param("causal_conv1d", marks=pytest.mark.slow)]
)
def test_prefill_is_no_decode_step_and_fuses_the_chunked_rule_and_the_conv(conv):
    """The defaults' causal_conv1d_after_state takes the cache's cat of state and prompt, its cache
    write and the conv over it; without it the plain fusion takes the conv over the cat."""
    step = _step("qwen3.5")
    report = fusion_passes.Report()
    torch._dynamo.reset()
    defaults = [f.name for f in get_fusions("all")]
    fusions = "all" if conv == "causal_conv1d_after_state" else [f for f in defaults if f != "causal_conv1d_after_state"]
    compiled = torch.compile(step, backend=fusion_passes.backend(fusions, report=report), fullgraph=True, dynamic=False)
    step.restore()
    with torch.no_grad():
        out = compiled(step.prompt, torch.arange(step.context))
        cache = [t.clone() for t in step.cache_tensors()]
        step.restore()
        expected = step(step.prompt, torch.arange(step.context))
        expected_cache = step.cache_tensors()
    assert report.final()["causal_conv1d_update"] == 0 and report.final()["gated_delta_step"] == 0
    # the prefill fusions, each GDN layer: the chunked rule and the padded conv (after the cache's
    # conv state: the step's cache was prefilled before)
    # (the tiny model's 2 key heads read by 4 value heads: the rule's op on the key heads as they are)
    assert report.matches["chunk_gated_delta_rule"] == report.final()["chunk_gated_delta_rule_gva"] == 3
    assert report.final()[conv] == 3
    before, after = report.ops_before(), report.ops_after()
    assert (before["aten.convolution.default"], after["aten.convolution.default"]) == (3, 0)
    assert (before["fusion_passes.causal_conv1d.default"], after["fusion_passes.causal_conv1d.default"]) == (0, 3)
    assert after["fusion_passes.causal_conv1d_update.default"] == after["fusion_passes.gated_delta_step.default"] == 0
    chunk = "fusion_passes.chunk_gated_delta_rule.default"
    assert (before[chunk], after[chunk]) == (0, 3)
    # the chunked rule starts from a zero state: no decode step's gating, no near miss
    assert not [m for m in report.near_misses if m.fusion in ("gated_delta_step", "causal_conv1d_update")]
    assert compare(out, expected).rel_norm <= tolerance(torch.bfloat16).rel_norm
    # the conv states written into the cache are the prompt's last projected inputs: the first
    # layer's exactly eager's (its inputs are), the later ones within rounding of their inputs
    conv_states = [i for i, t in enumerate(expected_cache) if t.dim() == 3 and t.shape[-1] == 4]
    assert len(conv_states) == 3 and torch.equal(cache[conv_states[0]], expected_cache[conv_states[0]])
    assert all(compare(cache[i], expected_cache[i]).rel_norm <= tolerance(torch.bfloat16).rel_norm for i in conv_states)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen3.5", "qwen3-next", "qwen3.5-moe"])
def test_decode_step_folds_every_gated_norm(name):
    """With gated_delta_step_norm (opt-in): each GDN layer's step and gated RMSNorm are one op. The
    first GDN layer's states are bit-equal to the defaults' (the same step reference on the CPU);
    its norm, the op's reference in place of Inductor's kernel, sums in another order, so later
    layers see other roundings: the outputs and states within bf16's tolerance of the defaults'
    and of eager's."""
    step = _step(name)
    defaults = [f.name for f in get_fusions("all")]
    runs = {}
    for fusions in (defaults, defaults + ["gated_delta_step_norm"]):
        report = fusion_passes.Report()
        torch._dynamo.reset()
        compiled = torch.compile(step, backend=fusion_passes.backend(fusions, report=report), fullgraph=True,
                                 dynamic=False)  # fmt: skip
        runs[len(fusions)] = (*_run(step, compiled), report)
    (outs, cache, _), (folded_outs, folded_cache, report) = runs[len(defaults)], runs[len(defaults) + 1]
    assert report.final()["gated_delta_step_norm"] == 3 and report.final()["gated_delta_step"] == 0
    after = report.ops_after()
    assert after["fusion_passes.gated_delta_step_norm.default"] == 3 and after["fusion_passes.gated_delta_step.default"] == 0
    states = _states(step)
    assert torch.equal(folded_cache[states[0]], cache[states[0]]) and torch.equal(folded_cache[states[1]], cache[states[1]])
    expected_outs, expected_cache = _run(step, step)
    bound = tolerance(torch.bfloat16).rel_norm
    for reference, reference_cache in ((outs, cache), (expected_outs, expected_cache)):
        assert all(compare(folded_cache[i], reference_cache[i]).rel_norm <= bound for i in states)
        assert all(compare(a, e).rel_norm <= bound for a, e in zip(folded_outs, reference, strict=True))
