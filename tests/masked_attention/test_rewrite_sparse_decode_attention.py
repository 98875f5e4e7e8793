"""DeepSeek V3.2's decode attention through the index top-k's mask, as the graph holds it once the
mask is fusion_passes.sparse_attention_mask's (transformers' SDPA call, with DeepSeek's scale;
Meta's [B, L, H, D] cache transposed): rewritten to fusion_passes::masked_attention, the output
within the dtype's tolerance of the unfused call; also through the pad and slice SDPA's fused paths
align a bias with. Not rewritten: a mask that is not the op's (a plain causal decode mask, the op's
shifted by a pad in front), several query tokens (not a site), a repeat of the keys (GQA's)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _rewrites import compile_with, op_changes
from _sdpa_spellings import transformers_sdpa

import fusion_passes  # noqa: F401  (registers torch.ops.fusion_passes)
from fusion_passes.numerics import tolerance

FUSION = ["sparse_decode_attention"]
OP = "fusion_passes.masked_attention.default"
SDPA = "aten._scaled_dot_product_flash_attention_for_cpu.default"
REWRITTEN = {SDPA: (1, 0), "getitem": (1, 0), OP: (0, 1)}


def _inputs(batch, heads, tokens, length, head_dim, dtype, kv_heads=None, bshd=False, seed=0):
    """A decode step on a full static cache of ``length`` slots; the indexer's scores [B, S, T]."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, tokens, head_dim, generator=g).to(dtype)
    kv = kv_heads or heads
    shape = (batch, length, kv, head_dim) if bshd else (batch, kv, length, head_dim)
    k, v = torch.randn(*shape, generator=g).to(dtype), torch.randn(*shape, generator=g).to(dtype)
    scores = torch.randn(batch, tokens, length, generator=g)
    first = torch.tensor([length - tokens])
    return q, k, v, scores, first


def v32_attention(query, key, value, index_scores, first, top_k=5):
    """transformers' DeepseekV32 decode attention once the index mask is the fused op's (cuDNN's
    bias on a GPU; -inf here, as SDPA's CPU paths take it), with DeepSeek's softmax scale."""
    mask = torch.ops.fusion_passes.sparse_attention_mask(index_scores, top_k, None, query.dtype, float("-inf"),
                                                         causal_first=first)  # fmt: skip
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=query.shape[-1] ** -0.5 * 1.1)


def v32_attention_aligned(query, key, value, index_scores, first, top_k=5):
    """The same with the mask aligned as SDPA's fused paths align a bias whose rows are at an odd
    stride (pad the last dim to a multiple of 16, slice it back), then expanded over the heads'
    batch dim."""
    mask = torch.ops.fusion_passes.sparse_attention_mask(index_scores, top_k, None, query.dtype, float("-inf"),
                                                         causal_first=first)  # fmt: skip
    length = mask.shape[-1]
    mask = F.pad(mask, (0, -length % 16))[..., :length].expand(query.shape[0], 1, 1, length)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=query.shape[-1] ** -0.5 * 1.1)


def v32_attention_bshd(query, key, value, index_scores, first):
    """The same on a cache laid out [B, L, H, D] (Meta's reference), transposed to heads first."""
    return v32_attention(query, key.transpose(1, 2), value.transpose(1, 2), index_scores, first)


def _assert_close(out, expected):
    tol = tolerance(out.dtype)
    torch.testing.assert_close(out.float(), expected.float(), rtol=tol.rtol, atol=tol.atol)


@pytest.mark.parametrize(
    ("spelling", "batch", "heads", "length", "head_dim", "dtype"),
    [(v32_attention, 2, 4, 19, 32, torch.float32), (v32_attention, 1, 6, 40, 16, torch.bfloat16),
     (v32_attention, 3, 2, 9, 24, torch.float16), (v32_attention_bshd, 2, 4, 21, 32, torch.bfloat16),
     (v32_attention_aligned, 2, 4, 21, 32, torch.float32)],
)  # fmt: skip
def test_decode_through_the_index_mask_is_rewritten(spelling, batch, heads, length, head_dim, dtype):
    args = _inputs(batch, heads, 1, length, head_dim, dtype, bshd=spelling is v32_attention_bshd, seed=length)
    out, report = compile_with(FUSION, spelling, args)
    assert report.final()["sparse_decode_attention"] == 1
    assert op_changes(report) == REWRITTEN
    if spelling is v32_attention_aligned:  # the mask reached through the pad and the slice
        assert report.ops_before()["aten.constant_pad_nd.default"] == 1
    _assert_close(out, spelling(*args))


def test_a_plain_mask_several_tokens_and_repeated_keys_are_left_alone():
    q, k, v, _, _ = _inputs(2, 4, 1, 21, 32, torch.float32)
    mask = (torch.arange(21) <= 20)[None, None, None].expand(2, 1, 1, 21)
    out, report = compile_with(FUSION, transformers_sdpa, (q, k, v, mask))
    assert report.final()["sparse_decode_attention"] == 0 and not report.rejected and op_changes(report) == {}
    assert torch.equal(out, transformers_sdpa(q, k, v, mask))

    args = _inputs(2, 4, 3, 21, 32, torch.float32)  # a prefill's 3 tokens: not a site
    out, report = compile_with(FUSION, v32_attention, args)
    assert report.final()["sparse_decode_attention"] == 0 and op_changes(report) == {}
    torch.testing.assert_close(out, v32_attention(*args))

    def shifted(q, k, v, scores, first):  # a pad in front moves the op's values: not its mask
        mask = torch.ops.fusion_passes.sparse_attention_mask(scores, 5, None, q.dtype, float("-inf"), causal_first=first)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=F.pad(mask, (3, 0))[..., :21])

    args = _inputs(2, 4, 1, 21, 32, torch.float32)
    out, report = compile_with(FUSION, shifted, args)
    assert report.final()["sparse_decode_attention"] == 0 and op_changes(report) == {}
    torch.testing.assert_close(out, shifted(*args))

    q, k, v, scores, first = _inputs(2, 8, 1, 21, 32, torch.float32, kv_heads=2)

    def repeated(q, k, v, scores, first):  # GQA: transformers' repeat_kv before the call
        rep = lambda x: x[:, :, None].expand(2, 2, 4, 21, 32).reshape(2, 8, 21, 32)  # noqa: E731
        return v32_attention(q, rep(k), rep(v), scores, first)

    out, report = compile_with(FUSION, repeated, (q, k, v, scores, first))
    assert report.final()["sparse_decode_attention"] == 0 and op_changes(report) == {}
    torch.testing.assert_close(out, repeated(q, k, v, scores, first))
