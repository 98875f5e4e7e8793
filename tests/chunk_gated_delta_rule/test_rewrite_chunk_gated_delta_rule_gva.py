"""Grouped values at prefill: the chunked rule's op on q and k repeated as transformers repeats them
(repeat_interleave over the heads) rewritten to the op on the key heads, the copies gone and the
outputs bit-equal on the CPU (the reference repeats the heads itself); a tile (repeat) of the heads
or q repeated with k tiled is not the pattern. A tiny Qwen 3.5 prefill (2 key / 4 value heads,
slow) fuses its three Gated DeltaNet layers, within bf16's tolerance of eager."""

from __future__ import annotations

import pytest
import torch
from _rewrites import compile_with, op_changes

import fusion_passes
from fusion_passes.models import build_model
from fusion_passes.models.decode import DecodeStep
from fusion_passes.numerics import compare, tolerance

FUSION = ["chunk_gated_delta_rule_gva"]
OP = "fusion_passes.chunk_gated_delta_rule.default"


def _op(q, k, v, g, beta, state):
    return torch.ops.fusion_passes.chunk_gated_delta_rule(q, k, v, g, beta, state, q.shape[-1] ** -0.5, True, 1e-6)


def transformers_gva(query, key, value, g, beta, state):
    """Qwen3_5GatedDeltaNet.forward's repeats before its chunked rule (here already the op)."""
    ratio = value.shape[2] // query.shape[2]
    if ratio > 1:
        query = query.repeat_interleave(ratio, dim=2)
        key = key.repeat_interleave(ratio, dim=2)
    return _op(query, key, value, g, beta, state)


def tiled_heads(query, key, value, g, beta, state):
    """Heads tiled (head h reads key head h % H), not repeated: other math, not the pattern."""
    return _op(query.repeat(1, 1, 2, 1), key.repeat(1, 1, 2, 1), value, g, beta, state)


def one_repeated(query, key, value, g, beta, state):
    """q repeated, k tiled: not the pattern (the heads pair up otherwise)."""
    return _op(query.repeat_interleave(2, dim=2), key.repeat(1, 1, 2, 1), value, g, beta, state)


def _inputs(batch, tokens, heads, value_heads, dk, dv, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(batch, tokens, heads, dk, generator=gen).to(dtype) for _ in range(2))
    v = torch.randn(batch, tokens, value_heads, dv, generator=gen).to(dtype)
    g = -torch.rand(batch, tokens, value_heads, generator=gen) * 0.5
    beta = torch.rand(batch, tokens, value_heads, generator=gen).to(dtype)
    state = torch.randn(batch, value_heads, dk, dv, generator=gen) * 0.1
    return q, k, v, g, beta, state


def _compile(fn, args, with_state=True):
    return compile_with(FUSION, fn if with_state else (lambda *a: fn(*a)[0]), args)


@pytest.mark.parametrize(
    ("heads", "value_heads", "dtype", "with_state"),
    [(2, 4, torch.bfloat16, True), (1, 3, torch.float32, True), (2, 8, torch.float16, False)],
)
def test_repeated_q_and_k_read_the_key_heads(heads, value_heads, dtype, with_state):
    args = _inputs(2, 70, heads, value_heads, 8, 6, dtype, seed=value_heads)
    out, report = _compile(transformers_gva, args, with_state)
    assert report.final()["chunk_gated_delta_rule_gva"] == 1
    changes = op_changes(report)
    assert changes.pop(OP, None) is None  # the op stays, once
    assert changes and all(after == 0 and before == 2 for before, after in changes.values()), changes  # the 2 repeats
    expected = transformers_gva(*args) if with_state else transformers_gva(*args)[0]
    for a, e in zip(out if with_state else (out,), expected if with_state else (expected,), strict=True):
        assert torch.equal(a, e)


@pytest.mark.parametrize("fn", [tiled_heads, one_repeated])
def test_tiles_and_a_single_repeat_are_not_the_pattern(fn):
    args = _inputs(1, 20, 2, 4, 8, 6, torch.float32)
    out, report = _compile(fn, args)
    assert report.final()["chunk_gated_delta_rule_gva"] == 0
    assert report.ops_after() == report.ops_before()
    assert all(torch.equal(a, e) for a, e in zip(out, fn(*args), strict=True))


@pytest.mark.slow
def test_qwen35_prefill_reads_the_key_heads():
    built = build_model("qwen3.5", size="tiny", dtype=torch.bfloat16, layers=4)
    step = DecodeStep(built.module, batch=2, context=70, steps=1)
    prompt = (step.prompt, torch.arange(70))
    report = fusion_passes.Report()
    torch._dynamo.reset()
    fusions = [f.name for f in fusion_passes.registry.get_fusions("all")] + FUSION
    compiled = torch.compile(step, backend=fusion_passes.backend(fusions, report=report), fullgraph=True, dynamic=False)
    with torch.no_grad():
        step.restore()
        out = compiled(*prompt).clone()
        step.restore()
        expected = step(*prompt).clone()
    # the chunked rule's 3 sites, each then read at the key heads (the final op is the latter's)
    assert report.matches["chunk_gated_delta_rule"] == 3 and report.final()["chunk_gated_delta_rule_gva"] == 3
    changes = op_changes(report)
    assert changes[OP] == (0, 3)
    assert changes["aten.clone.default"][0] - changes["aten.clone.default"][1] >= 2 * 3  # q's and k's repeats
    assert compare(out, expected).rel_norm <= tolerance(torch.bfloat16).rel_norm
