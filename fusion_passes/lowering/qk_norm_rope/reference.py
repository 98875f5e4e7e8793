"""Plain-torch reference of ``qk_norm_rope``: the single statement of its math.

Between the QKV projection and attention, q and k are RMS-normalised and rotated:

    per head   (norm_per_head=True:  Qwen3, Qwen3-MoE, Qwen3-Next, Qwen 3.5, Qwen 3.5-MoE)
        y = rms_norm(x, w, eps, weight_offset, cast_before_weight)       x: [B, S, H, D], w: [D]
    whole row  (norm_per_head=False: MiniMax-M2, all heads of a token together)
        y = rms_norm(x.reshape(B, S, H * D), w, ...).reshape(B, S, H, D)  w: [H * D]
    then RoPE on the first R = cos.shape[-1] dims of every head, the rest passed through: the
    canonical ``rope`` op's math (lowering/rope/reference.py), rotate_half's pairs (j, j + R/2)
    or GPT-J's (2j, 2j + 1) (interleaved), in cos's dtype: x.dtype as transformers computes it
    (each product and the sum rounded to x.dtype), or fp32 (fp32 cos / sin: Olmo2's and gpt-fast's
    fp32 math, rounded once at the end). For a pair (a, b) = (y[lo], y[hi]):
        out[lo] = a * cos[lo] + (-b) * sin[lo]
        out[hi] = b * cos[hi] + a * sin[hi]
        out[R:] = y[R:]
    returned as [B, H, S, D] (what attention consumes): a transpose(1, 2) view of a new
    contiguous [B, S, H, D] tensor, so the kernel writes each token's heads in one run.

cos / sin are [B or 1, S, R] in x.dtype or float32, one value per rotated element (transformers
casts them to the activations' dtype once per step; Qwen 3.5's interleaved MRoPE sections are already folded into them, so the op never sees
sections). The norm's two rounding forms are rms_norm_reference's.
"""

from __future__ import annotations

import torch

from fusion_passes.lowering.common.cache_slots import cache_slots, check_kv_caches
from fusion_passes.lowering.rope.reference import rope_reference
from fusion_passes.lowering.rms_norm.reference import (
    SUPPORTED_DTYPES,
    check_rms_norm_args,
    rms_norm_reference,
)


def check_qk_norm_rope_args(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    weight_offset: float = 0.0,
    cast_before_weight: bool = True,
    norm_per_head: bool = True,
    interleaved: bool = False,
) -> None:
    """Raise ValueError (one line) for inputs the canonical op does not define."""
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(
            f"qk_norm_rope: q and k must be [B, S, H, D], got {tuple(q.shape)} and {tuple(k.shape)}"
        )
    if q.dtype not in SUPPORTED_DTYPES or k.dtype != q.dtype:
        raise ValueError(
            f"qk_norm_rope: q and k must share one of float32/bfloat16/float16, got {q.dtype}, {k.dtype}"
        )
    b, s, _, d = q.shape
    if (k.shape[0], k.shape[1], k.shape[3]) != (b, s, d):
        raise ValueError(
            f"qk_norm_rope: k {tuple(k.shape)} must share q's batch, tokens and head dim {tuple(q.shape)}"
        )
    if cos.dim() != 3 or sin.shape != cos.shape:
        raise ValueError(
            f"qk_norm_rope: cos and sin must both be [B, S, R], got {tuple(cos.shape)} and {tuple(sin.shape)}"
        )
    if cos.dtype not in (q.dtype, torch.float32) or sin.dtype != cos.dtype:
        # The RoPE runs in cos's dtype: q's, or fp32 (rounded once at the end).
        raise ValueError(
            f"qk_norm_rope: cos/sin must be in q's dtype {q.dtype} or float32, got {cos.dtype}/{sin.dtype}"
        )
    r = cos.shape[-1]
    if cos.shape[0] not in (1, b) or cos.shape[1] != s or r % 2 or not 2 <= r <= d:
        raise ValueError(
            f"qk_norm_rope: cos/sin {tuple(cos.shape)} must be [{b} or 1, {s}, R] with R even, <= {d}"
        )
    for name, x, w in (("q", q, q_weight), ("k", k, k_weight)):
        width = d if norm_per_head else x.shape[2] * d
        try:
            check_rms_norm_args(x.new_empty((1, width)), w, weight_offset, cast_before_weight)
        except ValueError as e:
            raise ValueError(f"qk_norm_rope ({name}): {e}") from None


def _rope(y: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """RoPE on the first cos.shape[-1] dims of y [B, H, S, D] in cos's dtype (y's or fp32);
    cos/sin are [B or 1, S, R]."""
    compute_fp32 = cos.dtype != y.dtype
    return rope_reference(y, cos.unsqueeze(1), sin.unsqueeze(1), interleaved, compute_fp32)


def _branch(x, weight, cos, sin, eps, weight_offset, cast_before_weight, norm_per_head, interleaved):
    b, s, h, d = x.shape
    rows = x if norm_per_head else x.reshape(b, s, h * d)
    y = rms_norm_reference(rows, weight, eps, weight_offset, cast_before_weight)
    out = torch.empty((b, s, h, d), dtype=x.dtype, device=x.device).transpose(1, 2)
    out.copy_(_rope(y.reshape(b, s, h, d).transpose(1, 2), cos, sin, interleaved))
    return out


def qk_norm_rope_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    weight_offset: float = 0.0,
    cast_before_weight: bool = True,
    norm_per_head: bool = True,
    interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference QK-norm + RoPE (see the module docstring): returns (q_out, k_out), each
    [B, H, S, D] with the strides of a contiguous [B, S, H, D] tensor."""
    check_qk_norm_rope_args(
        q, k, q_weight, k_weight, cos, sin, weight_offset, cast_before_weight, norm_per_head,
        interleaved,
    )
    args = (cos, sin, eps, weight_offset, cast_before_weight, norm_per_head, interleaved)
    return _branch(q, q_weight, *args), _branch(k, k_weight, *args)


def check_qk_norm_rope_cache_args(q, k, v, q_weight, k_weight, cos, sin, k_cache, v_cache, positions,
                                  weight_offset=0.0, cast_before_weight=True, norm_per_head=True,
                                  interleaved=False) -> None:  # fmt: skip
    """Raise ValueError (one line) for inputs qk_norm_rope_cache does not define."""
    check_qk_norm_rope_args(q, k, q_weight, k_weight, cos, sin, weight_offset, cast_before_weight, norm_per_head,
                            interleaved)  # fmt: skip
    name = "qk_norm_rope_cache"
    b, s, hk, d = k.shape
    if v.dim() != 4 or tuple(v.shape[:3]) != (b, s, hk) or v.dtype != k.dtype:
        raise ValueError(f"{name}: v [{b}, {s}, {hk}, Dv] {k.dtype} expected, got {tuple(v.shape)} {v.dtype}")
    check_kv_caches(name, k_cache, v_cache, b, hk, d, v.shape[3], k.dtype, positions, s)


def qk_norm_rope_cache_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    positions: torch.Tensor,
    eps: float,
    weight_offset: float = 0.0,
    cast_before_weight: bool = True,
    norm_per_head: bool = True,
    interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q_out, k_cache, v_cache): qk_norm_rope's q_out, and the caches [B, Hk, T, *] with its k_out
    and v [B, S, Hk, Dv] (transposed) written at the slots ``cache_slots(positions, S)`` of dim 2,
    as new tensors (transformers' StaticLayer.update: index_copy_ of both)."""
    check_qk_norm_rope_cache_args(q, k, v, q_weight, k_weight, cos, sin, k_cache, v_cache, positions,
                                  weight_offset, cast_before_weight, norm_per_head, interleaved)  # fmt: skip
    q_out, k_out = qk_norm_rope_reference(q, k, q_weight, k_weight, cos, sin, eps, weight_offset,
                                          cast_before_weight, norm_per_head, interleaved)  # fmt: skip
    slots = cache_slots(positions, k.shape[1])
    return q_out, k_cache.index_copy(2, slots, k_out), v_cache.index_copy(2, slots, v.transpose(1, 2))
