"""Grouped-query attention at prefill on a static cache: one flash kernel that skips what the mask
closes, reading the KV heads from the cache as they are.

A prefill on transformers' StaticCache passes SDPA the whole cache (every slot, the unwritten ones
too) and a boolean mask (True: attend) that opens each query token's causal past; models with fewer
KV heads than query heads (MiniMax-M2 48 / 8, Qwen3-MoE 64 / 4, Qwen 3.5 16 / 2) repeat the keys
and values first, as the decode step does (``gqa_decode_attention``'s spellings: transformers'
repeat_kv, gpt-fast's repeat_interleave, Meta's / torchtitan's repeat on [B, L, Hkv, D]):

    key = repeat_kv(key, g);  value = repeat_kv(value, g)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling)

Unfused: the copies of the cache, g times wider, then SDPA over every key of every query token
         (cuDNN on one H200, the boolean mask turned into a bias of 0 / -65504 first): at
         MiniMax-M2's width and a 4096-token prompt, 2170 us per layer in a 2-layer prefill,
         about two thirds of the layer
Fused:   out = fusion_passes.masked_attention(query, key, value, mask, scaling)
         a flash-attention kernel over the key blocks the mask opens (a causal prompt: up to the
         diagonal; a bias at or below -65504 closes a key), the mask read only in blocks it does
         not open or close whole; query head h reads KV head h // g of the cache
         (lowering/masked_attention). On one H200, the same 2-layer prefill: 829 us per layer
         (the whole prefill 1.67x stock Inductor; Qwen3-MoE 1.71x)

The same math, summed in another order (fp32 scores and sums, the probabilities rounded to the
input's dtype before the product with v, as flash attention does): within the dtype's tolerance of
the unfused call, tested. Not a site: one query token (a decode step: gqa_decode_attention's).
Rejected with the reason: a mask per head; a head dim above 256. Not matched: a causal call,
dropout, keys tiled rather than repeated (as gqa_decode_attention).
"""

from __future__ import annotations

from typing import Any

import torch

from fusion_passes.fusion import Fusion, NotASite, Spelling
from fusion_passes.lowering.masked_attention.reference import check_masked_attention_args
from fusion_passes.patterns.gqa_decode_attention import (
    SCALE_SENTINEL,
    SDPA_BACKENDS,
    SDPA_OPS,
    _spelling,
    _spelling_bshd,
    key_is_repeat,
    query_tokens,
)

MAX_HEAD_DIM = 256  # the kernel's tiles at 256 still fit an H200's shared memory (64 query tokens)


def masked_attention(query, key, value, mask, scale):
    """The fused form on keys and values laid out [B, Hkv, L, D]; SDPA's default scale where the
    call gives none."""
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    return torch.ops.fusion_passes.masked_attention(query, key, value, mask, scale)


def masked_attention_bshd(query, key, value, mask, scale):
    """The same on keys and values laid out [B, L, Hkv, D] (read through a transpose)."""
    return masked_attention(query, key.transpose(1, 2), value.transpose(1, 2), mask, scale)


def _checker(kv_heads_dim: int):
    def check(values: dict[str, Any]) -> str | None:
        query, key, value, mask = values["query"], values["key"], values["value"], values["mask"]
        if query.dim() == 4 and query.shape[2] == 1:
            return NotASite("one query token (a decode step)")
        if kv_heads_dim == 2:
            key, value = key.transpose(1, 2), value.transpose(1, 2)
        return masked_attention_refusal(query, key, value, mask)

    return check


def masked_attention_refusal(query, key, value, mask) -> str | None:
    """Why the masked_attention op cannot take these SDPA arguments (keys and values [B, Hkv, L, D]),
    or None."""
    if not isinstance(mask, torch.Tensor):
        return "no mask"
    try:
        check_masked_attention_args(query, key, value, mask)
    except ValueError as e:
        return str(e).removeprefix("masked_attention: ")
    if max(query.shape[3], value.shape[3]) > MAX_HEAD_DIM:
        return f"a head dim of {max(query.shape[3], value.shape[3])} (the kernel takes up to {MAX_HEAD_DIM})"
    return None


def _is_prefill_repeat(node) -> bool:
    """An SDPA call on several query tokens whose key is a repeat."""
    tokens = query_tokens(node)
    return tokens is not None and tokens > 1 and key_is_repeat(node)


def _examples():
    # On the meta device, as gqa_decode_attention's: 8 query heads of 3 tokens; keys [2, 4, 4, 16]
    # read as 4 KV heads x 4 positions and as 4 positions x 4 KV heads; the additive mask SDPA's
    # fused kernels take (a boolean one is converted before the call).
    meta = {"device": "meta", "dtype": torch.bfloat16}
    q, kv = torch.empty(2, 8, 3, 16, **meta), torch.empty(2, 4, 4, 16, **meta)
    yield q, kv, torch.empty_like(kv), torch.empty(2, 1, 3, 4, **meta), SCALE_SENTINEL


MASKED_PREFILL_ATTENTION = Fusion(
    name="masked_prefill_attention",
    summary="repeat_kv of keys and values + SDPA with a boolean mask at prefill -> one flash kernel "
    "skipping the masked key blocks (no cache copies)",
    doc=__doc__.split("\n\n", 1)[1],
    spellings=tuple(
        Spelling(f"transformers_repeat_kv_sdpa_{name}", _spelling(sdpa), masked_attention, _checker(1))
        for name, sdpa in SDPA_BACKENDS.items()
    )
    + tuple(
        Spelling(f"meta_repeat_kv_bshd_sdpa_{name}", _spelling_bshd(sdpa), masked_attention_bshd, _checker(2))
        for name, sdpa in SDPA_BACKENDS.items()
    ),
    example_inputs=_examples,
    scalars={"scale": SCALE_SENTINEL},
    candidate_ops=SDPA_OPS,
    candidate=_is_prefill_repeat,
    builtin=True,
)



def sdpa_with_mask_spelling(sdpa):
    def sdpa_with_mask(query, key, value, mask, scale):
        return sdpa(query, key, value, mask, scale)

    return sdpa_with_mask


def _is_prefill(node) -> bool:
    """An SDPA call on several query tokens whose key is not a repeat (masked_prefill_attention's)."""
    tokens = query_tokens(node)
    return tokens is not None and tokens > 1 and not key_is_repeat(node)


def _mha_examples():
    # 4 query heads of 3 tokens on 4 KV heads of 4 positions; values of another head dim (MLA's
    # 192 / 128 split: DeepSeek V3 / V3.2)
    meta = {"device": "meta", "dtype": torch.bfloat16}
    q, k, v = torch.empty(2, 4, 3, 24, **meta), torch.empty(2, 4, 4, 24, **meta), torch.empty(2, 4, 4, 16, **meta)
    yield q, k, v, torch.empty(2, 1, 3, 4, **meta), SCALE_SENTINEL


MASKED_PREFILL_ATTENTION_MHA = Fusion(
    name="masked_prefill_attention_mha",
    summary="SDPA with a boolean mask at prefill on as many KV heads as query heads (DeepSeek V3 / V3.2's "
    "MLA, multi-head models) -> the same flash kernel skipping the masked key blocks",
    doc=(
        "The SDPA call of masked_prefill_attention without the repeat: models whose attention has as many KV "
        "heads as query heads (DeepSeek V3 / V3.2's MLA: 128 heads, q / k of 192, v of 128; multi-head "
        "models, where transformers' repeat_kv returns the cache as it is) call\n\n"
        "    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling)\n\n"
        "with the prompt's mask over the whole static cache (DeepSeek V3.2: the causal mask and the index "
        "top-k's). Unfused: SDPA over every key of every query token (cuDNN on an H200; DeepSeek V3.2's "
        "4096-token prefill: 5793 us per layer, 13% of the step). Fused: masked_attention, the same kernel and "
        "checks as masked_prefill_attention (each query head its own KV head): that attention region 5815 -> "
        "3744 us in a CUDA graph on one H200 (1.55x). Not a site: one query token; "
        "rejected with the reason: a per-head mask, a head dim above 256; not matched: a causal call, dropout."
    ),
    spellings=tuple(
        Spelling(f"sdpa_with_mask_{name}", sdpa_with_mask_spelling(sdpa), masked_attention, _checker(1))
        for name, sdpa in SDPA_BACKENDS.items()
    ),
    example_inputs=_mha_examples,
    scalars={"scale": SCALE_SENTINEL},
    candidate_ops=SDPA_OPS,
    candidate=_is_prefill,
    builtin=True,
)

FUSIONS = (MASKED_PREFILL_ATTENTION, MASKED_PREFILL_ATTENTION_MHA)
