"""The canonical ops of DeepSeek V3 / V3.2's pre-attention path (MLA and the V3.2 indexer).

Unfused (HF DeepseekV3Attention / DeepseekV32Indexer, after the RMSNorm fusion):
    kv_nope, k_pe = split(kv_a_proj_with_mqa(h), [R, P]); kv_nope = rms_norm(kv_nope)
    q_pass, q_pe = split(q_b_proj(...).view(B, S, H, D).transpose(1, 2), [D - P, P])
    q_pe, k_pe = rope(q_pe), rope(k_pe); query = cat(q_pass, q_pe)
    indexer: k = layer_norm(wk(h)); k = cat(rope(k[..., :P]), k[..., P:]); q likewise, no norm
Fused:
    kv_nope, k_pe = mla_kv_norm_rope(kv, w, cos, sin, eps, weight_offset, cast, interleave)
    query         = mla_q_rope(q, cos, sin, rope_first, interleave, heads_first)
    k             = mla_indexer_k_norm_rope(k, w, b, cos, sin, eps, interleave)
    query, kv_nope, k_pe = mla_q_kv_rope(q, kv, w, cos, sin, eps, ...): MLA's q and kv branches in
                    one launch (the mla_q_kv_rope fusion merges the two ops above: at decode
                    each launch is most of its branch's time)

Why these three: each is one branch between a GEMM and its consumer, and one kernel that reads
the GEMM's output once. The kv op keeps both of kv's slices in one kernel (the latent feeds
kv_b_proj, k_pe the key); the q op serves MLA's q_pe (rope last, written [B, H, S, D] as SDPA
reads it) and the indexer's q (rope first, [B, S, H, D]) with two flags; the indexer key needs its
own op because its norm is a LayerNorm whose output is rotated. The key assembly
(cat(k_nope, k_pe.expand(H))) after kv_b_proj stays one Inductor copy kernel, fused with the KV
cache write. The indexer key goes into its own cache at decode:
    indexer_keys = mla_indexer_k_norm_rope_cache(k, w, b, cos, sin, indexer_keys, positions, eps, interleave)
one kernel writing the rows into the cache's slots instead of a new tensor that a second kernel
copies there. And V3.2's key (k_nope from kv_b_proj, k_pe shared by the heads) and value go into
the KV cache in one kernel, not a kernel per cache:
    k_cache, v_cache = mla_kv_cache_write(k_nope, k_pe, value, k_cache, v_cache, positions)
The indexer's two RoPE branches (they share cos and sin) go in one launch too:
    query, k = mla_indexer_qk_rope(q, k, w, b, cos, sin, cache, positions, eps, interleave)
(with a cache: the cache with the key written, as mla_indexer_k_norm_rope_cache), and at decode
with MLA's KV cache write as well (a step's launches after its GEMMs: the indexer's and the KV
cache's, which read no output of each other):
    query, cache, k_cache, v_cache = mla_indexer_qk_rope_kv_cache(q, k, w, b, cos, sin, cache, positions,
                                         k_nope, k_pe, value, k_cache, v_cache, kv_positions, eps, interleave)

The math lives in ``mla_rope_reference``; CUDA tensors go to the kernels of ``mla_rope_triton``.
"""

from __future__ import annotations

import torch

from fusion_passes.lowering.common.direct_launch import register_launcher
from fusion_passes.lowering.common.ops import op_from_reference
from fusion_passes.lowering.mla_rope.reference import (
    check_indexer_k_cache_args,
    check_mla_indexer_qk_args,
    check_mla_kv_cache_write_args,
    mla_indexer_k_norm_rope_cache_reference,
    mla_indexer_k_norm_rope_reference,
    mla_indexer_qk_rope_kv_cache_reference,
    mla_indexer_qk_rope_reference,
    mla_q_a_kv_norm_rope_reference,
    mla_q_indexer_kv_cache_reference,
    mla_kv_cache_write_reference,
    mla_kv_norm_rope_reference,
    mla_q_kv_rope_reference,
    mla_q_rope_reference,
    rope_dim,
)


# Each op is its reference (which checks its arguments), outputs made contiguous:
#   mla_kv_norm_rope          (rms_norm(kv[..., :R]), rope(kv[..., R:]))
#   mla_q_rope                q [*lead, H, D] with RoPE on its rope slice, [..., H, S, D] when heads_first
#   mla_q_kv_rope             (query [..., H, S, D], normed [..., R], k_pe [..., P]): mla_q_rope
#                             (MLA's form) and mla_kv_norm_rope in one launch
#   mla_indexer_k_norm_rope   LayerNorm of k, then RoPE on its first P dims
#   mla_indexer_k_norm_rope_cache   the same keys written into the indexer's key cache (the new
#                             cache returned; on CUDA, launched by Inductor, written in place)
mla_kv_norm_rope = op_from_reference("mla_kv_norm_rope", mla_kv_norm_rope_reference)
mla_q_rope = op_from_reference("mla_q_rope", mla_q_rope_reference)
mla_q_kv_rope = op_from_reference("mla_q_kv_rope", mla_q_kv_rope_reference)
mla_indexer_k_norm_rope = op_from_reference("mla_indexer_k_norm_rope", mla_indexer_k_norm_rope_reference)
mla_indexer_k_norm_rope_cache = op_from_reference(
    "mla_indexer_k_norm_rope_cache", mla_indexer_k_norm_rope_cache_reference
)
#   mla_kv_cache_write        MLA's key (cat of k_nope and the shared k_pe) and value written into
#                             the KV cache (both caches returned; on CUDA, inlined, in place)
mla_kv_cache_write = op_from_reference("mla_kv_cache_write", mla_kv_cache_write_reference)
#   mla_indexer_qk_rope       the indexer's query RoPE and key (or key into its cache) in one launch
mla_indexer_qk_rope = op_from_reference("mla_indexer_qk_rope", mla_indexer_qk_rope_reference)
#   mla_indexer_qk_rope_kv_cache   that op into the indexer's cache and mla_kv_cache_write in one launch
mla_indexer_qk_rope_kv_cache = op_from_reference("mla_indexer_qk_rope_kv_cache", mla_indexer_qk_rope_kv_cache_reference)
#   mla_q_a_kv_norm_rope      q_a_layernorm (a canonical rms_norm) and mla_kv_norm_rope in one launch
#   mla_q_indexer_kv_cache    MLA's query RoPE and mla_indexer_qk_rope_kv_cache in one launch
mla_q_a_kv_norm_rope = op_from_reference("mla_q_a_kv_norm_rope", mla_q_a_kv_norm_rope_reference)
mla_q_indexer_kv_cache = op_from_reference("mla_q_indexer_kv_cache", mla_q_indexer_kv_cache_reference)


# The CUDA kernels double as direct launchers (`wrap` given when Inductor inlines the launch).
@mla_kv_norm_rope.register_kernel("cuda")
@register_launcher(torch.ops.fusion_passes.mla_kv_norm_rope.default)
def _mla_kv_norm_rope_cuda(*args, wrap=None):
    from fusion_passes.lowering.mla_rope.triton import mla_kv_norm_rope_triton

    return mla_kv_norm_rope_triton(*args, wrap=wrap)


@mla_q_rope.register_kernel("cuda")
@register_launcher(torch.ops.fusion_passes.mla_q_rope.default)
def _mla_q_rope_cuda(*args, wrap=None):
    from fusion_passes.lowering.mla_rope.triton import mla_q_rope_triton

    return mla_q_rope_triton(*args, wrap=wrap)


@mla_q_kv_rope.register_kernel("cuda")
@register_launcher(torch.ops.fusion_passes.mla_q_kv_rope.default)
def _mla_q_kv_rope_cuda(*args, wrap=None):
    from fusion_passes.lowering.mla_rope.triton import mla_q_kv_rope_triton

    return mla_q_kv_rope_triton(*args, wrap=wrap)


@mla_indexer_k_norm_rope.register_kernel("cuda")
@register_launcher(torch.ops.fusion_passes.mla_indexer_k_norm_rope.default)
def _mla_indexer_k_norm_rope_cuda(*args, wrap=None):
    from fusion_passes.lowering.mla_rope.triton import mla_indexer_k_norm_rope_triton

    return mla_indexer_k_norm_rope_triton(*args, wrap=wrap)


# The cache (argument 5) is written in place only when the launch is inlined (wrap given), else
# into a copy (a dispatcher call is functional).
@mla_indexer_k_norm_rope_cache.register_kernel("cuda")
@register_launcher(torch.ops.fusion_passes.mla_indexer_k_norm_rope_cache.default, writes_inputs=(5,))
def _mla_indexer_k_norm_rope_cache_cuda(*args, wrap=None):
    from fusion_passes.lowering.mla_rope.triton import mla_indexer_k_norm_rope_cache_triton

    return mla_indexer_k_norm_rope_cache_triton(*args, wrap=wrap)


# The cache (argument 6), where given, is written in place only when the launch is inlined.
@mla_indexer_qk_rope.register_kernel("cuda")
@register_launcher(torch.ops.fusion_passes.mla_indexer_qk_rope.default, writes_inputs=(6,))
def _mla_indexer_qk_rope_cuda(*args, wrap=None):
    from fusion_passes.lowering.mla_rope.triton import mla_indexer_qk_rope_triton

    return mla_indexer_qk_rope_triton(*args, wrap=wrap)


@mla_indexer_qk_rope_kv_cache.register_kernel("cuda")
@register_launcher(torch.ops.fusion_passes.mla_indexer_qk_rope_kv_cache.default, writes_inputs=(6, 11, 12))
def _mla_indexer_qk_rope_kv_cache_cuda(*args, wrap=None):
    from fusion_passes.lowering.mla_rope.triton import mla_indexer_qk_rope_kv_cache_triton

    return mla_indexer_qk_rope_kv_cache_triton(*args, wrap=wrap)


@mla_q_a_kv_norm_rope.register_kernel("cuda")
@register_launcher(torch.ops.fusion_passes.mla_q_a_kv_norm_rope.default)
def _mla_q_a_kv_norm_rope_cuda(*args, wrap=None):
    from fusion_passes.lowering.mla_rope.triton import mla_q_a_kv_norm_rope_triton

    return mla_q_a_kv_norm_rope_triton(*args, wrap=wrap)


@mla_q_indexer_kv_cache.register_kernel("cuda")
@register_launcher(torch.ops.fusion_passes.mla_q_indexer_kv_cache.default, writes_inputs=(10, 15, 16))
def _mla_q_indexer_kv_cache_cuda(*args, wrap=None):
    from fusion_passes.lowering.mla_rope.triton import mla_q_indexer_kv_cache_triton

    return mla_q_indexer_kv_cache_triton(*args, wrap=wrap)


@mla_kv_cache_write.register_kernel("cuda")
@register_launcher(torch.ops.fusion_passes.mla_kv_cache_write.default, writes_inputs=(3, 4))
def _mla_kv_cache_write_cuda(*args, wrap=None):
    from fusion_passes.lowering.mla_rope.triton import mla_kv_cache_write_triton

    return mla_kv_cache_write_triton(*args, wrap=wrap)


@mla_kv_norm_rope.register_fake
def _mla_kv_norm_rope_fake(kv, weight, cos, sin, eps, weight_offset=0.0, cast_before_weight=True, interleave=True):
    p = rope_dim(cos, interleave)
    lead = kv.shape[:-1]
    return kv.new_empty((*lead, kv.shape[-1] - p)), kv.new_empty((*lead, p))


@mla_q_rope.register_fake
def _mla_q_rope_fake(q, cos, sin, rope_first=False, interleave=True, heads_first=True):
    if heads_first:
        *batch, s, h, d = q.shape
        return q.new_empty((*batch, h, s, d))
    return q.new_empty(q.shape)


@mla_q_kv_rope.register_fake
def _mla_q_kv_rope_fake(q, kv, weight, cos, sin, eps, weight_offset=0.0, cast_before_weight=True, interleave=True):
    normed, k_pe = _mla_kv_norm_rope_fake(kv, weight, cos, sin, eps, weight_offset, cast_before_weight, interleave)
    return _mla_q_rope_fake(q, cos, sin, False, interleave, True), normed, k_pe


@mla_indexer_k_norm_rope.register_fake
def _mla_indexer_k_norm_rope_fake(k, *args):
    return k.new_empty(k.shape)


@mla_indexer_k_norm_rope_cache.register_fake
def _mla_indexer_k_norm_rope_cache_fake(k, weight, bias, cos, sin, cache, positions, eps, interleave=False):
    check_indexer_k_cache_args(k, weight, bias, cos, sin, cache, positions, interleave)
    return torch.empty_like(cache, memory_format=torch.contiguous_format)


@mla_kv_cache_write.register_fake
def _mla_kv_cache_write_fake(k_nope, k_pe, value, k_cache, v_cache, positions):
    check_mla_kv_cache_write_args(k_nope, k_pe, value, k_cache, v_cache, positions)
    return (torch.empty_like(k_cache, memory_format=torch.contiguous_format),
            torch.empty_like(v_cache, memory_format=torch.contiguous_format))  # fmt: skip


@mla_indexer_qk_rope.register_fake
def _mla_indexer_qk_rope_fake(q, k, weight, bias, cos, sin, cache, positions, eps, interleave=False):
    check_mla_indexer_qk_args(q, k, weight, bias, cos, sin, cache, positions, interleave)
    keys = k.new_empty(k.shape) if cache is None else torch.empty_like(cache, memory_format=torch.contiguous_format)
    return q.new_empty(q.shape), keys


@mla_indexer_qk_rope_kv_cache.register_fake
def _mla_indexer_qk_rope_kv_cache_fake(q, k, weight, bias, cos, sin, cache, positions, k_nope, k_pe, value, k_cache,
                                       v_cache, kv_positions, eps, interleave=False):  # fmt: skip
    query, keys = _mla_indexer_qk_rope_fake(q, k, weight, bias, cos, sin, cache, positions, eps, interleave)
    return (query, keys, *_mla_kv_cache_write_fake(k_nope, k_pe, value, k_cache, v_cache, kv_positions))


@mla_q_a_kv_norm_rope.register_fake
def _mla_q_a_kv_norm_rope_fake(x, x_weight, x_eps, x_weight_offset, x_cast_before_weight, kv, weight, cos, sin, eps,
                               weight_offset=0.0, cast_before_weight=True, interleave=True):  # fmt: skip
    normed, k_pe = _mla_kv_norm_rope_fake(kv, weight, cos, sin, eps, weight_offset, cast_before_weight, interleave)
    return x.new_empty(x.shape), normed, k_pe


@mla_q_indexer_kv_cache.register_fake
def _mla_q_indexer_kv_cache_fake(mq, mq_cos, mq_sin, mq_interleave, q, k, weight, bias, cos, sin, cache, positions,
                                 k_nope, k_pe, value, k_cache, v_cache, kv_positions, eps, interleave=False):  # fmt: skip
    rest = _mla_indexer_qk_rope_kv_cache_fake(q, k, weight, bias, cos, sin, cache, positions, k_nope, k_pe, value,
                                              k_cache, v_cache, kv_positions, eps, interleave)  # fmt: skip
    return (_mla_q_rope_fake(mq, mq_cos, mq_sin, False, mq_interleave, True), *rest)
