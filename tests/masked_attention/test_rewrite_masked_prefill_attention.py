"""GQA attention at prefill through a mask, as real code bases write it (transformers' repeat_kv
with a boolean mask, gpt-fast's repeat_interleave, Meta's / torchtitan's repeat on [B, L, Hkv, D]
with an additive one): rewritten to fusion_passes::masked_attention, the copies of keys and values
gone, the output within the dtype's tolerance of the unfused call's. Not rewritten: one query
token (a decode step: not a site), a per-head mask (rejected with the reason), keys tiled instead
of repeated, a causal call, dropout; a head dim above the kernel's 256 (rejected)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _rewrites import compile_with, op_changes
from _sdpa_spellings import (
    causal_sdpa,
    gpt_fast_sdpa,
    meta_sdpa,
    tiled_sdpa,
    transformers_repeat_kv,
    transformers_sdpa,
)

from fusion_passes.numerics import tolerance

FUSION = ["masked_prefill_attention"]
OP = "fusion_passes.masked_attention.default"
SDPA = "aten._scaled_dot_product_flash_attention_for_cpu.default"


def _inputs(batch, heads, kv_heads, tokens, length, head_dim, dtype, bshd=False, seed=0, offset=None, additive=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, tokens, head_dim, generator=g).to(dtype)
    shape = (batch, length, kv_heads, head_dim) if bshd else (batch, kv_heads, length, head_dim)
    k, v = (torch.randn(*shape, generator=g).to(dtype) for _ in range(2))
    # a StaticCache prefill's mask: the prompt after `offset` cached tokens, the slots after it unwritten
    offset = length - tokens - 3 if offset is None else offset
    positions = torch.arange(tokens) + offset
    mask = (torch.arange(length)[None, :] <= positions[:, None])[None, None].expand(batch, 1, tokens, length)
    if additive:  # Meta's reference builds its mask as 0 / -inf
        mask = torch.zeros(mask.shape, dtype=dtype).masked_fill(~mask, float("-inf"))
    return q, k, v, mask


def _compile(fn, args):
    return compile_with(FUSION, fn, args)


def _assert_close(out, expected):
    tol = tolerance(out.dtype)
    torch.testing.assert_close(out.float(), expected.float(), rtol=tol.rtol, atol=tol.atol)


REWRITTEN = {"aten.unsqueeze.default": (2, 0), "aten.expand.default": (2, 0), "aten.clone.default": (2, 0),
             "aten.reshape.default": (2, 0), SDPA: (1, 0), "getitem": (1, 0), OP: (0, 1)}  # fmt: skip


@pytest.mark.parametrize("spelling", [transformers_sdpa, gpt_fast_sdpa, meta_sdpa])
@pytest.mark.parametrize(
    ("batch", "heads", "kv_heads", "tokens", "length", "head_dim", "dtype"),
    [(2, 12, 4, 9, 19, 32, torch.float32), (1, 8, 2, 33, 40, 64, torch.bfloat16),
     (2, 6, 3, 5, 7, 24, torch.float16), (1, 16, 2, 17, 65, 16, torch.bfloat16)],
)  # fmt: skip
def test_repeated_kv_at_prefill_reads_the_kv_heads(spelling, batch, heads, kv_heads, tokens, length, head_dim, dtype):
    meta = spelling is meta_sdpa
    args = _inputs(batch, heads, kv_heads, tokens, length, head_dim, dtype, bshd=meta, seed=length, additive=meta)
    out, report = _compile(spelling, args)
    assert report.final()["masked_prefill_attention"] == 1
    assert op_changes(report) == REWRITTEN  # Meta's layout: its transposes stay, read by the op
    _assert_close(out, spelling(*args))


def test_one_mask_for_the_batch_and_a_first_prompt():
    q, k, v, mask = _inputs(3, 8, 2, 12, 20, 32, torch.bfloat16, offset=0)
    out, report = _compile(transformers_sdpa, (q, k, v, mask[:1]))
    assert report.final()["masked_prefill_attention"] == 1 and op_changes(report) == REWRITTEN
    _assert_close(out, transformers_sdpa(q, k, v, mask[:1]))


def test_decode_is_not_a_site():
    """One query token: gqa_decode_attention's site, not this fusion's (no rejection, no near miss)."""
    args = _inputs(2, 8, 2, 1, 21, 32, torch.float32)
    out, report = _compile(transformers_sdpa, args)
    assert report.final()["masked_prefill_attention"] == 0
    assert not report.rejected and not report.near_misses
    assert op_changes(report) == {}
    assert torch.equal(out, transformers_sdpa(*args))


@pytest.mark.parametrize("additive", [False, True])
def test_a_per_head_mask_is_rejected_with_the_reason(additive):
    q, k, v, mask = _inputs(2, 8, 2, 6, 21, 32, torch.float32, additive=additive)
    mask = mask.expand(2, 8, 6, 21).clone()
    reason = "must be [2 or 1, 1, 6, 21]"
    out, report = _compile(transformers_sdpa, (q, k, v, mask))
    assert report.final()["masked_prefill_attention"] == 0
    assert [r.fusion for r in report.rejected] == ["masked_prefill_attention"]
    assert reason in report.rejected[0].reason
    assert op_changes(report) == {}
    torch.testing.assert_close(out, transformers_sdpa(q, k, v, mask))


def test_tiled_keys_causal_calls_and_dropout_are_not_matched():
    q, k, v, mask = _inputs(2, 8, 2, 6, 21, 32, torch.float32)

    def with_dropout(q, k, v, mask):
        k, v = transformers_repeat_kv(k, 4), transformers_repeat_kv(v, 4)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.5)

    for fn, args in ((tiled_sdpa, (q, k, v, mask)), (causal_sdpa, (q, k, v, None)), (with_dropout, (q, k, v, mask))):
        _, report = _compile(fn, args)
        assert report.final()["masked_prefill_attention"] == 0, fn.__name__
        assert op_changes(report) == {}, fn.__name__


def test_a_head_dim_above_256_is_rejected_with_the_reason():
    args = _inputs(1, 4, 2, 5, 9, 320, torch.bfloat16)
    out, report = _compile(transformers_sdpa, args)
    assert report.final()["masked_prefill_attention"] == 0
    assert [r.reason for r in report.rejected] == ["a head dim of 320 (the kernel takes up to 256)"]
    assert op_changes(report) == {}
    torch.testing.assert_close(out, transformers_sdpa(*args))


def _attention_then_o_proj(query, key, value, mask, o_proj):
    """transformers' attention tail: sdpa_attention_forward's transpose(1, 2).contiguous(), the
    reshape to [B, S, H * D] and o_proj."""
    out = transformers_sdpa(query, key, value, mask).transpose(1, 2).contiguous()
    return out.reshape(out.shape[0], out.shape[1], -1) @ o_proj


def test_the_output_transpose_copy_goes_where_the_op_writes_that_layout():
    """The op writes [B, S, H, D] in memory, so transformers' transpose(1, 2).contiguous() after it
    is a no-op clone: removed once the fake values below the op are refreshed (stock Inductor copies
    SDPA's output there: a kernel and a read and write of the whole output)."""
    from unittest import mock

    import torch._inductor.config as inductor_config
    from torch._inductor.graph import GraphLowering

    q, k, v, mask = _inputs(1, 8, 2, 24, 30, 32, torch.float32, seed=5)
    o_proj = torch.randn(8 * 32, 16, generator=torch.Generator().manual_seed(6))
    codes: list[str] = []
    with inductor_config.patch(fx_graph_cache=False), \
            mock.patch.object(GraphLowering, "save_output_code", codes.append):  # fmt: skip
        out, report = _compile(_attention_then_o_proj, (q, k, v, mask, o_proj))
    assert report.final()["masked_prefill_attention"] == 1
    # the report counts ops before the no-op removal: the tail's clone and reshapes are still there
    assert op_changes(report) == {**REWRITTEN, "aten.clone.default": (3, 1), "aten.reshape.default": (5, 3)}
    (code,) = codes
    sources = [line for line in code.splitlines() if "Original ATen:" in line]
    assert sources and not any("aten.clone" in line for line in sources), sources
    _assert_close(out, _attention_then_o_proj(q, k, v, mask, o_proj))
