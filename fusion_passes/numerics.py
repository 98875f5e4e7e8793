"""The one per-dtype tolerance table, and the comparisons every check uses (in float64)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Tolerance:
    """rtol/atol for elementwise closeness of one op's output; rel_norm bounds
    ||actual - expected|| / ||expected|| for a whole model's output."""

    rtol: float
    atol: float
    rel_norm: float


# Elementwise: about two units in the last place of the dtype (bf16 has 8 bits of mantissa,
# 2 * 2**-8 = 7.8e-3, so 1.6e-2 also covers one rounding flip of the output); a reduction in a
# different order (Triton's tree vs ATen's) moves fp32 results by ~1e-6 relative.
# Whole models: errors accumulate over layers; the bound is what a correct rewrite stays under.
TOLERANCES: dict[torch.dtype, Tolerance] = {
    torch.float32: Tolerance(rtol=1e-5, atol=1e-5, rel_norm=1e-5),
    torch.bfloat16: Tolerance(rtol=1.6e-2, atol=1.6e-2, rel_norm=2e-2),
    torch.float16: Tolerance(rtol=2e-3, atol=2e-3, rel_norm=4e-3),
    torch.float64: Tolerance(rtol=1e-12, atol=1e-12, rel_norm=1e-12),
}


def tolerance(dtype: torch.dtype) -> Tolerance:
    if dtype not in TOLERANCES:
        raise ValueError(f"no tolerance defined for {dtype}")
    return TOLERANCES[dtype]


@dataclass(frozen=True)
class Comparison:
    max_abs: float
    max_rel: float
    rel_norm: float
    ok: bool


def compare(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None) -> Comparison:
    """Compare in float64 with the tolerance of ``dtype`` (default: expected's dtype).

    NaN where the other has none, or a shape/dtype difference, is a failure."""
    tol = tolerance(dtype or expected.dtype)
    if actual.shape != expected.shape:
        return Comparison(float("inf"), float("inf"), float("inf"), False)
    a = actual.detach().to(torch.float64).cpu()
    e = expected.detach().to(torch.float64).cpu()
    if not torch.equal(torch.isnan(a), torch.isnan(e)):
        return Comparison(float("nan"), float("nan"), float("nan"), False)
    a, e = torch.nan_to_num(a), torch.nan_to_num(e)
    diff = (a - e).abs()
    max_abs = diff.max().item() if diff.numel() else 0.0
    max_rel = (diff / e.abs().clamp_min(tol.atol)).max().item() if diff.numel() else 0.0
    denom = e.norm().item()
    rel_norm = diff.norm().item() / denom if denom > 0 else diff.norm().item()
    ok = bool(torch.all(diff <= tol.atol + tol.rtol * e.abs()).item())
    return Comparison(max_abs, max_rel, rel_norm, ok)


def fp8_codes_apart(actual: torch.Tensor, expected: torch.Tensor) -> int:
    """The most float8_e4m3fn codes two tensors of codes lie apart (0: equal, 1: neighbours).

    e4m3 codes of one sign are ordered by their uint8 value (sign bit, then exponent, then
    mantissa): mapping the negative half to -(u - 128) puts every code on one integer line,
    with -0 and +0 both at 0."""
    a, e = (t.view(torch.uint8).to(torch.int16) for t in (actual, expected))
    a, e = (torch.where(t >= 128, 128 - t, t) for t in (a, e))
    return int((a - e).abs().max().item()) if a.numel() else 0


def fp8_nan_codes(codes: torch.Tensor) -> torch.Tensor:
    """Where float8_e4m3fn codes are NaN: 0x7F or 0xFF (e4m3fn's only NaNs, one per sign)."""
    return (codes.view(torch.uint8) & 0x7F) == 0x7F


def fp8_codes_equal(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    """Codes bit for bit equal, NaN codes of either sign counted as one value (the sign of a NaN
    is the arithmetic's choice: x86 and CUDA make different default NaNs)."""
    nan = fp8_nan_codes(expected)
    if not torch.equal(fp8_nan_codes(actual), nan):
        return False
    return torch.equal(actual.view(torch.uint8)[~nan], expected.view(torch.uint8)[~nan])


def ue8m0_quantization_apart(
    q: torch.Tensor, scales: torch.Tensor, y: torch.Tensor, group_size: int, rtol: float
) -> tuple[bool, int]:
    """Check power-of-two (UE8M0) per-group codes and scales against the activation y (in its
    dtype) of a reference that may differ from the kernel's by the dtype's rounding.

    A group whose amax / 448 lies within rtol of a power of two may take either binade: one ulp of
    y at the amax moves the raw scale across the boundary, which doubles the scale and halves every
    code of the group (8 codes apart), though both sides rounded correctly. So: the scales must lie
    in [ue8m0(raw * (1 - rtol)), ue8m0(raw * (1 + rtol))] with raw = y's unrounded scales, and the
    codes are compared with y quantized by the kernel's own scales. Returns (scales ok, the most
    codes apart)."""
    from fusion_passes.lowering.common.fp8 import FP8_MAX, QuantFP8, quant_fp8_reference, ue8m0

    raw = quant_fp8_reference(y, QuantFP8("per_group", group_size=group_size))[1]
    scales_ok = scales.shape == raw.shape and bool(
        torch.all((ue8m0(raw * (1 - rtol)) <= scales) & (scales <= ue8m0(raw * (1 + rtol)))).item()
    )
    if not scales_ok:
        return False, fp8_codes_apart(q, quant_fp8_reference(y, QuantFP8("per_group", None, group_size, True))[0])
    groups = y.float().unflatten(-1, (-1, group_size)) / scales.unsqueeze(-1)
    expected = groups.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).flatten(-2)
    return True, fp8_codes_apart(q, expected)
