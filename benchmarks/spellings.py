"""The unfused code the benchmarks time, written as the models and serving engines write it: the
benchmarks' own copy, independent of the patterns that match it (a pattern module may change its
spellings; what is timed stays the same code).

- transformers' RoPE (apply_rotary_pos_emb, unsqueeze_dim=1), full and partial;
- the FP8 activation quantization of a serving engine's native fallback (divide by the scale,
  saturate, cast), per-tensor static, per-token and per-group of GROUP_SIZE, the dynamic scales
  floored at 1 / (448 * 512) after the divide.
"""

from __future__ import annotations

import torch

from fusion_passes.lowering.common.fp8 import FP8_MAX, MIN_SCALE

GROUP_SIZE = 128  # DeepSeek V3 / V3.2 block-wise activation quantization


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def rope_full(q, k, cos, sin):
    """Qwen3 / Qwen3-MoE (Llama's apply_rotary_pos_emb)."""
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed


def rope_partial(q, k, cos, sin):
    """Qwen3-Next / Qwen 3.5 / MiniMax-M2: rotary on the first cos.shape[-1] dims."""
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    rotary_dim = cos.shape[-1]
    q_rot, q_pass = q[..., :rotary_dim], q[..., rotary_dim:]
    k_rot, k_pass = k[..., :rotary_dim], k[..., rotary_dim:]
    q_embed = (q_rot * cos) + (rotate_half(q_rot) * sin)
    k_embed = (k_rot * cos) + (rotate_half(k_rot) * sin)
    q_embed = torch.cat([q_embed, q_pass], dim=-1)
    k_embed = torch.cat([k_embed, k_pass], dim=-1)
    return q_embed, k_embed


def quant_static(y, scale):
    return (y.to(torch.float32) / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def quant_per_token(y):
    y32 = y.to(torch.float32)
    scale = (y32.abs().amax(-1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)
    return (y32 / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def quant_per_group(y):
    y32 = y.to(torch.float32).unflatten(-1, (-1, GROUP_SIZE))
    scale = (y32.abs().amax(-1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)
    q = (y32 / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.flatten(-2), scale.squeeze(-1)
