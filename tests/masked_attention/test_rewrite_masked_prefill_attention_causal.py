"""A prefill's attention through the causal mask transformers builds from the cache position
(masking_utils' sdpa_mask over the whole static cache, then SDPA's additive form per layer): with
masked_prefill_attention, rewritten to fusion_passes::masked_attention_causal, the mask neither
built nor read; the output that of the masked op's (on the CPU both run their references: the same
mask, computed). Not rewritten: a cache offset on the kv axis, a padding mask combined with the
causal one, a first position that is a Python int."""

from __future__ import annotations

import pytest
import torch
from _rewrites import compile_with, op_changes
from _sdpa_spellings import transformers_sdpa

from fusion_passes.patterns.causal_masks import sdpa_decode_causal_mask

FUSIONS = ["masked_prefill_attention", "masked_prefill_attention_mha", "masked_prefill_attention_causal"]
CAUSAL_OP = "fusion_passes.masked_attention_causal.default"
MASKED_OP = "fusion_passes.masked_attention.default"


def prompt_attention(query, key, value, cache_position):
    """transformers at prefill: sdpa_mask from the cache position over the static cache, then
    sdpa_attention_forward (repeat_kv, SDPA with the boolean mask)."""
    mask = sdpa_decode_causal_mask(query.shape[0], query.shape[2], key.shape[2], cache_position[0], query.device)
    return transformers_sdpa(query, key, value, mask)


def two_layers(query, key, value, cache_position):
    """Two layers' attention reading the one mask (as a model's layers do)."""
    mask = sdpa_decode_causal_mask(query.shape[0], query.shape[2], key.shape[2], cache_position[0], query.device)
    first = transformers_sdpa(query, key, value, mask)
    return transformers_sdpa(first.transpose(1, 2).reshape(query.shape), key, value, mask)


def _inputs(b, heads, kv_heads, s, length, d, dtype, first, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, heads, s, d, generator=g).to(dtype)
    k, v = (torch.randn(b, kv_heads, length, d, generator=g).to(dtype) for _ in range(2))
    return q, k, v, torch.arange(s) + first


@pytest.mark.parametrize(
    ("b", "heads", "kv_heads", "s", "length", "d", "dtype", "first"),
    [(1, 8, 2, 24, 25, 16, torch.bfloat16, 0), (2, 4, 4, 9, 40, 32, torch.float32, 20), (1, 6, 3, 5, 8, 24, torch.float16, 3)],
)  # fmt: skip
def test_the_causal_mask_is_computed_in_the_kernel(b, heads, kv_heads, s, length, d, dtype, first):
    args = _inputs(b, heads, kv_heads, s, length, d, dtype, first)
    out, report = compile_with(FUSIONS, prompt_attention, args)
    assert report.final()["masked_prefill_attention_causal"] == 1 and not report.errors
    assert report.ops_after()[CAUSAL_OP] == 1 and report.ops_after()[MASKED_OP] == 0
    changes = op_changes(report)
    assert changes["aten.where.self"] == (1, 0) and changes["aten.le.Tensor"] == (1, 0)  # the mask is gone
    masked, _ = compile_with(FUSIONS[:2], prompt_attention, args)
    assert torch.equal(out, masked)


def test_every_layer_reading_the_one_mask():
    args = _inputs(1, 4, 2, 12, 13, 16, torch.bfloat16, 0)
    out, report = compile_with(FUSIONS, two_layers, args)
    assert report.final()["masked_prefill_attention_causal"] == 2 and report.ops_after()[MASKED_OP] == 0
    changes = op_changes(report)  # the one mask both layers read is gone
    assert changes[CAUSAL_OP] == (0, 2) and changes["aten.le.Tensor"] == (1, 0)
    masked, _ = compile_with(FUSIONS[:2], two_layers, args)
    assert torch.equal(out, masked)


def offset_cache(query, key, value, cache_position):
    """A sliding window's cache: the kv positions start past 0."""
    kv_idx = torch.arange(key.shape[2]) + 1
    q_idx = torch.arange(query.shape[2]) + cache_position[0]
    mask = (kv_idx[None, None, None, :] <= q_idx[None, None, :, None]).expand(query.shape[0], -1, query.shape[2], -1)
    return transformers_sdpa(query, key, value, mask)


def with_padding(query, key, value, cache_position):
    """A padded batch: the causal mask and the padding mask combined."""
    mask = sdpa_decode_causal_mask(query.shape[0], query.shape[2], key.shape[2], cache_position[0], query.device)
    padding = torch.ones(query.shape[0], 1, 1, key.shape[2], dtype=torch.bool)
    padding[0, ..., 0] = False
    return transformers_sdpa(query, key, value, mask & padding)


def literal_first(query, key, value, cache_position):
    """A mask built from a Python int position (not the cache position tensor)."""
    mask = sdpa_decode_causal_mask(query.shape[0], query.shape[2], key.shape[2], 2, query.device)
    return transformers_sdpa(query, key, value, mask)


@pytest.mark.parametrize("fn", [offset_cache, with_padding, literal_first])
def test_other_masks_stay_read(fn):
    args = _inputs(2, 4, 2, 6, 10, 16, torch.bfloat16, 2)
    out, report = compile_with(FUSIONS, fn, args)
    assert report.final()["masked_prefill_attention_causal"] == 0 and report.ops_after()[MASKED_OP] == 1
    changes = op_changes(report)  # the mask still built: its comparison as it was, no causal op
    assert CAUSAL_OP not in changes and "aten.le.Tensor" not in changes, changes
    masked, _ = compile_with(FUSIONS[:2], fn, args)
    assert torch.equal(out, masked)


@pytest.mark.slow  # two whole-model compiles
def test_minimax_m2_prefill():
    """A tiny MiniMax-M2 prefill into its StaticCache (2 layers): each layer's attention through the
    computed mask, the output and the cache those of the defaults' prefill."""
    from _rewrites import prefill

    from fusion_passes.models import build_model
    from fusion_passes.models.decode import DecodeStep

    built = build_model("minimax-m2", size="tiny", dtype=torch.bfloat16, layers=2)
    step = DecodeStep(built.module, batch=1, context=24, steps=1)
    defaults, _ = prefill(step, "all")
    ours, report = prefill(step, ["all", "masked_prefill_attention_causal"])
    assert report.final()["masked_prefill_attention_causal"] == 2 and not report.errors
    assert report.ops_after()[MASKED_OP] == 0 and op_changes(report)[CAUSAL_OP] == (0, 2)
    for a, b in zip(ours, defaults, strict=True):
        assert torch.equal(a, b)
