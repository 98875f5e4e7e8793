"""Plain-torch reference of the RMSNorm family: the single statement of its math.

Two flags say where a model spelling rounds, so that one op reproduces every spelling bit for bit:

    r = x + residual                       add_rms_norm only; rounded to x.dtype, as the model does
    n = f32(r) * rsqrt(mean(f32(r)^2, dim=-1) + eps)
        residual_in_fp32=True (vLLM's native forward): s = f32(x) + f32(residual) is normalised
        unrounded, n = s * rsqrt(mean(s^2) + eps), and r = s.to(x.dtype) is the new residual

    cast_before_weight=True   (Llama form: DeepSeek V3/V3.2, Qwen 3, MiniMax-M2)
        y = weight * n.to(x.dtype)          the normalised value is rounded, then scaled in x.dtype
    cast_before_weight=False  (F.rms_norm / nn.RMSNorm; Qwen3-Next / Qwen 3.5 with weight_offset=1)
        y = (n * (f32(weight) + weight_offset)).to(x.dtype)     scaled in fp32, rounded once

In fp32 graphs the two forms coincide.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class RMSNormForm(NamedTuple):
    """The scalars that say how a spelling normalises and rounds, in the ops' schema order (so
    ``op(x, weight, *norm)`` calls an op with them): the ops that extend a norm (FP8
    quantization, the allreduce) take them as one value."""

    eps: float  # added to mean(r^2) before the rsqrt
    weight_offset: float = 0.0  # the (1 + w) form's 1.0 (fp32-weight form only)
    cast_before_weight: bool = False  # Llama form: n rounded to x.dtype before the weight


def check_rms_norm_args(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_offset: float,
    cast_before_weight: bool,
    residual: torch.Tensor | None = None,
) -> None:
    """Raise ValueError (one line) for inputs the canonical op does not define."""
    if x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"rms_norm: x must be float32/bfloat16/float16, got {x.dtype}")
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(
            f"rms_norm: weight must have shape ({x.shape[-1]},), got {tuple(weight.shape)}"
        )
    if weight.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"rms_norm: weight must be float32/bfloat16/float16, got {weight.dtype}")
    if cast_before_weight and weight.dtype != x.dtype:
        # weight * n.to(x.dtype) would promote to weight's dtype: a different op.
        raise ValueError(
            f"rms_norm: the Llama form needs weight in x's dtype ({x.dtype}), got {weight.dtype}"
        )
    if cast_before_weight and weight_offset != 0.0:
        raise ValueError("rms_norm: weight_offset is only defined for the fp32-weight form")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(
            f"add_rms_norm: residual must match x ({tuple(x.shape)}, {x.dtype}), "
            f"got ({tuple(residual.shape)}, {residual.dtype})"
        )


def rms_norm_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    weight_offset: float = 0.0,
    cast_before_weight: bool = False,
) -> torch.Tensor:
    """Reference RMSNorm over the last dim (see the module docstring for the two forms)."""
    return _normalize(x.to(torch.float32), weight, eps, weight_offset, cast_before_weight, x.dtype)


def _normalize(h, weight, eps, weight_offset, cast_before_weight, dtype):
    """The norm of fp32 rows h, scaled and rounded to ``dtype`` in the form's order."""
    n = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if cast_before_weight:
        return weight * n.to(dtype)
    w = weight.to(torch.float32)
    if weight_offset != 0.0:
        w = w + weight_offset
    return (n * w).to(dtype)


def add_rms_norm_reference(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    weight_offset: float = 0.0,
    cast_before_weight: bool = False,
    residual_in_fp32: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference residual add + RMSNorm: returns (normed, new_residual = x + residual); with
    ``residual_in_fp32`` the fp32 sum is normalised before its rounding (module docstring)."""
    if residual_in_fp32:
        s = x.to(torch.float32) + residual.to(torch.float32)
        normed = _normalize(s, weight, eps, weight_offset, cast_before_weight, x.dtype)
        return normed, s.to(x.dtype)
    new_residual = x + residual
    return (
        rms_norm_reference(new_residual, weight, eps, weight_offset, cast_before_weight),
        new_residual,
    )
