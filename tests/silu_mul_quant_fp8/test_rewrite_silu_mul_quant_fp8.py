"""Rewrite tests of SiLU-and-mul + FP8 quantization: match counts, ops before/after, codes/scales
bit-exact against eager on the reference path (CPU), and the near misses left alone. The
quantizations are real code bases' spellings (tests/_fp8_spellings.py names each)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fusion_passes
from _fp8_spellings import (
    QUANT,
    per_group_quant,
    per_token_quant,
    torchao_quantize_affine_float8,
    vllm_quant_fp8_group_native,
    vllm_quant_fp8_native,
)
from fusion_passes.numerics import fp8_codes_apart

# Opt-in while the CUDA kernel awaits a GPU run: enabled by name.
FUSIONS = [f"silu_mul_quant_fp8_{s}" for s in QUANT]
OP = "fusion_passes.silu_mul_quant_fp8.default"
UNFUSED_OPS = {"aten.exp.default", "aten.amax.default", "aten.clamp_max.default"}
HIDDEN, INTERMEDIATE = 64, 256


def _bits(t):
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _run(fn, *args, lower_back=False):
    report = fusion_passes.Report()
    torch._dynamo.reset()
    with torch.no_grad():
        # lower_back=False: a raised quantization no region took runs its reference (eager's
        # numbers) rather than Inductor's recompilation of it.
        backend = fusion_passes.backend(FUSIONS, report=report, lower_back=lower_back)
        out = torch.compile(fn, backend=backend)(*args)
        expected = fn(*args)
    return out, expected, report


def _matched(report):
    """The region fusions' counts; the raise of each quantization to quant_fp8, which they start
    from, is counted in tests/quant_fp8."""
    return {k: v for k, v in report.matches.items() if v and not k.startswith("quant_fp8")}


def _assert_equal(out, expected):
    for a, e in zip(out, expected, strict=True):
        assert a.dtype == e.dtype and torch.equal(_bits(a), _bits(e))


# The MLP activations as models write them, each (x, w_gate, w_up, scale) -> quant(y, scale).
def transformers_mlp(quant):
    """LlamaMLP / Qwen3MLP / DeepseekV3MLP: act_fn(gate_proj(x)) * up_proj(x), act_fn = SiLU."""
    return lambda x, w_gate, w_up, scale: quant(F.silu(F.linear(x, w_gate)) * F.linear(x, w_up), scale)


def _fused_projection(split_halves):
    def form(quant):
        def fn(x, w_gate, w_up, scale):
            gate_up = F.linear(x, torch.cat([w_gate, w_up]))  # one merged gate_up_proj
            gate, up = split_halves(gate_up)
            return quant(F.silu(gate) * up, scale)

        return fn

    return form


FORMS = {
    "transformers": (transformers_mlp, None),
    "chunk": (_fused_projection(lambda t: t.chunk(2, -1)), "aten.split.Tensor"),
    "split": (_fused_projection(lambda t: t.split(t.shape[-1] // 2, -1)), "aten.split.Tensor"),
    # vLLM's SiluAndMul.forward_native: F.silu(x[..., :d]) * x[..., d:]
    "slice": (
        _fused_projection(lambda t: (t[..., : t.shape[-1] // 2], t[..., t.shape[-1] // 2 :])),
        "aten.slice.Tensor",
    ),
}


def _inputs(dtype, tokens=(3, 5)):
    x = torch.randn(*tokens, HIDDEN).to(dtype)
    w_gate, w_up = (torch.randn(INTERMEDIATE, HIDDEN).div(8).to(dtype) for _ in range(2))
    return x, w_gate, w_up, torch.tensor(0.01)


# fp16 graphs match the bf16-traced pattern (re-traced with their dtype): once per graph shape.
FORM_DTYPES = [(f, d) for f in FORMS for d in (torch.float32, torch.bfloat16)]
FORM_DTYPES += [("transformers", torch.float16), ("chunk", torch.float16)]


@pytest.mark.parametrize(("form", "dtype"), FORM_DTYPES, ids=lambda v: str(v).removeprefix("torch."))
@pytest.mark.parametrize("scheme", QUANT)
def test_silu_mul_then_quant_fuses_bit_exact(scheme, form, dtype):
    build, view_op = FORMS[form]
    out, expected, report = _run(build(QUANT[scheme]), *_inputs(dtype))
    name = f"silu_mul_quant_fp8_{scheme}"
    assert _matched(report) == {name: 1}
    assert not report.rejected and not report.errors
    (site,) = report.sites_of(name)
    assert site.spelling == f"silu_mul_then_{scheme}"
    (graph,) = report.graphs
    before, after = graph.ops_before, graph.ops_after
    expected_before = {"aten.exp.default", "aten.clamp_max.default", "aten.mm.default"}
    expected_before |= {"aten.amax.default"} if scheme != "static" else set()
    assert expected_before <= set(before) and OP not in before
    assert after[OP] == 1 and not UNFUSED_OPS & set(after)
    # The fused-projection forms hand the op the two halves of gate_up as views, read in place.
    assert view_op is None or after[view_op] == before[view_op]
    _assert_equal(out, expected)


def test_mlp_with_a_dequantized_down_projection():
    """The whole FP8 MLP: the codes and scales feed the down projection (dequantized per group,
    as a CPU stand-in for a block-scaled GEMM); one site per MLP, two MLPs in one graph. Stock
    Inductor's compile of this differs from eager (its dequantize-and-cast); the fused one not."""
    x, w_gate, w_up, _ = _inputs(torch.bfloat16, tokens=(7,))
    w_down = torch.randn(HIDDEN, INTERMEDIATE).div(16).to(torch.bfloat16)

    def mlp(h):
        gate, up = F.linear(h, torch.cat([w_gate, w_up])).chunk(2, -1)
        q, scales = per_group_quant(F.silu(gate) * up)
        dequantized = q.float().unflatten(-1, (-1, 128)) * scales.unsqueeze(-1)
        return F.linear(dequantized.flatten(-2).to(h.dtype), w_down)

    # Two MLPs in a row, no residual add between: Inductor folds an add after a matmul into addmm,
    # which rounds otherwise than eager (outside this fusion), and the fp8 codes would amplify it.
    out, expected, report = _run(lambda h: mlp(mlp(h)), x)
    assert _matched(report) == {"silu_mul_quant_fp8_per_group": 2}
    assert report.graphs[0].ops_after[OP] == 2 and "aten.exp.default" not in report.graphs[0].ops_after
    assert torch.equal(out, expected)


def _not_fused(fn, *args, rejected=None):
    """fn compiles with no region fusion applied: a quantization raised to quant_fp8 is lowered
    back (its op gone), the SiLU's unfused ops kept, the outputs stock Inductor's bit for bit
    (not eager's: Inductor's compiled exp is its own).
    ``rejected``: a substring of the one check rejection expected, else none."""
    out, _, report = _run(fn, *args, lower_back=True)
    assert _matched(report) == {}, fn.__name__
    (graph,) = report.graphs
    assert OP not in graph.ops_after and "fusion_passes.quant_fp8.default" not in graph.ops_after
    assert {"aten.exp.default", "aten.clamp_max.default"} <= set(graph.ops_after)
    reasons = [r.reason for r in report.rejected if not r.fusion.startswith("quant_fp8")]
    assert len(reasons) == (1 if rejected else 0) and all(rejected in r for r in reasons), reasons
    torch._dynamo.reset()
    with torch.no_grad():
        stock = torch.compile(fn)(*args)
    # The lowered-back quantization is Inductor's compile of the reference, not of the spelling:
    # where Inductor keeps a bf16 value in fp32 across the two it may differ by a code.
    for a, e in zip(out, stock, strict=True):
        assert a.dtype == e.dtype and a.shape == e.shape
        if a.dtype == torch.float8_e4m3fn:
            assert fp8_codes_apart(a, e) <= 1
        elif a.element_size() == 1:  # e5m2 codes: not raised, Inductor's own
            assert torch.equal(_bits(a), _bits(e))
        else:
            torch.testing.assert_close(a, e, rtol=2**-7, atol=0)


def test_activation_used_elsewhere_is_not_fused():
    """y, or silu(gate), also feeds another consumer that needs the unfused bf16 value."""
    gate, up = (torch.randn(4, 256).to(torch.bfloat16) for _ in range(2))

    def y_reused(gate, up):
        y = F.silu(gate) * up
        return (*per_token_quant(y), y * 2)

    def silu_reused(gate, up):
        s = F.silu(gate)
        return (*per_token_quant(s * up), s + 1)

    for fn in (y_reused, silu_reused):
        _not_fused(fn, gate, up)


def test_other_group_size_and_fp8_format_are_not_fused():
    """Groups of 64 (256 and 192 columns: 128 divides only the first), and float8_e5m2 codes."""
    gate_up = torch.randn(4, 512).to(torch.bfloat16)

    def group_64(gate_up):
        gate, up = gate_up.chunk(2, -1)
        y32 = (F.silu(gate) * up).float().unflatten(-1, (-1, 64))
        scale = (y32.abs().amax(-1, keepdim=True) / 448.0).clamp(min=1.0 / (448.0 * 512.0))
        return (y32 / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).flatten(-2), scale

    def e5m2(gate_up):
        gate, up = gate_up.chunk(2, -1)
        y32 = (F.silu(gate) * up).float()
        scale = (y32.abs().amax(-1, keepdim=True) / 448.0).clamp(min=1.0 / (448.0 * 512.0))
        return (y32 / scale).clamp(-448.0, 448.0).to(torch.float8_e5m2), scale

    for fn, arg in ((group_64, gate_up), (group_64, gate_up[:, :384]), (e5m2, gate_up)):
        _not_fused(fn, arg)


def test_broadcast_and_mixed_dtypes_are_not_fused():
    """An up that broadcasts over the tokens, or an up of another dtype (the product promotes):
    the op computes neither. The graph has the spelling's shape in each (the pattern holds no
    dtypes: it starts from the canonical quantization, which takes y in whatever dtype), and the
    check rejects it by name."""
    bf16 = torch.randn(4, 256).to(torch.bfloat16)

    def fn(gate, up):
        return per_token_quant(F.silu(gate) * up)

    _not_fused(fn, bf16, torch.randn(1, 256).to(torch.bfloat16), rejected="one shape")
    _not_fused(fn, bf16.float(), bf16, rejected="one dtype")
    _not_fused(fn, bf16, bf16.float(), rejected="one dtype")


def test_vllm_native_quantization_after_silu_and_mul_fuses():
    """vLLM's SiluAndMul.forward_native (``F.silu(x[..., :d]) * x[..., d:]``) followed by vLLM's
    own plain-torch quantization, QuantFP8._quantize_group_native (the amax of the bf16
    activation by ``max(dim)``) or QuantFP8.forward_native per token (that amax, then a multiply
    by the scale's reciprocal): each raises to quant_fp8 and fuses with the SiLU-and-mul, the
    outputs eager's bit for bit."""
    gate_up = torch.randn(4, 512).to(torch.bfloat16)

    def silu_and_mul(x):
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]

    def vllm_group_native(gate_up):
        return vllm_quant_fp8_group_native(silu_and_mul(gate_up))

    def vllm_per_token_native(gate_up):
        return vllm_quant_fp8_native(silu_and_mul(gate_up))

    for fn, scheme in ((vllm_group_native, "per_group"), (vllm_per_token_native, "per_token")):
        out, expected, report = _run(fn, gate_up)
        assert _matched(report) == {f"silu_mul_quant_fp8_{scheme}": 1}, fn.__name__
        assert report.matches["quant_fp8_dynamic"] == 1
        after = report.graphs[0].ops_after
        assert after[OP] == 1 and not UNFUSED_OPS & set(after) and "aten.max.dim" not in after
        _assert_equal(out, expected)


def test_group_size_must_divide_the_intermediate_size():
    """The per_group check refuses an activation whose width 128 does not divide (eager cannot
    even spell that quantization: the reshape fails; the check stands guard for the op)."""
    (fusion,) = fusion_passes.registry.get_fusions(["silu_mul_quant_fp8_per_group"])[-1:]
    fields = dict(floor_site="scale", floor=1e-4, apply="divide", pow2="none", fp8_max=448.0, scale_math="fp32",
                  group_size=128)  # fmt: skip
    for spelling in fusion.spellings:
        assert spelling.check({"gate": torch.empty(4, 256), "up": torch.empty(4, 256), **fields}) is None
        reason = spelling.check({"gate": torch.empty(4, 192), "up": torch.empty(4, 192), **fields})
        assert reason is not None and "must divide" in reason


def test_fusions_are_in_all_and_need_only_the_raised_quantization():
    raised = ["quant_fp8_dynamic", "quant_fp8_unfloored", "quant_fp8_static"]  # what it starts from
    assert [f.name for f in fusion_passes.registry.get_fusions(FUSIONS[:1])] == raised + FUSIONS[:1]
    assert set(FUSIONS) <= {f.name for f in fusion_passes.registry.get_fusions("all")}


def test_shapes_measured_slower_are_left_to_inductor():
    """On an H200 a static-scale site at 1-31 rows stays unfused, with the reason (its
    quantization is then lowered back); other GPUs, the CPU, other schemes and larger shapes fuse."""
    from fusion_passes.lowering.launch_tables import SILU_MUL_QUANT_FP8_REGION, fp8_region_refusal

    class FakeCuda:  # a fake tensor's view of a site: shape, numel, device
        def __init__(self, rows):
            self.shape, self.device = (rows, 4096), torch.device("cuda", 0)

        def numel(self):
            return self.shape[0] * self.shape[1]

        def dim(self):
            return 2

    from fusion_passes.lowering.common import launch_policy

    launch_policy._cuda_name.cache_clear()
    real = launch_policy._cuda_name
    try:
        launch_policy._cuda_name = lambda index: "NVIDIA H200"
        reason = fp8_region_refusal(SILU_MUL_QUANT_FP8_REGION, "static", FakeCuda(16))
        assert reason.startswith("static FP8 at 16 rows on NVIDIA H200: measured slower") and "\n" not in reason
        assert fp8_region_refusal(SILU_MUL_QUANT_FP8_REGION, "static", FakeCuda(32)) is None
        assert fp8_region_refusal(SILU_MUL_QUANT_FP8_REGION, "per_token", FakeCuda(16)) is None
        launch_policy._cuda_name = lambda index: "NVIDIA A100-SXM4-80GB"
        assert fp8_region_refusal(SILU_MUL_QUANT_FP8_REGION, "static", FakeCuda(16)) is None
    finally:
        launch_policy._cuda_name = real
    assert fp8_region_refusal(SILU_MUL_QUANT_FP8_REGION, "static", torch.empty(16, 4096)) is None


@pytest.mark.gpu
@pytest.mark.parametrize("launch", ["direct", "dispatch"])
def test_rewritten_graph_on_cuda(launch):
    """On CUDA: one site per scheme, the kernel inlined (direct) or dispatched, codes within one
    code of eager's and scales to bf16's rounding."""
    from torch._inductor.utils import run_and_get_code

    x, w_gate, w_up = (t.cuda() for t in _inputs(torch.bfloat16, tokens=(33,))[:3])
    scale = torch.tensor(0.01, device="cuda")

    def fn(x, w_gate, w_up, scale):
        gate, up = F.linear(x, torch.cat([w_gate, w_up])).chunk(2, -1)
        static = torchao_quantize_affine_float8(F.silu(gate) * up, scale)
        return (static, *per_token_quant(F.silu(up) * gate), *per_group_quant(F.silu(2 * gate) * up))

    report = fusion_passes.Report()
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=fusion_passes.backend(FUSIONS, report=report, launch=launch))
    out, (code,) = run_and_get_code(compiled, x, w_gate, w_up, scale)
    assert _matched(report) == {name: 1 for name in FUSIONS}
    assert ("_silu_mul_quant_fp8_kernel" in code) == (launch == "direct")
    for a, e in zip(out, fn(x, w_gate, w_up, scale), strict=True):
        if a.dtype == torch.float8_e4m3fn:
            assert fp8_codes_apart(a, e) <= 1
        else:
            torch.testing.assert_close(a, e, rtol=torch.finfo(torch.bfloat16).eps, atol=0)
