"""Plain-torch reference of ``rope``: the single statement of rotary position embedding's math.

One tensor at a time, elementwise along the last dim: the first R = cos.shape[-1] dims of every
row are rotated, the rest passed through. cos and sin are given as the model broadcasts them (any
shape that broadcasts to x[..., :R] without enlarging it: [B, 1, S, R] after the head transpose,
[1, S, 1, R] before it, [T, 1, R] for flat tokens), so x's layout needs no parameter.

    y = x[..., :R] in the compute dtype;  c, s = cos, sin in the compute dtype
    rotate_half (NeoX, interleaved=False):  rot(y) = cat(-y[..., R/2:], y[..., :R/2])
    GPT-J      (interleaved=True):          rot(y) = stack(-y[..., 1::2], y[..., 0::2]).flatten(-2)
    out = cat(to_x_dtype(y * c + rot(y) * s), x[..., R:])

cos and sin hold one value per rotated element, in the style's order: rotate_half reads
cos[..., j] and cos[..., j + R/2] for the pair (j, j + R/2) (transformers' cat((freqs, freqs))),
GPT-J cos[..., 2j] and cos[..., 2j + 1] for the pair (2j, 2j + 1) (GLM's repeat_interleave(2)).
A half-width cache (vLLM, gpt-fast) is widened by the raise rule (cat / repeat_interleave: copies,
so bit-exact).

compute_fp32 says where the model rounds:
    False: every op in x.dtype, each product and the sum rounded (transformers Llama / Qwen3 /
           Gemma / GLM / Phi-3, vLLM's native forward; cos / sin in x.dtype)
    True:  y, c, s upcast to fp32, one rounding at the end (Olmo2's fp32 cos / sin and its cast
           back; gpt-fast's x.float() on a bf16 cache, ``type_as(x)``)
y * c + rot(y) * s is the same rounding as x1 * c - x2 * s (a + (-b) is a - b in IEEE), so every
spelling's sign placement is one form.

Unfused: q * cos + rotate_half(q) * sin                       (2 muls, neg, cat, add: Inductor
         fuses them into its neighbours' kernels)
Fused:   fusion_passes.rope(q, cos, sin, interleaved, compute_fp32)  (a canonical op: consumed by
         the region fusions (qk_norm_rope), else lowered back to this reference)
"""

from __future__ import annotations

import torch

from fusion_passes.lowering.rms_norm.reference import SUPPORTED_DTYPES


def check_rope_args(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleaved: bool = False,
    compute_fp32: bool = False,
) -> int:
    """Raise ValueError (one line) for inputs the op does not define; returns R."""
    if x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"rope: x must be float32/bfloat16/float16, got {x.dtype}")
    if cos.shape != sin.shape or cos.dtype != sin.dtype:
        raise ValueError(
            f"rope: cos {tuple(cos.shape)} {cos.dtype} and sin {tuple(sin.shape)} {sin.dtype} differ"
        )
    if cos.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"rope: cos/sin must be float32/bfloat16/float16, got {cos.dtype}")
    if not compute_fp32 and cos.dtype != x.dtype:
        # x * cos would promote to cos's dtype: that is the compute_fp32 form.
        raise ValueError(f"rope: cos/sin must be in x's dtype {x.dtype} unless compute_fp32, got {cos.dtype}")
    if x.dim() == 0 or cos.dim() == 0:
        raise ValueError(f"rope: x {tuple(x.shape)} and cos {tuple(cos.shape)} need a last dim")
    r, d = cos.shape[-1], x.shape[-1]
    if r % 2 or not 2 <= r <= d:
        raise ValueError(f"rope: the rotary dim cos.shape[-1] = {r} must be even and in [2, {d}]")
    lead = tuple(x.shape[:-1])
    if cos.dim() > x.dim() or any(
        c not in (1, n) for c, n in zip(reversed(cos.shape[:-1]), reversed(lead))
    ):
        raise ValueError(f"rope: cos/sin {tuple(cos.shape)} do not broadcast to x {tuple(x.shape)}")
    return r


def rope_reference(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleaved: bool = False,
    compute_fp32: bool = False,
) -> torch.Tensor:
    """RoPE of x's first cos.shape[-1] dims (see the module docstring); returns x's shape and
    dtype. Unchecked (the op checks; lower-back traces this on values already checked)."""
    r = cos.shape[-1]
    dtype = torch.float32 if compute_fp32 else x.dtype
    y = x[..., :r].to(dtype)
    c, s = cos.to(dtype), sin.to(dtype)
    if interleaved:
        rotated = torch.stack((-y[..., 1::2], y[..., 0::2]), dim=-1).flatten(-2)
    else:
        rotated = torch.cat((-y[..., r // 2 :], y[..., : r // 2]), dim=-1)
    out = (y * c + rotated * s).to(x.dtype)
    if r == x.shape[-1]:
        return out
    return torch.cat([out, x[..., r:]], dim=-1)
