"""The canonical op ``fusion_passes::qk_norm_rope``: q/k RMSNorm + RoPE before attention.

Unfused (after the raise stage): rms_norm(q), rms_norm(k), views / transposes, then
    rope(q, cos, sin, interleaved, compute_fp32), rope(k, ...)   (canonical ops, see patterns/)
Fused:
    q_out, k_out = qk_norm_rope(q, k, q_weight, k_weight, cos, sin, eps, weight_offset,
                                cast_before_weight, norm_per_head, interleaved)
the RoPE computed in cos's dtype (q's, or fp32 for the compute_fp32 form). At decode, with the
KV cache writes of k and v (transformers' StaticLayer.update):
    q_out, k_cache, v_cache = qk_norm_rope_cache(q, k, v, q_weight, k_weight, cos, sin, k_cache,
                                                 v_cache, positions, eps, ...)

q [B, S, Hq, D] and k [B, S, Hk, D] are the projections' outputs (any strides: Qwen 3.5's q is a
chunk of the q+gate projection); the rotary dim R is cos.shape[-1] (transformers reads it there
too, so a separate argument could only disagree with it). The outputs are [B, H, S, D]
transposes of new contiguous [B, S, H, D] tensors. The math lives in ``qk_norm_rope_reference``;
CUDA tensors go to the Triton kernel of ``qk_norm_rope_triton``.
"""

from __future__ import annotations

import torch

from fusion_passes.lowering.common.direct_launch import register_launcher
from fusion_passes.lowering.common.ops import op_from_reference
from fusion_passes.lowering.qk_norm_rope.reference import (
    check_qk_norm_rope_args,
    check_qk_norm_rope_cache_args,
    qk_norm_rope_cache_reference,
    qk_norm_rope_reference,
)


# QK-norm + RoPE; see qk_norm_rope_reference for the math and the rounding points (it checks its
# arguments). Its outputs are transposed views of new tensors, as the fake kernel states.
qk_norm_rope = op_from_reference("qk_norm_rope", qk_norm_rope_reference, contiguous=False)
# The same with k and v written into the KV cache (the new caches returned; on CUDA, launched by
# Inductor, written in place): (q_out, k_cache, v_cache).
qk_norm_rope_cache = op_from_reference("qk_norm_rope_cache", qk_norm_rope_cache_reference, contiguous=False)


# The CUDA kernel doubles as the direct launcher (`wrap` given when Inductor inlines the launch).
@qk_norm_rope.register_kernel("cuda")
@register_launcher(torch.ops.fusion_passes.qk_norm_rope.default)
def _qk_norm_rope_cuda(*args, wrap=None):
    from fusion_passes.lowering.qk_norm_rope.triton import qk_norm_rope_triton

    return qk_norm_rope_triton(*args, wrap=wrap)


# The caches (arguments 7 and 8) are written in place only when the launch is inlined (wrap given).
@qk_norm_rope_cache.register_kernel("cuda")
@register_launcher(torch.ops.fusion_passes.qk_norm_rope_cache.default, writes_inputs=(7, 8))
def _qk_norm_rope_cache_cuda(*args, wrap=None):
    from fusion_passes.lowering.qk_norm_rope.triton import qk_norm_rope_cache_triton

    return qk_norm_rope_cache_triton(*args, wrap=wrap)


def _transposed_output(x: torch.Tensor) -> torch.Tensor:
    b, s, h, d = x.shape
    return x.new_empty((b, s, h, d)).transpose(1, 2)


@qk_norm_rope.register_fake
def _qk_norm_rope_fake(q, k, q_weight, k_weight, cos, sin, eps, *form):
    check_qk_norm_rope_args(q, k, q_weight, k_weight, cos, sin, *form)
    return _transposed_output(q), _transposed_output(k)


@qk_norm_rope_cache.register_fake
def _qk_norm_rope_cache_fake(q, k, v, q_weight, k_weight, cos, sin, k_cache, v_cache, positions, eps, *form):
    check_qk_norm_rope_cache_args(q, k, v, q_weight, k_weight, cos, sin, k_cache, v_cache, positions, *form)
    return (_transposed_output(q), torch.empty_like(k_cache, memory_format=torch.contiguous_format),
            torch.empty_like(v_cache, memory_format=torch.contiguous_format))  # fmt: skip
