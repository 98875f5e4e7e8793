"""The Gated DeltaNet decode step with its gated RMSNorm (gated_delta_step_norm) against its
plain-torch reference: both launch forms (the whole row with the norm in the step's program, and
the step's narrow tiles then a norm kernel), on CPU tensors through Triton's interpreter, or on
CUDA tensors, compiled, where a GPU is present."""

import os

import torch  # torch does not import triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    # Chosen before triton is first imported; only without a GPU (see test_rms_norm_kernel.py).
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from _hypothesis import examples  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from test_gated_delta_step_kernel import TOLERANCE, _inputs  # noqa: E402

import fusion_passes  # noqa: E402,F401  (registers torch.ops.fusion_passes)
from fusion_passes.lowering.gated_delta_step.norm_triton import gated_delta_step_norm_triton  # noqa: E402
from fusion_passes.lowering.gated_delta_step.reference import gated_delta_step_norm_reference  # noqa: E402

# The norm's forms (weight_offset, cast_before_weight): Qwen3_5RMSNormGated's Llama order, and the
# fp32-weight order with and without the (1 + w) offset.
FORMS = ((0.0, True), (0.0, False), (1.0, False))


def _norm_args(bsz, hv, dv, dtype, weight_dtype, g, z_stride=0):
    """z [B * HV, V] (rows z_stride apart when given: a slice of a wider GEMM output) and the weight."""
    z = torch.randn(bsz * hv, dv + z_stride, generator=g).to(DEVICE, dtype)[:, :dv]
    weight = (1 + 0.2 * torch.randn(dv, generator=g)).to(DEVICE, weight_dtype)
    return z, weight


def _check(step_args, z, weight, form, norm_form, epilogue, in_place):
    q, k, v, a, b, A_log, dt_bias, state = step_args
    norm = (1e-6, *norm_form)
    expected, expected_state = gated_delta_step_norm_reference(*step_args, z, weight, *form, *norm)
    before = state.clone()
    wrap = (lambda kernel: kernel) if in_place else None
    y, new_state = gated_delta_step_norm_triton(*step_args, z, weight, *form, *norm, wrap=wrap, epilogue=epilogue)
    (rtol, atol), (state_rtol, state_atol) = TOLERANCE[v.dtype]
    assert y.dtype == v.dtype and y.shape == z.shape and y.is_contiguous()
    # The norm divides by the row's rms: the step's output error (its tolerance) scaled by the
    # weight and silu(z), both O(1) here; one more rounding of y.
    torch.testing.assert_close(y.double(), expected.double(), rtol=2 * rtol, atol=4 * atol)
    torch.testing.assert_close(new_state.double(), expected_state.double(), rtol=state_rtol, atol=state_atol)
    if in_place:
        assert new_state.data_ptr() == state.data_ptr()
    else:
        assert torch.equal(state, before) and new_state.data_ptr() != state.data_ptr()
    return y, new_state


@st.composite
def _cases(draw):
    hk = draw(st.integers(1, 3))
    return dict(
        bsz=draw(st.integers(1, 4)),
        hk=hk,
        hv=hk * draw(st.sampled_from([1, 2, 3])),
        dk=draw(st.sampled_from([8, 16, 20])),
        dv=draw(st.sampled_from([8, 24, 32, 40])),
        dtype=draw(st.sampled_from(list(TOLERANCE))),
        norm_form=draw(st.sampled_from(FORMS)),
        fp32_params=draw(st.booleans()),
        epilogue=draw(st.booleans()),
        in_place=draw(st.booleans()),
        z_stride=draw(st.sampled_from([0, 3])),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


@settings(max_examples=examples(40), deadline=None)
@given(case=_cases())
def test_matches_reference(case):
    g = torch.Generator().manual_seed(case["seed"])
    dtype = case["dtype"]
    param_dtype = torch.float32 if case["fp32_params"] else dtype
    step = _inputs(case["bsz"], case["hk"], case["hv"], case["dk"], case["dv"], dtype, param_dtype, g, strided=True)
    # The Llama form needs the weight in the activations' dtype; the fp32-weight form takes either.
    weight_dtype = dtype if case["norm_form"][1] else param_dtype
    z, weight = _norm_args(case["bsz"], case["hv"], case["dv"], dtype, weight_dtype, g, case["z_stride"])
    form = (case["dk"] ** 0.5, True, True, 1e-6)
    _check(step, z, weight, form, case["norm_form"], case["epilogue"], case["in_place"])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_two_launch_forms_agree(dtype):
    """The whole-row epilogue and the step's tiles + norm kernel: the state bit-equal (each state
    column's step is the same sums over K in both), y within one rounding (the row's sum of
    squares may be reduced in another order)."""
    g = torch.Generator().manual_seed(5)
    step = _inputs(3, 2, 4, 16, 40, dtype, dtype, g)
    z, weight = _norm_args(3, 4, 40, dtype, dtype, g)
    form = (4.0, True, True, 1e-6)
    fused = _check(step, z, weight, form, (0.0, True), True, False)
    split = _check(step, z, weight, form, (0.0, True), False, False)
    assert torch.equal(fused[1], split[1])
    ulp = torch.finfo(dtype).eps
    torch.testing.assert_close(fused[0].double(), split[0].double(), rtol=2 * ulp, atol=2 * ulp)


def test_qwen_widths_bf16():
    """Qwen3-Next / Qwen 3.5's GDN at batch 2: 16 key heads, 32 value heads of 128, the whole row
    of 128 in one program (the epilogue form)."""
    g = torch.Generator().manual_seed(1)
    step = _inputs(2, 16, 32, 128, 128, torch.bfloat16, torch.bfloat16, g, strided=True)
    z, weight = _norm_args(2, 32, 128, torch.bfloat16, torch.bfloat16, g)
    _check(step, z, weight, (128**0.5, True, True, 1e-6), (0.0, True), True, True)


def test_matches_transformers_gated_norm():
    """The reference's norm is Qwen3_5RMSNormGated's forward, written out as transformers does."""
    g = torch.Generator().manual_seed(4)
    step = _inputs(2, 2, 4, 16, 24, torch.bfloat16, torch.bfloat16, g)
    z, weight = _norm_args(2, 4, 24, torch.bfloat16, torch.bfloat16, g)
    form = (4.0, True, True, 1e-6)
    y, _ = gated_delta_step_norm_reference(*step, z, weight, *form, 1e-6, 0.0, True)
    from fusion_passes.lowering.gated_delta_step.reference import gated_delta_step_reference

    out, _ = gated_delta_step_reference(*step, *form)
    h = out.reshape(-1, 24).to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    h = weight * h.to(torch.bfloat16)
    assert torch.equal(y, (h * F.silu(z.to(torch.float32))).to(torch.bfloat16))


def test_op_is_functional_and_checked():
    g = torch.Generator().manual_seed(2)
    step = _inputs(2, 2, 4, 16, 8, torch.float32, torch.float32, g)
    z, weight = _norm_args(2, 4, 8, torch.float32, torch.float32, g)
    args = (*step, z, weight, 4.0, True, True, 1e-6, 1e-6, 0.0, True)
    torch.library.opcheck(torch.ops.fusion_passes.gated_delta_step_norm.default, args)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda a: a.__setitem__(8, a[8][:-1]), r"z \(7, 8\)"),  # a gate row short
        (lambda a: a.__setitem__(8, a[8].half()), "z .* must be"),  # the gate in another dtype
        (lambda a: a.__setitem__(9, a[9][:4]), "weight must have shape"),  # a weight of the wrong width
        (lambda a: a.__setitem__(7, a[7].bfloat16()), "float32"),  # the step's own checks
    ],
)
def test_bad_arguments_raise(change, message):
    g = torch.Generator().manual_seed(3)
    step = _inputs(2, 2, 4, 16, 8, torch.float32, torch.float32, g)
    args = [*step, *_norm_args(2, 4, 8, torch.float32, torch.float32, g)]
    change(args)
    with pytest.raises(ValueError, match=message):
        gated_delta_step_norm_triton(*args, 4.0, True, True, 1e-6, 1e-6, 0.0, True)
