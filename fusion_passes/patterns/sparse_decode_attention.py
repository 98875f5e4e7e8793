"""DeepSeek V3.2's attention at decode: only the keys the indexer's top-k keeps are read.

A V3.2 decode step attends each new token to its top-k cached positions (2048 of them) through a
mask: transformers' DeepseekV32 attention builds a boolean index mask from the indexer's top-k,
combines it with the causal mask and calls SDPA over the whole static cache (128 heads of 192 /
128, as many KV heads as query heads). With the default fusions that mask is one
``fusion_passes.sparse_attention_mask`` launch (sparse_index_mask.py), so the graph holds:

    mask = fusion_passes.sparse_attention_mask(index_scores, top_k, ...)   # 0 / -65504 (cuDNN) or -inf
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling)

Unfused: SDPA reads every cached key and value of every head, the 3 of 4 the top-k closes too (at
         real width and 8192 cached tokens: 671 MB a layer at batch 1; cuDNN 265 us of a 620 us
         layer on one H200)
Fused:   out = fusion_passes.masked_attention(query, key, value, mask, scaling)
         at one query token, a kernel that loads only the key and value rows the mask opens
         (lowering/masked_attention/decode.py): a quarter of the cache at 2048 of 8192

The same math, summed in another order, in fp32 (exact products of the inputs, fp32 probabilities
times v): within the dtype's tolerance of the unfused call, tested. Matched where the mask is the
sparse_attention_mask op's output, through views and the appending pad SDPA aligns a bias with;
not a site otherwise: a dense mask (DeepSeek V3, the prefix a causal mask opens) leaves cuDNN
nothing to skip but the unwritten slots, and is not measured. Not a site either: several query
tokens (masked_prefill_attention_mha's), repeated keys (gqa_decode_attention's). Not matched: a
causal call, dropout.
"""

from __future__ import annotations

from typing import Any

import torch

from fusion_passes.fusion import Fusion, NotASite, Spelling
from fusion_passes.patterns.gqa_decode_attention import (
    SCALE_SENTINEL,
    SDPA_BACKENDS,
    SDPA_OPS,
    key_is_repeat,
    mask_source,
    query_tokens,
)
from fusion_passes.patterns.masked_prefill_attention import (
    masked_attention,
    masked_attention_refusal,
    sdpa_with_mask_spelling,
)

def is_index_top_k_mask(mask) -> bool:
    """A graph node is fusion_passes.sparse_attention_mask's output, through views and end pads
    (the SDPA call's mask is as wide as the cache: a pad's appended values are sliced off)."""
    return getattr(mask_source(mask), "target", None) == torch.ops.fusion_passes.sparse_attention_mask.default


def _sdpa_mask(node):
    """An SDPA call's mask argument, in each backend's position (cuDNN's and the memory-efficient
    kernel's fourth argument, the CPU flash kernel's attn_mask keyword)."""
    if "attn_mask" in node.kwargs:
        return node.kwargs["attn_mask"]
    return node.args[3] if len(node.args) > 3 else None


def _is_sparse_decode(node) -> bool:
    """An SDPA call on one query token, its keys not a repeat, its mask the index top-k's."""
    return query_tokens(node) == 1 and not key_is_repeat(node) and is_index_top_k_mask(_sdpa_mask(node))


def _site_check(match) -> str | None:
    """Only a mask the index top-k built is a site (on any other the kernel has little to skip), and
    only keys as the cache holds them (a repeat is gqa_decode_attention's)."""
    sdpa = next(n for n in match.nodes if str(n.target) in SDPA_OPS)
    if not is_index_top_k_mask(_sdpa_mask(sdpa)):
        return NotASite("a mask that is not sparse_attention_mask's")
    if key_is_repeat(sdpa):
        return NotASite("repeated keys (gqa_decode_attention's)")
    return None


def _check(values: dict[str, Any]) -> str | None:
    query, key, value, mask = values["query"], values["key"], values["value"], values["mask"]
    if query.dim() != 4 or query.shape[2] != 1:
        return NotASite(f"a query of {query.shape[2] if query.dim() == 4 else '?'} tokens per head")
    return masked_attention_refusal(query, key, value, mask)


def _examples():
    # On the meta device, as the other SDPA fusions': 4 heads of one query token on 4 KV heads of
    # 6 cached positions; values of another head dim (MLA's 192 / 128 split)
    meta = {"device": "meta", "dtype": torch.bfloat16}
    q, k, v = torch.empty(2, 4, 1, 24, **meta), torch.empty(2, 4, 6, 24, **meta), torch.empty(2, 4, 6, 16, **meta)
    yield q, k, v, torch.empty(2, 1, 1, 6, **meta), SCALE_SENTINEL


SPARSE_DECODE_ATTENTION = Fusion(
    name="sparse_decode_attention",
    summary="DeepSeek V3.2 decode: SDPA through the index top-k's mask over the whole cache -> masked_attention "
    "reading only the keys the mask keeps",
    doc=__doc__.split("\n\n", 1)[1],
    spellings=tuple(
        Spelling(f"sdpa_index_mask_{name}", sdpa_with_mask_spelling(sdpa), masked_attention, _check)
        for name, sdpa in SDPA_BACKENDS.items()
    ),
    example_inputs=_examples,
    scalars={"scale": SCALE_SENTINEL},
    candidate_ops=SDPA_OPS,
    candidate=_is_sparse_decode,
    match_check=_site_check,
    requires=("sparse_attention_mask",),
    opt_in="not yet timed on a GPU: cuDNN reads the whole cache (265 us of a 620 us DeepSeek V3.2 layer at "
    "batch 1 and 8192 cached tokens on one H200); this kernel reads the quarter the top-k keeps",
    builtin=True,
)

FUSIONS = (SPARSE_DECODE_ATTENTION,)
