"""FP8 (float8_e4m3fn) activation quantization: its arguments and its plain-torch reference, the
single statement of the quantization every "... + FP8 quantization" op ends with.

Unfused (what FP8 serving runs before a projection):
    scale = amax(|y|) / 448 (per token or per group of G columns; or a given static scale)
    q     = fp8_e4m3fn(clamp(y / scale, -448, 448))
Fused:   the epilogue of the norm, SiLU and allreduce kernels (common/fp8_triton.py), computing

    y32   = f32(y)
    static     scale given (fp32, shape [] or [1])
    per_token  scale = max(amax(|y32|, dim=-1) / 448, MIN_SCALE)              shape [..., 1]
    per_group  scale = max(amax(|y32| over each G columns) / 448, MIN_SCALE)  shape [..., N / G]
               scale_ue8m0: scale = 2^ceil(log2(scale))   (power-of-two scales, DeepSeek V3)
    q     = fp8_e4m3fn(clamp(y32 / scale, -448, 448))        rounded to nearest, ties to even

It divides by the scale (no reciprocal multiply): serving engines' native fallbacks divide, and
the division decides the codes bit for bit.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
# Floor of the dynamic scales: an all-zero row or group has amax 0, and a zero scale would turn
# its codes into 0 / 0 = NaN. 1 / (448 * 512) is vLLM's floor for dynamic per-token scales: far
# below any real activation's amax / 448, so it changes nothing else.
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)
SCHEMES = ("static", "per_token", "per_group")


class QuantFP8(NamedTuple):
    """How an activation is quantized along its last dim: the arguments every "... + FP8
    quantization" op, reference, launcher and kernel wrapper takes, in the ops' schema order (so
    ``op(..., *quant)`` calls an op with them)."""

    scheme: str  # "static" (scale given), "per_token" or "per_group" (scales computed)
    scale: torch.Tensor | None = None  # the static scheme's fp32 scale, shape [] or [1]
    group_size: int = 128  # per_group: the columns one scale covers
    scale_ue8m0: bool = False  # per_group: computed scales rounded up to powers of two

    def check(self, x: torch.Tensor) -> None:
        """Raise ValueError (one line) for arguments the ops do not define; x is the tensor
        quantized along its last dim (or the op's input of that shape)."""
        scheme, scale, group_size = self.scheme, self.scale, self.group_size
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
        if self.scale_ue8m0 and scheme != "per_group":
            raise ValueError("quant_fp8: scale_ue8m0 is only defined for the per_group scheme")

    def groups(self, n: int) -> tuple[int, int]:
        """(groups, columns per group) of a row of n columns: per_group N / G groups of G, else
        one group of the whole row."""
        return (n // self.group_size, self.group_size) if self.scheme == "per_group" else (1, n)

    def fake_outputs(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Empty (codes, scales) of the shapes and dtypes the ops return for x, contiguous."""
        q = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
        if self.scheme == "static":
            return q, torch.empty_like(self.scale, memory_format=torch.contiguous_format)
        return q, x.new_empty((*x.shape[:-1], self.groups(x.shape[-1])[0]), dtype=torch.float32)

    def own(self, scales: torch.Tensor) -> torch.Tensor:
        """The scales as a new contiguous tensor: the static scheme hands back the given scale,
        and an op's outputs may not alias its inputs (Inductor's buffer planning assumes so)."""
        return scales.clone() if scales is self.scale else scales.contiguous()


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


def quant_fp8_reference(y: torch.Tensor, quant: QuantFP8) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize y along its last dim to float8_e4m3fn; returns (codes, scales)."""
    quant.check(y)
    y32 = y.to(torch.float32)
    if quant.scheme == "static":
        return (y32 / quant.scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), quant.scale
    if quant.scheme == "per_group":
        y32 = y32.unflatten(-1, quant.groups(y32.shape[-1]))
    scales = (y32.abs().amax(-1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)
    if quant.scale_ue8m0:
        scales = ue8m0(scales)
    q = (y32 / scales).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    if quant.scheme == "per_group":
        return q.flatten(-2), scales.squeeze(-1)
    return q, scales
