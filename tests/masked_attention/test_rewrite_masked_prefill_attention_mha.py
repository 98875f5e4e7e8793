"""Attention at prefill through a mask on as many KV heads as query heads, as real code bases write
it (transformers' sdpa_attention_forward, whose repeat_kv returns the cache as it is; DeepSeek V3's
MLA call with its scale; Meta's reference on [B, L, H, D] transposed): rewritten to
fusion_passes::masked_attention, the output within the dtype's tolerance of the unfused call's. Not
rewritten: one query token (not a site), a per-head mask (rejected with the reason), a causal call
and dropout. A GQA site with both prefill fusions is masked_prefill_attention's (its copies go)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _rewrites import compile_with, op_changes
from _sdpa_spellings import causal_sdpa, transformers_sdpa

from fusion_passes.numerics import tolerance

FUSION = ["masked_prefill_attention_mha"]
OP = "fusion_passes.masked_attention.default"
SDPA = "aten._scaled_dot_product_flash_attention_for_cpu.default"
REWRITTEN = {SDPA: (1, 0), "getitem": (1, 0), OP: (0, 1)}


def _inputs(batch, heads, tokens, length, head_dim, dtype, v_dim=None, bshd=False, seed=0, additive=False):
    """A StaticCache prefill: the prompt's tokens after length - tokens - 2 cached ones, 2 slots unwritten."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, tokens, head_dim, generator=g).to(dtype)
    k_shape = (batch, length, heads, head_dim) if bshd else (batch, heads, length, head_dim)
    v_shape = (*k_shape[:3], v_dim or head_dim)
    k, v = torch.randn(*k_shape, generator=g).to(dtype), torch.randn(*v_shape, generator=g).to(dtype)
    positions = torch.arange(tokens) + length - tokens - 2
    mask = (torch.arange(length)[None, :] <= positions[:, None])[None, None].expand(batch, 1, tokens, length)
    if additive:
        mask = torch.zeros(mask.shape, dtype=dtype).masked_fill(~mask, float("-inf"))
    return q, k, v, mask


def deepseek_sdpa(query, key, value, mask):
    """DeepSeek V3's attention through transformers' SDPA path: k = cat(k_nope, k_pe), scaling =
    qk_head_dim ** -0.5 times the YaRN mscale. Its values' other head dim (128 against 192) takes
    SDPA's math path on the CPU, which traces to matmuls and a softmax, no SDPA op: the CUDA
    backends' calls with it are tested on the GPU (test_gpu_masked_attention.py)."""
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=0.0,
                                          scale=query.shape[-1] ** -0.5 * 1.1, is_causal=False)  # fmt: skip


def meta_mha_sdpa(xq, keys, values, mask):
    """Meta's llama reference with n_kv_heads == n_heads (repeat_kv returns x): the cache's
    [B, L, H, D] transposed to heads first."""
    return F.scaled_dot_product_attention(xq, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask)


def _assert_close(out, expected):
    tol = tolerance(out.dtype)
    torch.testing.assert_close(out.float(), expected.float(), rtol=tol.rtol, atol=tol.atol)


@pytest.mark.parametrize(
    ("spelling", "batch", "heads", "tokens", "length", "head_dim", "v_dim", "dtype"),
    [(transformers_sdpa, 2, 4, 9, 19, 32, None, torch.float32), (transformers_sdpa, 1, 6, 17, 21, 16, None, torch.float16),
     (deepseek_sdpa, 1, 8, 12, 15, 24, None, torch.bfloat16), (deepseek_sdpa, 2, 3, 5, 40, 48, None, torch.float32),
     (meta_mha_sdpa, 2, 4, 7, 11, 32, None, torch.bfloat16)],
)  # fmt: skip
def test_mha_at_prefill_is_rewritten(spelling, batch, heads, tokens, length, head_dim, v_dim, dtype):
    meta = spelling is meta_mha_sdpa
    args = _inputs(batch, heads, tokens, length, head_dim, dtype, v_dim, bshd=meta, seed=length, additive=meta)
    out, report = compile_with(FUSION, spelling, args)
    assert report.final()["masked_prefill_attention_mha"] == 1
    assert op_changes(report) == REWRITTEN  # Meta's transposes stay: the op reads the strided cache
    _assert_close(out, spelling(*args))


def test_decode_is_not_a_site_and_a_per_head_mask_is_rejected():
    args = _inputs(2, 4, 1, 21, 32, torch.float32)
    out, report = compile_with(FUSION, transformers_sdpa, args)
    assert report.final()["masked_prefill_attention_mha"] == 0 and not report.rejected and op_changes(report) == {}
    assert torch.equal(out, transformers_sdpa(*args))
    q, k, v, mask = _inputs(2, 4, 6, 21, 32, torch.float32)
    mask = mask.expand(2, 4, 6, 21).clone()
    out, report = compile_with(FUSION, transformers_sdpa, (q, k, v, mask))
    assert [r.fusion for r in report.rejected] == ["masked_prefill_attention_mha"]
    assert "must be [2 or 1, 1, 6, 21]" in report.rejected[0].reason and op_changes(report) == {}
    torch.testing.assert_close(out, transformers_sdpa(q, k, v, mask))


def test_causal_calls_and_dropout_are_not_matched():
    q, k, v, mask = _inputs(2, 4, 6, 21, 32, torch.float32)

    def with_dropout(q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.5)

    for fn, args in ((causal_sdpa, (q, k, v, None)), (with_dropout, (q, k, v, mask))):
        _, report = compile_with(FUSION, fn, args)
        assert report.final()["masked_prefill_attention_mha"] == 0, fn.__name__
        assert op_changes(report) == {}, fn.__name__


def test_a_gqa_site_goes_to_masked_prefill_attention():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 8, 6, 32, generator=g)
    k, v = (torch.randn(1, 2, 9, 32, generator=g) for _ in range(2))
    mask = (torch.arange(9)[None, :] <= torch.arange(6)[:, None] + 1)[None, None]
    out, report = compile_with(["masked_prefill_attention", *FUSION], transformers_sdpa, (q, k, v, mask))
    assert report.final()["masked_prefill_attention"] == 1 and report.final()["masked_prefill_attention_mha"] == 0
    assert op_changes(report)["aten.clone.default"] == (2, 0)  # repeat_kv's copies gone
    _assert_close(out, transformers_sdpa(q, k, v, mask))
