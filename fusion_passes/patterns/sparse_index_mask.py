"""DeepSeek sparse attention (V3.2) within its top-k: the index mask of every cached position.

transformers' DeepseekV32 attention (its eager / SDPA path) turns the indexer's choice into a
mask every layer:

    idx  = index_scores.topk(min(index_topk, T), dim=-1).indices.to(torch.int32)   # [B, S, k]
    mask = idx.new_ones((B, S, T), dtype=torch.bool).scatter(-1, idx.long(), False)
    attention_mask = attention_mask & ~mask (or masked_fill)

Where the cache holds no more positions than index_topk (T <= index_topk: k = T), top-k over the
whole last dim returns a permutation of 0..T-1, so the scatter writes False at every position:
the mask is all False whatever the scores are. The rewrite says so:

    Unfused: topk over T scores (a full radix sort: 21 us per layer at T = 1040 on one H200), a
             scatter, and the indexer's score GEMMs that only feed the top-k
    Fused:   mask = zeros_like(ones): the topk, the scatter and the scores become dead code,
             which Inductor drops (the indexer's key-cache write stays: it is a mutation)

Exact (bit-equal masks for every input, NaN scores included: the indices are distinct). Not a
match where k < T (a longer cache: the mask is live), nor a scatter along another dim than the
top-k's, nor a scatter into a tensor wider than the indices.

Where k < T (``sparse_index_mask_topk``: a cache longer than index_topk, the mask live):

    Unfused: topk over T scores (a radix sort of each row) and the scatter of its indices
    Fused:   mask = fusion_passes.sparse_index_mask(index_scores, k): one kernel, no sort and no
             indices (a radix select of the k-th largest score, then one pass writing the mask)

Equal scores at the k-th place are kept by lowest position, as torch's CUDA top-k keeps them; the
op's reference states the order (-0.0 below +0.0, NaN above +inf, as torch's radix select ranks).
"""

from __future__ import annotations

from typing import Any

import torch

from fusion_passes.fusion import Fusion, NotASite, Spelling
from fusion_passes.patterns.causal_masks import causal_mask_refusal, sdpa_decode_causal_mask
from fusion_passes.lowering.sparse_index_mask.reference import SCORE_DTYPES

# topk's k is traced as this sentinel (and the example's last dim with it), so the pattern
# takes every k; the check compares the matched k with the scores' last dim.
K_SENTINEL = 23


def transformers_index_mask(index_scores, ones, k):
    idx = index_scores.topk(k, dim=-1).indices.to(torch.int32)
    return ones.scatter(-1, idx.long(), False)


def _ones_like(value: torch.Tensor, values: dict[str, Any]) -> torch.Tensor:
    """verify=True's input for the mask the model scatters into: ones, as it builds it."""
    return torch.ones(tuple(int(n) for n in value.shape), dtype=value.dtype, device=value.device)


def _all_selected(index_scores, ones, k):
    return torch.zeros_like(ones)


def _check(values: dict[str, Any]) -> str | None:
    scores, ones, k = values["index_scores"], values["ones"], values["k"]
    if k != scores.shape[-1]:
        # The sparse attention doing its work (a cache longer than index_topk): no site, nothing
        # to report in every layer of every long-context step.
        return NotASite(f"top-{k} of {scores.shape[-1]} positions: the index mask is live")
    if tuple(ones.shape) != tuple(scores.shape) or ones.dtype != torch.bool:
        return f"the mask {tuple(ones.shape)} {ones.dtype} is not the scores' shape {tuple(scores.shape)} in bool"
    return None


def _masked_by_kernel(index_scores, ones, k):
    return torch.ops.fusion_passes.sparse_index_mask(index_scores, k)


def _check_live(values: dict[str, Any]) -> str | None:
    scores, ones, k = values["index_scores"], values["ones"], values["k"]
    if k >= scores.shape[-1]:
        return NotASite(f"top-{k} of {scores.shape[-1]} positions: every position (sparse_index_mask_all)")
    if tuple(ones.shape) != tuple(scores.shape) or ones.dtype != torch.bool:
        return f"the mask {tuple(ones.shape)} {ones.dtype} is not the scores' shape {tuple(scores.shape)} in bool"
    if scores.dtype not in SCORE_DTYPES:
        return f"scores are {scores.dtype}; the kernel takes fp32, bf16 or fp16"
    return None


def _examples():
    yield (torch.randn(2, 1, K_SENTINEL), torch.ones(2, 1, K_SENTINEL, dtype=torch.bool), K_SENTINEL)


SPARSE_INDEX_MASK_ALL = Fusion(
    name="sparse_index_mask_all",
    summary="DeepSeek V3.2 index mask where top-k takes every cached position -> all False (no sort)",
    doc=__doc__.split("\n\n", 1)[1],
    spellings=(Spelling("transformers_index_mask", transformers_index_mask, _all_selected),),
    example_inputs=_examples,
    scalars={"k": K_SENTINEL},
    check=_check,
    builtin=True,
)

SPARSE_INDEX_MASK_TOPK = Fusion(
    name="sparse_index_mask_topk",
    summary="DeepSeek V3.2 index mask where top-k keeps part of the cache -> one kernel (no sort, no indices)",
    doc=__doc__.split("\n\n", 1)[1],
    spellings=(Spelling("transformers_index_mask", transformers_index_mask, _masked_by_kernel),),
    example_inputs=_examples,
    scalars={"k": K_SENTINEL},
    check=_check_live,
    # the model scatters into a mask of ones (new_ones): a random bool tensor is not one
    verify_inputs={"ones": _ones_like},
    builtin=True,
)

# The bias of a closed position is a pattern argument, traced with this sentinel (exact in every
# float dtype): -inf where SDPA runs its math or flash path, -65504 where it calls cuDNN.
FILL_SENTINEL = -(2.0**-9)


def _sdpa_masked(dtype: torch.dtype):
    """transformers' DeepseekV32Attention with a boolean mask (SDPA): ``attention_mask & ~index_mask``,
    which SDPA turns into its additive form in the attention's dtype: where(mask.logical_not(),
    fill, 0), fill -inf or (cuDNN) -65504. Inductor leaves it as where(mask, 0, fill), its two
    constants as full([], ...); the inverted form is kept beside it."""

    def _keep(index_scores, attention_mask, k):
        index_mask = torch.ops.fusion_passes.sparse_index_mask(index_scores, k).unsqueeze(1)
        return attention_mask & ~index_mask

    def _constants(index_scores, fill):
        zero = torch.full([], 0.0, dtype=dtype, device=index_scores.device)
        return zero, torch.full([], fill, dtype=dtype, device=index_scores.device)

    def sdpa_masked(index_scores, attention_mask, k, fill):
        zero, closed = _constants(index_scores, fill)
        return torch.where(_keep(index_scores, attention_mask, k), zero, closed)

    def sdpa_masked_inverted(index_scores, attention_mask, k, fill):
        zero, closed = _constants(index_scores, fill)
        return torch.where(torch.logical_not(_keep(index_scores, attention_mask, k)), closed, zero)

    def additive(index_scores, attention_mask, k, fill):
        return torch.ops.fusion_passes.sparse_attention_mask(index_scores, k, attention_mask, dtype, fill)

    name = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]
    return (Spelling(f"sdpa_masked_{name}", sdpa_masked, additive),
            Spelling(f"sdpa_masked_inverted_{name}", sdpa_masked_inverted, additive))  # fmt: skip


# Query tokens up to which the additive mask is this fusion's: a decode step's (and a few
# speculative tokens). A prefill's mask is masked_prefill_attention's, whose kernel reads the
# boolean one itself (and skips the blocks it closes): taking it here would keep SDPA.
MAX_QUERY_TOKENS = 16


def _check_attention(values: dict[str, Any]) -> str | None:
    scores, mask, fill = values["index_scores"], values["attention_mask"], values["fill"]
    if scores.dim() == 3 and scores.shape[1] > MAX_QUERY_TOKENS:
        return NotASite(f"{scores.shape[1]} query tokens: a prefill's mask (masked_prefill_attention reads it)")
    if not isinstance(fill, (int, float)) or not fill < 0:
        return f"a closed position's bias of {fill}, not a negative number"
    if scores.dim() != 3 or mask.dtype != torch.bool or tuple(mask.shape) != (scores.shape[0], 1, *scores.shape[1:]):
        return (f"an attention mask of {mask.dtype} {tuple(mask.shape)} for scores {tuple(scores.shape)}: the op "
                "takes a bool [B, 1, S, T] one")  # fmt: skip
    return None


def _attention_examples():
    yield (torch.randn(2, 1, K_SENTINEL), torch.rand(2, 1, 1, K_SENTINEL) > 0.5, K_SENTINEL, FILL_SENTINEL)


SPARSE_ATTENTION_MASK = Fusion(
    name="sparse_attention_mask",
    summary="DeepSeek V3.2 index mask combined with the attention mask and made additive for SDPA -> the index "
    "mask kernel's last pass",
    doc=(
        "Where the attention mask is boolean (SDPA), transformers' DeepseekV32Attention drops the positions outside "
        "the top k from it, attention_mask & ~index_mask, and SDPA makes the result additive: where(keep, 0, fill) in "
        "the attention's dtype (fill -inf, or -65504 where SDPA calls cuDNN). Unfused: an elementwise kernel reading "
        "the index mask and the attention mask (or recomputing the causal one) and writing the additive mask (1.0 us "
        "per layer in a DeepSeek V3.2 decode step at 8192 cached tokens on one H200). Fused: mask = "
        "fusion_passes.sparse_attention_mask(index_scores, k, attention_mask, dtype, fill), the same kernel as "
        "sparse_index_mask_topk's, whose last pass writes the additive mask instead of the boolean one: bit-equal. "
        "Decode steps only (up to 16 query tokens): a prefill's boolean mask is masked_prefill_attention's. A float "
        "attention mask (the eager attention's masked_fill(index_mask, finfo.min)) is not this spelling and is left "
        "alone."
    ),
    spellings=tuple(sp for dtype in (torch.bfloat16, torch.float16, torch.float32) for sp in _sdpa_masked(dtype)),
    example_inputs=_attention_examples,
    scalars={"k": K_SENTINEL, "fill": FILL_SENTINEL},
    check=_check_attention,
    requires=("sparse_index_mask_topk",),
    applies_to=lambda graph: bool(graph.find_nodes(op="call_function", target=torch.ops.fusion_passes.sparse_index_mask.default)),
    builtin=True,
)



def _sdpa_causal(dtype: torch.dtype):
    """sparse_attention_mask's op reading the decode step's causal mask as transformers builds it
    from the cache position (patterns/causal_masks.py), for a mask of ``dtype``."""

    def sdpa_causal(index_scores, k, first, fill):
        b, s, t = index_scores.shape
        mask = sdpa_decode_causal_mask(b, s, t, first, index_scores.device)
        return torch.ops.fusion_passes.sparse_attention_mask(index_scores, k, mask, dtype, fill)

    def from_first_position(index_scores, k, first, fill):
        return torch.ops.fusion_passes.sparse_attention_mask(index_scores, k, None, dtype, fill, first)

    name = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]
    return Spelling(f"sdpa_causal_{name}", sdpa_causal, from_first_position)


def _check_causal_attention(values: dict[str, Any]) -> str | None:
    scores, first, fill = values["index_scores"], values["first"], values["fill"]
    if not isinstance(first, torch.Tensor) or first.numel() != 1 or first.dtype not in (torch.int64, torch.int32):
        return f"the first position is not one int tensor: {getattr(first, 'shape', first)}"
    if scores.dim() != 3 or not isinstance(fill, (int, float)) or not fill < 0:
        return f"scores {tuple(scores.shape)} with a closed position's bias of {fill}"
    return None


def _causal_attention_examples():
    # a decode step (1 token) and 2 tokens, from a 0-d first position as the step reads it off
    # cache_position; T is not k's sentinel, which would stand for the mask's sizes too
    for s in (1, 2):
        yield (torch.randn(2, s, K_SENTINEL + 1), K_SENTINEL, torch.tensor(20), FILL_SENTINEL)


SPARSE_ATTENTION_MASK_CAUSAL = Fusion(
    name="sparse_attention_mask_causal",
    summary="sparse_attention_mask's causal attention mask (built from the cache position) -> compared in its kernel",
    doc=(
        "At decode transformers builds the causal mask from the cache position (sdpa_mask: arange(T) <= first + "
        "arange(S), expanded over [B, 1, S, T]) and every layer's attention reads it. Unfused, with "
        "sparse_attention_mask: Inductor writes that bool mask for the op to read, in a kernel of its own at each "
        "layer (it copies a view it hands to a kernel it does not generate: 2 launches for 2 layers in Inductor's "
        "sm_90 code of a tiny DeepSeek V3.2 decode step). Fused: sparse_attention_mask(..., None, dtype, fill, "
        "causal_first=first) compares each position with the token's own in the kernel's last pass, reading the "
        "first position only: bit-equal, no mask built. A cache offset (a sliding window) is refused with the reason."
    ),
    spellings=tuple(_sdpa_causal(dtype) for dtype in (torch.bfloat16, torch.float16, torch.float32)),
    example_inputs=_causal_attention_examples,
    scalars={"k": K_SENTINEL, "fill": FILL_SENTINEL},
    check=_check_causal_attention,
    match_check=lambda match: causal_mask_refusal(match, head_selected=False),
    shared_nodes=(torch.ops.aten.expand.default,),
    requires=("sparse_attention_mask",),
    applies_to=lambda graph: bool(
        graph.find_nodes(op="call_function", target=torch.ops.fusion_passes.sparse_attention_mask.default)
    ),
    builtin=True,
)

# Every position first: where k == T the mask is a constant, cheaper than any kernel.
FUSIONS = (SPARSE_INDEX_MASK_ALL, SPARSE_INDEX_MASK_TOPK, SPARSE_ATTENTION_MASK, SPARSE_ATTENTION_MASK_CAUSAL)
