"""The FP8 epilogue's quantization forms (common/fp8_triton.py: the floor on the amax or the scale
or none, a divide, a reciprocal multiply or the ``448 / amax`` multiplier, with or without
saturation; the floor of SGLang's reference rounded to the activation's dtype) in the norm and
SiLU kernels, against the plain-torch reference: on CPU tensors through Triton's interpreter, or
on CUDA tensors, compiled, where a GPU is present.

Bit for bit: the inputs make the kernels' activation y exactly the reference's (norm rows of
+-2, so y = +-weight in any summation order; bf16 SiLU, which the interpreter rounds as torch
does), with a zero row (each floor's scale, or NaN codes without one) and, statically, codes past
448 (NaN codes without saturation)."""

import os

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from fusion_passes.lowering.common.fp8 import QuantFP8, kernel_problem  # noqa: E402
from fusion_passes.lowering.common.fp8_triton import cast_saturates  # noqa: E402
from fusion_passes.lowering.rms_norm.reference import RMSNormForm  # noqa: E402
from fusion_passes.lowering.rms_norm_quant_fp8.reference import (  # noqa: E402
    add_rms_norm_quant_fp8_reference,
    rms_norm_quant_fp8_reference,
)
from fusion_passes.lowering.rms_norm_quant_fp8.triton import rms_norm_quant_fp8_triton  # noqa: E402
from fusion_passes.lowering.silu_mul_quant_fp8.reference import silu_mul_quant_fp8_reference  # noqa: E402
from fusion_passes.lowering.silu_mul_quant_fp8.triton import silu_mul_quant_fp8_triton  # noqa: E402

# Each code base's form (QuantFP8's fields after the first four), as patterns/quant_fp8.py raises it.
FORMS = {
    "vllm_per_token": dict(apply="reciprocal"),
    "sglang_native": dict(floor_site="amax", floor=1e-10, scale_math="input_amax"),
    "sglang_triton": dict(floor_site="amax", floor=1e-10, apply="reciprocal"),
    "deepgemm": dict(floor_site="amax", floor=1e-4, apply="reciprocal", saturate=False),
    "deepseek_v3": dict(floor_site="none", floor=0.0, saturate=False),
    "multiplier": dict(floor_site="amax", floor=1e-6, apply="multiplier"),
    "torchao_inference": dict(floor_site="none", floor=0.0, scale_math="input"),
}
# The default run: one case per form (both kernels, both schemes among them); the rest slow.
DEFAULT = {
    ("vllm_per_token", "per_token", "norm"), ("sglang_native", "per_group", "silu"),
    ("sglang_triton", "per_group", "norm"), ("deepgemm", "per_group", "silu"),
    ("deepseek_v3", "per_token", "norm"), ("multiplier", "per_token", "silu"),
    ("torchao_inference", "per_token", "silu"), ("torchao_inference", "per_group", "norm"),
}  # fmt: skip
CASES = [
    pytest.param(form, scheme, op, marks=() if (form, scheme, op) in DEFAULT else pytest.mark.slow)
    for form in FORMS
    for scheme in ("per_token", "per_group")
    for op in ("norm", "silu")
]


def _quant(form, scheme, scale=None):
    return QuantFP8(scheme, scale, 128, False)._replace(**FORMS[form])


def _same_codes(a, b):
    """The same fp8 bits, NaN codes counted equal whatever their sign (a NaN's sign is the
    device's)."""
    a8, b8 = a.view(torch.uint8), b.view(torch.uint8)
    nan_a, nan_b = (a8 & 0x7F) == 0x7F, (b8 & 0x7F) == 0x7F
    return bool(torch.equal(nan_a, nan_b) and torch.equal(a8[~nan_a], b8[~nan_b]))


def _same_scales(a, b):
    return a.shape == b.shape and bool(torch.equal(a.isnan(), b.isnan()) and torch.equal(a[~a.isnan()], b[~b.isnan()]))


def _norm_inputs(dtype, rows=5, n=384, seed=0):
    """Rows of +-2 (rms 2, so n = +-1 and y = +-weight exactly), a zero row (rms 0: y = 0)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.where(torch.rand(rows, n, generator=g) < 0.5, -2.0, 2.0)
    x[2] = 0.0
    weight = (torch.randn(n, generator=g) * 3).bfloat16()
    return x.to(DEVICE, dtype), weight.to(DEVICE, dtype)


def _silu_inputs(rows=5, n=384, seed=0):
    g = torch.Generator().manual_seed(seed)
    gate, up = (torch.randn(rows, n, generator=g) * 3 for _ in range(2))
    up[2] = 0.0  # a zero row of y
    return gate.to(DEVICE, torch.bfloat16), up.to(DEVICE, torch.bfloat16)


@pytest.mark.parametrize(("form", "scheme", "op"), CASES)
def test_form_bit_exact(form, scheme, op):
    quant = _quant(form, scheme)
    assert kernel_problem(quant) is None
    if op == "norm":
        dtype = torch.bfloat16 if form != "deepseek_v3" else torch.float32
        dtype = torch.float16 if form == "torchao_inference" else dtype
        x, weight = _norm_inputs(dtype)
        norm = RMSNormForm(2.0**-30, 0.0, True)  # 4 + eps rounds to 4: rstd exactly 1 / 2
        q, scales, _ = rms_norm_quant_fp8_triton(x, weight, norm, quant)
        ref_q, ref_scales = rms_norm_quant_fp8_reference(x, weight, norm, quant)
    else:
        gate, up = _silu_inputs()
        q, scales = silu_mul_quant_fp8_triton(gate, up, quant)
        ref_q, ref_scales = silu_mul_quant_fp8_reference(gate, up, quant)
    assert _same_codes(q, ref_q) and _same_scales(scales, ref_scales)
    zero_row_codes = q.view(torch.uint8)[2]
    if FORMS[form].get("floor_site") == "none":  # deepseek_v3, torchao
        assert ((zero_row_codes & 0x7F) == 0x7F).all()  # 0 / 0
    else:
        assert (zero_row_codes & 0x7F == 0).all()


@pytest.mark.parametrize(
    ("apply", "saturate"),
    [("reciprocal", True), pytest.param("divide", False, marks=pytest.mark.slow), ("multiplier", False)],
)
def test_static_forms_and_overflow(apply, saturate):
    """A given scale applied by a divide, a reciprocal multiply or as a multiplier; small enough
    that codes pass 448: saturated to +-448, or without saturation what torch's cast gives (+-448
    on recent torch, NaN codes past 464 on older); the residual form."""
    scale = torch.tensor([0.004 if apply != "multiplier" else 250.0], device=DEVICE)
    quant = QuantFP8("static", scale, 128, False)._replace(apply=apply, saturate=saturate)
    x, weight = _norm_inputs(torch.bfloat16, seed=1)
    residual = torch.zeros_like(x)
    norm = RMSNormForm(2.0**-30, 0.0, True)  # 4 + eps rounds to 4: rstd exactly 1 / 2
    q, scales, new_residual = rms_norm_quant_fp8_triton(x, weight, norm, quant, residual)
    ref_q, ref_scales, ref_residual = add_rms_norm_quant_fp8_reference(x, residual, weight, norm, quant)
    assert _same_codes(q, ref_q) and torch.equal(scales, ref_scales) and torch.equal(new_residual, ref_residual)
    overflow = (ref_q.view(torch.uint8) & 0x7F) == 0x7F
    saturates = cast_saturates(x.device.type)
    assert bool(overflow.any()) == (not saturate and not saturates)
    if saturate or saturates:  # (unsaturated, quotients in (448, 464] round to 448 too)
        assert bool(((ref_q.view(torch.uint8) & 0x7F) == 0x7E).any())


@pytest.mark.parametrize(
    ("quant", "reason"),
    [
        (QuantFP8("per_tensor"), "per_tensor scheme"),
        (QuantFP8("per_group", pow2="ceil"), "pow2='ceil'"),
        (QuantFP8("per_token", scale_math="fp64", floor_site="amax", apply="multiplier"), "scale_math='fp64'"),
        (QuantFP8("per_token", scale_math="input", apply="multiplier"), "scale_math='input' with the multiplier"),
        (QuantFP8("per_token", fp8_max=240.0), "fp8_max 240.0"),
    ],
)
def test_forms_the_kernels_do_not_compute_raise(quant, reason):
    """What the epilogue does not compute is refused with a one-line reason (the region checks
    return the same reason), never approximated."""
    assert reason in kernel_problem(quant)
    gate = torch.randn(2, 256, device=DEVICE)
    x, weight = gate, torch.ones(256, device=DEVICE)
    for call in (
        lambda: silu_mul_quant_fp8_triton(gate, gate, quant),
        lambda: rms_norm_quant_fp8_triton(x, weight, RMSNormForm(1e-6), quant),
    ):
        with pytest.raises(ValueError, match=reason.replace("(", r"\(")) as raised:
            call()
        assert "\n" not in str(raised.value)


@pytest.mark.parametrize(
    "fields",
    [
        dict(floor_site="below"), dict(apply="times"), dict(pow2="round"), dict(scale_math="fp16"),
        dict(floor_site="amax", floor=0.0), dict(fp8_max=57344.0), dict(scale_ue8m0=True, pow2="ceil"),
    ],
)  # fmt: skip
def test_bad_quant_fields_raise(fields):
    x = torch.randn(2, 256)
    with pytest.raises(ValueError) as raised:
        torch.ops.fusion_passes.quant_fp8(x, *QuantFP8("per_token")._replace(**fields))
    assert "\n" not in str(raised.value) and str(raised.value).startswith("quant_fp8: ")


def test_quant_fp8_op_check():
    """opcheck on the canonical op (schema, fake kernel, no aliasing of the static scale)."""
    x = torch.randn(3, 256).bfloat16()
    torch.library.opcheck(torch.ops.fusion_passes.quant_fp8.default, (x, *QuantFP8("per_group")))
    scale = torch.tensor([0.02])
    torch.library.opcheck(torch.ops.fusion_passes.quant_fp8.default, (x, *QuantFP8("static", scale)))
    torch.library.opcheck(torch.ops.fusion_passes.quant_fp8.default, (x, *QuantFP8("per_tensor")))
