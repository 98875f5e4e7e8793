"""FP8 (float8_e4m3fn) activation quantization: its arguments (``QuantFP8``), the single statement
of the quantization every "... + FP8 quantization" op ends with and of the canonical
``quant_fp8`` op (``lowering/quant_fp8/reference.py`` holds the math; ``quant_fp8_reference`` here
calls it).

Unfused (what FP8 serving runs before a projection, in one of many spellings):
    scale = amax(|y|) / 448 (per token, per group of G columns, per tensor; or a given static one)
    q     = fp8_e4m3fn(clamp(y / scale, -448, 448))
The spellings differ in what changes codes or scales, and each such choice is a field of
``QuantFP8`` (see its comments): where the scale's floor sits and its value, divide vs reciprocal
multiply vs ``448 / amax`` multiplier, the arithmetic's dtype, power-of-two rounding, saturation.

The defaults are the quantization the fused kernels were first written for (vLLM's per-token math
in DeepSeek-V3's order): fp32 amax, scale = max(amax / 448, MIN_SCALE), q = fp8(clamp(y / scale)).
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
SCHEMES = ("static", "per_token", "per_group", "per_tensor")
FLOOR_SITES = ("scale", "amax", "none")
APPLY_FORMS = ("divide", "reciprocal", "multiplier")
POW2_FORMS = ("none", "ceil", "floor")
SCALE_MATHS = ("fp32", "fp64", "input", "input_amax")
# The activation dtypes the quantization is defined for.
INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class QuantFP8(NamedTuple):
    """How an activation is quantized along its last dim: the arguments every "... + FP8
    quantization" op, reference, launcher and kernel wrapper takes, in the ops' schema order (so
    ``op(..., *quant)`` calls an op with them). The first four fields are the original ones (same
    order and defaults); the rest default to what those meant.

    The dynamic schemes compute, in this order (each step as the spellings round it):
        amax  = max |x| over the row / group / tensor          (exact in any dtype)
        a     = amax in scale_math's dtype; floor_site "amax": a = max(a, floor) in that dtype
        s     = a / fp8_max   (apply "multiplier": s = reciprocal(a) * fp8_max, how torch
                evaluates ``fp8_max / amax``), in scale_math's dtype, then cast to fp32
        pow2  "ceil" / "floor": s = exp2(ceil / floor(log2(s))) in fp32, as torch computes it
        floor_site "scale": s = max(s, floor)
        scale_ue8m0: s = 2^ceil(log2(s)) exactly (from the exponent bits: ``ue8m0``)
    then, for every scheme (static: s is the given scale):
        q = x32 / s  ("divide") | x32 * reciprocal(s) ("reciprocal": ``x * (1 / s)`` and
            ``x * s.reciprocal()`` alike) | x32 * s ("multiplier": s multiplies)
        q = fp8_e4m3fn(clamp(q, -fp8_max, fp8_max)) (saturate) or fp8_e4m3fn(q) (|q| > 464: NaN)
    and returns (codes, s): s of shape [..., 1] (per_token), [..., N / G] (per_group), []
    (per_tensor) or the given scale's (static), fp32. The static scheme reads only apply,
    saturate and fp8_max (the raise leaves the others at their defaults).
    """

    scheme: str  # "static" (scale given), "per_token", "per_group", "per_tensor" (computed)
    scale: torch.Tensor | None = None  # the static scheme's fp32 scale, one element
    group_size: int = 128  # per_group: the columns one scale covers
    scale_ue8m0: bool = False  # computed scales rounded up to powers of two, exactly, last
    floor_site: str = "scale"  # the floor on the amax before the divide, on the scale after, none
    floor: float = MIN_SCALE  # its value (unused for "none")
    apply: str = "divide"  # how the scale is applied: "divide", "reciprocal", "multiplier"
    pow2: str = "none"  # log2-based power-of-two rounding right after the divide: "ceil", "floor"
    saturate: bool = True  # clamp to +-fp8_max before the cast
    fp8_max: float = FP8_MAX  # the divisor (multiplier's numerator) and the clamp bound
    scale_math: str = "fp32"  # "fp32"; "fp64" (torchao training); "input": amax, floor and divide
    # in the activation's dtype, then fp32 (torchao inference); "input_amax": amax and its floor
    # in the activation's dtype, the divide in fp32 (SGLang's reference)

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
        if scale is not None and (scale.dtype != torch.float32 or scale.numel() != 1):
            raise ValueError(
                f"quant_fp8: the static scale must be a float32 tensor of one element, "
                f"got {scale.dtype} {tuple(scale.shape)}"
            )
        if scheme == "per_group" and (group_size < 1 or x.shape[-1] % group_size != 0):
            raise ValueError(f"quant_fp8: group_size {group_size} must divide the hidden size {x.shape[-1]}")
        for name, value, allowed in (
            ("floor_site", self.floor_site, FLOOR_SITES),
            ("apply", self.apply, APPLY_FORMS),
            ("pow2", self.pow2, POW2_FORMS),
            ("scale_math", self.scale_math, SCALE_MATHS),
        ):
            if value not in allowed:
                raise ValueError(f"quant_fp8: {name} must be one of {allowed}, got {value!r}")
        if self.scale_ue8m0 and self.pow2 != "none":
            raise ValueError("quant_fp8: scale_ue8m0 and pow2 both round the scale; give one")
        if not 0.0 < self.fp8_max <= FP8_MAX:
            raise ValueError(f"quant_fp8: fp8_max must be in (0, {FP8_MAX}] for float8_e4m3fn, got {self.fp8_max}")
        if self.floor_site != "none" and not self.floor > 0.0:
            raise ValueError(f"quant_fp8: the floor must be positive, got {self.floor}")
        if x.dtype not in INPUT_DTYPES:
            raise ValueError(f"quant_fp8: x must be one of {INPUT_DTYPES}, got {x.dtype}")

    def groups(self, n: int) -> tuple[int, int]:
        """(groups, columns per group) of a row of n columns: per_group N / G groups of G, else
        one group of the whole row."""
        return (n // self.group_size, self.group_size) if self.scheme == "per_group" else (1, n)

    def scale_shape(self, x: torch.Tensor) -> tuple[int, ...]:
        """The shape of the scales the ops return for x."""
        if self.scheme == "static":
            return tuple(self.scale.shape)
        if self.scheme == "per_tensor":
            return ()
        return (*x.shape[:-1], self.groups(x.shape[-1])[0])

    def fake_outputs(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Empty (codes, scales) of the shapes and dtypes the ops return for x, contiguous."""
        q = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
        if self.scheme == "static":
            return q, torch.empty_like(self.scale, memory_format=torch.contiguous_format)
        return q, x.new_empty(self.scale_shape(x), dtype=torch.float32)

    def own(self, scales: torch.Tensor) -> torch.Tensor:
        """The scales as a new contiguous tensor: the static scheme hands back the given scale,
        and an op's outputs may not alias its inputs (Inductor's buffer planning assumes so)."""
        return scales.clone() if scales is self.scale else scales.contiguous()

    def is_base_form(self) -> bool:
        """Whether the fields after the first four hold their defaults (the quantization the
        allreduce kernels implement)."""
        return self[4:] == QuantFP8("static")[4:]


def kernel_problem(quant: QuantFP8) -> str | None:
    """Why the FP8 epilogue (common/fp8_triton.py) cannot compute ``quant`` (None: it can). It
    computes the scales in fp32 from the amax (its floor on the amax or on the scale, or none; a
    divide, rounded to the activation's dtype for scale_math "input", or the ``448 / amax``
    multiplier), optionally the exact UE8M0 rounding, then applies them by a divide, a
    reciprocal multiply or a multiplier, with or without saturation."""
    if quant.scheme not in ("static", "per_token", "per_group"):
        return f"the {quant.scheme} scheme needs the whole tensor's amax before any code (two passes)"
    if quant.fp8_max != FP8_MAX:
        return f"fp8_max {quant.fp8_max}: the kernels divide by and saturate at {FP8_MAX}"
    if quant.pow2 != "none":
        return f"pow2={quant.pow2!r}: the kernels round scales to powers of two exactly, not by log2 / exp2"
    if quant.scale_math == "fp64":
        return "scale_math='fp64': the kernels compute the scales in fp32"
    if quant.scale_math == "input" and quant.apply == "multiplier":
        return "scale_math='input' with the multiplier: the kernels round a divide's scale only"
    return None


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
    """Quantize y along its last dim to float8_e4m3fn; returns (codes, scales). The math is the
    canonical op's reference (lowering/quant_fp8/reference.py), stated once there."""
    from fusion_passes.lowering.quant_fp8.reference import quantize

    return quantize(y, quant)
