"""The indexer-scores kernel against its plain-torch reference and against transformers' two
matmuls: odd head counts, head dims and cache lengths, one and several query tokens, fp32 / bf16 /
fp16 q and k, NaN kept by the relu as F.relu keeps it; on CPU tensors through Triton's
interpreter, or on CUDA tensors, compiled, where a GPU is present."""

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
from fusion_passes.lowering.sparse_index_scores.reference import sparse_index_scores_reference  # noqa: E402
from fusion_passes.lowering.sparse_index_scores.triton import sparse_index_scores_triton  # noqa: E402


def _transformers_scores(q, k, weights, scale):
    scores = F.relu(torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * scale)
    return torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)


def _inputs(b, s, h, d, t, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, s, h, d, generator=g).to(DEVICE, dtype)
    k = torch.randn(b, t, d, generator=g).to(DEVICE, dtype)
    return q, k, torch.randn(b, s, h, generator=g).to(DEVICE) * h**-0.5


def _assert_close(out, expected, h, d):
    # fp32 sums in another order: h * d products of unit size summed, a few fp32 ulps of the
    # largest partial sums (sqrt(d) * sqrt(h) scaled): 1e-5 relative to the row's magnitude.
    scale = expected.abs().amax(-1, keepdim=True).clamp_min(1.0)
    assert ((out - expected).abs() / scale).max().item() <= 1e-5 * (1 + (h * d) ** 0.5 / 16)


@st.composite
def _cases(draw):
    return dict(
        b=draw(st.sampled_from([1, 2])), s=draw(st.sampled_from([1, 3])), h=draw(st.sampled_from([1, 4, 17, 64])),
        d=draw(st.sampled_from([16, 24, 128])), t=draw(st.sampled_from([1, 5, 64, 130, 777])),
        dtype=draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16])), seed=draw(st.integers(0, 2**31 - 1)),
    )  # fmt: skip


@settings(max_examples=examples(24), deadline=None)
@given(case=_cases())
def test_matches_reference(case):
    q, k, w = _inputs(case["b"], case["s"], case["h"], case["d"], case["t"], case["dtype"], case["seed"])
    scale = case["d"] ** -0.5
    out = sparse_index_scores_triton(q, k, w, scale)
    assert out.dtype == torch.float32 and out.shape == (case["b"], case["s"], case["t"])
    _assert_close(out, sparse_index_scores_reference(q, k, w, scale), case["h"], case["d"])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_deepseek_v32_widths_equal_transformers_within_fp32_order(dtype):
    q, k, w = _inputs(1, 1, 64, 128, 300, dtype, 7)  # 64 indexer heads of 128
    out = sparse_index_scores_triton(q, k, w, 128**-0.5)
    _assert_close(out, _transformers_scores(q, k, w, 128**-0.5), 64, 128)


def test_strided_cache_and_heads():
    """k a slice of a longer cache, q a view of a wider projection (the model's layouts)."""
    q, k, w = _inputs(2, 1, 4, 16, 40, torch.bfloat16, 3)
    cache = torch.zeros(2, 64, 16, dtype=torch.bfloat16, device=DEVICE)
    cache[:, :40] = k
    wide = torch.zeros(2, 1, 4, 32, dtype=torch.bfloat16, device=DEVICE)
    wide[..., :16] = q
    out = sparse_index_scores_triton(wide[..., :16], cache[:, :40], w, 0.25)
    _assert_close(out, sparse_index_scores_reference(q, k, w, 0.25), 4, 16)


def test_nan_is_kept_and_negative_dots_vanish():
    q, k, w = _inputs(1, 1, 4, 16, 6, torch.float32, 1)
    k[0, 2] = float("nan")
    q = q.abs()
    k[0, 4] = -k[0, 4].abs() - 1  # every head's dot negative: the relu zeroes the position
    out = sparse_index_scores_triton(q, k, w, 0.25)
    expected = sparse_index_scores_reference(q, k, w, 0.25)
    assert torch.isnan(out[0, 0, 2]) and torch.isnan(expected[0, 0, 2])
    assert out[0, 0, 4].item() == 0.0 == expected[0, 0, 4].item()
    keep = [0, 1, 3, 5]
    _assert_close(out[..., keep], expected[..., keep], 4, 16)


@pytest.mark.parametrize(
    "shapes,dtypes,message",
    [(((2, 1, 4, 16), (2, 9, 8), (2, 1, 4)), None, "must be \\[2, T >= 1, 16\\]"),
     (((2, 1, 4, 16), (2, 9, 16), (2, 1, 5)), None, "weights \\(2, 1, 5\\) must be"),
     (((2, 4, 16), (2, 9, 16), (2, 1, 4)), None, "q \\[B, S, H, D\\]"),
     (((2, 1, 4, 16), (2, 9, 16), (2, 1, 4)), (torch.bfloat16, torch.bfloat16, torch.int32), "fp32, bf16 or fp16 expected"),
     (((2, 1, 4, 16), (2, 9, 16), (2, 1, 4)), (torch.int32, torch.bfloat16, torch.float32), "fp32, bf16 or fp16")],
)  # fmt: skip
def test_bad_arguments_get_one_line_errors(shapes, dtypes, message):
    dtypes = dtypes or (torch.float32,) * 3
    q, k, w = (torch.zeros(s, dtype=dt) for s, dt in zip(shapes, dtypes, strict=True))
    with pytest.raises(ValueError, match=message):
        torch.ops.fusion_passes.sparse_index_scores(q, k, w, 0.25)
    with pytest.raises(ValueError, match=message):
        sparse_index_scores_triton(q.to(DEVICE), k.to(DEVICE), w.to(DEVICE), 0.25)


def test_a_keep_mask_of_the_wrong_shape_or_dtype_gets_a_one_line_error():
    q, k, w = _inputs(2, 1, 4, 16, 9, torch.bfloat16, 4)
    for keep in (torch.ones(2, 1, 8, dtype=torch.bool), torch.ones(2, 1, 9, dtype=torch.int8)):
        with pytest.raises(ValueError, match="keep must be a bool \\[2, 1, 9\\] mask"):
            torch.ops.fusion_passes.sparse_index_scores(q.cpu(), k.cpu(), w.cpu(), 0.25, 1.0, keep)
        with pytest.raises(ValueError, match="keep must be a bool"):
            sparse_index_scores_triton(q, k, w, 0.25, 1.0, keep.to(DEVICE))


@pytest.mark.parametrize("s", [1, 3, 20])  # 20: the tiled kernel
@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float32])
def test_weights_scale_and_keep_mask_as_the_model_applies_them(s, wdtype):
    """The model's weights (weights_proj's bf16 output, upcast, times H^-1/2) and its masked_fill of
    the scores by the attention mask, folded in: against transformers' statements; the mask a
    causal one broadcast over the batch (stride 0), as sdpa_mask's expand gives it."""
    b, h, d, t = 2, 5, 16, 37
    q, k, _ = _inputs(b, s, h, d, t, torch.bfloat16, s)
    g = torch.Generator().manual_seed(s + 1)
    raw = torch.randn(b, s, h, generator=g).to(DEVICE, wdtype)
    position = t - s + torch.arange(s, device=DEVICE)
    keep = (torch.arange(t, device=DEVICE)[None, :] <= position[:, None])[None].expand(b, s, t)
    c = h**-0.5
    out = sparse_index_scores_triton(q, k, raw, d**-0.5, c, keep)
    expected = _transformers_scores(q, k, raw.float() * c, d**-0.5).masked_fill(~keep, float("-inf"))
    reference = sparse_index_scores_reference(q, k, raw, d**-0.5, c, keep)
    torch.testing.assert_close(reference, expected, rtol=0, atol=0)  # the same statements, bit-equal
    assert torch.equal(torch.isinf(out), ~keep) and (out[~keep] < 0).all()
    _assert_close(out.masked_fill(~keep, 0.0), expected.masked_fill(~keep, 0.0), h, d)


@pytest.mark.parametrize("s", [1, 3, 20])  # 20: the tiled kernel
@pytest.mark.parametrize("with_keep", [False, True])
def test_the_causal_mask_from_the_first_position(s, with_keep):
    """causal_first: the mask a decode step builds from the cache position (token s at first + s
    sees t <= first + s), computed in the kernels: bit for bit the scores stored with that keep
    mask; with a keep mask too (a padding mask), both apply."""
    b, h, d, t = 2, 5, 16, 37
    q, k, w = _inputs(b, s, h, d, t, torch.bfloat16, s + 7)
    first = t - s - 3  # the last 3 positions are past every token
    causal = (torch.arange(t, device=DEVICE)[None, :] <= first + torch.arange(s, device=DEVICE)[:, None])[None]
    padding = torch.rand(b, 1, t, generator=torch.Generator().manual_seed(s)).to(DEVICE) > 0.2
    keep = padding.expand(b, s, t) if with_keep else None
    out = sparse_index_scores_triton(q, k, w, d**-0.5, 1.0, keep, torch.tensor(first, device=DEVICE))
    expected_keep = causal.expand(b, s, t) & (keep if with_keep else True)
    assert torch.equal(out, sparse_index_scores_triton(q, k, w, d**-0.5, 1.0, expected_keep.contiguous()))
    reference = sparse_index_scores_reference(q, k, w, d**-0.5, 1.0, keep, torch.tensor(first, device=DEVICE))
    assert torch.equal(torch.isinf(reference), ~expected_keep)
    _assert_close(out.masked_fill(~expected_keep, 0.0), reference.masked_fill(~expected_keep, 0.0), h, d)


def test_a_causal_first_of_several_values_gets_a_one_line_error():
    q, k, w = _inputs(2, 1, 4, 16, 9, torch.bfloat16, 4)
    with pytest.raises(ValueError, match="causal_first must be one int64 / int32 position"):
        sparse_index_scores_triton(q, k, w, 0.25, 1.0, None, torch.tensor([3, 4], device=DEVICE))


def test_opcheck():
    q, k, w = _inputs(2, 1, 4, 16, 19, torch.bfloat16, 2)
    torch.library.opcheck(torch.ops.fusion_passes.sparse_index_scores.default, (q, k, w, 0.25))
    keep = torch.rand(2, 1, 19, generator=torch.Generator().manual_seed(0)).to(DEVICE) > 0.5
    torch.library.opcheck(torch.ops.fusion_passes.sparse_index_scores.default, (q, k, w.bfloat16(), 0.25, 0.5, keep))
    first = torch.tensor(12, device=DEVICE)
    torch.library.opcheck(torch.ops.fusion_passes.sparse_index_scores.default, (q, k, w, 0.25, 1.0, None, first))


@pytest.mark.parametrize(
    ("b", "s", "h", "d", "t", "dtype"),
    [(1, 17, 4, 16, 40, torch.bfloat16), (2, 70, 3, 24, 130, torch.float16), (1, 33, 5, 16, 77, torch.float32),
     (1, 100, 64, 128, 129, torch.bfloat16)],
)  # fmt: skip
def test_prefill_tokens_take_the_tiled_kernel(b, s, h, d, t, dtype):
    """Above TILED_ABOVE query tokens (a prefill) the tiled kernel: partial token and position
    tiles, odd head counts and dims, DeepSeek V3.2's 64 heads of 128; against transformers' form."""
    from fusion_passes.lowering.sparse_index_scores.triton import TILED_ABOVE

    assert s > TILED_ABOVE
    q, k, w = _inputs(b, s, h, d, t, dtype, s + t)
    out = sparse_index_scores_triton(q, k, w, d**-0.5)
    assert out.shape == (b, s, t) and out.dtype == torch.float32
    _assert_close(out, _transformers_scores(q, k, w, d**-0.5), h, d)


def test_prefill_mixed_dtypes_strided_and_nan():
    """The tiled kernel on a bf16 q against an fp16 cache slice, q a view of a wider projection; a
    NaN key kept, a position every head's dot is negative on zeroed."""
    q, k, w = _inputs(1, 20, 4, 16, 30, torch.bfloat16, 5)
    q = q.abs()
    cache = torch.zeros(1, 48, 16, dtype=torch.float16, device=DEVICE)
    cache[:, :30] = k.to(torch.float16)
    cache[0, 2] = float("nan")
    cache[0, 4] = -cache[0, 4].abs() - 1
    wide = torch.zeros(1, 20, 4, 32, dtype=torch.bfloat16, device=DEVICE)
    wide[..., :16] = q
    out = sparse_index_scores_triton(wide[..., :16], cache[:, :30], w, 0.25)
    expected = sparse_index_scores_reference(q, cache[:, :30], w, 0.25)
    assert torch.isnan(out[0, :, 2]).all() and torch.isnan(expected[0, :, 2]).all()
    assert (out[0, :, 4] == 0).all() and (expected[0, :, 4] == 0).all()
    keep = [i for i in range(30) if i != 2]
    _assert_close(out[..., keep], expected[..., keep], 4, 16)
