"""torchao's float8 activation quantization after an RMSNorm: its static quantization primitive
fuses; its dynamic activation quantization raises to the canonical quant_fp8 (scale_math "input":
the amax divided in the activation's dtype, no floor) and fuses where the norm's output reaches it
directly; the history below says why the floored per_token / per_group forms could not take it.

Static: torchao's ``_quantize_affine_float8(y, scale)`` (``y.to(float32) / scale``, clamped to
+-448, cast) is the static spelling the patterns take: it fuses as written.

``quantize_(model, Float8DynamicActivationFloat8WeightConfig(granularity=...))`` swaps each
linear's weight for a ``Float8Tensor``; its linear quantizes the activation ``y`` in forward
(``Float8Tensor.from_hp``, torch path: ``_choose_scale_float8`` + ``_quantize_affine_float8``).
The post-grad graph, for a bf16 ``y`` of shape [2, 8, 256]:

    abs_1 = aten.abs(y)                                 bf16
    amax  = aten.amax(abs_1, [2], True)                 bf16   PerTensor: [0, 1, 2] -> [1, 1, 1]
    div   = aten.div.Tensor(amax, 448.0)                bf16   (no floor)
    scale = prims.convert_element_type(div, f32)
    q     = convert(clamp_max(clamp_min(convert(y, f32) / scale, -448), 448), float8_e4m3fn)

The default per_token (per_group) scale is ``max(f32(amax) / 448, MIN_SCALE)``. torchao's differs
in two ways, so it raises with its own fields (floor_site "none", scale_math "input"):
  - no floor: an all-zero row (padding) gets scale 0 and NaN codes, a row with amax < 1/512 a
    scale below MIN_SCALE; the op gives MIN_SCALE and finite codes;
  - in bf16 the division by 448 rounds to bf16 before the cast to fp32: other scales in most rows,
    so other codes. (PerRow, the row-wise config, requires bf16 weights: the usual case.)
In fp32 the floor is the only difference: rows with amax >= 1/512 quantize bit for bit as the op.
PerTensor is a dynamic per-tensor scale (one amax over every token), a scheme the op does not have.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fusion_passes
from fusion_passes.lowering.common.fp8 import MIN_SCALE, QuantFP8, quant_fp8_reference
from fusion_passes.numerics import fp8_codes_apart

torchao = pytest.importorskip("torchao")
from torchao.quantization import (  # noqa: E402
    Float8DynamicActivationFloat8WeightConfig,
    PerBlock,
    PerRow,
    PerTensor,
    quantize_,
)
from torchao.quantization.quantize_.common import _choose_quant_func_and_quantize_tensor  # noqa: E402
from torchao.quantization.quantize_.workflows import QuantizeTensorToFloat8Kwargs  # noqa: E402

# AOTAutograd's cache asks torchao's weight subclass for a hash it does not define: not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore:Float8Tensor does not implement _stable_hash_for_caching")

QUANT_FUSIONS = [
    f"{p}rms_norm_quant_fp8_{s}" for p in ("", "add_") for s in ("static", "per_token", "per_group")
]
GRANULARITY = {"per_row": PerRow(), "per_tensor": PerTensor(), "per_block_128": PerBlock([1, 128])}
FUSED_OPS = {"fusion_passes.rms_norm_quant_fp8.default", "fusion_passes.add_rms_norm_quant_fp8.default"}


def _bits(t):
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _outputs(out):
    return (out,) if isinstance(out, torch.Tensor) else out


def _compile(fn, fusions, *args):
    report = fusion_passes.Report()
    torch._dynamo.reset()
    # No compile caches: torchao's Float8Tensor weight has no stable hash, so a PerRow and a
    # PerTensor model (one Dynamo graph, the granularity inside the weight) share a cache entry,
    # and the second would run the first's compiled code.
    with torch.no_grad(), torch._functorch.config.patch(enable_autograd_cache=False), \
            torch._inductor.config.patch(fx_graph_cache=False):  # fmt: skip
        out = torch.compile(fn, backend=fusion_passes.backend(fusions, report=report))(*args)
    return out, report


def _assert_left_unfused(fn, *args, raised=None, rejected=None):
    """With the quant fusions on, the norm is rewritten and the quantization raised (``raised``:
    the raise fusion, or None) but not fused with it (``rejected``: a reason given, or None); the
    raised quantization is lowered back, so the outputs are within an fp8 code of the compile that
    fuses the norm alone (Inductor's compile of the reference, not of the spelling)."""
    out, report = _compile(fn, QUANT_FUSIONS, *args)
    unfused, _ = _compile(fn, ["rms_norm"], *args)
    assert {k: v for k, v in report.matches.items() if v} == {"rms_norm": 1} | ({raised: 1} if raised else {})
    assert not report.errors
    reasons = [r.reason for r in report.rejected]
    assert (rejected is None and not reasons) or any(rejected in r for r in reasons), reasons
    (graph,) = report.graphs
    assert graph.ops_before["aten.amax.default"] == 1 and graph.ops_before["aten.abs.default"] == 1
    # The canonical norm and quantization no region took are lowered back (as plain torch again).
    lowered = {"fusion_passes.rms_norm.default": 1} | ({"fusion_passes.quant_fp8.default": 1} if raised else {})
    assert graph.lowered_back == lowered and not FUSED_OPS & set(graph.ops_after)
    for a, e in zip(_outputs(out), _outputs(unfused), strict=True):
        assert a.dtype == e.dtype and a.shape == e.shape
        if a.dtype == torch.float8_e4m3fn:
            assert fp8_codes_apart(a, e) <= 1
        else:
            torch.testing.assert_close(a, e, rtol=2**-7, atol=0)
    return graph


class _NormThenLinear(nn.Module):
    def __init__(self, dtype):
        super().__init__()
        self.norm = nn.RMSNorm(256, eps=1e-6, dtype=dtype)
        self.proj = nn.Linear(256, 128, bias=False, dtype=dtype)
        with torch.no_grad():
            self.norm.weight.copy_(1 + 0.3 * torch.randn(256))

    def forward(self, x):
        return self.proj(self.norm(x))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_static_quantization_primitive_after_norm_fuses(dtype):
    """torchao's own static activation quantization, ``_quantize_affine_float8`` with a calibrated
    per-tensor scale, after ``F.rms_norm``: the norm and the quantization become one
    rms_norm_quant_fp8 op, whose codes equal torchao's eager ones bit for bit."""
    from torchao.quantization.quant_primitives import _quantize_affine_float8

    def fn(x, w, scale):
        return _quantize_affine_float8(nn.functional.rms_norm(x, (256,), w, 1e-6), scale, torch.float8_e4m3fn)

    x, w, scale = torch.randn(2, 8, 256).to(dtype), (1 + 0.3 * torch.randn(256)).to(dtype), torch.tensor(0.02)
    out, report = _compile(fn, QUANT_FUSIONS, x, w, scale)
    assert {k: v for k, v in report.matches.items() if v} == {
        "rms_norm": 1, "quant_fp8_static": 1, "rms_norm_quant_fp8_static": 1,
    }  # fmt: skip
    assert not report.errors and not report.rejected
    (graph,) = report.graphs
    assert graph.ops_before["aten.clamp_max.default"] == 1 and "aten.rsqrt.default" in graph.ops_before
    assert graph.ops_after["fusion_passes.rms_norm_quant_fp8.default"] == 1
    assert not {"aten.clamp_max.default", "aten.rsqrt.default", "aten.div.Tensor"} & set(graph.ops_after)
    with torch.no_grad():
        expected = fn(x, w, scale)
    assert out.dtype == expected.dtype and torch.equal(_bits(out), _bits(expected))


@pytest.mark.parametrize(
    "granularity,dtype",
    [("per_row", torch.bfloat16), ("per_tensor", torch.bfloat16), ("per_tensor", torch.float32)],
    ids=str,
)
def test_quantized_linear_after_norm(monkeypatch, granularity, dtype):
    """The model as torchao quantizes it; its forward runs on the CPU (torch._scaled_mm). PerRow:
    the activation quantization raises and fuses with the norm, the output eager's bit for bit;
    PerTensor raises and the norm + quant fusion refuses it (one amax over every token)."""
    import torchao.quantization.quant_api as quant_api

    # torchao asserts an sm89+ GPU before quantizing; its torch path runs on the CPU all the same.
    monkeypatch.setattr(quant_api, "_check_hardware_support", lambda granularities: None)
    model = _NormThenLinear(dtype)
    config = Float8DynamicActivationFloat8WeightConfig(
        granularity=GRANULARITY[granularity],
        set_inductor_config=False,  # leave Inductor's config alone
    )
    quantize_(model, config)
    assert type(model.proj.weight).__name__ == "Float8Tensor"
    x = torch.randn(2, 8, 256, dtype=dtype)
    if granularity == "per_tensor":
        graph = _assert_left_unfused(model, x, raised="quant_fp8_unfloored", rejected="per_tensor scheme")
        assert graph.ops_after["aten._scaled_mm.default"] == 1
        return
    out, report = _compile(model, QUANT_FUSIONS, x)
    assert {k: v for k, v in report.matches.items() if v} == {
        "rms_norm": 1, "quant_fp8_unfloored": 1, "rms_norm_quant_fp8_per_token": 1,
    }  # fmt: skip
    assert not report.errors and not report.rejected
    after = report.graphs[0].ops_after
    assert after["aten._scaled_mm.default"] == 1 and after["fusion_passes.rms_norm_quant_fp8.default"] == 1
    with torch.no_grad():
        expected = model(x)
    assert torch.equal(out, expected)


def _torchao_quant(granularity):
    """The activation quantization torchao's Float8Tensor linear runs on its input."""
    kwargs = QuantizeTensorToFloat8Kwargs(torch.float8_e4m3fn, GRANULARITY[granularity])

    def quant(y):
        q = _choose_quant_func_and_quantize_tensor(y, kwargs)
        return q.qdata, q.scale

    return quant


def test_fp32_per_row_activation_quantization_after_norm_fuses():
    """fp32 PerRow on the normed activation itself: raised (no floor) and fused with the norm, the
    codes and scales torchao's eager ones bit for bit."""
    quant = _torchao_quant("per_row")

    def fn(x, w):
        return quant(nn.functional.rms_norm(x, (256,), w, 1e-6))

    x, w = torch.randn(2, 8, 256), 1 + 0.3 * torch.randn(256)
    out, report = _compile(fn, QUANT_FUSIONS, x, w)
    assert {k: v for k, v in report.matches.items() if v} == {
        "rms_norm": 1, "quant_fp8_unfloored": 1, "rms_norm_quant_fp8_per_token": 1,
    }  # fmt: skip
    assert report.graphs[0].ops_after["fusion_passes.rms_norm_quant_fp8.default"] == 1
    with torch.no_grad():
        expected = fn(x, w)
    for a, e in zip(out, expected, strict=True):
        assert a.dtype == e.dtype and torch.equal(_bits(a), _bits(e))


def test_fp32_per_block_activation_quantization_after_norm_stays_unfused():
    """PerBlock([1, 128]) expands its scales to the activation's shape before the divide: no
    spelling of the raise takes it, and the static one (a divide by a given tensor) refuses the
    expanded scale with the reason."""
    quant = _torchao_quant("per_block_128")

    def fn(x, w):
        return quant(nn.functional.rms_norm(x, (256,), w, 1e-6))

    _assert_left_unfused(fn, torch.randn(2, 8, 256), 1 + 0.3 * torch.randn(256), rejected="static scale")


@pytest.mark.parametrize("granularity,scheme", [("per_row", "per_token"), ("per_block_128", "per_group")])
def test_fp32_scale_has_no_floor(granularity, scheme):
    """Why fp32 is not fused: the op's math equals torchao's on rows with amax >= 1/512 and
    differs below, where the op floors the scale at MIN_SCALE and torchao does not."""
    y = torch.randn(6, 256)
    y[4] = 0.0  # a padding row: torchao 0 / 0 -> NaN codes, scale 0
    y[5] *= 1e-4 / y[5].abs().max()  # amax 1e-4 < 1/512: a scale below MIN_SCALE
    q, s = _torchao_quant(granularity)(y)
    ref_q, ref_s = quant_fp8_reference(y, QuantFP8(scheme, group_size=128))
    assert s.shape == ref_s.shape and s.dtype == ref_s.dtype == torch.float32
    assert torch.equal(_bits(q[:4]), _bits(ref_q[:4])) and torch.equal(s[:4], ref_s[:4])
    assert (s[4] == 0).all() and q[4].float().isnan().all()
    assert (ref_s[4] == MIN_SCALE).all() and (ref_q[4].float() == 0).all()
    assert (s[5] < MIN_SCALE).all() and (ref_s[5] == MIN_SCALE).all()


def test_bf16_scale_is_rounded_to_bf16():
    """Why bf16 is not fused either: torchao divides the bf16 amax by 448 in bf16, the op in fp32."""
    y = torch.randn(64, 256).bfloat16()
    q, s = _torchao_quant("per_row")(y)
    assert torch.equal(s, (y.abs().amax(-1, keepdim=True) / 448.0).float())
    ref_q, ref_s = quant_fp8_reference(y, QuantFP8("per_token"))
    assert (s != ref_s).sum() > 32  # most rows: a bf16 rounding of amax / 448 is no fp32 one
    assert not torch.equal(_bits(q), _bits(ref_q))
