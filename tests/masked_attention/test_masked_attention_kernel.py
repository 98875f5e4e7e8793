"""The masked grouped-query attention kernels against their plain-torch reference (SDPA's math in
fp32): odd query and cache lengths, head dims that are not powers of two, GQA ratios; additive
masks as SDPA's fused kernels take them (a boolean mask's 0 / -inf): causal at an offset (a prompt
continuing a cache), random, a bias that is neither 0 nor -inf, rows the mask closes entirely
(zeros, as SDPA's math), one mask for the batch; fp32 / bf16 / fp16; on CPU tensors through
Triton's interpreter, or on CUDA tensors, compiled, where a GPU is present."""

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

import fusion_passes  # noqa: E402,F401  (registers torch.ops.fusion_passes)
from fusion_passes.lowering.masked_attention.reference import masked_attention_reference  # noqa: E402
from fusion_passes.lowering.masked_attention.triton import masked_attention_triton  # noqa: E402
from fusion_passes.numerics import tolerance  # noqa: E402


def _inputs(b, heads, kv_heads, s, length, d, dv, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, heads, s, d, generator=g).to(DEVICE, dtype)
    k = torch.randn(b, kv_heads, length, d, generator=g).to(DEVICE, dtype)
    v = torch.randn(b, kv_heads, length, dv, generator=g).to(DEVICE, dtype)
    return q, k, v


def additive(keep, dtype=torch.float32, closed=float("-inf")):
    """A boolean mask as SDPA passes it to its fused kernels: 0 where True, -inf where False (its
    cuDNN path: -65504)."""
    return torch.zeros(keep.shape, dtype=dtype, device=DEVICE).masked_fill(~keep.to(DEVICE), closed)


def causal(s, length, offset, batch=1, dtype=torch.float32):
    """transformers' StaticCache prefill mask: query i (at position offset + i) sees keys <= it."""
    positions = torch.arange(s) + offset
    keep = (torch.arange(length)[None, :] <= positions[:, None])[None, None].expand(batch, 1, s, length)
    return additive(keep, dtype)


def _assert_close(out, expected):
    # the input dtype's tolerance: fp32 sums in another order, the probabilities rounded to the
    # input's dtype before the product with v (as flash attention rounds them)
    tol = tolerance(out.dtype)
    assert out.shape == expected.shape
    # laid out [B, S, Hq, Dv] (a size-1 dim's stride is free)
    assert [st for st, n in zip(out.stride(), out.shape) if n > 1] == [
        st for st, n in zip(expected.stride(), expected.shape) if n > 1
    ]
    torch.testing.assert_close(out.float(), expected.float(), rtol=tol.rtol, atol=tol.atol)


@st.composite
def _cases(draw):
    kv_heads = draw(st.sampled_from([1, 2, 3]))
    return dict(
        b=draw(st.sampled_from([1, 2])), kv_heads=kv_heads, heads=kv_heads * draw(st.sampled_from([1, 2, 4])),
        s=draw(st.sampled_from([2, 17, 64, 70])), extra=draw(st.sampled_from([0, 5, 40])),
        d=draw(st.sampled_from([16, 24, 64])), dv=draw(st.sampled_from([16, 40])),
        dtype=draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16])),
        kind=draw(st.sampled_from(["causal", "random", "one_mask", "bias"])), seed=draw(st.integers(0, 2**31 - 1)),
    )  # fmt: skip


@settings(max_examples=examples(30), deadline=None)
@given(case=_cases())
def test_matches_reference(case):
    b, s = case["b"], case["s"]
    length = s + case["extra"]
    q, k, v = _inputs(b, case["heads"], case["kv_heads"], s, length, case["d"], case["dv"], case["dtype"], case["seed"])
    g = torch.Generator().manual_seed(case["seed"])
    if case["kind"] == "random":
        mask = additive(torch.rand(b, 1, s, length, generator=g) > 0.4, case["dtype"])
    elif case["kind"] == "bias":  # an additive bias (ALiBi-like) on a causal mask
        mask = causal(s, length, case["extra"], b) + torch.randn(b, 1, s, length, generator=g).to(DEVICE)
    else:  # a prompt after `extra` cached tokens; one_mask: one [1, 1, S, L] mask for the batch
        mask = causal(s, length, case["extra"], batch=1 if case["kind"] == "one_mask" else b, dtype=case["dtype"])
    scale = case["d"] ** -0.5
    out = masked_attention_triton(q, k, v, mask, scale, block_m=16, block_n=16)
    _assert_close(out, masked_attention_reference(q, k, v, mask, scale))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_default_tiles_and_sdpa_on_repeated_heads(dtype):
    """The launcher's own tiles; and the reference is SDPA on repeat_kv's copies (what it replaces)."""
    q, k, v = _inputs(1, 8, 2, 150, 160, 64, 64, dtype, 3)
    mask = causal(150, 160, 4)
    out = masked_attention_triton(q, k, v, mask, 0.125)
    _assert_close(out, masked_attention_reference(q, k, v, mask, 0.125))
    repeated = F.scaled_dot_product_attention(q.float(), k.float().repeat_interleave(4, 1),
                                              v.float().repeat_interleave(4, 1), attn_mask=mask, scale=0.125)  # fmt: skip
    # and a boolean mask given to SDPA as it is
    keep = mask == 0
    torch.testing.assert_close(
        repeated, F.scaled_dot_product_attention(q.float(), k.float().repeat_interleave(4, 1),
                                                 v.float().repeat_interleave(4, 1), attn_mask=keep, scale=0.125)
    )  # fmt: skip
    _assert_close(out, repeated.to(dtype).transpose(1, 2).contiguous().transpose(1, 2))


def test_closed_rows_are_zeros_and_strided_inputs():
    """A row the mask closes entirely gives zeros (SDPA's math); q a view of a wider projection, the
    cache a slice of a longer one."""
    q, k, v = _inputs(2, 4, 2, 20, 30, 16, 16, torch.float32, 5)
    mask = causal(20, 30, 10, batch=2).clone()
    mask[1, 0, 7] = float("-inf")
    wide = torch.zeros(2, 4, 20, 48, device=DEVICE)
    wide[..., 8:24] = q
    cache = torch.zeros(2, 2, 64, 16, device=DEVICE)
    cache[:, :, :30] = k
    out = masked_attention_triton(wide[..., 8:24], cache[:, :, :30], v, mask, 0.25, block_m=16, block_n=16)
    expected = masked_attention_reference(q, k, v, mask, 0.25)
    assert out[1, :, 7].abs().max().item() == 0.0 == expected[1, :, 7].abs().max().item()
    _assert_close(out, expected)


@pytest.mark.parametrize(
    "shapes,mask_dtype,message",
    [(((2, 4, 5, 16), (2, 3, 7, 16), (2, 3, 7, 16), (2, 1, 5, 7)), torch.float32, "not a multiple of 3 KV heads"),
     (((2, 4, 5, 16), (2, 2, 7, 16), (2, 2, 7, 16), (2, 1, 5, 7)), torch.bool, "an additive fp32, bf16 or fp16"),
     (((2, 4, 5, 16), (2, 2, 7, 16), (2, 2, 7, 16), (2, 4, 5, 7)), torch.float32, "must be \\[2 or 1, 1, 5, 7\\]"),
     (((2, 4, 5, 16), (2, 2, 7, 8), (2, 2, 7, 16), (2, 1, 5, 7)), torch.float32, "do not fit query"),
     (((4, 5, 16), (2, 2, 7, 16), (2, 2, 7, 16), (2, 1, 5, 7)), torch.float32, "query \\[B, Hq, S, D\\]")],
)  # fmt: skip
def test_bad_arguments_get_one_line_errors(shapes, mask_dtype, message):
    q, k, v = (torch.zeros(s) for s in shapes[:3])
    mask = torch.zeros(shapes[3], dtype=mask_dtype)
    with pytest.raises(ValueError, match=message):
        torch.ops.fusion_passes.masked_attention(q, k, v, mask, 0.25)
    with pytest.raises(ValueError, match=message):
        masked_attention_triton(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), mask.to(DEVICE), 0.25)


def test_mixed_dtypes_are_refused():
    q, k, v = _inputs(1, 2, 1, 3, 4, 16, 16, torch.bfloat16, 1)
    with pytest.raises(ValueError, match="must share fp32, bf16 or fp16"):
        masked_attention_triton(q, k.float(), v, causal(3, 4, 1), 0.25)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cudnn_mask_form_with_closed_rows_and_blocks(dtype):
    """SDPA's cuDNN path writes False as -65504: those keys add exactly 0 where the row has an open
    key, so their blocks are skipped; a row without one (and a query block without one) takes the
    whole row, as SDPA's softmax over -65504 biases does (not zeros)."""
    q, k, v = _inputs(1, 4, 2, 40, 50, 16, 16, dtype, 9)
    keep = (torch.arange(50)[None, :] <= torch.arange(40)[:, None] + 10)[None, None].clone()
    keep[0, 0, 5] = False  # one row closed
    keep[0, 0, 32:] = False  # a whole query block closed (rows 32-39 at 16 a block)
    mask = additive(keep, dtype, closed=-65504.0)
    out = masked_attention_triton(q, k, v, mask, 0.25, block_m=16, block_n=16)
    expected = masked_attention_reference(q, k, v, mask, 0.25)
    assert expected[0, :, 5].abs().max().item() > 0  # the softmax over -65504 biases: an average
    _assert_close(out, expected)
    # -inf there: zeros
    mask = additive(keep, dtype)
    out = masked_attention_triton(q, k, v, mask, 0.25, block_m=16, block_n=16)
    assert out[0, :, 5].abs().max().item() == 0.0 and out[0, :, 32:].abs().max().item() == 0.0
    _assert_close(out, masked_attention_reference(q, k, v, mask, 0.25))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_finite_mask_value_keeps_sdpas_rounding(dtype):
    """Older code writes a closed key as -10000 (above the -65504 that closes a block): those keys are
    summed as any bias, and a row whose every key has it (best logit below REDO_BELOW) is redone in
    SDPA's natural-unit logits, within fp32's tolerance of the reference too."""
    q, k, v = _inputs(1, 4, 2, 40, 50, 16, 16, dtype, 11)
    keep = (torch.arange(50)[None, :] <= torch.arange(40)[:, None] + 10)[None, None].clone()
    keep[0, 0, 7] = False
    mask = additive(keep, dtype, closed=-10000.0)
    out = masked_attention_triton(q, k, v, mask, 0.25, block_m=16, block_n=16)
    expected = masked_attention_reference(q, k, v, mask, 0.25)
    assert expected[0, :, 7].abs().max().item() > 0
    _assert_close(out, expected)


def test_opcheck():
    q, k, v = _inputs(2, 4, 2, 5, 9, 16, 16, torch.bfloat16, 2)
    torch.library.opcheck(torch.ops.fusion_passes.masked_attention.default, (q, k, v, causal(5, 9, 4, batch=2), 0.25))
