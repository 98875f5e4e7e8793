"""QK-norm + RoPE with the decode step's KV cache writes: the keys go into the cache from the
kernel that makes them, and the values with them.

In a decode step on transformers' StaticCache (Qwen3 / Qwen3-MoE, Qwen 3.5's full-attention layers,
MiniMax-M2), after the qk_norm_rope fusions:

    q_out, k_out = fusion_passes.qk_norm_rope(q, k, w_q, w_k, cos, sin, eps, ...)  (either order)
    k_cache.index_copy_(2, arange(S) + length, k_out)          StaticLayer.update, functionalized:
    v_cache.index_copy_(2, arange(S) + length, v.transpose(1, 2))   two index_puts (or at a slot
                                                                     per token: cache[:, :, slots] = ...)

Unfused: the qk_norm_rope kernel writes k_out, and Inductor copies it into the key cache and v into
         the value cache: 3 launches (for a per-head norm stock Inductor fuses the RoPE and the key's
         write into one kernel, so qk_norm_rope alone is left to it at decode: 3 launches either
         way).
Fused:   q_out, k_cache, v_cache = fusion_passes.qk_norm_rope_cache(q, k, v, w_q, w_k, cos, sin,
                                                                    k_cache, v_cache, positions, eps, ...)
         one launch, writing both caches in place on CUDA (launched by Inductor; the copies of the
         caches back into the model's buffers go).

Decode steps only (at most CACHE_MAX_TOKENS tokens): the op takes a token's heads in one step.
A batch of one stored by indexing (``cache[:, :, slots] = k``) is traced by torch.compile with
the values reshaped to drop the batch dim: a spelling of its own.
While this fusion is enabled, the per-head qk_norm_rope sites of a decode step are no longer
left to Inductor (decode_cache_write_refusal): this one takes them further.
"""

from __future__ import annotations

import operator
from typing import Any

import torch

from fusion_passes.fusion import DEFAULT_SCALAR_SENTINEL, Fusion, Spelling
from fusion_passes.lowering.qk_norm_rope.reference import check_qk_norm_rope_cache_args
from fusion_passes.lowering.qk_norm_rope.triton import CACHE_MAX_TOKENS
from fusion_passes.patterns.cache_writes import SLOT_FORMS, cache_write, slot_index, slots_refusal, valid_slots

# The norm forms of the qk_norm_rope op: (weight_offset, cast_before_weight) as that family's
# patterns write them (transformers' Llama form, an fp32 weight, Qwen3-Next / Qwen 3.5's (1 + w)).
# The matcher re-traces a candidate with its literals, so a form matches its own sites only.
_FORMS = {"llama": (0.0, True), "fp32_weight": (0.0, False), "offset": (1.0, False)}


def _spelling(per_head: bool, form: str, interleaved: bool, k_first: bool, slots: str) -> Spelling:
    """slots: how the step writes the caches (patterns/cache_writes.py)."""
    offset, cast = _FORMS[form]

    # a / b: the op's two tensors as the qk_norm_rope fusion ordered them (either may be the keys)
    def pattern(a, b, v, a_weight, b_weight, cos, sin, k_cache, v_cache, positions, eps):
        out_a, out_b = torch.ops.fusion_passes.qk_norm_rope.default(
            a, b, a_weight, b_weight, cos, sin, eps, offset, cast, per_head, interleaved
        )
        k_out, q_out = (out_a, out_b) if k_first else (out_b, out_a)
        index = slot_index(positions, a.shape[1], a.device, slots)
        k_new = cache_write(k_cache, 2, index, k_out, slots)
        return q_out, k_new, cache_write(v_cache, 2, index, v.transpose(1, 2), slots)

    def replacement(a, b, v, a_weight, b_weight, cos, sin, k_cache, v_cache, positions, eps):
        (q, q_weight), (k, k_weight) = ((b, b_weight), (a, a_weight)) if k_first else ((a, a_weight), (b, b_weight))
        return torch.ops.fusion_passes.qk_norm_rope_cache.default(
            q, k, v, q_weight, k_weight, cos, sin, k_cache, v_cache, positions, eps, offset, cast, per_head,
            interleaved,
        )  # fmt: skip

    def check(values: dict[str, Any]) -> str | None:
        a, b = values["a"], values["b"]
        (q, q_weight), (k, k_weight) = (
            ((b, values["b_weight"]), (a, values["a_weight"])) if k_first else ((a, values["a_weight"]), (b, values["b_weight"]))
        )  # fmt: skip
        args = (q, k, values["v"], q_weight, k_weight, values["cos"], values["sin"], values["k_cache"],
                values["v_cache"], values["positions"])  # fmt: skip
        try:
            check_qk_norm_rope_cache_args(*args, offset, cast, per_head, interleaved)
        except ValueError as e:
            return str(e)
        tokens = q.shape[0] * q.shape[1]
        if not isinstance(tokens, int) or tokens > CACHE_MAX_TOKENS:
            return f"{tokens} tokens: a decode step's (at most {CACHE_MAX_TOKENS}) are the op's"
        return slots_refusal(slots, values["positions"])

    name = f"{form}_{'interleaved' if interleaved else 'rotate_half'}_{'k_first' if k_first else 'q_first'}_{SLOT_FORMS[slots]}"
    return Spelling(name, pattern, replacement, check)


def _examples(per_head: bool):
    """Two heads of 16 for q and k (either may be the keys), full RoPE, a cache of 7 slots: two
    sequences of one token at a 0-d first slot, of three at a slot each; one of two tokens at a
    slot each (the batch-one store traces at a batch of one only)."""

    def example_inputs():
        for bsz, s, positions in ((2, 1, torch.tensor(2)), (2, 3, torch.tensor([3, 0, 2])), (1, 2, torch.tensor([3, 0]))):
            a, b, v = (torch.randn(bsz, s, 2, 16, dtype=torch.bfloat16) for _ in range(3))
            width = 16 if per_head else 32
            weights = torch.randn(width, dtype=torch.bfloat16), torch.randn(width, dtype=torch.bfloat16)
            cos = torch.randn(1, s, 16, dtype=torch.bfloat16)
            caches = torch.randn(bsz, 2, 7, 16, dtype=torch.bfloat16), torch.randn(bsz, 2, 7, 16, dtype=torch.bfloat16)
            yield a, b, v, *weights, cos, torch.randn_like(cos), *caches, positions, DEFAULT_SCALAR_SENTINEL

    return example_inputs


_VIEWS = {torch.ops.aten.reshape.default, torch.ops.aten.view.default, torch.ops.aten.permute.default,
          torch.ops.aten.expand.default, torch.ops.aten.unsqueeze.default, torch.ops.aten.squeeze.dim}  # fmt: skip


def _writes_a_fused_key(per_head: bool):
    """A near-miss candidate: an index_put (a cache write) of the output of a qk_norm_rope op of
    this fusion's norm (per head or whole row), through views, that the fusion did not take."""

    def candidate(node) -> bool:
        value = node.args[2] if len(node.args) > 2 else None
        while getattr(value, "target", None) in _VIEWS:
            value = value.args[0]
        if getattr(value, "target", None) is operator.getitem:
            value = value.args[0]
        if getattr(value, "target", None) is not torch.ops.fusion_passes.qk_norm_rope.default:
            return False
        return len(value.args) > 9 and value.args[9] == per_head  # the op's norm_per_head

    return candidate


def _fusion(per_head: bool) -> Fusion:
    name = "qk_norm_rope_cache" if per_head else "qk_norm_rope_whole_row_cache"
    spellings = tuple(
        _spelling(per_head, form, interleaved, k_first, slots)
        for slots in SLOT_FORMS for k_first in (True, False)
        for form in _FORMS for interleaved in (False, True)
    )  # fmt: skip
    return Fusion(
        name=name,
        summary="q/k norm + RoPE + the KV cache writes of k and v -> one qk_norm_rope_cache launch",
        doc=__doc__.split("\n\n", 1)[1],
        spellings=spellings,
        example_inputs=_examples(per_head),
        scalars={"eps": DEFAULT_SCALAR_SENTINEL},
        requires=("qk_norm_rope" if per_head else "qk_norm_rope_whole_row",),
        candidate_ops=("aten.index_put.default",),
        candidate=_writes_a_fused_key(per_head),
        verify_inputs={"positions": valid_slots("k_cache", 2)},
        opt_in="not yet timed on a GPU: on one H200 at batch 1 the two cache writes it removes are 1.0-1.1 us "
               "each per layer (MiniMax-M2, Qwen3-MoE)",  # fmt: skip
        builtin=True,
    )


FUSIONS = (_fusion(per_head=True), _fusion(per_head=False))
