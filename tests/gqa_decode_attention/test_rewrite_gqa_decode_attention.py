"""GQA attention at decode, as real code bases write it (transformers' repeat_kv, gpt-fast's
repeat_interleave, Meta's / torchtitan's repeat on [B, L, Hkv, D]): rewritten to SDPA's own
grouped-query attention, the copies of keys and values gone, the output equal to the unfused
step's (bit-equal on the CPU, whose flash kernel takes grouped heads as they are). Not rewritten:
a prefill (not a site, no near miss), keys tiled instead of repeated (another head order), a
causal call, dropout; a repeat left beside a one-token SDPA is reported as a near miss."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fusion_passes
from _rewrites import compile_with, op_changes
from _sdpa_spellings import (
    causal_sdpa,
    gpt_fast_sdpa,
    meta_sdpa,
    tiled_sdpa,
    transformers_repeat_kv,
    transformers_sdpa,
)

FUSION = ["gqa_decode_attention"]


def _inputs(batch, heads, kv_heads, tokens, length, head_dim, dtype, bshd=False, float_mask=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, tokens, head_dim, generator=g).to(dtype)
    shape = (batch, length, kv_heads, head_dim) if bshd else (batch, kv_heads, length, head_dim)
    k, v = (torch.randn(*shape, generator=g).to(dtype) for _ in range(2))
    mask = torch.rand(batch, 1, tokens, length, generator=g) > 0.3
    mask[..., 0] = True
    if float_mask:
        mask = torch.zeros(mask.shape, dtype=dtype).masked_fill(~mask, float("-inf"))
    return q, k, v, mask


def _compile(fn, args):
    return compile_with(FUSION, fn, args)


REMOVED = {"aten.unsqueeze.default": (2, 0), "aten.expand.default": (2, 0), "aten.clone.default": (2, 0),
           "aten.reshape.default": (2, 0)}  # fmt: skip


@pytest.mark.parametrize("spelling", [transformers_sdpa, gpt_fast_sdpa, meta_sdpa])
@pytest.mark.parametrize(
    ("batch", "heads", "kv_heads", "length", "head_dim", "dtype", "float_mask"),
    [(3, 12, 4, 19, 32, torch.float32, False), (1, 8, 2, 33, 64, torch.bfloat16, True),
     (2, 6, 3, 7, 24, torch.float16, False), (5, 16, 2, 65, 16, torch.bfloat16, False)],
)  # fmt: skip
def test_repeated_kv_at_decode_reads_the_kv_heads(spelling, batch, heads, kv_heads, length, head_dim, dtype, float_mask):
    args = _inputs(batch, heads, kv_heads, 1, length, head_dim, dtype, bshd=spelling is meta_sdpa,
                   float_mask=float_mask, seed=length)  # fmt: skip
    out, report = _compile(spelling, args)
    assert report.final()["gqa_decode_attention"] == 1
    assert op_changes(report) == REMOVED
    assert report.ops_after()["aten._scaled_dot_product_flash_attention_for_cpu.default"] == 1
    assert torch.equal(out, spelling(*args))


def test_broadcast_masks_of_fewer_dims_and_per_head_masks():
    q, k, v, mask = _inputs(2, 8, 2, 1, 21, 32, torch.float32)
    for m in (mask[0, 0], mask.expand(2, 8, 1, 21).clone()):  # [1, L] and one row per query head
        out, report = _compile(transformers_sdpa, (q, k, v, m))
        assert report.final()["gqa_decode_attention"] == 1
        assert op_changes(report) == REMOVED
        assert torch.equal(out, transformers_sdpa(q, k, v, m))


def test_prefill_is_not_a_site():
    args = _inputs(2, 8, 2, 5, 21, 32, torch.float32)
    out, report = _compile(transformers_sdpa, args)
    assert report.final()["gqa_decode_attention"] == 0
    assert not report.rejected and not report.near_misses
    assert op_changes(report) == {}
    assert torch.equal(out, transformers_sdpa(*args))


def test_tiled_keys_are_not_grouped_heads():
    args = _inputs(2, 8, 2, 1, 21, 32, torch.float32)
    out, report = _compile(tiled_sdpa, args)
    assert report.final()["gqa_decode_attention"] == 0
    assert op_changes(report) == {}
    assert torch.allclose(out, tiled_sdpa(*args), rtol=1e-5, atol=1e-6)


def test_a_causal_call_is_not_matched_and_is_a_near_miss():
    q, k, v, _ = _inputs(2, 8, 2, 1, 21, 32, torch.float32)
    out, report = _compile(causal_sdpa, (q, k, v, None))
    assert report.final()["gqa_decode_attention"] == 0
    assert op_changes(report) == {}
    assert [m.fusion for m in report.near_misses] == ["gqa_decode_attention"]
    assert torch.allclose(out, causal_sdpa(q, k, v, None), rtol=1e-5, atol=1e-6)


def test_dropout_is_not_matched():
    q, k, v, mask = _inputs(2, 8, 2, 1, 21, 32, torch.float32)

    def with_dropout(q, k, v, mask):
        k, v = transformers_repeat_kv(k, 4), transformers_repeat_kv(v, 4)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.5)

    _, report = _compile(with_dropout, (q, k, v, mask))
    assert report.final()["gqa_decode_attention"] == 0
    assert report.ops_before()["aten.clone.default"] == report.ops_after()["aten.clone.default"] == 2


def test_a_varying_batch_reuses_one_dynamic_graph():
    """A serving engine's batch varies: the recompile marks it dynamic, and that graph fuses too."""
    report = fusion_passes.Report()
    torch._dynamo.reset()
    fn = torch.compile(transformers_sdpa, backend=fusion_passes.backend(FUSION, report=report), fullgraph=True)
    with torch.no_grad():
        for batch in (2, 3, 5):
            args = _inputs(batch, 8, 2, 1, 19, 32, torch.float32, seed=batch)
            assert torch.equal(fn(*args), transformers_sdpa(*args))
    assert [g.ops_before.get("aten.clone.default", 0) for g in report.graphs] == [2, 2]  # k's and v's repeats
    assert [g.ops_after.get("aten.clone.default", 0) for g in report.graphs] == [0, 0]
    assert report.final()["gqa_decode_attention"] == 2  # the static graph and the batch-dynamic one
