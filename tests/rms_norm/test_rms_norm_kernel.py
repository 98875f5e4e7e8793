"""The Triton RMSNorm kernel against the plain-torch reference: on CPU tensors through Triton's
interpreter, or on CUDA tensors, compiled, where a GPU is present."""

import os

import torch  # torch does not import triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    # The interpreter must be chosen before triton is first imported (fusion_passes imports it).
    # Only without a GPU: set in a GPU session it would turn later tests' kernels interpreted.
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
from _hypothesis import examples  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from fusion_passes.lowering.rms_norm.reference import (  # noqa: E402
    add_rms_norm_reference,
    rms_norm_reference,
)
from fusion_passes.lowering.rms_norm.triton import rms_norm_triton  # noqa: E402

# (rtol, atol) for outputs compared in float64. fp32: only the sum order and rsqrt differ from
# torch (seen up to 3 fp32 eps, 3.6e-7, relative). fp16: the interpreter rounds to nearest like the
# GPU, so only a rare 1-ulp flip from that fp32 difference per rounding (seen 1.7 eps on an H200).
# bf16: the interpreter truncates every fp32 -> bf16 cast instead of rounding; the Llama add form
# passes three of them in a chain (r, n, y), each off by up to 1 ulp (<= eps relative): seen up to
# 2.9 eps, so allow 4 (the GPU, rounding, stays within 1.3).
TOLERANCE = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2 * torch.finfo(torch.float16).eps, 1e-5),
    torch.bfloat16: (4 * torch.finfo(torch.bfloat16).eps, 1e-5),
}
DTYPES = list(TOLERANCE)


def _randn(shape, dtype, generator):
    """Standard normal values drawn on the CPU from generator, as dtype on DEVICE."""
    return torch.randn(shape, generator=generator).to(DEVICE, dtype)


def _reference(x, weight, eps, weight_offset, cast_before_weight, residual, residual_in_fp32=False):
    if residual is None:
        return rms_norm_reference(x, weight, eps, weight_offset, cast_before_weight), None
    return add_rms_norm_reference(
        x, residual, weight, eps, weight_offset, cast_before_weight, residual_in_fp32
    )


def _check(x, weight, eps, weight_offset, cast_before_weight, residual, residual_in_fp32=False):
    """Run the kernel and assert it matches the reference within the dtype's tolerance."""
    form = (eps, weight_offset, cast_before_weight, residual_in_fp32)
    out, new_residual = rms_norm_triton(x, weight, *form, residual=residual)
    ref, ref_residual = _reference(x, weight, *form[:3], residual, residual_in_fp32)
    rtol, atol = TOLERANCE[x.dtype]
    assert out.dtype == x.dtype and out.shape == x.shape and out.is_contiguous()
    torch.testing.assert_close(out.double(), ref.double(), rtol=rtol, atol=atol)
    if residual is None:
        assert new_residual is None
    else:
        assert new_residual.dtype == x.dtype and new_residual.is_contiguous()
        torch.testing.assert_close(
            new_residual.double(), ref_residual.double(), rtol=rtol, atol=atol
        )
    return out, new_residual


@st.composite
def _cases(draw):
    """Shapes, dtypes and flags of one kernel call; inputs are drawn from a per-example seed."""
    dtype = draw(st.sampled_from(DTYPES))
    cast_before_weight = draw(st.booleans())
    # The Llama form needs weight in x.dtype and no offset; the fp32-weight form takes either.
    weight_dtype = dtype if cast_before_weight else draw(st.sampled_from([dtype, torch.float32]))
    weight_offset = 0.0 if cast_before_weight else draw(st.sampled_from([0.0, 1.0]))
    rows = draw(st.integers(1, 70))
    hidden = draw(st.one_of(st.integers(1, 300), st.sampled_from([1, 7, 100, 129, 256])))
    leading = draw(st.sampled_from([(rows,), (2, rows), (rows, 3)]))
    return dict(
        shape=(*leading, hidden),
        dtype=dtype,
        weight_dtype=weight_dtype,
        eps=draw(st.floats(1e-6, 1e-2)),
        weight_offset=weight_offset,
        cast_before_weight=cast_before_weight,
        with_residual=draw(st.booleans()),
        residual_in_fp32=draw(st.booleans()),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


@settings(max_examples=examples(40), deadline=None)
@given(case=_cases())
def test_matches_reference(case):
    g = torch.Generator().manual_seed(case["seed"])
    shape, dtype = case["shape"], case["dtype"]
    x = _randn(shape, dtype, g)
    weight = _randn(shape[-1], case["weight_dtype"], g)
    residual = _randn(shape, dtype, g) if case["with_residual"] else None
    form = (case["eps"], case["weight_offset"], case["cast_before_weight"])
    _check(x, weight, *form, residual, case["residual_in_fp32"] and residual is not None)


@pytest.mark.parametrize("hidden", [1, 7, 100, 129, 3072, 7168])
@pytest.mark.parametrize("with_residual", [False, True, "fp32"])
def test_hidden_sizes_llama_bf16(hidden, with_residual):
    """The model sizes and odd sizes, in the Llama form the benchmark times (and vLLM's fp32 add)."""
    g = torch.Generator().manual_seed(hidden)
    x = _randn((3, hidden), torch.bfloat16, g)
    weight = _randn(hidden, torch.bfloat16, g)
    residual = _randn((3, hidden), torch.bfloat16, g) if with_residual else None
    _check(x, weight, 1e-6, 0.0, True, residual, with_residual == "fp32")


def test_outputs_fully_written(monkeypatch):
    """Outputs allocated NaN-filled come back NaN-free: every element was stored."""
    real_empty = torch.empty

    def poisoned_empty(*args, **kwargs):
        return real_empty(*args, **kwargs).fill_(float("nan"))

    monkeypatch.setattr(torch, "empty", poisoned_empty)
    g = torch.Generator().manual_seed(0)
    # 37 rows of 100: neither a multiple of the rows per program nor of the block width.
    x = _randn((37, 100), torch.float16, g)
    residual = _randn((37, 100), torch.float16, g)
    weight = _randn(100, torch.float16, g)
    out, new_residual = _check(x, weight, 1e-5, 0.0, False, residual)
    assert not out.isnan().any() and not new_residual.isnan().any()


def test_strided_inputs():
    """Row-strided views are read in place; a non-unit column stride is copied first."""
    g = torch.Generator().manual_seed(1)
    padded_x = _randn((9, 160), torch.bfloat16, g)
    padded_residual = _randn((9, 200), torch.bfloat16, g)
    weight = _randn(129, torch.bfloat16, g)
    x, residual = padded_x[:, :129], padded_residual[:, 50:179]
    assert x.stride() == (160, 1) and residual.stride() == (200, 1)
    _check(x, weight, 1e-6, 0.0, True, residual)
    _check(x.t().contiguous().t(), weight, 1e-6, 0.0, True, residual)  # column stride 9
    _check(x, _randn(258, torch.float32, g)[::2], 1e-6, 1.0, False, None)  # weight stride 2


@pytest.mark.parametrize(
    ("weight", "cast_before_weight"),
    [
        (torch.ones(7, dtype=torch.bfloat16), False),  # wrong length
        (torch.ones(8, 1, dtype=torch.bfloat16), False),  # not 1-D
        (torch.ones(8, dtype=torch.float32), True),  # Llama form, weight not in x.dtype
    ],
)
def test_bad_arguments_raise(weight, cast_before_weight):
    x = torch.randn(2, 8).to(DEVICE, torch.bfloat16)
    with pytest.raises(ValueError):
        rms_norm_triton(x, weight, 1e-6, 0.0, cast_before_weight)
