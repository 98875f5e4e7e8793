"""CUDA: the chunked prefill op through flash-linear-attention's chunk kernels against the fp32
reference (bf16 activations, Qwen widths and odd lengths, grouped values, from zeros and from a
state), and a
tiny Qwen 3.5 prefill through a StaticCache with the fusion: every GDN layer's rule one op, the
output and the recurrent states as close to eager's as stock Inductor's. Skipped without a GPU,
and the op's test without fla-core (the extra ``fla``)."""

from __future__ import annotations

import functools

import pytest
import torch

import fusion_passes
from fusion_passes.lowering.chunk_gated_delta_rule.op import fla_chunk_kernel
from fusion_passes.lowering.chunk_gated_delta_rule.reference import chunk_gated_delta_rule_reference
from fusion_passes.models import build_model
from fusion_passes.models.decode import DecodeStep
from fusion_passes.numerics import compare, tolerance

pytestmark = pytest.mark.gpu
needs_fla = pytest.mark.skipif(
    fla_chunk_kernel() is None, reason="fla-core (the extra `fla`) is not installed"
)


@needs_fla
@pytest.mark.parametrize(
    "tokens, heads, dk, dv, key_heads",
    # key_heads < heads: grouped values (Qwen 3.5's 16 key / 32 value heads; chunk_gated_delta_rule_gva)
    [(4096, 32, 128, 128, 32), (1000, 4, 128, 128, 4), (70, 3, 64, 32, 3), (4096, 32, 128, 128, 16),
     (333, 6, 64, 64, 2)],
)  # fmt: skip
@pytest.mark.parametrize("zero_state", [True, False])
def test_chunk_kernel_matches_reference(tokens, heads, dk, dv, key_heads, zero_state):
    g = torch.Generator(device="cuda").manual_seed(tokens)

    def rand(*shape):
        return torch.randn(*shape, device="cuda", generator=g)

    q, k, v = (rand(1, tokens, h, d).bfloat16() for h, d in ((key_heads, dk), (key_heads, dk), (heads, dv)))
    decay = -torch.nn.functional.softplus(rand(1, tokens, heads)) * 0.5
    beta = torch.sigmoid(rand(1, tokens, heads)).bfloat16()
    state = torch.zeros(1, heads, dk, dv, device="cuda") if zero_state else rand(1, heads, dk, dv) * 0.1
    args = (q, k, v, decay, beta, state, dk**-0.5, True, 1e-6)
    out, final = torch.ops.fusion_passes.chunk_gated_delta_rule(*args)
    ref_out, ref_final = chunk_gated_delta_rule_reference(*args)
    assert out.dtype == torch.bfloat16 and final.dtype == torch.float32
    bound = tolerance(torch.bfloat16).rel_norm
    assert compare(out, ref_out).rel_norm <= bound and compare(final, ref_final).rel_norm <= bound


@needs_fla
@pytest.mark.parametrize("tokens, key_heads, heads", [(4096, 16, 32), (333, 2, 6)])
def test_the_prep_kernel_gives_fla_s_own_l2norm_path(monkeypatch, tokens, key_heads, heads):
    """q, k, v as views of a causal conv's [B, C, T] output (Qwen 3.5's split into heads): with
    QKV_PREP_KERNEL, the l2norms and copies in one kernel of ours and the chunk kernels told q and k
    are normalized; without, fla's input guard copies and its l2norm. Both within bf16's bound of
    the reference, and of each other."""
    from fusion_passes.lowering.chunk_gated_delta_rule import op

    g = torch.Generator(device="cuda").manual_seed(tokens)
    dk = dv = 128
    channels = 2 * key_heads * dk + heads * dv
    mixed = torch.randn(1, channels, tokens, device="cuda", generator=g).bfloat16().transpose(1, 2)
    q, k, v = torch.split(mixed, [key_heads * dk, key_heads * dk, heads * dv], dim=-1)
    q, k, v = q.reshape(1, tokens, key_heads, dk), k.reshape(1, tokens, key_heads, dk), v.reshape(1, tokens, heads, dv)
    decay = -torch.nn.functional.softplus(torch.randn(1, tokens, heads, device="cuda", generator=g)) * 0.5
    beta = torch.sigmoid(torch.randn(1, tokens, heads, device="cuda", generator=g)).bfloat16()
    state = torch.randn(1, heads, dk, dv, device="cuda", generator=g) * 0.1
    args = (q, k, v, decay, beta, state, dk**-0.5, True, 1e-6)
    runs = {}
    for prep in (False, True):
        monkeypatch.setattr(op, "QKV_PREP_KERNEL", prep)
        runs[prep] = torch.ops.fusion_passes.chunk_gated_delta_rule(*args)
    ref_out, ref_final = chunk_gated_delta_rule_reference(*args)
    bound = tolerance(torch.bfloat16).rel_norm
    for out, final in runs.values():
        assert compare(out, ref_out).rel_norm <= bound and compare(final, ref_final).rel_norm <= bound
    assert compare(runs[True][0], runs[False][0]).rel_norm <= bound / 4
    assert compare(runs[True][1], runs[False][1]).rel_norm <= bound / 4


@functools.cache
def _qwen35_prefill():
    """A tiny Qwen 3.5 (4 layers) prefilling 200 tokens after its cache's own prefill: the step,
    the prefill runner, and eager's and stock Inductor's (output, cache) once for every variant
    (stock Inductor's compile of the unrolled chunk loop is this test's longest part)."""
    built = build_model("qwen3.5", size="tiny", dtype=torch.bfloat16, layers=4, device="cuda")
    step = DecodeStep(built.module, batch=2, context=200, steps=1)
    positions = torch.arange(step.context, device="cuda")

    def prefill(fn):
        step.restore()
        with torch.no_grad():
            out = fn(step.prompt, positions)
        return out, [t.clone() for t in step.cache_tensors()]

    expected = prefill(step)
    torch._dynamo.reset()
    stock = prefill(torch.compile(step, backend="inductor", fullgraph=True))
    return step, prefill, expected, stock


@needs_fla
@pytest.mark.parametrize("conv, gva", [("causal_conv1d", False), ("causal_conv1d_after_state", False),
                                       ("causal_conv1d_after_state", True)])  # fmt: skip
def test_qwen35_prefill_fuses_on_cuda(conv, gva):
    """The prefill continues the cache's conv state (the step's cache was prefilled before): the
    plain conv fusion takes the conv over the cache's cat, causal_conv1d_after_state the cat and
    the cache write too (the op reads the state). gva: the op then reads the 2 key heads as they
    are (chunk_gated_delta_rule_gva), not their repeats for the 4 value heads."""
    step, prefill, (expected, expected_cache), (stock, stock_cache) = _qwen35_prefill()
    report = fusion_passes.Report()
    torch._dynamo.reset()
    backend = fusion_passes.backend(["chunk_gated_delta_rule", conv] + ["chunk_gated_delta_rule_gva"] * gva,
                                    report=report)  # fmt: skip
    out, cache = prefill(torch.compile(step, backend=backend, fullgraph=True))
    assert report.matches["chunk_gated_delta_rule"] == 3 and not report.rejected
    assert report.final()["chunk_gated_delta_rule_gva" if gva else "chunk_gated_delta_rule"] == 3
    # torch <= 2.11 traces transformers' forward-substitution form (no triangular solve): either fuses
    before, after = report.ops_before(), report.ops_after()
    fused = "fusion_passes.chunk_gated_delta_rule.default"
    assert (before[fused], after[fused]) == (0, 3) and "aten.linalg_solve_triangular.default" not in after
    # the prefill's padded conv too: its Triton kernel on CUDA
    assert report.final()[conv] == 3
    assert (before["aten.convolution.default"], after["aten.convolution.default"]) == (3, 0)
    error, stock_error = compare(out, expected).rel_norm, compare(stock, expected).rel_norm
    assert error <= max(tolerance(torch.bfloat16).rel_norm, 1.25 * stock_error)
    for ours, theirs, base in zip(cache, stock_cache, expected_cache, strict=True):
        if base.is_floating_point():
            assert compare(ours, base).rel_norm <= max(tolerance(torch.bfloat16).rel_norm,
                                                       1.25 * compare(theirs, base).rel_norm)  # fmt: skip
