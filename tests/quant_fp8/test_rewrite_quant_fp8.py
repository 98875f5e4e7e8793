"""FP8 activation quantization raised to the canonical ``quant_fp8`` from every code base's
spelling (tests/_fp8_spellings.py, written as each code base writes it), and the region fusions
(norm + quant, SiLU + quant) built on it: match counts, ops before and after, codes and scales
bit-equal to eager on the CPU (the canonical and fused ops run their references there).

Compiles are shared: one function holds every spelling (on its own input), compiled once per
dtype (module-scoped fixtures), and each test reads its sites from that one report."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fusion_passes
from _fp8_spellings import (
    bits,
    deepgemm_per_token_cast_to_fp8,
    deepseek_v3_act_quant,
    llama_rms_norm,
    per_group_quant,
    per_token_quant,
    qwen3_next_rms_norm,
    sglang_per_token_group_quant_fp8,
    sglang_per_token_group_quant_fp8_reciprocal,
    te_current_scaling,
    torchao_float8_per_row,
    torchao_float8_per_tensor,
    torchao_quantize_affine_float8,
    torchao_training_tensorwise,
    torchtitan_rms_norm,
    vllm_quant_fp8_group_native,
    vllm_quant_fp8_native,
)

RAISE = ["quant_fp8_dynamic", "quant_fp8_unfloored", "quant_fp8_static"]
REGIONS = [f"{p}rms_norm_quant_fp8_{s}" for s in ("static", "per_token", "per_group") for p in ("add_", "")]
SILU = [f"silu_mul_quant_fp8_{s}" for s in ("static", "per_token", "per_group")]
HIDDEN = 384  # three groups of 128
STATIC_SCALE = 0.02

# name -> (the code base's quantization: (y, static scale) -> outputs; the raise fusion and the
# pattern spelling it matches; the region fusion the norm + it fuses into, or the reason the
# region check gives where the kernels do not compute it)
SPELLINGS = {
    "vllm_per_token": (
        lambda y, s: vllm_quant_fp8_native(y), "quant_fp8_dynamic", "vllm_per_token", "rms_norm_quant_fp8_per_token"
    ),
    "vllm_per_tensor": (
        lambda y, s: vllm_quant_fp8_native(y, per_token=False), "quant_fp8_dynamic", "vllm_per_tensor",
        "per_tensor scheme",
    ),
    "vllm_static": (
        lambda y, s: vllm_quant_fp8_native(y, s)[:1], "quant_fp8_static", "vllm_static", "rms_norm_quant_fp8_static"
    ),
    "vllm_group": (
        lambda y, s: vllm_quant_fp8_group_native(y), "quant_fp8_dynamic", "vllm_group", "rms_norm_quant_fp8_per_group"
    ),
    "vllm_group_ue8m0": (
        lambda y, s: vllm_quant_fp8_group_native(y, use_ue8m0=True), "quant_fp8_dynamic", "vllm_group_ue8m0",
        "pow2='ceil'",
    ),
    "sglang_group": (
        lambda y, s: sglang_per_token_group_quant_fp8(y), "quant_fp8_dynamic", "sglang_group",
        "rms_norm_quant_fp8_per_group",
    ),
    "sglang_group_reciprocal": (
        lambda y, s: sglang_per_token_group_quant_fp8_reciprocal(y), "quant_fp8_dynamic", "sglang_group_reciprocal",
        "rms_norm_quant_fp8_per_group",
    ),
    "deepgemm": (
        lambda y, s: deepgemm_per_token_cast_to_fp8(y), "quant_fp8_dynamic", "deepgemm_group",
        "rms_norm_quant_fp8_per_group",
    ),
    "deepseek_v3": (
        lambda y, s: deepseek_v3_act_quant(y), "quant_fp8_unfloored", "deepseek_v3_group",
        "rms_norm_quant_fp8_per_group",
    ),
    "torchao_per_row": (
        lambda y, s: torchao_float8_per_row(y), "quant_fp8_unfloored", "torchao_per_row",
        "rms_norm_quant_fp8_per_token",
    ),
    "torchao_per_tensor": (
        lambda y, s: torchao_float8_per_tensor(y), "quant_fp8_unfloored", "torchao_per_tensor", "per_tensor scheme"
    ),
    "torchao_training": (
        lambda y, s: torchao_training_tensorwise(y), "quant_fp8_dynamic", "torchao_training", "per_tensor scheme"
    ),
    "torchao_training_pow2": (
        lambda y, s: torchao_training_tensorwise(y, True), "quant_fp8_dynamic", "torchao_training_pow2",
        "per_tensor scheme",
    ),
    "te_current_scaling": (
        lambda y, s: te_current_scaling(y), "quant_fp8_dynamic", "te_multiplier", "per_tensor scheme"
    ),
    "torchao_static": (
        lambda y, s: (torchao_quantize_affine_float8(y, s),), "quant_fp8_static", "static",
        "rms_norm_quant_fp8_static",
    ),
    "per_token": (lambda y, s: per_token_quant(y), "quant_fp8_dynamic", "per_token", "rms_norm_quant_fp8_per_token"),
    "per_group": (lambda y, s: per_group_quant(y), "quant_fp8_dynamic", "per_group", "rms_norm_quant_fp8_per_group"),
}
NAMES = list(SPELLINGS)
TWO_D = {"deepgemm"}  # DeepGEMM's cast takes [m, n]


def _inputs(dtype, seed=0):
    """Fresh random activations per spelling: [3, 5, 384] (odd token counts), [7, 384] for the 2D
    casts; one static scale."""
    g = torch.Generator().manual_seed(seed)
    xs = []
    for name in NAMES:
        shape = (7, HIDDEN) if name in TWO_D else (3, 5, HIDDEN)
        xs.append((torch.randn(shape, generator=g) * 2.0).to(dtype))
    return xs


def _compile(fn, args, fusions):
    report = fusion_passes.Report()
    torch._dynamo.reset()
    with torch.no_grad():
        # lower_back=False: a canonical op no region takes stays, and runs its reference, so the
        # codes are the reference's (with lower_back Inductor recompiles the reference's math,
        # which for bf16 scales rounds otherwise than eager, as it does the spelling itself).
        backend = fusion_passes.backend(fusions, report=report, lower_back=False)
        out = torch.compile(fn, backend=backend)(*args)
        expected = fn(*args)
    return out, expected, report


def _assert_bit_equal(out, expected):
    assert len(out) == len(expected)
    for a, e in zip(out, expected, strict=True):
        assert a.dtype == e.dtype and a.shape == e.shape, (a.dtype, e.dtype, a.shape, e.shape)
        assert torch.equal(bits(a), bits(e))


# --- the raise alone ---


def _every_quantization(*args):
    *xs, scale = args
    out = []
    for name, x in zip(NAMES, xs, strict=True):
        out.extend(SPELLINGS[name][0](x, scale))
    return tuple(out)


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16, torch.float16], ids=str)
def raised(request):
    args = (*_inputs(request.param), torch.tensor([STATIC_SCALE]))
    return _compile(_every_quantization, args, RAISE)


def test_every_spelling_raises_bit_exact(raised):
    out, expected, report = raised
    _assert_bit_equal(out, expected)
    assert not report.errors and not report.rejected
    # TE's two upcasts are one op in fp32 graphs (no casts): either te_multiplier spelling.
    spellings = sorted(site.spelling.removesuffix("_two_upcasts") for site in report.sites)
    assert spellings == sorted(SPELLINGS[n][2] for n in NAMES)
    for fusion in RAISE:
        assert report.matches[fusion] == sum(SPELLINGS[n][1] == fusion for n in NAMES)
    (graph,) = report.graphs
    assert graph.ops_after["fusion_passes.quant_fp8.default"] == len(NAMES)
    for op in ("aten.amax.default", "aten.max.dim", "aten.max.default", "aten.reciprocal.default",
               "aten.clamp_max.default", "aten.log2.default"):  # fmt: skip
        assert op not in graph.ops_after, op
    assert graph.ops_before["aten.max.dim"] >= 3 and graph.ops_before["aten.log2.default"] == 2


# --- norm + quantization: the region fusion on the canonical op ---


def _norm_then_every_quantization(*args):
    *xs, w, residual, scale = args
    out = []
    for i, (name, x) in enumerate(zip(NAMES, xs, strict=True)):
        norm = (llama_rms_norm, torchtitan_rms_norm, qwen3_next_rms_norm)[i % 3]
        if name in TWO_D:  # the decoder's residual add before the norm: its sum is an output
            hidden = residual + x
            out.extend((*SPELLINGS[name][0](norm(hidden, w, 1e-6), scale), hidden))
        else:
            out.extend(SPELLINGS[name][0](norm(x, w, 1e-5), scale))
    return tuple(out)


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=str)
def norm_fused(request):
    dtype = request.param
    g = torch.Generator().manual_seed(1)
    w = (1.0 + 0.3 * torch.randn(HIDDEN, generator=g)).to(dtype)
    residual = torch.randn(7, HIDDEN, generator=g).to(dtype)
    args = (*_inputs(dtype, seed=2), w, residual, torch.tensor([STATIC_SCALE]))
    return _compile(_norm_then_every_quantization, args, REGIONS)


def test_norm_then_every_spelling_fuses_or_says_why(norm_fused):
    """Each spelling the kernel computes reaches the norm + quant fusion (the add_ one after the
    residual add); the others raise and are rejected by the region check with its reason."""
    out, expected, report = norm_fused
    _assert_bit_equal(out, expected)
    assert not report.errors
    regions = {}
    for name in NAMES:
        target = SPELLINGS[name][3]
        if target.startswith("rms_norm_quant_fp8"):
            target = ("add_" if name in TWO_D else "") + target
            regions[target] = regions.get(target, 0) + 1
    for fusion in REGIONS:
        assert report.matches[fusion] == regions.get(fusion, 0), fusion
    reasons = [r.reason for r in report.rejected if r.fusion in REGIONS]
    for name in NAMES:
        target = SPELLINGS[name][3]
        if not target.startswith("rms_norm_quant_fp8"):
            assert any(target in reason for reason in reasons), (name, reasons)
    (graph,) = report.graphs
    fused = sum(regions.values())
    after = graph.ops_after
    assert after.get("fusion_passes.rms_norm_quant_fp8.default", 0) + after.get(
        "fusion_passes.add_rms_norm_quant_fp8.default", 0
    ) == fused
    assert after["fusion_passes.quant_fp8.default"] == len(NAMES) - fused
    assert "aten.rsqrt.default" in graph.ops_before and "aten.rsqrt.default" not in after


# --- SiLU-and-mul + quantization ---


SILU_NAMES = [n for n in NAMES if SPELLINGS[n][3].startswith("rms_norm_quant_fp8") and n not in TWO_D]


def _silu_then_quantizations(*args):
    *gate_ups, scale = args
    out = []
    for name, (gate, up) in zip(SILU_NAMES, zip(gate_ups[::2], gate_ups[1::2]), strict=True):
        out.extend(SPELLINGS[name][0](F.silu(gate) * up, scale))
    return tuple(out)


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=str)
def silu_fused(request):
    g = torch.Generator().manual_seed(3)
    tensors = [(torch.randn(2, 3, HIDDEN, generator=g) * 2).to(request.param) for _ in range(2 * len(SILU_NAMES))]
    return _compile(_silu_then_quantizations, (*tensors, torch.tensor([STATIC_SCALE])), SILU)


def test_silu_mul_then_every_fusable_spelling_fuses(silu_fused):
    out, expected, report = silu_fused
    _assert_bit_equal(out, expected)
    assert not report.errors and not [r for r in report.rejected if r.fusion in SILU]
    for scheme in ("static", "per_token", "per_group"):
        want = sum(SPELLINGS[n][3] == f"rms_norm_quant_fp8_{scheme}" for n in SILU_NAMES)
        assert report.matches[f"silu_mul_quant_fp8_{scheme}"] == want, scheme
    (graph,) = report.graphs
    assert graph.ops_after["fusion_passes.silu_mul_quant_fp8.default"] == len(SILU_NAMES)
    assert "fusion_passes.quant_fp8.default" not in graph.ops_after
    assert "aten.exp.default" not in graph.ops_after


# --- zero rows, negatives ---


def test_zero_rows_follow_each_spelling():
    """A deliberate zero row: floored spellings give zero codes and their floor's scale, unfloored
    ones (DeepSeek-V3, torchao) NaN codes, as eager does."""

    def fn(x1, x2, x3, x4, w):
        return (*vllm_quant_fp8_native(llama_rms_norm(x1, w, 1e-6)),
                *deepgemm_per_token_cast_to_fp8(llama_rms_norm(x2, w, 1e-6)),
                *deepseek_v3_act_quant(llama_rms_norm(x3, w, 1e-6)),
                *torchao_float8_per_row(llama_rms_norm(x4, w, 1e-6)))  # fmt: skip

    g = torch.Generator().manual_seed(5)
    xs = [torch.randn(5, HIDDEN, generator=g).bfloat16() for _ in range(4)]
    for x in xs:
        x[2] = 0.0
    w = torch.randn(HIDDEN, generator=g).bfloat16()
    out, expected, report = _compile(fn, (*xs, w), REGIONS)
    _assert_bit_equal(out, expected)
    assert report.matches["rms_norm_quant_fp8_per_token"] == 2
    assert report.matches["rms_norm_quant_fp8_per_group"] == 2
    assert torch.isnan(out[4].float()[2]).all() and not torch.isnan(out[0].float()[2]).any()
    assert torch.isnan(out[6].float()[2]).all()  # torchao: 0 / 0


def test_negatives():
    """Not raised or not fused, each with the graph left computing eager's numbers:
    - the amax also read by another op (an amax history): the spelling's intermediate is used
      outside it, so it does not raise;
    - e5m2 codes: another format, refused with that reason;
    - LayerNorm before the quantization: the quantization raises, no region takes it."""

    def amax_reused(x):
        x_max, _ = x.abs().max(dim=-1)
        x_max = x_max.unsqueeze(-1).to(torch.float32)
        scale = (x_max / 448.0).clamp(min=1.0 / (448.0 * 512.0))
        out = (x.to(torch.float32) * scale.reciprocal()).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
        return out, scale, x_max * 2

    def e5m2(x):
        y32 = x.float()
        scale = (y32.abs().amax(-1, keepdim=True) / 57344.0).clamp(min=1e-12)
        return (y32 / scale).clamp(-57344.0, 57344.0).to(torch.float8_e5m2), scale

    def layer_norm_then_quant(x, w):
        return per_token_quant(F.layer_norm(x, (x.shape[-1],), w, None, 1e-5))

    def fn(a, b, d, w):
        return (*amax_reused(a), *e5m2(b), *layer_norm_then_quant(d, w))

    g = torch.Generator().manual_seed(4)
    a, b, d = (torch.randn(3, HIDDEN, generator=g).bfloat16() for _ in range(3))
    w = torch.randn(HIDDEN, generator=g).bfloat16()
    out, expected, report = _compile(fn, (a, b, d, w), [*RAISE, *REGIONS])
    for x, e in zip(out, expected, strict=True):
        if x.dtype.itemsize == 1:
            assert torch.equal(bits(x), bits(e))
        else:
            torch.testing.assert_close(x, e, rtol=0, atol=0)
    assert {k: v for k, v in report.matches.items() if v} == {"quant_fp8_dynamic": 1}  # layer norm's
    (site,) = report.sites
    assert site.spelling == "per_token"
    # Refused once per traced pattern that reached it (the bf16 one, then the fp32 one).
    e5m2_refused = [r.reason for r in report.rejected if r.spelling == "per_token_e5m2"]
    assert e5m2_refused and all("float8_e4m3fn (max 448) only" in reason for reason in e5m2_refused)
    after = report.graphs[0].ops_after
    assert after["aten.max.dim"] == 1 and after["aten.amax.default"] == 1
    assert after["fusion_passes.quant_fp8.default"] == 1 and "fusion_passes.rms_norm_quant_fp8.default" not in after


def test_group_size_that_does_not_divide_is_rejected():
    """No code base's group spelling runs on a row the group size does not divide (their reshapes
    of the scales fail), but a flat reshape (SGLang's ``x.reshape(numel // 128, 128)``) does, with
    groups straddling rows: every group spelling's check refuses it, and so does the op."""
    (fusion,) = [f for f in fusion_passes.registry.get_fusions(["quant_fp8_dynamic"])]
    groups = [s for s in fusion.spellings if "group" in s.name]
    assert len(groups) == 6
    for spelling in groups:
        assert spelling.check({"x": torch.empty(4, 256), "floor": 1e-4}) is None
        reason = spelling.check({"x": torch.empty(2, 192), "floor": 1e-4})
        assert reason == "quant_fp8: group_size 128 must divide the hidden size 192", spelling.name
    with pytest.raises(ValueError, match="must divide the hidden size 192"):
        torch.ops.fusion_passes.quant_fp8(
            torch.randn(2, 192), "per_group", None, 128, False, "scale", 1e-4, "divide", "none", True, 448.0,
            "fp32",
        )  # fmt: skip


def test_silu_mul_then_per_tensor_quantization_is_refused_with_the_reason():
    """A per-tensor quantization after the SiLU-and-mul raises, and the SiLU + quant fusion
    refuses it with the kernels' reason (one amax over the whole tensor before any code)."""

    def fn(gate, up):
        return vllm_quant_fp8_native(F.silu(gate) * up, per_token=False)

    gate, up = (torch.randn(3, HIDDEN).bfloat16() for _ in range(2))
    _, _, report = _compile(fn, (gate, up), SILU)
    assert {k: v for k, v in report.matches.items() if v} == {"quant_fp8_dynamic": 1}
    (rejection,) = [r for r in report.rejected if r.fusion in SILU]
    assert rejection.spelling == "silu_mul_then_per_tensor" and "per_tensor scheme" in rejection.reason
    assert report.graphs[0].ops_after["fusion_passes.quant_fp8.default"] == 1


def test_an_unraised_float8_conversion_is_a_near_miss():
    """A quantization no spelling raises (amax over the tokens, not the row) is reported: the
    closest spelling and where it diverged; the upcasts to fp32 are not candidates."""
    import fusion_passes as fp

    def amax_over_tokens(x):
        x32 = x.float()
        s = (x32.abs().amax(0, keepdim=True) / 448.0).clamp(min=1e-10)
        return (x32 / s).clamp(-448, 448).to(torch.float8_e4m3fn), s

    report = fp.Report()
    torch._dynamo.reset()
    torch.compile(amax_over_tokens, backend=fp.backend(report=report))(torch.randn(8, 256, dtype=torch.bfloat16))
    assert not any(report.matches.values())
    assert report.graphs[0].ops_after == report.graphs[0].ops_before
    (miss,) = report.near_misses
    assert miss.fusion.startswith("quant_fp8_") and miss.matched < miss.total
    assert miss.reason == "aten.amax.default argument 1 is [0], the spelling has [-1]", miss
