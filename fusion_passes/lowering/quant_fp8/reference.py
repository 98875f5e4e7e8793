"""Plain-torch reference of FP8 (float8_e4m3fn) activation quantization: the single statement of
its math, for the canonical op ``fusion_passes::quant_fp8`` and for every fused "... + FP8
quantization" op (common/fp8.py's ``quant_fp8_reference`` calls ``quantize``).

Unfused (one of many spellings; patterns/quant_fp8.py lists those raised):
    amax = x.abs().amax(-1, keepdim=True); s = (amax / 448).clamp(min=floor)
    q = (x.float() / s).clamp(-448, 448).to(torch.float8_e4m3fn)
Fused:   q, s = fusion_passes.quant_fp8(x, *QuantFP8(...))

Each step below is the torch operation a spelling runs, in its dtype, so the reference gives the
spelling's codes and scales bit for bit (eager, same device): ``fp8_max / amax`` is evaluated by
torch as ``amax.reciprocal() * fp8_max`` and ``x * (1 / s)`` as ``x * s.reciprocal()``, so they
are written so here; the amax is exact in any dtype (a max of the values), so it is taken once.
"""

from __future__ import annotations

import torch

from fusion_passes.lowering.common.fp8 import FP8_DTYPE, QuantFP8, ue8m0


def _amax(x: torch.Tensor, quant: QuantFP8) -> torch.Tensor:
    """max |x| per row ([..., 1]), per group ([..., N / G, 1]) or over the tensor ([]), in x's dtype."""
    if quant.scheme == "per_tensor":
        return x.abs().amax()
    if quant.scheme == "per_group":
        x = x.unflatten(-1, (-1, quant.group_size))
    return x.abs().amax(-1, keepdim=True)


def computed_scales(x: torch.Tensor, quant: QuantFP8) -> torch.Tensor:
    """The dynamic schemes' fp32 scales of x, shaped for broadcasting against x (per_group:
    [..., N / G, 1] against x grouped); see QuantFP8 for the steps."""
    math = quant.scale_math
    dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(math, x.dtype)
    a = _amax(x, quant).to(dtype)
    if quant.floor_site == "amax":
        a = a.clamp(min=quant.floor)
    if math == "input_amax":
        a = a.to(torch.float32)
    s = a.reciprocal() * quant.fp8_max if quant.apply == "multiplier" else a / quant.fp8_max
    s = s.to(torch.float32)
    if quant.pow2 == "ceil":
        s = torch.exp2(torch.ceil(torch.log2(s)))
    elif quant.pow2 == "floor":
        s = torch.exp2(torch.floor(torch.log2(s)))
    if quant.floor_site == "scale":
        s = s.clamp(min=quant.floor)
    if quant.scale_ue8m0:
        s = ue8m0(s)
    return s


def apply_scale(x32: torch.Tensor, s: torch.Tensor, quant: QuantFP8) -> torch.Tensor:
    """The codes of fp32 x32 under scales s (broadcasting against it)."""
    if quant.apply == "divide":
        q = x32 / s
    elif quant.apply == "reciprocal":
        q = x32 * s.reciprocal()
    else:
        q = x32 * s
    if quant.saturate:
        q = q.clamp(-quant.fp8_max, quant.fp8_max)
    return q.to(FP8_DTYPE)


def quantize(x: torch.Tensor, quant: QuantFP8) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize x along its last dim to float8_e4m3fn; returns (codes, scales)."""
    quant.check(x)
    x32 = x.to(torch.float32)
    if quant.scheme == "static":
        return apply_scale(x32, quant.scale, quant), quant.scale
    s = computed_scales(x, quant)
    if quant.scheme == "per_group":
        q = apply_scale(x32.unflatten(-1, (-1, quant.group_size)), s, quant)
        return q.flatten(-2), s.squeeze(-1)
    return apply_scale(x32, s, quant), s


def quant_fp8_reference(
    x: torch.Tensor,
    scheme: str,
    scale: torch.Tensor | None,
    group_size: int,
    scale_ue8m0: bool,
    floor_site: str,
    floor: float,
    apply: str,
    pow2: str,
    saturate: bool,
    fp8_max: float,
    scale_math: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 quantization of x along its last dim: (codes, scales); the arguments are QuantFP8's
    fields, in its order, none defaulted (a traced call then always holds every one, so the
    region fusions' patterns bind each). The static scheme returns a copy of its scale. Bad
    arguments raise in ``quantize`` (QuantFP8.check), so the op needs no check of its own."""
    quant = QuantFP8(scheme, scale, group_size, scale_ue8m0, floor_site, floor, apply, pow2, saturate,
                     fp8_max, scale_math)  # fmt: skip
    q, s = quantize(x, quant)
    return q, quant.own(s)
