"""Grouped-query attention at decode: the KV heads read once, not copied once per query head.

Models whose attention has fewer KV heads than query heads (GQA: MiniMax-M2 48 / 8, Qwen3-MoE
64 / 4, Qwen 3.5 16 / 2) repeat each KV head before SDPA when they pass a mask, which a decode
step on a static cache always does:

    # transformers (repeat_kv; it asks SDPA for GQA only without a mask)
    key = key[:, :, None].expand(B, Hkv, g, L, D).reshape(B, Hkv * g, L, D)   # the same for value
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling)

gpt-fast's ``k.repeat_interleave(g, dim=1)`` traces to the same graph; Meta's reference and
torchtitan repeat on [B, L, Hkv, D] and transpose after.

Unfused: two copies of the cache, g times wider ([B, Hkv * g, L, D] each for keys and values),
         then SDPA reading the copies: at MiniMax-M2's width, batch 64 and 1028 cached tokens the
         copies take 2 x 244 us and the attention 377 us per layer on one H200
Fused:   out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling,
                                              enable_gqa=True)
         SDPA's own grouped-query attention (query head h reads KV head h // g, as repeat_kv
         lays them out): no copy, the kernel reads the cache as it is

The same math; the kernel SDPA picks for grouped heads may round differently (bf16 tolerance
against the unfused step, tested). Refused where the dispatcher has no fused kernel for grouped
heads with a mask on the device (its math fallback would upcast and materialize the scores).

A varying batch (torch.compile's automatic dynamic shapes: the recompile marks the batch dynamic)
fuses too; ``dynamic=True``, which makes the head counts symbolic as well, does not (a near miss).

Matched on the SDPA call as Inductor's graph holds it: the backend the dispatcher chose when the
model was traced (cuDNN or memory-efficient attention on CUDA, the flash kernel on the CPU), with
a mask. Not a site: a query of several tokens (a prefill, not measured). Not matched: a causal
call, dropout, or keys tiled (``repeat(1, g, 1, 1)``: head h reads KV head h % Hkv) rather than
repeated (tested).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.fx
from torch._guards import detect_fake_mode

from fusion_passes.fusion import Fusion, NotASite, Spelling, trace_functional

# The softmax scale is a pattern argument, traced with this sentinel (exact in every float dtype).
SCALE_SENTINEL = 2.0**-5

_aten = torch.ops.aten


def repeat_kv(hidden_states: torch.Tensor, n_rep: int) -> torch.Tensor:
    """transformers' repeat_kv: [B, Hkv, L, D] -> [B, Hkv * n_rep, L, D], each head n_rep times."""
    batch, kv_heads, length, head_dim = hidden_states.shape
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, kv_heads, n_rep, length, head_dim)
    return hidden_states.reshape(batch, kv_heads * n_rep, length, head_dim)


# The SDPA call per backend, as AOTAutograd leaves it in the graph (no grad: no log-sum-exp).
def _cudnn(q, k, v, mask, scale):
    return _aten._scaled_dot_product_cudnn_attention(q, k, v, mask, False, 0.0, False, False, scale=scale)[0]


def _efficient(q, k, v, mask, scale):
    return _aten._scaled_dot_product_efficient_attention(q, k, v, mask, False, 0.0, False, scale=scale)[0]


def _cpu_flash(q, k, v, mask, scale):
    return _aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=mask, scale=scale)[0]


SDPA_BACKENDS = {"cudnn": _cudnn, "efficient": _efficient, "cpu_flash": _cpu_flash}
SDPA_OPS = (
    "aten._scaled_dot_product_cudnn_attention.default",
    "aten._scaled_dot_product_efficient_attention.default",
    "aten._scaled_dot_product_flash_attention_for_cpu.default",
)
# What the grouped call may become (flash attention takes grouped heads, but no mask)
_FUSED_SDPA_OPS = SDPA_OPS + ("aten._scaled_dot_product_flash_attention.default",)


def repeat_kv_bshd(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """Meta's llama reference and torchtitan's repeat_kv, on [B, L, Hkv, D] (the cache's layout
    there; transposed to heads-first after it): [B, L, Hkv * n_rep, D]."""
    bs, slen, n_kv_heads, head_dim = x.shape
    return x[:, :, :, None, :].expand(bs, slen, n_kv_heads, n_rep, head_dim).reshape(bs, slen, n_kv_heads * n_rep, head_dim)


def _spelling(sdpa):
    def repeat_kv_sdpa(query, key, value, mask, scale):
        n_rep = query.shape[1] // key.shape[1]  # module.num_key_value_groups
        return sdpa(query, repeat_kv(key, n_rep), repeat_kv(value, n_rep), mask, scale)

    return repeat_kv_sdpa


def _spelling_bshd(sdpa):
    def repeat_kv_bshd_sdpa(query, key, value, mask, scale):
        n_rep = query.shape[1] // key.shape[2]
        keys, values = repeat_kv_bshd(key, n_rep).transpose(1, 2), repeat_kv_bshd(value, n_rep).transpose(1, 2)
        return sdpa(query, keys, values, mask, scale)

    return repeat_kv_bshd_sdpa


def grouped_decode_attention(query, key, value, mask, scale):
    """The fused form: SDPA's grouped-query attention on the cache's own KV heads."""
    return torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale,
                                                            enable_gqa=True)  # fmt: skip


def grouped_decode_attention_bshd(query, key, value, mask, scale):
    """The same on keys and values laid out [B, L, Hkv, D] (read through a transpose)."""
    return grouped_decode_attention(query, key.transpose(1, 2), value.transpose(1, 2), mask, scale)


def _gqa_sdpa_op(query, key, value, mask) -> str | None:
    """The fused SDPA op the dispatcher picks for grouped heads with this mask on the values'
    device (traced as the matcher traces the replacement), or None where it would run the math
    fallback (which upcasts and materializes the scores)."""
    with detect_fake_mode([query]) or contextlib.nullcontext():
        gm = trace_functional(grouped_decode_attention, [query, key, value, mask, 1.0])
    ops = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
    return next((op for op in _FUSED_SDPA_OPS if op in ops), None)


def _checker(kv_heads_dim: int):
    def check(values: dict[str, Any]) -> str | None:
        query, key, value = values["query"], values["key"], values["value"]
        if query.dim() != 4 or query.shape[2] != 1:
            # a prefill: the copies are a small part of its attention there, and it is not measured
            return NotASite(f"a query of {query.shape[2] if query.dim() == 4 else '?'} tokens per head")
        kv_heads = key.shape[kv_heads_dim]
        if value.shape[kv_heads_dim] != kv_heads or query.shape[1] % kv_heads:
            return f"{query.shape[1]} query heads over {kv_heads} key / {value.shape[kv_heads_dim]} value heads"
        if values["mask"].dim() > 4:
            return f"a mask of {values['mask'].dim()} dims"
        if kv_heads_dim == 2:
            key, value = key.transpose(1, 2), value.transpose(1, 2)
        if _gqa_sdpa_op(query, key, value, values["mask"]) is None:
            return "no fused SDPA kernel takes grouped heads with a mask on this device (the math fallback would)"
        return None

    return check


def query_tokens(node) -> int | None:
    """The query tokens per head of an SDPA call's node (None where its query is not [B, H, S, D])."""
    val = getattr(node.args[0], "meta", {}).get("val")
    return None if val is None or val.dim() != 4 else val.shape[2]


def key_is_repeat(node) -> bool:
    """An SDPA call's key is a repeat: a reshape of a copy of an expand (transposed after, in Meta's layout)."""
    key = node.args[1]
    if getattr(key, "target", None) == _aten.permute.default:
        key = key.args[0]
    for target in (_aten.reshape.default, _aten.clone.default, _aten.expand.default):
        if getattr(key, "target", None) != target:
            return False
        key = key.args[0]
    return True


# what may stand between a mask and the SDPA call reading it without moving a value: views, the
# expand SDPA's callers add
_MASK_VIEWS = (_aten.view.default, _aten.reshape.default, _aten._unsafe_view.default, _aten.expand.default,
               _aten.unsqueeze.default, _aten.alias.default)  # fmt: skip


def _keeps_positions(node) -> bool:
    """A view, an end pad (every leading pad 0) or a slice from 0 with step 1: SDPA's alignment of
    a bias whose rows are at an odd stride (pad the last dim, slice it back) keeps every value
    where it was."""
    if node.target in _MASK_VIEWS:
        return True
    if node.target == _aten.constant_pad_nd.default:
        pads = node.args[1] if len(node.args) > 1 else ()
        return all(p == 0 for p in pads[::2])
    if node.target == _aten.slice.Tensor:
        start = node.args[2] if len(node.args) > 2 else 0
        step = node.args[4] if len(node.args) > 4 else 1
        return start in (0, None) and step == 1
    return False


def mask_source(mask):
    """The node an SDPA call's mask argument is made from, behind the views and the alignment that
    keep each value at its position (``_keeps_positions``)."""
    while isinstance(mask, torch.fx.Node) and mask.op == "call_function" and _keeps_positions(mask):
        mask = mask.args[0]
    return mask


def _is_decode_repeat(node) -> bool:
    """An SDPA call on one query token whose key is a repeat."""
    return query_tokens(node) == 1 and key_is_repeat(node)


def _examples():
    # On the meta device: the CUDA backends' calls trace there as the CPU's (their meta kernels).
    # 8 query heads; keys [2, 4, 4, 16] read as 4 KV heads x 4 positions (heads first) and as 4
    # positions x 4 KV heads (Meta's layout): every spelling is traced with every example.
    meta = {"device": "meta", "dtype": torch.bfloat16}
    q, kv = torch.empty(2, 8, 1, 16, **meta), torch.empty(2, 4, 4, 16, **meta)
    yield q, kv, torch.empty_like(kv), torch.empty(2, 1, 1, 4, **meta), SCALE_SENTINEL


GQA_DECODE_ATTENTION = Fusion(
    name="gqa_decode_attention",
    summary="repeat_kv of keys and values + SDPA at decode -> SDPA's grouped-query attention (no cache copies)",
    doc=__doc__.split("\n\n", 1)[1],
    spellings=tuple(
        Spelling(f"transformers_repeat_kv_sdpa_{name}", _spelling(sdpa), grouped_decode_attention, _checker(1))
        for name, sdpa in SDPA_BACKENDS.items()
    )
    + tuple(
        Spelling(f"meta_repeat_kv_bshd_sdpa_{name}", _spelling_bshd(sdpa), grouped_decode_attention_bshd, _checker(2))
        for name, sdpa in SDPA_BACKENDS.items()
    ),
    example_inputs=_examples,
    scalars={"scale": SCALE_SENTINEL},
    candidate_ops=SDPA_OPS,
    candidate=_is_decode_repeat,
    builtin=True,
)

FUSIONS = (GQA_DECODE_ATTENTION,)
