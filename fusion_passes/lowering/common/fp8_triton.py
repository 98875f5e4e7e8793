"""Device code of FP8 (float8_e4m3fn) quantization shared by every "... + FP8 quantization"
kernel (norm, SiLU, the one-shot allreduce): the scales from a block's amax, the exact quotient,
and the codes, computed as common/fp8.py's quant_fp8_reference computes them.

Unfused: an amax reduction over y, then a scale-and-cast pass writing the codes.
Fused:   the epilogue of a kernel that holds y in registers: store_quantized(y, ...) computes the
    scales per group (or takes the static one), stores them, and stores fp8(clamp(y / scale)).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from fusion_passes.lowering.common.fp8 import APPLY_FORMS, FLOOR_SITES, FP8_MAX, QuantFP8
from fusion_passes.lowering.common.fp8 import kernel_problem  # noqa: F401  (the kernels' callers check with it)

_FP8_MAX = tl.constexpr(FP8_MAX)
# |q| above this rounds to float8_e4m3fn's NaN code (0x7F) in a torch cast that does not saturate
# (older torch; cast_saturates): 464 is the midpoint of 448 (0x7E) and the next step 480, and ties
# go to 448's even mantissa.
_OVERFLOW = tl.constexpr(464.0)
# fp32(1 / 448), rounded once as torch's CUDA division by a scalar rounds it (448 = 7 * 2^6).
_RECIPROCAL_FP8_MAX = tl.constexpr(float(torch.tensor(1.0 / FP8_MAX, dtype=torch.float32)))


def quant_form(quant: QuantFP8, dtype: torch.dtype, device: torch.device | str = "cpu") -> int:
    """The epilogue's QUANT_FORM constexpr of ``quant`` for an activation of ``dtype``: bits 0-1
    the floor site (FLOOR_SITES' index: scale, amax, none), bits 2-3 the apply form (APPLY_FORMS'
    index: divide, reciprocal, multiplier), bit 4 no saturation, bits 5-6 the dtype the scale is
    rounded to after the divide (``scale_math="input"``: 1 bf16, 2 fp16). 0 is the defaults of
    QuantFP8. ``device``: where the codes are computed (the cast probed there)."""
    unsaturated = not quant.saturate and not cast_saturates(torch.device(device).type)
    rounding = {torch.bfloat16: 1, torch.float16: 2}.get(dtype, 0) if quant.scale_math == "input" else 0
    return (
        FLOOR_SITES.index(quant.floor_site) | APPLY_FORMS.index(quant.apply) << 2 | unsaturated << 4
        | rounding << 5
    )  # fmt: skip


@functools.cache
def cast_saturates(device_type: str = "cpu") -> bool:
    """Whether torch's fp32 -> float8_e4m3fn cast on ``device_type`` saturates values past 448 to
    +-448 (recent torch's c10 conversion saturates finite overflow and inf) or gives NaN (older
    torch). Probed on the device itself: the CPU and CUDA casts of one torch need not agree.
    Without the spelling's clamp the codes are the cast's: where it saturates, an unsaturated
    spelling's codes are the saturated ones."""
    from torch.utils._python_dispatch import _disable_current_modes

    # Real tensors even when first asked while Inductor traces a launch (fake / proxy modes on).
    with _disable_current_modes():
        big = torch.tensor([1e5, float("inf")], device=device_type).to(torch.float8_e4m3fn)
        return bool((big.view(torch.uint8).cpu() == 0x7E).all())


def kernel_floor(quant: QuantFP8, dtype: torch.dtype) -> float:
    """The floor the epilogue compares in fp32: ``scale_math="input_amax"`` floors the amax in the
    activation's dtype, so the floor is rounded to it first (the max of a value of that dtype and
    the rounded floor is the dtype's clamp: no value of the dtype lies between the two)."""
    if quant.floor_site == "none":
        return 0.0
    if quant.scale_math in ("input", "input_amax") and quant.floor_site == "amax":
        return float(torch.tensor(quant.floor, dtype=torch.float32).to(dtype).float())
    return float(torch.tensor(quant.floor, dtype=torch.float32))


@triton.jit
def _fp8_e4m3fn_codes(v, HW_CONVERT: tl.constexpr):
    """The float8_e4m3fn bit patterns (as uint8) of fp32 values |v| <= 448, rounded to nearest,
    ties to even: the integer steps of c10's fp8e4m3fn_from_fp32_value, which torch's
    .to(torch.float8_e4m3fn) runs, less its NaN and overflow branches.

    Why not v.to(tl.float8e4nv): Triton 3.6's interpreter converts fp32 to fp8 with its own bit
    arithmetic, which rounds ties away from zero, flushes the fp8 subnormals (|v| < 2^-6) to zero
    and ORs a mantissa rounded up past 7 into the exponent (probed: 1e-3 gave 0, not 2^-9; 100.0
    gave 104.0, not 96.0; 7.9 gave 4.0, not 8.0). These integer steps give torch's codes in the
    interpreter and compiled alike, and need no fp8 type in either: the kernel stores bytes.

    A NaN gives torch's NaN code, 0x7F with v's sign bit.

    HW_CONVERT (compiled for a GPU): the hardware conversion instead (cvt.rn.satfinite, round to
    nearest even, subnormals kept, NaN to NaN: the same codes), one instruction per two values
    where the integer steps take about a dozen per value: at 16384 x 7168 that is ~1.4G
    instructions. satfinite also saturates |v| > 448 to +-448, so the caller's clamp is not
    needed on this path."""
    if HW_CONVERT:
        return v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    magnitude = bits & 0x7FFFFFFF
    # |v| < 2^-6, the subnormals (steps of 2^-9): fp32's ulp at 2^14 is 2^-9, so the fp32 sum
    # 2^14 + |v| rounds |v| to the nearest step, ties to even; its low bits count the steps.
    sum_bits = (magnitude.to(tl.float32, bitcast=True) + 16384.0).to(tl.int32, bitcast=True)
    subnormal = sum_bits - (141 << 23)
    # Normal: rebias the exponent (127 to 7) and round off 20 mantissa bits to nearest even; a
    # mantissa that rounds up past 7 carries into the exponent.
    normal = (magnitude - (120 << 23) + 0x7FFFF + ((magnitude >> 20) & 1)) >> 20
    code = tl.where(magnitude < (121 << 23), subnormal, normal)
    return (tl.where(magnitude > 0x7F800000, 0x7F, code) | sign).to(tl.uint8)


@triton.jit
def max_keeping_nan(a, b):
    """max.NaN: a NaN operand gives NaN (tl.reduce's combine for an amax that keeps NaN)."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def exact_quotient(y, scale):
    """y / scale[:, :, None] rounded to nearest even, as div_rn gives it, for the computed scales
    (positive, or NaN from a NaN row) and static ones of 2^-100..2^100 in magnitude (either
    sign), by Markstein's theorem: with rcp = RN(1 / scale),
    q0 = RN(y * rcp) lies within one ulp of y / scale, the residual y - scale * q0 is exact in
    one fma, and RN(q0 + residual * rcp) is the correctly rounded quotient, while everything
    stays in fp32's normal range: |y| >= 2^-100 (the residual, ~2^-24 |y|, must not underflow)
    and 2^-100 <= |y / scale| <= 2^100, which holds the kernels' quotients (at most 448: |y| <=
    amax = 448 * scale). Smaller y or quotients give a signed fp8 zero either way. One
    division per group, then one multiply and two fmas per element, where div.rn costs a range
    check (FCHK) and a Newton sequence per element, and a slow-path call per zero numerator.

    The residual is carried negated (fma(q0, scale, -y)) so a zero y keeps its sign for a positive
    scale: -0 gives -0, as -0 / scale does (a negative scale would give +0 for both zeros).
    Negation is a multiply by -1: Triton's unary minus is 0 - x, which turns -0 into +0. An
    infinite scale (amax overflowed) takes rcp = 0 and a zero fma scale, leaving q0 = y * 0 (a
    signed zero; NaN for an infinite y), as y / inf gives it.
    Compiled for a GPU only: the interpreter's fma rounds the product first."""
    # != inf, not < inf: a NaN scale must stay NaN (rcp NaN gives NaN codes, as NaN / NaN).
    not_inf = scale != float("inf")
    rcp = tl.where(not_inf, tl.div_rn(1.0, scale), 0.0)[:, :, None]
    fma_scale = tl.where(not_inf, scale, 0.0)[:, :, None]
    q0 = y * rcp
    neg_residual = tl.fma(q0, fma_scale, y * -1.0)
    return tl.fma(neg_residual * -1.0, rcp, q0)


@triton.jit
def _static_quotient(y, given, scale, mask):
    """y / scale[:, :, None] for the given (static) scale, as far as the clamp to +-448 can tell:
    exact_quotient for a scale of 2^-100 <= |scale| <= 2^100, with |y| first bounded by
    449 |scale| (a larger quotient clamps to +-448 either way; the bound keeps the quotient in
    exact_quotient's range); any other scale (0, subnormal, huge, NaN: a caller's mistake) takes
    div.rn, with masked lanes dividing 1, not their 0 (a zero numerator is div.rn's slow path)."""
    s = tl.abs(given)
    if (s >= 2.0**-100) & (s <= 2.0**100):
        bound = 449.0 * s
        y = tl.minimum(tl.maximum(y, -bound, propagate_nan=tl.PropagateNan.ALL), bound,
                       propagate_nan=tl.PropagateNan.ALL)  # fmt: skip
        # exact_quotient keeps a zero's sign for positive scales only: divide -y by |scale|
        # (y / -3 = -y / 3 exactly, +0 / -3 = -0 included).
        if given < 0:
            y = y * -1.0
        q = exact_quotient(y, tl.abs(scale))
    else:
        q = tl.div_rn(tl.where(mask, y, 1.0), scale[:, :, None])
    return q


@triton.jit
def load_static_scale(scale_ptr, STATIC: tl.constexpr):
    """The given scale of the static scheme (1.0, unused, otherwise). Kernels load it first: read
    where it is used, it sat behind the row reduction's two bar.sync in the norm kernel's SASS,
    one dependent load latency more on every call (the whole kernel at decode sizes)."""
    if STATIC:
        given = tl.load(scale_ptr)
    else:
        given = 1.0
    return given


@triton.jit
def scales_of(amax, SCALE_UE8M0: tl.constexpr, AMAX_TIMES_RECIPROCAL: tl.constexpr, floor, QUANT_FORM: tl.constexpr):
    """The scales of amax under QUANT_FORM (quant_form): floored on the amax (bits 0-1 == 1) or
    on the scale (== 0) at floor, amax / 448 or the multiplier reciprocal(amax) * 448 (bits 2-3
    == 2), rounded up to a power of two under SCALE_UE8M0."""
    FLOOR_SITE: tl.constexpr = QUANT_FORM & 3
    APPLY: tl.constexpr = (QUANT_FORM >> 2) & 3
    ROUND_SCALE: tl.constexpr = (QUANT_FORM >> 5) & 3
    if FLOOR_SITE == 1:
        amax = tl.maximum(amax, floor, propagate_nan=tl.PropagateNan.ALL)
    if APPLY == 2:
        # torch evaluates ``448 / amax`` as reciprocal(amax) * 448: two roundings, both here.
        scale = tl.div_rn(1.0, amax) * _FP8_MAX
    elif AMAX_TIMES_RECIPROCAL:
        # The model's `amax / 448`, as torch computes it on the device: on CUDA, torch divides by
        # a Python scalar as a multiply by its fp32 reciprocal (one ulp off the quotient for 54%
        # of bf16 amax values); on CPU it divides. div_rn, not '/': Triton's '/' is an
        # approximate division on NVIDIA GPUs (div.full.f32, 2 ulp).
        scale = amax * _RECIPROCAL_FP8_MAX
    else:
        scale = tl.div_rn(amax, _FP8_MAX)
    if ROUND_SCALE == 1:
        # The divide in bf16 (torchao): torch divides in fp32 and rounds to bf16, to nearest even;
        # by integer steps, as the interpreter truncates a bf16 cast (silu.round_to says so).
        bits = scale.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        scale = tl.where(scale == scale, bits.to(tl.float32, bitcast=True), scale)
    elif ROUND_SCALE == 2:
        scale = scale.to(tl.float16).to(tl.float32)
    if FLOOR_SITE == 0:
        scale = tl.maximum(scale, floor, propagate_nan=tl.PropagateNan.ALL)
    if SCALE_UE8M0:
        # 2^ceil(log2(scale)) exactly: a non-zero mantissa carries the exponent up by one
        # (a NaN's would carry out of the exponent: it stays NaN).
        scale_bits = (scale.to(tl.int32, bitcast=True) + 0x7FFFFF) & 0x7F800000
        scale = tl.where(scale == scale, scale_bits.to(tl.float32, bitcast=True), scale)
    return scale


@triton.jit
def store_scales(
    amax, scale_ptr, rows, groups, num_groups, group_mask, SCALE_UE8M0: tl.constexpr,
    AMAX_TIMES_RECIPROCAL: tl.constexpr, floor, QUANT_FORM: tl.constexpr,
):  # fmt: skip
    """scales_of(amax) per group, stored at scale_ptr[rows * num_groups + groups] and returned
    [ROWS, GROUPS] (store_quantized's computed scales; arguments as there)."""
    scale = scales_of(amax, SCALE_UE8M0, AMAX_TIMES_RECIPROCAL, floor, QUANT_FORM)
    tl.store(scale_ptr + rows[:, None] * num_groups + groups[None, :], scale, mask=group_mask)
    return scale


@triton.jit
def store_quantized(
    y,  # fp32 [ROWS, BLOCK_GROUPS, BLOCK_GROUP]: the model's activation (rounded to its dtype)
    q_ptr,  # *uint8 [M, N] contiguous: the float8_e4m3fn codes
    scale_ptr,  # *fp32 [M, num_groups]: the computed scales (written; not used when STATIC)
    given,  # fp32: the static scale (load_static_scale), used when STATIC
    rows,  # int64 [ROWS]: this program's rows
    groups,  # [BLOCK_GROUPS]: group indices
    rows_3d,  # rows[:, None, None]
    cols,  # [1, BLOCK_GROUPS, BLOCK_GROUP]: column of each element
    N,  # row length
    num_groups,  # groups per row (1 unless per_group)
    group_mask,  # [ROWS, BLOCK_GROUPS]: real rows and groups
    mask,  # [ROWS, BLOCK_GROUPS, BLOCK_GROUP]: real elements
    more_amax,  # fp32 [ROWS, BLOCK_GROUPS] or 0.0: the amax of the groups' columns not in y
    ROWS: tl.constexpr,
    BLOCK_GROUPS: tl.constexpr,
    STATIC: tl.constexpr,
    SCALE_UE8M0: tl.constexpr,
    AMAX_TIMES_RECIPROCAL: tl.constexpr,
    HW_CONVERT: tl.constexpr,
    floor,  # fp32: the floor of the computed scales (kernel_floor)
    QUANT_FORM: tl.constexpr,  # floor site, apply form, saturation (quant_form)
):
    """quant_fp8_reference on a block: scales (computed per group and stored, or the static one),
    then codes = fp8(clamp(y / scale, -448, 448)); returns the scales [ROWS, BLOCK_GROUPS] so a
    caller holding a group in two blocks quantizes the other with store_codes. Shared by every
    "... + FP8 quantization" kernel. NaN propagates as in torch: a NaN in a group makes its amax,
    its scale and so all its codes NaN (tl.max and tl.maximum would drop it: PTX max.f32 returns
    the operand that is not NaN)."""
    if STATIC:
        scale = tl.broadcast_to(given, (ROWS, BLOCK_GROUPS))
    else:
        # Masked elements hold 0: nothing to the amax.
        amax = max_keeping_nan(tl.reduce(tl.abs(y), 2, max_keeping_nan), more_amax)
        scale = store_scales(amax, scale_ptr, rows, groups, num_groups, group_mask, SCALE_UE8M0,
                             AMAX_TIMES_RECIPROCAL, floor, QUANT_FORM)  # fmt: skip
    store_codes(y, scale, given, q_ptr, rows_3d, cols, N, mask, STATIC, HW_CONVERT, SCALE_UE8M0, QUANT_FORM)
    return scale


@triton.jit
def store_codes(
    y, scale, given, q_ptr, rows_3d, cols, N, mask, STATIC: tl.constexpr, HW_CONVERT: tl.constexpr,
    SCALE_UE8M0: tl.constexpr, QUANT_FORM: tl.constexpr,
):  # fmt: skip
    """codes = fp8(clamp(y op scale[:, :, None], -448, 448)) stored at q_ptr[rows_3d * N + cols]
    (store_quantized's second half, arguments as there): op a divide, a multiply by the rounded
    reciprocal (QUANT_FORM bits 2-3 == 1) or by the scale (== 2); without saturation (bit 4, set
    only where torch's cast does not saturate: cast_saturates) NaN past 464, as that cast."""
    APPLY: tl.constexpr = (QUANT_FORM >> 2) & 3
    SATURATE: tl.constexpr = ((QUANT_FORM >> 4) & 1) == 0
    if APPLY == 1:
        q = y * tl.div_rn(1.0, scale)[:, :, None]
    elif APPLY == 2:
        q = y * scale[:, :, None]
    elif not HW_CONVERT or (STATIC and not SATURATE):
        # Unsaturated, a static quotient past 464 must reach the NaN code: _static_quotient
        # bounds it at 449 (enough where it saturates), so divide exactly instead.
        q = tl.div_rn(y, scale[:, :, None])
    elif STATIC:
        q = _static_quotient(y, given, scale, mask)
    elif SCALE_UE8M0:
        # A computed UE8M0 scale is a power of two (2^-17 .. 2^120), inf or NaN, so 1 / scale is
        # exact and y * (1 / scale) is y / scale exactly: exact_quotient's two fmas add nothing
        # (on one H200, norm-only per_group 1.00-1.06x, 1.03-1.06x at >= 4096 tokens; add+norm
        # 1.00-1.04x; silu 1.00-1.02x; codes and scales equal bit for bit). The product rounds
        # only below 2^-126, where every quotient is a signed fp8 zero anyway (|q| < 2^-10); an
        # infinite scale gives y * 0, a signed zero (NaN for an infinite y) as y / inf does.
        q = y * tl.div_rn(1.0, scale)[:, :, None]
    else:
        q = exact_quotient(y, scale)
    if SATURATE and not HW_CONVERT:  # cvt.rn.satfinite saturates to +-448 itself (2 instructions an element)
        q = tl.minimum(tl.maximum(q, -_FP8_MAX, propagate_nan=tl.PropagateNan.ALL), _FP8_MAX,
                       propagate_nan=tl.PropagateNan.ALL)  # fmt: skip
    codes = _fp8_e4m3fn_codes(q, HW_CONVERT)
    if not SATURATE:
        # Past 464 (inf included) that cast gives the NaN code with q's sign, where satfinite
        # would give 448 and the integer steps would carry into the sign bit.
        sign = ((q.to(tl.int32, bitcast=True) >> 24) & 0x80).to(tl.uint8)
        codes = tl.where(tl.abs(q) > _OVERFLOW, sign | 0x7F, codes)
    tl.store(q_ptr + rows_3d * N + cols, codes, mask=mask)
