"""The masked attention op's kernel at one query token (lowering/masked_attention/decode.py) against
the op's plain-torch reference (SDPA's math in fp32): DeepSeek V3.2's index masks (a random top-k
of the cache, 0 / -65504 as cuDNN takes them, or -inf), odd cache lengths, head dims that are not
powers of two and q / k wider than v (MLA's 192 / 128), GQA ratios, one mask for the batch, rows
the mask closes entirely, strided inputs; fp32 / bf16 / fp16; on CPU tensors through Triton's
interpreter, or on CUDA tensors, compiled, where a GPU is present."""

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
from fusion_passes.lowering.masked_attention.decode import masked_decode_attention_triton  # noqa: E402
from fusion_passes.lowering.masked_attention.reference import masked_attention_reference  # noqa: E402
from fusion_passes.numerics import tolerance  # noqa: E402


def _inputs(b, heads, kv_heads, length, d, dv, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, heads, 1, d, generator=g).to(DEVICE, dtype)
    k = torch.randn(b, kv_heads, length, d, generator=g).to(DEVICE, dtype)
    v = torch.randn(b, kv_heads, length, dv, generator=g).to(DEVICE, dtype)
    return q, k, v


def index_mask(b, length, kept, dtype, closed, seed):
    """The index top-k's additive mask [B, 1, 1, L]: ``kept`` random positions of each row open."""
    g = torch.Generator().manual_seed(seed)
    order = torch.rand(b, length, generator=g).argsort(dim=1)
    keep = torch.zeros(b, length, dtype=torch.bool).scatter(1, order[:, :kept], True)
    mask = torch.zeros(b, 1, 1, length, dtype=dtype).masked_fill(~keep[:, None, None], closed)
    return mask.to(DEVICE)


def _assert_close(out, expected):
    tol = tolerance(out.dtype)
    assert out.shape == expected.shape
    torch.testing.assert_close(out.float(), expected.float(), rtol=tol.rtol, atol=tol.atol)


@st.composite
def _cases(draw):
    kv_heads = draw(st.sampled_from([1, 2, 3]))
    length = draw(st.sampled_from([1, 9, 64, 70, 200]))
    return dict(
        b=draw(st.sampled_from([1, 2])), kv_heads=kv_heads, heads=kv_heads * draw(st.sampled_from([1, 2])),
        length=length, kept=draw(st.integers(1, length)), d=draw(st.sampled_from([16, 24, 48])),
        dv=draw(st.sampled_from([16, 40])), dtype=draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16])),
        closed=draw(st.sampled_from([float("-inf"), -65504.0])), block_n=draw(st.sampled_from([16, 32])),
        splits=draw(st.sampled_from([None, 1, 2, 5])),
        seed=draw(st.integers(0, 2**31 - 1)),
    )  # fmt: skip


@settings(max_examples=examples(30), deadline=None)
@given(case=_cases())
def test_matches_reference(case):
    b, length = case["b"], case["length"]
    q, k, v = _inputs(b, case["heads"], case["kv_heads"], length, case["d"], case["dv"], case["dtype"], case["seed"])
    mask = index_mask(b, length, case["kept"], case["dtype"], case["closed"], case["seed"])
    scale = case["d"] ** -0.5
    out = masked_decode_attention_triton(q, k, v, mask, scale, block_n=case["block_n"], splits=case["splits"])
    _assert_close(out, masked_attention_reference(q, k, v, mask, scale))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_deepseek_head_dims_through_the_op(dtype):
    """MLA's 192 / 128 head dims (a padded tile) at the launcher's own tiles, through the op (its
    CUDA kernel at one token is this one), a top-k of 40 of 300 cached positions."""
    q, k, v = _inputs(2, 4, 4, 300, 192, 128, dtype, 7)
    mask = index_mask(2, 300, 40, dtype, -65504.0, 7)
    scale = 192**-0.5 * 1.1
    expected = masked_attention_reference(q, k, v, mask, scale)
    _assert_close(masked_decode_attention_triton(q, k, v, mask, scale), expected)
    _assert_close(torch.ops.fusion_passes.masked_attention(q, k, v, mask, scale), expected)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_closed_rows_one_mask_and_strided_inputs(dtype):
    """A row the mask closes entirely: zeros under -inf, SDPA's softmax over the biases under
    -65504 (not zeros); one [1, 1, 1, L] mask for the batch; q a view of a wider projection and the
    cache a slice of a longer one."""
    q, k, v = _inputs(2, 4, 2, 30, 16, 16, dtype, 5)
    for closed in (float("-inf"), -65504.0):
        mask = index_mask(2, 30, 6, dtype, closed, 5)
        mask[1] = closed
        expected = masked_attention_reference(q, k, v, mask, 0.25)
        assert (expected[1].abs().max().item() > 0) == (closed != float("-inf"))
        for splits in (1, 2):  # the closed row redone in the kernel, or in the splits' combine
            out = masked_decode_attention_triton(q, k, v, mask, 0.25, block_n=16, splits=splits)
            _assert_close(out, expected)
    mask = index_mask(1, 30, 9, dtype, -65504.0, 6)
    wide = torch.zeros(2, 4, 1, 48, dtype=dtype, device=DEVICE)
    wide[..., 8:24] = q
    cache = torch.zeros(2, 2, 64, 16, dtype=dtype, device=DEVICE)
    cache[:, :, :30] = k
    out = masked_decode_attention_triton(wide[..., 8:24], cache[:, :, :30], v, mask, 0.25, block_n=16)
    _assert_close(out, masked_attention_reference(q, k, v, mask, 0.25))


def test_several_query_tokens_are_refused():
    q, k, v = _inputs(1, 2, 2, 8, 16, 16, torch.float32, 1)
    mask = torch.zeros(1, 1, 2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="one query token expected, got 2"):
        masked_decode_attention_triton(torch.cat([q, q], dim=2), k, v, mask, 0.25)
