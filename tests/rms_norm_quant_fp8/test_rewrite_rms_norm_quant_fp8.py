"""Rewrite tests of RMSNorm (+ residual add) + FP8 quantization: match counts, ops before/after,
and codes/scales bit-exact against eager on the reference path (CPU). The norms and quantizations
are real code bases' spellings (tests/_fp8_spellings.py names each): each quantization first
raises to the canonical quant_fp8 (patterns/quant_fp8.py), which the norm + quant fusion takes."""

from __future__ import annotations

import pytest
import torch

import fusion_passes
from _fp8_spellings import (
    QUANT,
    bits,
    llama_rms_norm,
    per_group_quant,
    per_token_quant,
    qwen3_next_rms_norm,
    sglang_per_token_group_quant_fp8,
    torchtitan_rms_norm,
    vllm_quant_fp8_group_native,
    vllm_quant_fp8_native,
)

# The pattern's form name (the spelling's suffix) -> the model code written in that form.
NORMS = {"llama": llama_rms_norm, "fp32_weight": torchtitan_rms_norm, "offset": qwen3_next_rms_norm}
QUANT_OPS = {"aten.amax.default", "aten.clamp_max.default"}
_bits = bits


# Opt-in while their CUDA kernel awaits a GPU run: enabled by name (the norm fusions come along).
QUANT_FUSIONS = [f"{p}rms_norm_quant_fp8_{s}" for p in ("", "add_") for s in QUANT]


def _run(fn, *args):
    report = fusion_passes.Report()
    torch._dynamo.reset()
    with torch.no_grad():
        # lower_back=False: a canonical op no region took (a norm, a quantization) runs its
        # reference, eager's numbers; lowered back, Inductor would recompute it in its own order.
        backend = fusion_passes.backend(QUANT_FUSIONS, report=report, lower_back=False)
        out = torch.compile(fn, backend=backend)(*args)
        expected = fn(*args)
    return out, expected, report


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("with_residual", [False, True], ids=["norm", "add_norm"])
@pytest.mark.parametrize("form", NORMS)
@pytest.mark.parametrize("scheme", QUANT)
def test_norm_then_quant_fuses_bit_exact(scheme, form, with_residual, dtype):
    norm, quant = NORMS[form], QUANT[scheme]
    x = torch.randn(3, 5, 256).to(dtype)
    residual = torch.randn_like(x)
    weight = ((0.0 if form == "offset" else 1.0) + 0.3 * torch.randn(256)).to(dtype)
    scale = torch.tensor(0.01)

    if with_residual:

        def fn(x, residual, w, scale):
            hidden = residual + x
            return (*quant(norm(hidden, w, 1e-6), scale), hidden)

        args = (x, residual, weight, scale)
    else:

        def fn(x, w, scale):
            return quant(norm(x, w, 1e-6), scale)

        args = (x, weight, scale)
    out, expected, report = _run(fn, *args)
    name = f"{'add_' if with_residual else ''}rms_norm_quant_fp8_{scheme}"
    norm_fusion = "add_rms_norm" if with_residual else "rms_norm"  # canonicalizes first
    raised = "quant_fp8_static" if scheme == "static" else "quant_fp8_dynamic"
    assert {k: v for k, v in report.matches.items() if v} == {name: 1, norm_fusion: 1, raised: 1}
    (site,) = report.sites_of(name)
    assert site.spelling.endswith(f"_{form}_then_{scheme}")
    after = report.graphs[0].ops_after
    assert after[f"fusion_passes.{name.removesuffix('_' + scheme)}.default"] == 1
    assert not QUANT_OPS & set(after) and "aten.rsqrt.default" not in after
    expected_before = {"aten.clamp_max.default"} | ({"aten.amax.default"} if scheme != "static" else set())
    assert expected_before <= set(report.graphs[0].ops_before)
    for a, e in zip(out, expected, strict=True):
        assert a.dtype == e.dtype and torch.equal(_bits(a), _bits(e))


def test_normed_value_used_elsewhere_is_not_fused():
    """The bf16 activation also feeds another consumer: the quantization cannot absorb the norm."""
    x, weight = torch.randn(4, 256).to(torch.bfloat16), torch.randn(256).to(torch.bfloat16)

    def fn(x, w):
        y = llama_rms_norm(x, w, 1e-6)
        return (*per_token_quant(y), y * 2)

    out, expected, report = _run(fn, x, weight)
    assert {k: v for k, v in report.matches.items() if v} == {"rms_norm": 1, "quant_fp8_dynamic": 1}
    for a, e in zip(out, expected, strict=True):
        assert torch.equal(_bits(a), _bits(e))


def test_other_group_size_and_fp8_format_are_not_fused():
    x, weight = torch.randn(4, 256).to(torch.bfloat16), torch.randn(256).to(torch.bfloat16)

    def group_64(x, w):
        y32 = llama_rms_norm(x, w, 1e-6).float().unflatten(-1, (-1, 64))
        scale = (y32.abs().amax(-1, keepdim=True) / 448.0).clamp(min=1.0 / (448.0 * 512.0))
        return (y32 / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).flatten(-2), scale

    def e5m2(x, w):
        y32 = llama_rms_norm(x, w, 1e-6).float()
        scale = (y32.abs().amax(-1, keepdim=True) / 448.0).clamp(min=1.0 / (448.0 * 512.0))
        return (y32 / scale).clamp(-448.0, 448.0).to(torch.float8_e5m2), scale

    # Groups of 64 spelled by an unflatten of the fp32 activation: the quantization of the
    # [..., N / 64, 64] view raises as per_token over its rows (the same numbers), which no
    # region takes (the norm's output reaches it through the upcast and the view).
    expect = {group_64: {"rms_norm": 1, "quant_fp8_dynamic": 1}, e5m2: {"rms_norm": 1}}
    for fn in (group_64, e5m2):
        out, expected, report = _run(fn, x, weight)
        assert {k: v for k, v in report.matches.items() if v} == expect[fn], fn.__name__
        assert not [m for m in report.matches if m.startswith("rms_norm_quant") and report.matches[m]]
        for a, e in zip(out, expected, strict=True):
            bits = [t.view(torch.uint8) if t.element_size() == 1 else t for t in (a, e)]
            assert torch.equal(*bits)


def _per_token_parts(x, w):
    """The per-token quantization of the normed x, spelled out, with its intermediate values."""
    y32 = llama_rms_norm(x, w, 1e-6).float()
    amax = y32.abs().amax(-1, keepdim=True)
    unclamped = amax / 448.0
    scale = unclamped.clamp(min=1.0 / (448.0 * 512.0))
    quotient = y32 / scale
    return quotient.clamp(-448.0, 448.0).to(torch.float8_e4m3fn), scale, amax, unclamped, quotient


@pytest.mark.parametrize("reused", [None, "amax", "unclamped_scale", "quotient"])
def test_quantization_whose_inner_value_is_reused_is_not_fused(reused):
    """Another consumer reads a value the fused op never produces (the row's amax, e.g. for an
    amax history; the scale before its floor; the fp32 quotient before the cast): the quantization
    stays unfused and only the norm is rewritten. The same spelling with no such consumer fuses.
    The results equal eager's bit for bit."""
    x, weight = torch.randn(4, 256).to(torch.bfloat16), torch.randn(256).to(torch.bfloat16)

    def fn(x, w):
        parts = _per_token_parts(x, w)
        if reused is None:
            return parts[:2]
        return parts[0], parts[1], parts[["amax", "unclamped_scale", "quotient"].index(reused) + 2] * 2

    out, expected, report = _run(fn, x, weight)
    fused = {"rms_norm": 1} if reused else {"rms_norm": 1, "quant_fp8_dynamic": 1, "rms_norm_quant_fp8_per_token": 1}
    assert {k: v for k, v in report.matches.items() if v} == fused
    before, after = report.graphs[0].ops_before, report.graphs[0].ops_after
    assert QUANT_OPS <= set(before) and "aten.rsqrt.default" in before
    assert "aten.rsqrt.default" not in after
    if reused:  # the norm became its op; the quantization's amax and clamp stay as written
        assert after["fusion_passes.rms_norm.default"] == 1 and QUANT_OPS <= set(after)
    else:
        assert after["fusion_passes.rms_norm_quant_fp8.default"] == 1 and not QUANT_OPS & set(after)
    for a, e in zip(out, expected, strict=True):
        assert torch.equal(_bits(a), _bits(e))


@pytest.mark.parametrize("with_residual", [False, True], ids=["norm", "add_norm"])
def test_group_size_must_divide_the_hidden_size(with_residual):
    """The per_group check refuses rows whose width the group size 128 does not divide (eager
    cannot spell that quantization: its reshape fails; the check stands guard for the op)."""
    name = f"{'add_' if with_residual else ''}rms_norm_quant_fp8_per_group"
    (fusion,) = [f for f in fusion_passes.registry.get_fusions([name]) if f.name == name]
    fields = dict(floor_site="scale", floor=1e-4, apply="divide", pow2="none", fp8_max=448.0, scale_math="fp32",
                  group_size=128)  # fmt: skip
    for spelling in fusion.spellings:
        assert spelling.check({"x": torch.empty(4, 256), **fields}) is None
        reason = spelling.check({"x": torch.empty(4, 192), **fields})
        assert reason is not None and "divide" in reason, spelling.name


def test_quant_fusion_enables_the_norm_fusions_it_starts_from():
    names = [f.name for f in fusion_passes.registry.get_fusions(["rms_norm_quant_fp8_per_token"])]
    assert names == [
        "add_rms_norm", "rms_norm", "quant_fp8_dynamic", "quant_fp8_unfloored", "quant_fp8_static",
        "rms_norm_quant_fp8_per_token",
    ]  # fmt: skip
    assert set(QUANT_FUSIONS) <= {f.name for f in fusion_passes.registry.get_fusions("all")}


def test_a_graph_without_quantization_is_not_deduplicated():
    """The norm + quant fusions deduplicate identical subgraphs only where a raised quantization
    is: a plain model compiled with "all" keeps its graph's duplicates (here two equal products)."""

    def twice(x, w):
        return (x * w).sum(), (x * w).mean()

    report = fusion_passes.Report()
    torch._dynamo.reset()
    torch.compile(twice, backend=fusion_passes.backend(report=report))(torch.randn(4, 8), torch.randn(8))
    ops = report.graphs[0]
    assert ops.ops_before["aten.mul.Tensor"] == ops.ops_after["aten.mul.Tensor"] == 2


def test_one_activation_quantized_per_projection_fuses_once():
    """q / k / v projections each quantize the same normed activation (Fp8Linear per projection):
    each raises to quant_fp8, the pass deduplicates the three, then fuses the norm with the one left;
    without the deduplication the norm would have three consumers and stay unfused."""

    def fn(x, w, projections):
        y = llama_rms_norm(x, w, 1e-6)
        outs = []
        for p in projections:  # each projection quantizes y itself, then multiplies
            q, s = per_token_quant(y)
            outs.append((q.float() * s) @ p)
        return outs

    x, w = torch.randn(4, 256).bfloat16(), (1 + 0.3 * torch.randn(256)).bfloat16()
    projections = [torch.randn(256, 64) for _ in range(3)]
    out, expected, report = _run(fn, x, w, projections)
    assert {k: v for k, v in report.matches.items() if v} == {
        "rms_norm": 1,
        "quant_fp8_dynamic": 3,  # each raised, then one after the deduplication
        "rms_norm_quant_fp8_per_token": 1,
    }
    before, after = report.ops_before(), report.ops_after()
    assert before["aten.amax.default"] == 3 and "aten.amax.default" not in after
    assert after["fusion_passes.rms_norm_quant_fp8.default"] == 1
    for a, e in zip(out, expected, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)


# Real engines' own spellings that the norm + quant patterns did not fuse before the canonical
# quant_fp8 (tests/_fp8_spellings.py says where each parts from the old patterns), each with an
# op of it that the rewrite removes, and the region fusion it now reaches (None: raised only, the
# region check's reason given).
ENGINE_NATIVE = {
    # vLLM QuantFP8.forward_native, static: x.float() * scale.reciprocal()
    "vllm_native_static": (
        lambda y, scale: vllm_quant_fp8_native(y, scale)[:1], "aten.reciprocal.default", "rms_norm_quant_fp8_static"
    ),
    # vLLM QuantFP8.forward_native, dynamic per token: bf16 amax by max(dim), reciprocal multiply
    "vllm_native_per_token": (
        lambda y, scale: vllm_quant_fp8_native(y), "aten.max.dim", "rms_norm_quant_fp8_per_token"
    ),
    # vLLM QuantFP8._quantize_group_native: bf16 amax by max(dim), divide (the fused op's numbers)
    "vllm_group_native": (
        lambda y, scale: vllm_quant_fp8_group_native(y), "aten.max.dim", "rms_norm_quant_fp8_per_group"
    ),
    # the same with power-of-two (UE8M0) scales by exp2(ceil(log2(s))): raised, not fused
    "vllm_group_native_ue8m0": (
        lambda y, scale: vllm_quant_fp8_group_native(y, use_ue8m0=True), "aten.exp2.default", None
    ),
    # SGLang's native_per_token_group_quant_fp8: amax floored at 1e-10 before the divide
    "sglang_per_token_group": (
        lambda y, scale: sglang_per_token_group_quant_fp8(y), "aten.max.dim", "rms_norm_quant_fp8_per_group"
    ),
}


@pytest.mark.parametrize("spelling", ENGINE_NATIVE)
def test_engine_native_quantization_fuses(spelling):
    """The transformers Llama norm followed by a serving engine's own plain-torch quantization:
    the quantization raises to quant_fp8 and the norm + quant fusion takes both (or, for log2
    power-of-two scales, the region check says why not and the raised op stays); the compiled
    outputs equal eager's bit for bit."""
    quant, removed_op, region = ENGINE_NATIVE[spelling]
    x = torch.randn(3, 5, 256).bfloat16()
    weight = (1.0 + 0.3 * torch.randn(256)).bfloat16()

    def fn(x, w, scale):
        return quant(llama_rms_norm(x, w, 1e-6), scale)

    out, expected, report = _run(fn, x, weight, torch.tensor(0.01))
    raised = "quant_fp8_static" if spelling == "vllm_native_static" else "quant_fp8_dynamic"
    assert {k: v for k, v in report.matches.items() if v} == {"rms_norm": 1, raised: 1} | (
        {region: 1} if region else {}
    )
    assert not report.errors
    (graph,) = report.graphs
    before, after = graph.ops_before, graph.ops_after
    assert before[removed_op] >= 1 and removed_op not in after
    assert "aten.clamp_max.default" in before and "aten.clamp_max.default" not in after
    if region:
        assert after["fusion_passes.rms_norm_quant_fp8.default"] == 1
    else:
        assert after["fusion_passes.quant_fp8.default"] == 1 and after["fusion_passes.rms_norm.default"] == 1
        assert any("pow2='ceil'" in r.reason for r in report.rejected)
    for a, e in zip(out, expected, strict=True):
        assert a.dtype == e.dtype and torch.equal(_bits(a), _bits(e))
    if spelling == "vllm_group_native":  # the same numbers as the fused spelling
        for a, e in zip(expected, per_group_quant(llama_rms_norm(x, weight, 1e-6)), strict=True):
            assert torch.equal(_bits(a), _bits(e))
