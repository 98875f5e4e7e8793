"""The decode step's causal conv kernel against its plain-torch reference: on CPU tensors through
Triton's interpreter, or on CUDA tensors, compiled, where a GPU is present."""

import os

import torch  # torch does not import triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    # Chosen before triton is first imported; only without a GPU (see test_rms_norm_kernel.py).
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
from _hypothesis import examples  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import fusion_passes  # noqa: E402,F401  (registers torch.ops.fusion_passes)
from fusion_passes.lowering.causal_conv1d_update.reference import causal_conv1d_update_reference  # noqa: E402
from fusion_passes.lowering.causal_conv1d_update.triton import causal_conv1d_update_triton  # noqa: E402

# The conv output is rounded twice (conv, then SiLU) in both; the W-term sum's order differs (fp32).
# bf16 under the interpreter truncates instead of rounding: one ulp per rounding, two in a row.
TOLERANCE = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}


def _inputs(bsz, channels, tokens, state_len, taps, dtype, bias, g):
    def randn(*shape):
        return torch.randn(shape, generator=g).to(DEVICE, dtype)

    x = randn(bsz, tokens, channels).transpose(1, 2)  # the projection's output, transposed
    return x, randn(bsz, channels, state_len), randn(channels, taps), randn(channels) if bias else None


def _check(x, state, weight, bias, silu, in_place=False):
    expected, expected_state = causal_conv1d_update_reference(x, state, weight, bias, silu)
    before = state.clone()
    wrap = (lambda kernel: kernel) if in_place else None
    out, new_state = causal_conv1d_update_triton(x, state, weight, bias, silu, wrap=wrap)
    rtol, atol = TOLERANCE[x.dtype]
    assert out.dtype == x.dtype and out.shape == x.shape
    torch.testing.assert_close(out.double(), expected.double(), rtol=rtol, atol=atol)
    # the shifted state holds the inputs unchanged: exact
    assert torch.equal(new_state, expected_state)
    if in_place:
        assert new_state.data_ptr() == state.data_ptr()
    else:
        assert torch.equal(state, before)


@st.composite
def _cases(draw):
    taps = draw(st.integers(2, 5))
    return dict(
        bsz=draw(st.integers(1, 4)),
        channels=draw(st.sampled_from([1, 7, 64, 100, 300])),
        tokens=draw(st.integers(1, 3)),
        state_len=taps - 1 + draw(st.integers(0, 2)),
        taps=taps,
        dtype=draw(st.sampled_from(list(TOLERANCE))),
        bias=draw(st.booleans()),
        silu=draw(st.booleans()),
        in_place=draw(st.booleans()),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


@settings(max_examples=examples(40), deadline=None)
@given(case=_cases())
def test_matches_reference(case):
    g = torch.Generator().manual_seed(case["seed"])
    args = _inputs(case["bsz"], case["channels"], case["tokens"], case["state_len"], case["taps"],
                   case["dtype"], case["bias"], g)  # fmt: skip
    _check(*args, case["silu"], case["in_place"])


def test_qwen_width_bf16():
    """Qwen 3.5-MoE's conv: 2 x 16 x 128 + 32 x 128 = 8192 channels, 4 taps, a 4-entry state."""
    g = torch.Generator().manual_seed(0)
    _check(*_inputs(2, 8192, 1, 4, 4, torch.bfloat16, False, g), True, in_place=True)


def test_op_is_functional_and_checked():
    g = torch.Generator().manual_seed(1)
    x, state, weight, bias = _inputs(2, 24, 1, 4, 4, torch.float32, True, g)
    torch.library.opcheck(torch.ops.fusion_passes.causal_conv1d_update.default, (x, state, weight, bias, True))


@pytest.mark.parametrize(
    ("state_len", "state_dtype", "message"),
    [(2, torch.float32, "state for 4 taps"), (4, torch.bfloat16, "conv_state is torch.bfloat16")],
)
def test_bad_arguments_raise(state_len, state_dtype, message):
    g = torch.Generator().manual_seed(2)
    x, _, weight, _ = _inputs(2, 24, 1, 4, 4, torch.float32, False, g)
    state = torch.randn(2, 24, state_len).to(DEVICE, state_dtype)
    with pytest.raises(ValueError, match=message):
        causal_conv1d_update_triton(x, state, weight, None, True)
