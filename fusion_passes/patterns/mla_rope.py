"""DeepSeek V3 / V3.2 pre-attention spellings (MLA and the V3.2 indexer), mapped to the ops of
``fusion_passes.lowering.mla_rope.op``.

Canonicalize, then fuse: the RMSNorm fusions have already turned kv_a_layernorm (and
q_a_layernorm, which sits between two GEMMs and is one kernel already) into
``fusion_passes.rms_norm``; these patterns start from that op. As transformers 5 writes them:

mla_kv_norm_rope (DeepseekV3Attention / DeepseekV32Attention, kv branch)
    Unfused: kv_nope, k_rot = split(kv_a_proj_with_mqa(h), [R, P], -1)
             kv_nope = rms_norm(kv_nope); k_rot = rope(k_rot.view(B, 1, S, P), cos, sin)
    Fused:   kv_nope, k_rot = mla_kv_norm_rope(kv, w, cos, sin, eps, offset, cast, interleave)
mla_q_rope (the same attention, q branch; and the V3.2 indexer's query)
    Unfused: q_pass, q_rot = split(q.view(B, S, H, D).transpose(1, 2), [D - P, P], -1)
             query = cat(q_pass, rope(q_rot, cos, sin))
             indexer: q_rot, q_pass = split(q, [P, D - P]); q = cat(rope(q_rot), q_pass)
    Fused:   query = mla_q_rope(q, cos, sin, rope_first, interleave, heads_first)
mla_indexer_k_norm_rope (DeepseekV32Indexer key)
    Unfused: k = layer_norm(wk(h)).unsqueeze(2); k_rot, k_pass = split(k, [P, D - P])
             k = cat(rope(k_rot, cos, sin), k_pass).squeeze(2)
    Fused:   k = mla_indexer_k_norm_rope(k, w, b, cos, sin, eps, interleave)
mla_q_kv_rope (the two MLA ops above, which share cos and sin, merged into one launch)
    Unfused: query = mla_q_rope(q, cos, sin, ...); kv_nope, k_rot = mla_kv_norm_rope(kv, ...)
    Fused:   query, kv_nope, k_rot = mla_q_kv_rope(q, kv, w, cos, sin, eps, offset, cast, interleave)

rope is ``apply_rotary_pos_emb_interleave`` (config.rope_interleave, V3.2's MLA) or
``apply_rotary_pos_emb`` (rotate_half: V3 with rope_interleave=False, the indexer). cos and sin
are pattern inputs as the attention slices them (``cos[..., :P/2].unsqueeze(1)`` or
``cos.unsqueeze(dim)``): q and k share those nodes, so neither pattern may own them.

The rotary width P is read from shapes (the rms_norm weight's width for kv, cos for q and the
indexer), the other widths from the inputs, so one pattern matches every head count and dim;
the checks reject cos/sin that do not fit (another shape, dtype, or axis).
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F
from torch._guards import detect_fake_mode

from fusion_passes.lowering.mla_rope.reference import (
    check_indexer_k_args,
    check_indexer_k_cache_args,
    check_mla_indexer_qk_args,
    check_mla_kv_cache_write_args,
    check_mla_kv_args,
    check_mla_q_args,
    check_mla_q_kv_args,
)
from fusion_passes.lowering.rms_norm.reference import check_rms_norm_args
from fusion_passes.patterns.cache_writes import SLOT_FORMS, cache_write, slot_index, slots_refusal, valid_slots
from fusion_passes.fusion import (
    DEFAULT_SCALAR_SENTINEL,
    Fusion,
    Rewritten,
    Spelling,
)
from fusion_passes.lowering.common.ops import schema_values
from fusion_passes.regions import nodes_region
from fusion_passes.report import module_path, source_location

# --- RoPE as transformers writes it (traced; keep the op order exactly) ---


def rope_interleave(x, cos, sin):
    """apply_rotary_pos_emb_interleave, one tensor, cos/sin already sliced and unsqueezed."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def rope_rotate_half(x, cos, sin):
    """apply_rotary_pos_emb, one tensor, cos/sin already unsqueezed."""
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return (x * cos) + (torch.cat((-x2, x1), dim=-1) * sin)


_ROPES = {True: rope_interleave, False: rope_rotate_half}
_NORM_FORMS = {"llama": (0.0, True), "fp32_weight": (0.0, False), "offset": (1.0, False)}


def _rope_width(cos, interleave: bool) -> int:
    return cos.shape[-1] * (2 if interleave else 1)


# --- mla_kv_norm_rope ---


def _kv_spelling(form: str, interleave: bool):
    offset, cast = _NORM_FORMS[form]
    rope = _ROPES[interleave]

    def pattern(kv, weight, cos, sin, eps):
        p = kv.shape[-1] - weight.shape[0]
        kv_nope, k_rot = torch.split(kv, [weight.shape[0], p], dim=-1)
        kv_nope = torch.ops.fusion_passes.rms_norm.default(kv_nope, weight, eps, offset, cast)
        k_rot = k_rot.view(kv.shape[0], 1, kv.shape[1], p)
        return kv_nope, rope(k_rot, cos, sin)

    def replacement(kv, weight, cos, sin, eps):
        kv_nope, k_rot = torch.ops.fusion_passes.mla_kv_norm_rope.default(
            kv, weight, cos.squeeze(1), sin.squeeze(1), eps, offset, cast, interleave
        )
        return kv_nope, k_rot.unsqueeze(1)

    def check(values: dict[str, Any]) -> str | None:
        kv, weight, cos, sin = (values[k] for k in ("kv", "weight", "cos", "sin"))
        reason = _check_unsqueezed(cos, sin, 1)
        if reason:
            return reason
        try:
            r = check_mla_kv_args(kv, weight, cos.squeeze(1), sin.squeeze(1), interleave)
            check_rms_norm_args(kv[..., :r], weight, offset, cast)
        except ValueError as e:
            return str(e)
        return None

    name = f"rms_norm_{form}_rope_{'interleave' if interleave else 'rotate_half'}"
    return Spelling(name, pattern, replacement, check)


def _check_unsqueezed(cos, sin, dim: int) -> str | None:
    """cos/sin as the attention broadcasts them: [B, S, C] with a size-1 (head) dim at ``dim``."""
    if cos.shape != sin.shape:
        return f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)} differ"
    if cos.dim() != 4 or cos.shape[dim] != 1:
        return f"cos {tuple(cos.shape)} is not [B, S, C] unsqueezed at dim {dim}"
    return None


def _kv_examples(interleave: bool):
    """Latent 16, rope 8 (cos width 4 interleaved, 8 rotate_half); fp32 and bf16 (the rms_norm
    op hides the casts, so both give one pattern)."""

    def example_inputs():
        for dtype in (torch.float32, torch.bfloat16):
            kv = torch.randn(2, 3, 24, dtype=dtype)
            cos = torch.randn(2, 1, 3, 4 if interleave else 8, dtype=dtype)
            w = torch.randn(16, dtype=dtype)
            yield kv, w, cos, torch.randn_like(cos), DEFAULT_SCALAR_SENTINEL

    return example_inputs


def _kv_fusion(interleave: bool) -> Fusion:
    style = "interleaved (even/odd)" if interleave else "rotate_half"
    return Fusion(
        # Two fusions of one op: the registry traces every spelling of a fusion on every example,
        # and cos is half as wide for the interleaved RoPE.
        name="mla_kv_norm_rope" if interleave else "mla_kv_norm_rope_rotate_half",
        summary=f"MLA kv: RMSNorm of the latent + {style} RoPE of k_pe -> one mla_kv_norm_rope kernel",
        doc="""MLA's kv_a_proj_with_mqa output: latent normalised, k_pe rotated, in one kernel.

        Unfused: kv_nope, k_pe = split(kv, [R, P]); rms_norm(kv_nope); rope(k_pe.view(B, 1, S, P))
                 (an RMSNorm kernel and a RoPE kernel, each reading its slice of kv)
        Fused:   kv_nope, k_pe = fusion_passes.mla_kv_norm_rope(kv, w, cos, sin, eps, offset,
                 cast, interleave)""",
        spellings=tuple(_kv_spelling(form, interleave) for form in _NORM_FORMS),
        example_inputs=_kv_examples(interleave),
        scalars={"eps": DEFAULT_SCALAR_SENTINEL},
        requires=("rms_norm",),
        builtin=True,
    )


MLA_KV_NORM_ROPE = _kv_fusion(interleave=True)
MLA_KV_NORM_ROPE_ROTATE_HALF = _kv_fusion(interleave=False)


# --- mla_q_rope ---


def _q_spelling(indexer: bool, interleave: bool):
    rope = _ROPES[interleave]
    # MLA's q_rot is [B, H, S, P] (cos unsqueezed at 1); the indexer's [B, S, H, P] (at 2).
    dim = 2 if indexer else 1

    if indexer:

        def pattern(q, cos, sin):
            p = _rope_width(cos, interleave)
            q_rot, q_pass = torch.split(q, [p, q.shape[-1] - p], dim=-1)
            return torch.cat([rope(q_rot, cos, sin), q_pass], dim=-1)

    else:

        def pattern(q, cos, sin):
            p = _rope_width(cos, interleave)
            q = q.transpose(1, 2)
            q_pass, q_rot = torch.split(q, [q.shape[-1] - p, p], dim=-1)
            return torch.cat((q_pass, rope(q_rot, cos, sin)), dim=-1)

    def replacement(q, cos, sin):
        return torch.ops.fusion_passes.mla_q_rope.default(
            q, cos.squeeze(dim), sin.squeeze(dim), indexer, interleave, not indexer
        )

    def check(values: dict[str, Any]) -> str | None:
        q, cos, sin = (values[k] for k in ("q", "cos", "sin"))
        reason = _check_unsqueezed(cos, sin, dim)
        if reason:
            return reason
        if q.dim() != 4:
            return f"q {tuple(q.shape)} is not [B, S, H, D]"
        try:
            p = check_mla_q_args(q, cos.squeeze(dim), sin.squeeze(dim), interleave)
        except ValueError as e:
            return str(e)
        if p == q.shape[-1]:
            return "no pass-through slice: the split has one part"
        return None

    name = f"{'indexer_q' if indexer else 'mla_q'}_rope_{'interleave' if interleave else 'rotate_half'}"
    return Spelling(name, pattern, replacement, check)


def _q_examples():
    """Head dim 12, cos width 4: rope 8 (interleaved) or 4 (rotate_half), both with a
    pass-through slice. RoPE in fp32 and bf16 traces alike (no casts)."""
    q = torch.randn(2, 3, 5, 12)
    cos_mla = torch.randn(2, 1, 3, 4)
    yield q, cos_mla, torch.randn_like(cos_mla)


def _q_examples_for(indexer: bool):
    def example_inputs():
        for q, cos, sin in _q_examples():
            if indexer:  # cos [B, S, 1, C]
                cos, sin = cos.transpose(1, 2), sin.transpose(1, 2)
            yield q, cos.contiguous(), sin.contiguous()

    return example_inputs


MLA_Q_ROPE = Fusion(
    name="mla_q_rope",
    summary="MLA q (and V3.2 indexer q): split + RoPE + cat -> one mla_q_rope kernel",
    doc="""q's rope slice rotated and reassembled with the pass-through slice, in one kernel.

    Unfused: q_pass, q_rot = split(q.transpose(1, 2), [D - P, P]); cat(q_pass, rope(q_rot))
             (indexer: q_rot, q_pass = split(q, [P, D - P]); cat(rope(q_rot), q_pass))
    Fused:   query = fusion_passes.mla_q_rope(q, cos, sin, rope_first, interleave, heads_first)""",
    spellings=tuple(_q_spelling(False, il) for il in (True, False)),
    example_inputs=_q_examples_for(indexer=False),
    builtin=True,
)

# The indexer's q has cos unsqueezed at another dim, so its own example: a separate fusion of
# the same op (the registry traces every spelling of a fusion on every example).
MLA_INDEXER_Q_ROPE = Fusion(
    name="mla_indexer_q_rope",
    summary="V3.2 indexer q: split + RoPE + cat -> one mla_q_rope kernel",
    doc=MLA_Q_ROPE.doc,
    spellings=tuple(_q_spelling(True, il) for il in (True, False)),
    example_inputs=_q_examples_for(indexer=True),
    builtin=True,
)


# --- mla_indexer_k_norm_rope ---


def _indexer_k_spelling(interleave: bool):
    rope = _ROPES[interleave]

    def pattern(k, weight, bias, cos, sin, eps):
        p = _rope_width(cos, interleave)
        k = F.layer_norm(k, (k.shape[-1],), weight, bias, eps).unsqueeze(2)
        k_rot, k_pass = torch.split(k, [p, k.shape[-1] - p], dim=-1)
        return torch.cat([rope(k_rot, cos, sin), k_pass], dim=-1).squeeze(2)

    def replacement(k, weight, bias, cos, sin, eps):
        return torch.ops.fusion_passes.mla_indexer_k_norm_rope.default(
            k, weight, bias, cos.squeeze(2), sin.squeeze(2), eps, interleave
        )

    def check(values: dict[str, Any]) -> str | None:
        k, weight, bias, cos, sin = (values[n] for n in ("k", "weight", "bias", "cos", "sin"))
        reason = _check_unsqueezed(cos, sin, 2)
        if reason:
            return reason
        if k.dim() != 3:
            return f"k {tuple(k.shape)} is not [B, S, D]"
        try:
            p = check_indexer_k_args(k, weight, bias, cos.squeeze(2), sin.squeeze(2), interleave)
        except ValueError as e:
            return str(e)
        if p == k.shape[-1]:
            return "no pass-through slice: the split has one part"
        return None

    name = f"layer_norm_rope_{'interleave' if interleave else 'rotate_half'}"
    return Spelling(name, pattern, replacement, check)


def _indexer_k_examples():
    """fp32 graphs drop the casts that bf16/fp16 LayerNorm graphs keep: trace both."""
    for dtype in (torch.float32, torch.bfloat16):
        k = torch.randn(2, 3, 12, dtype=dtype)
        w, b = torch.randn(12, dtype=dtype), torch.randn(12, dtype=dtype)
        cos = torch.randn(2, 3, 1, 4, dtype=dtype)
        yield k, w, b, cos, torch.randn_like(cos), DEFAULT_SCALAR_SENTINEL


MLA_INDEXER_K_NORM_ROPE = Fusion(
    name="mla_indexer_k_norm_rope",
    summary="V3.2 indexer key: LayerNorm + RoPE -> one mla_indexer_k_norm_rope kernel",
    doc="""The DSA indexer's key: LayerNorm, then RoPE on its first P dims, in one kernel.

    Unfused: k = layer_norm(k).unsqueeze(2); k_rot, k_pass = split(k, [P, D - P]);
             cat(rope(k_rot), k_pass).squeeze(2)       (a LayerNorm kernel, a RoPE + cat kernel)
    Fused:   k = fusion_passes.mla_indexer_k_norm_rope(k, w, b, cos, sin, eps, interleave)""",
    spellings=tuple(_indexer_k_spelling(il) for il in (False, True)),
    example_inputs=_indexer_k_examples,
    scalars={"eps": DEFAULT_SCALAR_SENTINEL},
    builtin=True,
)

# --- mla_q_kv_rope: MLA's two branches in one launch ---

# From this many tokens (a static count), the branches stay two launches. Measured on an H200 (bf16,
# CUDA graph, DeepSeek V3 widths, us, one launch / two): 2.7 / 4.6 at 1 token, 4.2 / 6.0 at 64,
# 8.5 / 10.5 at 256, 31.7 / 31.7 at 1024, 61.2 / 58.4 at 2048, 121.7 / 112.3 at 4096 (one
# launch shares one warp count between the two kernels' programs). A symbolic count merges: the
# decode steps gain the most.
ONE_LAUNCH_MAX_TOKENS = 2048


def _q_kv_spelling(form: str, interleave: bool):
    offset, cast = _NORM_FORMS[form]

    def pattern(q, kv, weight, cos, sin, eps):
        # As the two fusions above leave them: each op squeezes the attention's cos / sin.
        query = torch.ops.fusion_passes.mla_q_rope.default(
            q, cos.squeeze(1), sin.squeeze(1), False, interleave, True
        )
        normed, k_pe = torch.ops.fusion_passes.mla_kv_norm_rope.default(
            kv, weight, cos.squeeze(1), sin.squeeze(1), eps, offset, cast, interleave
        )
        return query, normed, k_pe

    def replacement(q, kv, weight, cos, sin, eps):
        return torch.ops.fusion_passes.mla_q_kv_rope.default(
            q, kv, weight, cos.squeeze(1), sin.squeeze(1), eps, offset, cast, interleave
        )

    def check(values: dict[str, Any]) -> str | None:
        q, kv, weight, cos, sin = (values[k] for k in ("q", "kv", "weight", "cos", "sin"))
        try:
            check_mla_q_kv_args(q, kv, weight, cos.squeeze(1), sin.squeeze(1), interleave)
        except ValueError as e:
            return str(e)
        tokens = q.shape[0] * q.shape[1]
        if isinstance(tokens, int) and tokens >= ONE_LAUNCH_MAX_TOKENS:
            return (
                f"{tokens} tokens: left as two launches (faster from {ONE_LAUNCH_MAX_TOKENS} tokens, "
                "each kernel with its own launch shape)"
            )
        return None

    return Spelling(f"{form}_{'interleave' if interleave else 'rotate_half'}", pattern, replacement, check)


def _q_kv_examples(interleave: bool):
    """Heads 5 of dim 12 and a latent of 16, rope 8 (cos width 4 interleaved, 8 rotate_half)."""

    def example_inputs():
        for dtype in (torch.float32, torch.bfloat16):
            cos = torch.randn(2, 1, 3, 4 if interleave else 8, dtype=dtype)
            q = torch.randn(2, 3, 5, 12, dtype=dtype)
            kv, w = torch.randn(2, 3, 24, dtype=dtype), torch.randn(16, dtype=dtype)
            yield q, kv, w, cos, torch.randn_like(cos), DEFAULT_SCALAR_SENTINEL

    return example_inputs


def _q_kv_fusion(interleave: bool) -> Fusion:
    kv = "mla_kv_norm_rope" if interleave else "mla_kv_norm_rope_rotate_half"
    return Fusion(
        name="mla_q_kv_rope" if interleave else "mla_q_kv_rope_rotate_half",
        summary="MLA q rope + kv norm/rope (two kernels sharing cos/sin) -> one mla_q_kv_rope launch",
        doc="""MLA's two pre-attention branches, already fused one kernel each, in one launch.

        Unfused: query = fusion_passes.mla_q_rope(q, cos, sin, ...)
                 kv_nope, k_pe = fusion_passes.mla_kv_norm_rope(kv, w, cos, sin, eps, ...)
                 (two launches: at decode each is most of its branch's time)
        Fused:   query, kv_nope, k_pe = fusion_passes.mla_q_kv_rope(q, kv, w, cos, sin, eps, ...)

        Below ONE_LAUNCH_MAX_TOKENS tokens (or a symbolic count); above, two launches are faster.""",
        spellings=tuple(_q_kv_spelling(form, interleave) for form in _NORM_FORMS),
        example_inputs=_q_kv_examples(interleave),
        scalars={"eps": DEFAULT_SCALAR_SENTINEL},
        requires=(kv, "mla_q_rope"),
        builtin=True,
    )


MLA_Q_KV_ROPE = _q_kv_fusion(interleave=True)
MLA_Q_KV_ROPE_ROTATE_HALF = _q_kv_fusion(interleave=False)

# --- mla_indexer_k_norm_rope_cache: the indexer key written into its cache by the same kernel ---


def _indexer_k_cache_spelling(interleave: bool, slots: str):
    """slots: how the step writes the cache (patterns/cache_writes.py; transformers' indexer
    cache layer: "first")."""

    def pattern(k, weight, bias, cos, sin, cache, positions, eps):
        key = torch.ops.fusion_passes.mla_indexer_k_norm_rope.default(k, weight, bias, cos, sin, eps, interleave)
        return cache_write(cache, 1, slot_index(positions, k.shape[1], k.device, slots), key, slots)

    def replacement(k, weight, bias, cos, sin, cache, positions, eps):
        return torch.ops.fusion_passes.mla_indexer_k_norm_rope_cache.default(
            k, weight, bias, cos, sin, cache, positions, eps, interleave
        )

    def check(values: dict[str, Any]) -> str | None:
        names = ("k", "weight", "bias", "cos", "sin", "cache", "positions")
        k, weight, bias, cos, sin, cache, positions = (values[n] for n in names)
        try:
            check_indexer_k_cache_args(k, weight, bias, cos, sin, cache, positions, interleave)
        except ValueError as e:
            return str(e)
        return slots_refusal(slots, positions)

    return Spelling(f"{SLOT_FORMS[slots]}_{'interleave' if interleave else 'rotate_half'}", pattern, replacement, check)


def _indexer_k_cache_examples():
    """Keys of width 12 (rope 4 rotate_half / 8 interleaved: cos width 4), a cache of 7 slots:
    one token per sequence at a 0-d first slot (a write counter), three at a slot each, and a
    batch of one with two at a slot each. Every spelling traces on each (one token: a 0-d slot is a
    slot per token)."""
    for dtype in (torch.float32, torch.bfloat16):
        w, b = torch.randn(12, dtype=dtype), torch.randn(12, dtype=dtype)
        for bsz, s, positions in ((2, 1, torch.tensor(2)), (2, 3, torch.tensor([3, 0, 2])), (1, 2, torch.tensor([3, 0]))):
            k, cos = torch.randn(bsz, s, 12, dtype=dtype), torch.randn(bsz, s, 4, dtype=dtype)
            cache = torch.randn(bsz, 7, 12, dtype=dtype)
            yield k, w, b, cos, torch.randn_like(cos), cache, positions, DEFAULT_SCALAR_SENTINEL


MLA_INDEXER_K_NORM_ROPE_CACHE = Fusion(
    name="mla_indexer_k_norm_rope_cache",
    summary="V3.2 indexer key + its cache write -> one mla_indexer_k_norm_rope_cache kernel",
    doc="""The DSA indexer's key written into the indexer's key cache by the kernel that makes it.

    Unfused: key = fusion_passes.mla_indexer_k_norm_rope(k, w, b, cos, sin, eps, interleave)
             indexer_keys.index_copy_(1, arange(S) + length, key)   (transformers' cache layer;
             or at given slots)                                      (a second kernel: the copy)
    Fused:   indexer_keys = fusion_passes.mla_indexer_k_norm_rope_cache(k, w, b, cos, sin,
                                indexer_keys, positions, eps, interleave)
             one kernel; on CUDA (launched by Inductor) it writes the rows into the cache in place,
             and the copy of the new cache back into the model's buffer goes.""",
    spellings=tuple(_indexer_k_cache_spelling(il, slots) for slots in SLOT_FORMS for il in (False, True)),
    example_inputs=_indexer_k_cache_examples,
    scalars={"eps": DEFAULT_SCALAR_SENTINEL},
    verify_inputs={"positions": valid_slots("cache", 1)},
    requires=("mla_indexer_k_norm_rope",),
    builtin=True,
)

# --- mla_kv_cache_write: MLA's key assembly and both cache writes in one kernel ---


def _mla_key(k_nope, k_pe, new_tensor: bool):
    k_rot = k_pe.expand(-1, k_nope.shape[1], -1, -1)
    if not new_tensor:  # the usual spelling (vLLM's and SGLang's torch paths, older transformers)
        return torch.cat([k_nope, k_rot], dim=-1)
    # transformers' DeepseekV32Attention.expand_kv: a new tensor, each part copied into its slice
    nope = k_nope.shape[-1]
    key = k_nope.new_empty(*k_nope.shape[:-1], nope + k_pe.shape[-1])
    key[..., :nope].copy_(k_nope)
    key[..., nope:].copy_(k_rot)
    return key


def _kv_cache_write_spelling(new_tensor: bool, slots: str):
    """slots: how the step writes the caches (patterns/cache_writes.py)."""

    # kv: kv_b_proj's output viewed [B, H, S, NOPE + V] (expand_kv: view, then transpose): the
    # split into k_nope and value is part of the pattern, so that the value's write (a placeholder
    # value alone) cannot match the key's.
    def pattern(kv, k_pe, k_cache, v_cache, positions):
        nope = k_cache.shape[-1] - k_pe.shape[-1]
        k_nope, value = torch.split(kv, [nope, kv.shape[-1] - nope], dim=-1)
        key = _mla_key(k_nope, k_pe, new_tensor)
        index = slot_index(positions, kv.shape[2], kv.device, slots)
        return cache_write(k_cache, 2, index, key, slots), cache_write(v_cache, 2, index, value, slots)

    def replacement(kv, k_pe, k_cache, v_cache, positions):
        nope = k_cache.shape[-1] - k_pe.shape[-1]
        k_nope, value = torch.split(kv, [nope, kv.shape[-1] - nope], dim=-1)
        return torch.ops.fusion_passes.mla_kv_cache_write.default(k_nope, k_pe, value, k_cache, v_cache, positions)

    def check(values: dict[str, Any]) -> str | None:
        kv, k_pe, k_cache, v_cache, positions = (values[n] for n in ("kv", "k_pe", "k_cache", "v_cache", "positions"))
        nope = k_cache.shape[-1] - k_pe.shape[-1]
        if kv.dim() != 4 or kv.shape[-1] != nope + v_cache.shape[-1]:
            # the matcher takes any split point: the key's part must fill the key cache's width
            return (f"kv {tuple(kv.shape)} is not [B, H, S, {nope} + {v_cache.shape[-1]}] "
                    f"(the key cache's width less k_pe's, then the value cache's)")  # fmt: skip
        try:
            check_mla_kv_cache_write_args(kv[..., :nope], k_pe, kv[..., nope:], k_cache, v_cache, positions)
        except ValueError as e:
            return str(e)
        return slots_refusal(slots, positions)

    return Spelling(f"{'copies' if new_tensor else 'cat'}_{SLOT_FORMS[slots]}", pattern, replacement, check)


def _kv_cache_write_examples():
    """3 heads of 8 + 4 (nope + rope) keys and 6-wide values, a cache of 7 slots: one token per
    sequence at a 0-d first slot, three at a slot each, and a batch of one with two at a slot each
    (every spelling traces on each)."""
    for dtype in (torch.float32, torch.bfloat16):
        for bsz, s, positions in ((2, 1, torch.tensor(2)), (2, 3, torch.tensor([3, 0, 2])), (1, 2, torch.tensor([3, 0]))):
            kv = torch.randn(bsz, s, 3, 14, dtype=dtype).transpose(1, 2)
            k_pe = torch.randn(bsz, 1, s, 4, dtype=dtype)
            caches = torch.randn(bsz, 3, 7, 12, dtype=dtype), torch.randn(bsz, 3, 7, 6, dtype=dtype)
            yield kv, k_pe, *caches, positions


MLA_KV_CACHE_WRITE = Fusion(
    name="mla_kv_cache_write",
    summary="MLA key assembly + the KV cache's two writes -> one mla_kv_cache_write kernel",
    doc="""DeepSeek V3.2's key (k_nope from kv_b_proj, the rotated k_pe every head shares) and value
    written into the KV cache by one kernel.

    Unfused: key = cat(k_nope, k_pe.expand(H))    (transformers: a new tensor, each part copied in)
             k_cache.index_copy_(2, slots, key); v_cache.index_copy_(2, slots, value)
             (a kernel per cache with stock Inductor, the key assembly fused into the first)
    Fused:   k_cache, v_cache = fusion_passes.mla_kv_cache_write(k_nope, k_pe, value, k_cache,
                                                                  v_cache, positions)
             one kernel; on CUDA (launched by Inductor) it writes both caches in place.""",
    spellings=tuple(_kv_cache_write_spelling(new, slots) for slots in SLOT_FORMS for new in (True, False)),
    example_inputs=_kv_cache_write_examples,
    verify_inputs={"positions": valid_slots("k_cache", 2)},
    builtin=True,
)

# --- mla_indexer_qk_rope: the indexer's two RoPE ops (they share cos and sin) in one launch ---


def _indexer_qk_spelling(interleave: bool, into_cache: bool):
    def query(q, cos, sin):
        # As the indexer fusions leave them: each op squeezes the indexer's cos / sin.
        return torch.ops.fusion_passes.mla_q_rope.default(q, cos.squeeze(2), sin.squeeze(2), True, interleave, False)

    def check_merge(q, k, weight, bias, cos, sin, cache, positions) -> str | None:
        try:
            check_mla_indexer_qk_args(q, k, weight, bias, cos.squeeze(2), sin.squeeze(2), cache, positions, interleave)
        except ValueError as e:
            return str(e)
        tokens = q.shape[0] * q.shape[1]
        if isinstance(tokens, int) and tokens >= ONE_LAUNCH_MAX_TOKENS:
            return f"{tokens} tokens: left as two launches (as mla_q_kv_rope, from {ONE_LAUNCH_MAX_TOKENS} tokens)"
        return None

    if into_cache:

        def pattern(q, k, weight, bias, cos, sin, cache, positions, eps):
            keys = torch.ops.fusion_passes.mla_indexer_k_norm_rope_cache.default(
                k, weight, bias, cos.squeeze(2), sin.squeeze(2), cache, positions, eps, interleave
            )
            return query(q, cos, sin), keys

        def replacement(q, k, weight, bias, cos, sin, cache, positions, eps):
            return torch.ops.fusion_passes.mla_indexer_qk_rope.default(
                q, k, weight, bias, cos.squeeze(2), sin.squeeze(2), cache, positions, eps, interleave
            )

        def check(values: dict[str, Any]) -> str | None:
            return check_merge(*(values[n] for n in ("q", "k", "weight", "bias", "cos", "sin", "cache", "positions")))

    else:

        def pattern(q, k, weight, bias, cos, sin, eps):
            keys = torch.ops.fusion_passes.mla_indexer_k_norm_rope.default(
                k, weight, bias, cos.squeeze(2), sin.squeeze(2), eps, interleave
            )
            return query(q, cos, sin), keys

        def replacement(q, k, weight, bias, cos, sin, eps):
            return torch.ops.fusion_passes.mla_indexer_qk_rope.default(
                q, k, weight, bias, cos.squeeze(2), sin.squeeze(2), None, None, eps, interleave
            )

        def check(values: dict[str, Any]) -> str | None:
            return check_merge(*(values[n] for n in ("q", "k", "weight", "bias", "cos", "sin")), None, None)

    return Spelling("interleave" if interleave else "rotate_half", pattern, replacement, check)


def _indexer_qk_examples(into_cache: bool):
    """Indexer q (4 heads of 12) and key of width 12, rope 4 rotate_half / 8 interleaved (cos width
    4); into the cache: a cache of 7 slots from slot 2."""

    def example_inputs():
        for dtype in (torch.float32, torch.bfloat16):
            q, k = torch.randn(2, 3, 4, 12, dtype=dtype), torch.randn(2, 3, 12, dtype=dtype)
            w, b = torch.randn(12, dtype=dtype), torch.randn(12, dtype=dtype)
            cos = torch.randn(2, 3, 1, 4, dtype=dtype)
            cache = (torch.randn(2, 7, 12, dtype=dtype), torch.tensor(2)) if into_cache else ()
            yield q, k, w, b, cos, torch.randn_like(cos), *cache, DEFAULT_SCALAR_SENTINEL

    return example_inputs


def _indexer_qk_fusion(into_cache: bool) -> Fusion:
    key_op = "mla_indexer_k_norm_rope_cache" if into_cache else "mla_indexer_k_norm_rope"
    return Fusion(
        name="mla_indexer_qk_rope_cache" if into_cache else "mla_indexer_qk_rope",
        summary=f"V3.2 indexer q RoPE + {key_op} (two kernels sharing cos/sin) -> one mla_indexer_qk_rope launch",
        doc=f"""The DSA indexer's two pre-score branches, already fused one kernel each, in one launch.

        Unfused: query = fusion_passes.mla_q_rope(q, cos, sin, rope_first=True, ...)
                 key = fusion_passes.{key_op}(k, w, b, cos, sin, ...)
                 (two launches: at decode each is mostly launch latency)
        Fused:   query, key = fusion_passes.mla_indexer_qk_rope(q, k, w, b, cos, sin, cache, positions, eps, ...)

        Below ONE_LAUNCH_MAX_TOKENS tokens (or a symbolic count), as mla_q_kv_rope.""",
        spellings=tuple(_indexer_qk_spelling(il, into_cache) for il in (False, True)),
        example_inputs=_indexer_qk_examples(into_cache),
        scalars={"eps": DEFAULT_SCALAR_SENTINEL},
        requires=("mla_indexer_q_rope", key_op),
        verify_inputs={"positions": valid_slots("cache", 1)} if into_cache else {},
        # Into the cache it is a default: with the other cache folds of a V3.2 decode step it measured
        # 1264-1281 -> 1237-1242 us (one H200, batch 1, 8192 cached tokens, two runs). Without a cache
        # write (use_cache=False forwards) it has not been timed.
        opt_in="" if into_cache else (
            "not yet timed on a GPU: the two kernels it merges take 1.4 and 2.3 us per layer on one H200 at "
            "batch 1 (mla_q_kv_rope, the same merge for MLA, took 4.6 -> 2.7 us at 1 token)"
        ),  # fmt: skip
        builtin=True,
    )


MLA_INDEXER_QK_ROPE = _indexer_qk_fusion(into_cache=False)
MLA_INDEXER_QK_ROPE_CACHE = _indexer_qk_fusion(into_cache=True)

# --- mla_indexer_qk_rope_kv_cache: a decode step's indexer launch and KV cache write in one ---

_INDEXER_QK = torch.ops.fusion_passes.mla_indexer_qk_rope.default
_KV_WRITE = torch.ops.fusion_passes.mla_kv_cache_write.default


def _ancestors(node: torch.fx.Node) -> set[torch.fx.Node]:
    seen, stack = set(), list(node.all_input_nodes)
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return seen


def _full_args(node: torch.fx.Node) -> list[Any]:
    """The node's op arguments in schema order, defaults filled in."""
    return schema_values(node.target, node.args, node.kwargs)


def merge_indexer_and_kv_writes(graph: torch.fx.Graph) -> list[Rewritten]:
    """Each layer's indexer launch into its cache (mla_indexer_qk_rope with a cache) and its KV
    cache write (mla_kv_cache_write) become one mla_indexer_qk_rope_kv_cache launch. The two read
    no output of each other and run after the step's GEMMs; the replacement nodes carry no module
    path, so a layer's pair is the i-th of each in graph order, taken only where the counts agree
    and neither node feeds the other."""
    indexer = [n for n in graph.find_nodes(op="call_function", target=_INDEXER_QK) if n.args[6] is not None]
    writes = list(graph.find_nodes(op="call_function", target=_KV_WRITE))
    if not indexer or len(indexer) != len(writes):
        return []
    done = []
    for idx, kv in zip(indexer, writes):
        if idx in _ancestors(kv) or kv in _ancestors(idx):
            continue
        before = nodes_region([idx, kv])
        module, location = module_path(idx), source_location(idx)
        q, k, weight, bias, cos, sin, cache, positions, eps, interleave = _full_args(idx)
        args = (q, k, weight, bias, cos, sin, cache, positions, *_full_args(kv), eps, interleave)
        later = max(idx, kv, key=list(graph.nodes).index)
        with graph.inserting_after(later):
            merged = graph.call_function(torch.ops.fusion_passes.mla_indexer_qk_rope_kv_cache.default, args)
        values = torch.fx.map_arg(args, lambda n: n.meta["val"])
        with detect_fake_mode([v for v in values if isinstance(v, torch.Tensor)]):
            merged.meta["val"] = merged.target(*values)
        for old, offset in ((idx, 0), (kv, 2)):
            for user in list(old.users):
                user.args = (merged, user.args[1] + offset)
            graph.erase_node(old)
        for user in merged.users:
            user.meta["val"] = merged.meta["val"][user.args[1]]
        done.append(Rewritten("indexer_then_kv_write", module, location, before, nodes_region([merged]), (merged,)))
    return done


MLA_INDEXER_QK_ROPE_KV_CACHE = Fusion(
    name="mla_indexer_qk_rope_kv_cache",
    summary="V3.2 decode: the indexer's launch into its cache + the KV cache write -> one launch",
    doc="""The two launches of a DeepSeek V3.2 decode step's attention that follow its GEMMs, merged.

    Unfused: query, idx_cache = fusion_passes.mla_indexer_qk_rope(q, k, w, b, cos, sin, idx_cache, positions, ...)
             k_cache, v_cache = fusion_passes.mla_kv_cache_write(k_nope, k_pe, value, k_cache, v_cache, kv_positions)
             (two launches, neither reading the other's outputs; at decode each is mostly launch latency)
    Fused:   query, idx_cache, k_cache, v_cache = fusion_passes.mla_indexer_qk_rope_kv_cache(...)
             one launch: the indexer's programs, then the KV write's, outputs theirs bit for bit.
    No pattern pairs them (they share no input: each cache counts its own slots), so this is a
    graph rewrite (Fusion.rewrite) pairing each layer's two ops.""",
    spellings=(),
    example_inputs=lambda: (),
    rewrite=merge_indexer_and_kv_writes,
    requires=("mla_indexer_qk_rope_cache", "mla_kv_cache_write"),
    applies_to=lambda graph: bool(graph.find_nodes(op="call_function", target=_KV_WRITE)),
    builtin=True,
)

# --- mla_decode_regroup: a DeepSeek V3.2 decode step's pre-attention launches regrouped ---

_Q_KV = torch.ops.fusion_passes.mla_q_kv_rope.default
_QK_KV_CACHE = torch.ops.fusion_passes.mla_indexer_qk_rope_kv_cache.default
_RMS_NORM = torch.ops.fusion_passes.rms_norm.default
_VIEWS = {torch.ops.aten.reshape.default, torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default,
          torch.ops.aten.permute.default, torch.ops.aten.clone.default}  # fmt: skip


def _under_views(node):
    while isinstance(node, torch.fx.Node) and node.target in _VIEWS:
        node = node.args[0]
    return node


def _q_a_norm(q_kv: torch.fx.Node):
    """The canonical rms_norm whose output q_b_proj projects into q_kv's query, or None."""
    mm = _under_views(q_kv.args[0])
    if not (isinstance(mm, torch.fx.Node) and mm.target is torch.ops.aten.mm.default):
        return None
    norm = _under_views(mm.args[0])
    if not (isinstance(norm, torch.fx.Node) and norm.target is _RMS_NORM):
        return None
    x, weight = norm.args[0].meta.get("val"), norm.args[1].meta.get("val")
    out = norm.meta.get("val")
    if not all(isinstance(t, torch.Tensor) for t in (x, weight, out)) or not x.dtype == weight.dtype == out.dtype:
        return None  # the merged kernel stores the norm in x's dtype, weighting as the kv branch does
    return norm


def _with_fake_value(node: torch.fx.Node) -> None:
    values = torch.fx.map_arg(node.args, lambda n: n.meta["val"])
    with detect_fake_mode([v for v in torch.utils._pytree.tree_leaves(values) if isinstance(v, torch.Tensor)]):
        node.meta["val"] = node.target(*values)


def _repoint(old: torch.fx.Node, new: torch.fx.Node, offset: int) -> None:
    """old's getitem users read new's outputs from ``offset`` on (old returns a tuple)."""
    for user in list(old.users):
        user.args = (new, user.args[1] + offset)
        user.meta["val"] = new.meta["val"][user.args[1]]


def regroup_decode_launches(graph: torch.fx.Graph) -> list[Rewritten]:
    """Per layer: q_a_layernorm (a canonical rms_norm), mla_q_kv_rope and
    mla_indexer_qk_rope_kv_cache (three launches) -> mla_q_a_kv_norm_rope before the
    up-projections (the two norms: the kv branch no longer waits for q_b_proj) and
    mla_q_indexer_kv_cache after them (MLA's query RoPE with the indexer's launch and the KV
    write): two launches. A layer's q_kv and cache ops are the i-th of each in graph order, taken
    where the counts agree and q_kv's query comes from q_b_proj of the norm."""
    q_kvs = list(graph.find_nodes(op="call_function", target=_Q_KV))
    caches = list(graph.find_nodes(op="call_function", target=_QK_KV_CACHE))
    if not q_kvs or len(q_kvs) != len(caches):
        return []
    done = []
    for q_kv, cache_op in zip(q_kvs, caches):
        norm = _q_a_norm(q_kv)
        # one launch for the norm and the kv branch: kv must not come from the norm (nor the
        # MLA query from the cache launch)
        if norm is None or norm in _ancestors(q_kv.args[1]) or cache_op in _ancestors(q_kv):
            continue
        before = nodes_region([norm, q_kv, cache_op])
        module, location = module_path(norm), source_location(norm)
        q, kv, weight, cos, sin, eps, weight_offset, cast, interleave = _full_args(q_kv)
        x, x_weight, x_eps, x_offset, x_cast = _full_args(norm)
        with graph.inserting_before(norm):
            first = graph.call_function(
                torch.ops.fusion_passes.mla_q_a_kv_norm_rope.default,
                (x, x_weight, x_eps, x_offset, x_cast, kv, weight, cos, sin, eps, weight_offset, cast, interleave),
            )
            normed = graph.call_function(operator.getitem, (first, 0))
        _with_fake_value(first)
        normed.meta["val"] = first.meta["val"][0]
        norm.replace_all_uses_with(normed)
        graph.erase_node(norm)
        with graph.inserting_after(cache_op):
            second = graph.call_function(
                torch.ops.fusion_passes.mla_q_indexer_kv_cache.default, (q, cos, sin, interleave, *_full_args(cache_op))
            )
        _with_fake_value(second)
        for user in list(q_kv.users):  # (query, normed, k_pe): the query from the second launch
            target, index = (second, 0) if user.args[1] == 0 else (first, user.args[1])
            user.args = (target, index)
            user.meta["val"] = target.meta["val"][index]
        _repoint(cache_op, second, 1)
        graph.erase_node(q_kv)
        graph.erase_node(cache_op)
        done.append(Rewritten("q_a_norm_kv_then_q_indexer_kv", module, location, before,
                              nodes_region([first, second]), (first, second)))  # fmt: skip
    return done


MLA_DECODE_REGROUP = Fusion(
    name="mla_decode_regroup",
    summary="V3.2 decode: q_a_layernorm + mla_q_kv_rope + the indexer / KV write launch -> two launches",
    doc="""DeepSeek V3.2's pre-attention launches at decode, regrouped by what they wait for.

    Unfused: x = fusion_passes.rms_norm(q_a, ...)                  (q_a_layernorm; q_b_proj reads it)
             query, kv_n, k_pe = fusion_passes.mla_q_kv_rope(q_b_proj(x), kv_a, ...)   (waits for q_b_proj)
             iq, icache, kc, vc = fusion_passes.mla_indexer_qk_rope_kv_cache(...)     (after the GEMMs)
             three launches a layer
    Fused:   x, kv_n, k_pe = fusion_passes.mla_q_a_kv_norm_rope(q_a, ..., kv_a, ...)    (before the up-projections)
             query, iq, icache, kc, vc = fusion_passes.mla_q_indexer_kv_cache(q_b_proj(x), ...)
             two launches; the kv branch, MLA's query and the caches bit for bit the kernels' they
             replace, q_a's norm by the kv branch's norm rows (within two ulps of rms_norm's reference).
    A rewrite (Fusion.rewrite) pairing each layer's ops in graph order.""",
    spellings=(),
    example_inputs=lambda: (),
    rewrite=regroup_decode_launches,
    requires=("mla_indexer_qk_rope_kv_cache",),
    applies_to=lambda graph: bool(graph.find_nodes(op="call_function", target=_QK_KV_CACHE)),
    builtin=True,
)

FUSIONS = (
    MLA_KV_NORM_ROPE,
    MLA_KV_NORM_ROPE_ROTATE_HALF,
    # The indexer key first: its unsqueezed [B, S, 1, D] rope + cat also has the indexer q's shape.
    MLA_INDEXER_K_NORM_ROPE,
    MLA_Q_ROPE,
    MLA_INDEXER_Q_ROPE,
    # After both of the ops they merge.
    MLA_Q_KV_ROPE,
    MLA_Q_KV_ROPE_ROTATE_HALF,
    # After the indexer key's op, which its patterns start from.
    MLA_INDEXER_K_NORM_ROPE_CACHE,
    MLA_KV_CACHE_WRITE,
    # After the indexer's q and key ops, and the key's cache fold, which their spellings start from.
    MLA_INDEXER_QK_ROPE,
    MLA_INDEXER_QK_ROPE_CACHE,
    # After both ops it merges.
    MLA_INDEXER_QK_ROPE_KV_CACHE,
    # After that merge and mla_q_kv_rope, whose ops it regroups.
    MLA_DECODE_REGROUP,
)
