"""The prefill's causal conv kernel against its plain-torch reference: on CPU tensors through
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
from fusion_passes.lowering.causal_conv1d.reference import causal_conv1d_reference  # noqa: E402
from fusion_passes.lowering.causal_conv1d.triton import causal_conv1d_triton  # noqa: E402

# The conv output is rounded twice (conv, then SiLU) in both; the W-term sum's order differs (fp32).
# bf16 under the interpreter truncates instead of rounding: one ulp per rounding, two in a row.
TOLERANCE = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}


def _inputs(bsz, channels, tokens, taps, dtype, bias, transposed, g, state_len=None):
    def randn(*shape):
        return torch.randn(shape, generator=g).to(DEVICE, dtype)

    # transposed: the projection's [B, T, C] output seen as [B, C, T], as the models pass it
    x = randn(bsz, tokens, channels).transpose(1, 2) if transposed else randn(bsz, channels, tokens)
    state = None if state_len is None else randn(bsz, channels, state_len)
    return x, randn(channels, taps), randn(channels) if bias else None, state


def _check(x, weight, bias, state, silu):
    expected = causal_conv1d_reference(x, weight, bias, silu, state)
    out = causal_conv1d_triton(x, weight, bias, silu, state)
    rtol, atol = TOLERANCE[x.dtype]
    assert out.dtype == x.dtype and out.shape == x.shape and out.is_contiguous()
    torch.testing.assert_close(out.double(), expected.double(), rtol=rtol, atol=atol)


@st.composite
def _cases(draw):
    taps = draw(st.integers(1, 5))
    return dict(
        bsz=draw(st.integers(1, 3)),
        channels=draw(st.sampled_from([1, 7, 64, 100, 130])),
        tokens=draw(st.sampled_from([1, 2, 3, 5, 63, 64, 65, 150])),
        taps=taps,
        # a cached state that the prompt continues: at least the W - 1 inputs the first outputs read
        state_len=draw(st.sampled_from([None, taps - 1, taps, taps + 2])),
        dtype=draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16])),
        bias=draw(st.booleans()),
        transposed=draw(st.booleans()),
        silu=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )


@settings(max_examples=examples(40), deadline=None)
@given(case=_cases())
def test_matches_reference(case):
    case = dict(case)
    silu, g = case.pop("silu"), torch.Generator().manual_seed(case.pop("seed"))
    _check(*_inputs(**case, g=g), silu)


def test_qwen_width_bf16():
    """Qwen 3.5's conv (2 x 16 x 128 + 32 x 128 = 8192 channels, 4 taps, no bias) over 130 tokens
    of the transposed projection: a few token tiles, the last one partial."""
    g = torch.Generator().manual_seed(0)
    _check(*_inputs(1, 8192, 130, 4, torch.bfloat16, False, True, g), True)
    # a prompt continuing the StaticCache's 4-entry conv state
    _check(*_inputs(1, 8192, 130, 4, torch.bfloat16, False, True, g, state_len=4), True)


@pytest.mark.parametrize("state_len", [None, 4])
def test_fewer_tokens_than_taps(state_len):
    """Every output reads the inputs before the prompt: zeros, or the state's."""
    g = torch.Generator().manual_seed(1)
    _check(*_inputs(2, 7, 2, 4, torch.float32, True, False, g, state_len=state_len), True)


@pytest.mark.parametrize("state_len", [None, 3])
def test_op_is_functional_and_checked(state_len):
    g = torch.Generator().manual_seed(2)
    args = _inputs(2, 24, 9, 4, torch.float32, True, True, g, state_len=state_len)
    torch.library.opcheck(torch.ops.fusion_passes.causal_conv1d.default, (*args[:3], True, args[3]))


def test_bad_input_is_one_line_error():
    x = torch.randn(1, 8, 5, device=DEVICE)
    with pytest.raises(ValueError, match=r"^causal_conv1d: weight \(9, 4\) and bias None do not match x's 8 channels$"):
        causal_conv1d_triton(x, torch.randn(9, 4, device=DEVICE), None, True)
    with pytest.raises(ValueError, match=r"^causal_conv1d: x \[B, C, T\] and weight \[C, W\] expected"):
        torch.ops.fusion_passes.causal_conv1d(x[0], torch.randn(8, 4, device=DEVICE), None, True)
    with pytest.raises(ValueError, match="dtype torch.int32 is not one of"):
        causal_conv1d_triton(x.int(), torch.randn(8, 4, device=DEVICE), None, True)
    with pytest.raises(ValueError, match=r"^causal_conv1d: initial_state holds 2 inputs, 3 needed$"):
        causal_conv1d_triton(x, torch.randn(8, 4, device=DEVICE), None, True, torch.randn(1, 8, 2, device=DEVICE))
