"""Plain-torch reference of RMSNorm (+ residual add) + FP8 quantization: the single statement of
its math.

Unfused: y = rms_norm(x) (or add_rms_norm), rounded to x.dtype as the model produces it; then an
    amax reduction over y and a scale-and-cast pass writing float8_e4m3fn codes.
Fused:   one pass; the math is the same, in this order:

    y   = rms_norm_reference(x, ...) / add_rms_norm_reference(x, residual, ...)     in x.dtype
    y32 = f32(y)
    static     scale given (fp32, shape [] or [1])
    per_token  scale = max(amax(|y32|, dim=-1) / 448, MIN_SCALE)              shape [..., 1]
    per_group  scale = max(amax(|y32| over each G columns) / 448, MIN_SCALE)  shape [..., N / G]
               scale_ue8m0: scale = 2^ceil(log2(scale))   (power-of-two scales, DeepSeek V3)
    q   = fp8_e4m3fn(clamp(y32 / scale, -448, 448))        rounded to nearest, ties to even

The quantization is a function of its own, ``quant_fp8_reference``, the reference of every
"... + FP8 quantization" op. It divides by the scale (no reciprocal multiply): serving engines'
native fallbacks divide, and the division decides the codes bit for bit.
"""

from __future__ import annotations

import torch

from fusion_passes.lowering.rms_norm.reference import add_rms_norm_reference, rms_norm_reference

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
# Floor of the dynamic scales: an all-zero row or group has amax 0, and a zero scale would turn
# its codes into 0 / 0 = NaN. 1 / (448 * 512) is vLLM's floor for dynamic per-token scales: far
# below any real activation's amax / 448, so it changes nothing else.
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)
SCHEMES = ("static", "per_token", "per_group")


def check_quant_args(
    x: torch.Tensor,
    scheme: str,
    scale: torch.Tensor | None = None,
    group_size: int = 128,
    scale_ue8m0: bool = False,
) -> None:
    """Raise ValueError (one line) for quantization arguments the ops do not define; x is the
    tensor quantized along its last dim (or the op's input of that shape)."""
    if scheme not in SCHEMES:
        raise ValueError(f"quant_fp8: scheme must be one of {SCHEMES}, got {scheme!r}")
    if scheme == "static" and scale is None:
        raise ValueError("quant_fp8: the static scheme needs a scale")
    if scheme != "static" and scale is not None:
        raise ValueError(f"quant_fp8: the {scheme} scheme computes its scales; got a scale")
    if scale is not None and (scale.dtype != torch.float32 or scale.dim() > 1 or scale.numel() != 1):
        raise ValueError(
            f"quant_fp8: the static scale must be a float32 tensor of shape [] or [1], "
            f"got {scale.dtype} {tuple(scale.shape)}"
        )
    if scheme == "per_group" and (group_size < 1 or x.shape[-1] % group_size != 0):
        raise ValueError(f"quant_fp8: group_size {group_size} must divide the hidden size {x.shape[-1]}")
    if scale_ue8m0 and scheme != "per_group":
        raise ValueError("quant_fp8: scale_ue8m0 is only defined for the per_group scheme")


def ue8m0(scales: torch.Tensor) -> torch.Tensor:
    """Power-of-two (UE8M0) scales: 2^ceil(log2(scale)), from the exponent bits (frexp), not from
    a log2: float32's log2 rounds 2^k * (1 + 2^-23) to exactly k (ceil would then round it down),
    and float64's log2 on CUDA need not give an integer at a power of two (ceil then rounds 2^k
    up to 2^(k+1)): the same scales must come out on every device. frexp: scale = m * 2^e, m in
    [0.5, 1); a power of two (m = 0.5) stays, anything else rounds up to 2^e. Zero, inf and NaN
    stay as they are."""
    mantissa, exponent = torch.frexp(scales)
    exponent = torch.where(mantissa == 0.5, exponent - 1, exponent)
    rounded = torch.ldexp(torch.ones_like(scales), exponent)
    return torch.where(torch.isfinite(scales) & (scales != 0), rounded, scales)


def quant_fp8_reference(
    y: torch.Tensor,
    scheme: str,
    scale: torch.Tensor | None = None,
    group_size: int = 128,
    scale_ue8m0: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize y along its last dim to float8_e4m3fn; returns (codes, scales)."""
    check_quant_args(y, scheme, scale, group_size, scale_ue8m0)
    y32 = y.to(torch.float32)
    if scheme == "static":
        return (y32 / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale
    if scheme == "per_group":
        y32 = y32.unflatten(-1, (y32.shape[-1] // group_size, group_size))
    scales = (y32.abs().amax(-1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)
    if scale_ue8m0:
        scales = ue8m0(scales)
    q = (y32 / scales).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    if scheme == "per_group":
        return q.flatten(-2), scales.squeeze(-1)
    return q, scales


def rms_norm_quant_fp8_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    weight_offset: float,
    cast_before_weight: bool,
    scheme: str,
    scale: torch.Tensor | None = None,
    group_size: int = 128,
    scale_ue8m0: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference RMSNorm + FP8 quantization: returns (codes, scales)."""
    y = rms_norm_reference(x, weight, eps, weight_offset, cast_before_weight)
    return quant_fp8_reference(y, scheme, scale, group_size, scale_ue8m0)


def add_rms_norm_quant_fp8_reference(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    weight_offset: float,
    cast_before_weight: bool,
    scheme: str,
    scale: torch.Tensor | None = None,
    group_size: int = 128,
    scale_ue8m0: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference residual add + RMSNorm + FP8 quantization: returns (codes, scales,
    new_residual = x + residual)."""
    y, new_residual = add_rms_norm_reference(x, residual, weight, eps, weight_offset, cast_before_weight)
    return (*quant_fp8_reference(y, scheme, scale, group_size, scale_ue8m0), new_residual)
