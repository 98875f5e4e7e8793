"""One Triton kernel for RMSNorm (+ residual add) + FP8 (float8_e4m3fn) quantization over the last dim.

Unfused: add_rms_norm writes y in x.dtype, an amax reduction reads y, and a scale-and-cast kernel
    reads y again to write the fp8 codes: three passes, y written once and read twice.
Fused:   one pass per row, all math in fp32, rounding where rms_norm_quant_fp8_reference.py does:
    r, y  as rms_norm_triton computes them (r stored as new_residual); y32 = f32(to_x_dtype(y))
    scale = the given one (static), or max(amax(|y32|) / 448, MIN_SCALE) per row (per_token) or
            per group of G columns (per_group), rounded up to a power of two under scale_ue8m0
    q     = fp8_e4m3fn(clamp(y32 / scale, -448, 448)), stored with the computed scales

Each program holds whole rows in registers as [ROWS, GROUPS, GROUP] blocks: a per_group row is
GROUPS = N / G groups of G columns, a per_token or static row one group of N columns, so one
reduction over the last axis gives the amax of a group or of a row alike.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from fusion_passes.lowering.rms_norm_quant_fp8.reference import (
    FP8_DTYPE,
    FP8_MAX,
    MIN_SCALE,
    check_quant_args,
)
from fusion_passes.lowering.rms_norm.reference import check_rms_norm_args
from fusion_passes.lowering.rms_norm.triton import as_rows, launch_config, scale_by_weight

_FP8_MAX = tl.constexpr(FP8_MAX)
_MIN_SCALE = tl.constexpr(MIN_SCALE)
# fp32(1 / 448), rounded once as torch's CUDA division by a scalar rounds it (448 = 7 * 2^6).
_RECIPROCAL_FP8_MAX = tl.constexpr(float(torch.tensor(1.0 / FP8_MAX, dtype=torch.float32)))


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
def after_weight(x, w, N):
    """x, bit for bit, as a value that depends on the weight w loaded for it: x | (w & 0), the
    zero being N >> 31 (N is a row length, so >= 0), which ptxas cannot fold.

    Why: ptxas issues the weight's loads after the row reduction's first shuffles, not beside the
    row's loads as the PTX orders them: 2-7 of the LDGs in every norm-only configuration compiled
    for sm_90 (hidden 7168 / 5120 / 4096 / 3072, each scheme) and 5-7 in the add+norm block of
    8192 lanes. Each row then waits one more load latency between rstd and y, and the add+norm
    block held 151-166 registers (3 programs an SM). With x depending on the weight every load
    comes before the first shuffle, and that block holds 126-128 (4 programs an SM), with about
    as many instructions (per_token 1111 -> 1121 a thread, per_group 1343 -> 1326).
    """
    bits: tl.constexpr = tl.int16 if x.dtype.primitive_bitwidth == 16 else tl.int32
    w_bits = w.to(tl.int16 if w.dtype.primitive_bitwidth == 16 else tl.int32, bitcast=True).to(bits)
    zero = tl.cast(N >> 31, bits)  # tl.cast: N is a Python int where specialised (N == 1)
    return (x.to(bits, bitcast=True) | (w_bits & zero)).to(x.dtype, bitcast=True)


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
def scales_of(amax, SCALE_UE8M0: tl.constexpr, AMAX_TIMES_RECIPROCAL: tl.constexpr):
    """scale = max(amax / 448, MIN_SCALE), rounded up to a power of two under SCALE_UE8M0."""
    # The model's `amax / 448`, as torch computes it on the device: on CUDA, torch divides by a
    # Python scalar as a multiply by its fp32 reciprocal (one ulp off the quotient for 54%
    # of bf16 amax values); on CPU it divides. div_rn, not '/': Triton's '/' is an approximate
    # division on NVIDIA GPUs (div.full.f32, 2 ulp).
    if AMAX_TIMES_RECIPROCAL:
        scale = amax * _RECIPROCAL_FP8_MAX
    else:
        scale = tl.div_rn(amax, _FP8_MAX)
    scale = tl.maximum(scale, _MIN_SCALE, propagate_nan=tl.PropagateNan.ALL)
    if SCALE_UE8M0:
        # 2^ceil(log2(scale)) exactly: a non-zero mantissa carries the exponent up by one
        # (a NaN's would carry out of the exponent: it stays NaN).
        scale_bits = (scale.to(tl.int32, bitcast=True) + 0x7FFFFF) & 0x7F800000
        scale = tl.where(scale == scale, scale_bits.to(tl.float32, bitcast=True), scale)
    return scale


@triton.jit
def store_scales(
    amax, scale_ptr, rows, groups, num_groups, group_mask, SCALE_UE8M0: tl.constexpr,
    AMAX_TIMES_RECIPROCAL: tl.constexpr,
):  # fmt: skip
    """scales_of(amax) per group, stored at scale_ptr[rows * num_groups + groups] and returned
    [ROWS, GROUPS] (store_quantized's computed scales; arguments as there)."""
    scale = scales_of(amax, SCALE_UE8M0, AMAX_TIMES_RECIPROCAL)
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
                             AMAX_TIMES_RECIPROCAL)  # fmt: skip
    store_codes(y, scale, given, q_ptr, rows_3d, cols, N, mask, STATIC, HW_CONVERT, SCALE_UE8M0)
    return scale


@triton.jit
def store_codes(
    y, scale, given, q_ptr, rows_3d, cols, N, mask, STATIC: tl.constexpr, HW_CONVERT: tl.constexpr,
    SCALE_UE8M0: tl.constexpr,
):  # fmt: skip
    """codes = fp8(clamp(y / scale[:, :, None], -448, 448)) stored at q_ptr[rows_3d * N + cols]
    (store_quantized's second half, arguments as there)."""
    if not HW_CONVERT:
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
    if not HW_CONVERT:  # cvt.rn.satfinite saturates to +-448 itself (2 instructions an element)
        q = tl.minimum(tl.maximum(q, -_FP8_MAX, propagate_nan=tl.PropagateNan.ALL), _FP8_MAX,
                       propagate_nan=tl.PropagateNan.ALL)  # fmt: skip
    tl.store(q_ptr + rows_3d * N + cols, _fp8_e4m3fn_codes(q, HW_CONVERT), mask=mask)


@triton.jit
def rms_norm_quantize_block(
    r,  # fp32 [ROWS, BLOCK_GROUPS, BLOCK_GROUP]: the rows to normalise (masked elements 0)
    w,  # fp32 [1, BLOCK_GROUPS, BLOCK_GROUP]: the weight (masked columns 0)
    eps,  # fp32
    weight_offset,  # fp32
    q_ptr, scale_ptr, given, rows, groups, rows_3d, cols, N, num_groups, group_mask, mask,
    dtype: tl.constexpr,  # the model's activation dtype
    ROWS: tl.constexpr,
    BLOCK_GROUPS: tl.constexpr,
    CAST_BEFORE_WEIGHT: tl.constexpr,
    STATIC: tl.constexpr,
    SCALE_UE8M0: tl.constexpr,
    AMAX_TIMES_RECIPROCAL: tl.constexpr,
    HW_CONVERT: tl.constexpr,
):  # fmt: skip
    """RMSNorm of a [ROWS, GROUPS, GROUP] block, rounded to the model's dtype, then quantized and
    stored (store_quantized). Shared by the norm + quant kernel below and the one-shot allreduce
    one, so the two cannot drift apart."""
    # Masked columns hold 0, so they add nothing to the sum (nor to the amax); divide by the true N.
    rstd = tl.rsqrt(tl.sum(tl.sum(r * r, axis=2), axis=1) / N + eps)
    y = scale_by_weight(r * rstd[:, None, None], w, weight_offset, dtype, CAST_BEFORE_WEIGHT)
    # The model quantizes the activation it produced in its dtype: round there, then back to fp32.
    y = y.to(dtype).to(tl.float32)
    store_quantized(
        y, q_ptr, scale_ptr, given, rows, groups, rows_3d, cols, N, num_groups, group_mask, mask, 0.0,
        ROWS, BLOCK_GROUPS, STATIC, SCALE_UE8M0, AMAX_TIMES_RECIPROCAL, HW_CONVERT,
    )  # fmt: skip


@triton.jit
def _rms_norm_quantize_chunks(
    x_ptr, weight_ptr, q_ptr, scale_ptr, M, N, num_groups, stride_x, eps, weight_offset,
    CAST_BEFORE_WEIGHT: tl.constexpr, STATIC: tl.constexpr, SCALE_UE8M0: tl.constexpr,
    AMAX_TIMES_RECIPROCAL: tl.constexpr, HW_CONVERT: tl.constexpr, BLOCK_GROUPS: tl.constexpr,
    BLOCK_GROUP: tl.constexpr, ROWS: tl.constexpr, CHUNKS: tl.constexpr, WEIGHT_FIRST: tl.constexpr,
):  # fmt: skip
    """The norm-only kernel on rows held as CHUNKS chunks of CHUNK = BLOCK_GROUPS * BLOCK_GROUP
    columns, N = CHUNKS * CHUNK exactly (arguments as the kernel's): the same math and rounding
    as rms_norm_quantize_block, on no padded lanes. One padded block of hidden 7168 is 8192 wide
    and 3072 is 4096: 12.5% / 25% of the lanes compute zeros (instructions, registers) for no
    bytes; 7 / 3 chunks of 1024 have none. BLOCK_GROUPS == 1: one scale a row (per_token) or the
    static one; > 1: each chunk holds whole groups of BLOCK_GROUP columns (per_group).
    The chunks are squared and added (and their |y| maxed) element by element, then reduced once:
    a reduction per chunk would cost a cross-warp round (two bar.sync) each."""
    CHUNK: tl.constexpr = BLOCK_GROUPS * BLOCK_GROUP
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    groups = tl.arange(0, BLOCK_GROUPS)
    in_group = tl.arange(0, BLOCK_GROUP)
    local = (groups[:, None] * BLOCK_GROUP + in_group[None, :])[None, :, :]  # a chunk's columns
    group_mask = (rows < M)[:, None] & (groups < BLOCK_GROUPS)[None, :]  # real rows
    mask = group_mask[:, :, None] & (in_group < BLOCK_GROUP)[None, None, :]
    rows = rows.to(tl.int64)
    rows_3d = rows[:, None, None]
    dtype = x_ptr.dtype.element_ty
    given = load_static_scale(scale_ptr, STATIC)
    w_loaded = ()
    for c in tl.static_range(CHUNKS):
        w_loaded = w_loaded + (tl.load(weight_ptr + c * CHUNK + local),)
    ws = ()
    rs = ()
    for c in tl.static_range(CHUNKS):
        ws = ws + (w_loaded[c].to(tl.float32),)
        x_ptrs = x_ptr + rows_3d * stride_x + c * CHUNK + local
        r = tl.load(x_ptrs, mask=mask, other=0.0)
        if WEIGHT_FIRST:
            r = after_weight(r, w_loaded[c], N)
        rs = rs + (r.to(tl.float32),)
    squares = rs[0] * rs[0]
    for c in tl.static_range(1, CHUNKS):
        squares = squares + rs[c] * rs[c]
    rstd = tl.rsqrt(tl.sum(tl.sum(squares, axis=2), axis=1) / N + eps)
    ys = ()
    for c in tl.static_range(CHUNKS):
        y = scale_by_weight(rs[c] * rstd[:, None, None], ws[c], weight_offset, dtype, CAST_BEFORE_WEIGHT)
        ys = ys + (y.to(dtype).to(tl.float32),)
    if BLOCK_GROUPS > 1 and not STATIC:
        # Every chunk's scales go into one [ROWS, GROUPS, chunk] block, stored once: a store per
        # chunk converts the amax's layout through shared memory each time (Triton's coalescing
        # picks another layout for the store), two bar.sync a chunk. Measured on one H200 at
        # 4096 / 16384 tokens: 5120 20.00 / 66.65 us against 21.32 / 70.74, 3072 1.03x / 1.02x.
        CHUNKS_PADDED: tl.constexpr = triton.next_power_of_2(CHUNKS)
        chunk_ids = tl.arange(0, CHUNKS_PADDED)[None, None, :]
        scales = tl.zeros((ROWS, BLOCK_GROUPS, CHUNKS_PADDED), tl.float32)
        for c in tl.static_range(CHUNKS):
            scale = scales_of(
                tl.reduce(tl.abs(ys[c]), 2, max_keeping_nan), SCALE_UE8M0, AMAX_TIMES_RECIPROCAL
            )
            scales = tl.where(chunk_ids == c, scale[:, :, None], scales)
            store_codes(ys[c], scale, given, q_ptr, rows_3d, c * CHUNK + local, N, mask, STATIC, HW_CONVERT,
                        SCALE_UE8M0)  # fmt: skip
        scale_offsets = rows_3d * num_groups + chunk_ids * BLOCK_GROUPS + groups[None, :, None]
        tl.store(scale_ptr + scale_offsets, scales, mask=group_mask[:, :, None] & (chunk_ids < CHUNKS))
    else:
        if STATIC:
            scale = tl.broadcast_to(given, (ROWS, BLOCK_GROUPS))
        else:
            magnitude = tl.abs(ys[0])
            for c in tl.static_range(1, CHUNKS):
                magnitude = max_keeping_nan(magnitude, tl.abs(ys[c]))
            amax = tl.reduce(magnitude, 2, max_keeping_nan)
            scale = store_scales(amax, scale_ptr, rows, groups, num_groups, group_mask, SCALE_UE8M0,
                                 AMAX_TIMES_RECIPROCAL)  # fmt: skip
        for c in tl.static_range(CHUNKS):
            store_codes(ys[c], scale, given, q_ptr, rows_3d, c * CHUNK + local, N, mask, STATIC, HW_CONVERT,
                        SCALE_UE8M0)  # fmt: skip


@triton.jit
def _rms_norm_quant_fp8_kernel(
    x_ptr,  # *x.dtype [M, N]: rows to normalise; column stride 1, row stride stride_x
    residual_ptr,  # *x.dtype [M, N]: residual added to x (read only when HAS_RESIDUAL)
    weight_ptr,  # *weight.dtype [N]: per-column scale
    q_ptr,  # *uint8 [M, N] contiguous: the float8_e4m3fn bit patterns (the fp8 output views them)
    scale_ptr,  # *fp32: STATIC: the given scale (1 element, read); else [M, num_groups], written
    residual_out_ptr,  # *x.dtype [M, N] contiguous: r = x + residual (only when HAS_RESIDUAL)
    M,  # number of rows (tokens)
    N,  # row length (hidden size): the normalised dimension
    num_groups,  # groups a row is quantized in: N / group_size (per_group), else 1
    group_size,  # columns of a group: G (per_group), else N
    stride_x,  # elements between the starts of consecutive rows of x
    stride_residual,  # elements between the starts of consecutive rows of residual
    eps,  # added to mean(r^2) before the rsqrt
    weight_offset,  # added to f32(weight) in the fp32-weight form (1.0 for Qwen3-Next), else 0.0
    HAS_RESIDUAL: tl.constexpr,  # add residual first and store r (the add_rms_norm form)
    CAST_BEFORE_WEIGHT: tl.constexpr,  # Llama form: round n to x.dtype before scaling by weight
    STATIC: tl.constexpr,  # the scale is given (static scheme); else computed per group, stored
    SCALE_UE8M0: tl.constexpr,  # round computed scales up to powers of two
    AMAX_TIMES_RECIPROCAL: tl.constexpr,  # scale = amax * fp32(1/448) (CUDA torch), else amax / 448
    HW_FP8_CONVERT: tl.constexpr,  # convert with the GPU's fp8 instruction (not in the interpreter)
    BLOCK_GROUPS: tl.constexpr,  # next_power_of_2(num_groups); CHUNKS > 1: a chunk's groups
    BLOCK_GROUP: tl.constexpr,  # next_power_of_2(group_size); CHUNKS > 1: a chunk's group columns
    ROWS_PER_PROGRAM: tl.constexpr,  # rows each program works on, as one [ROWS, GROUPS, GROUP] block
    CHUNKS: tl.constexpr,  # 1: a row is one padded block; more: exact chunks (norm_only_chunks)
    WEIGHT_FIRST: tl.constexpr,  # the row's values made to depend on the weight (after_weight)
):
    # Inductor's launches pass Python floats as fp64: pin the scalars to fp32 (see rms_norm_triton).
    eps = tl.cast(eps, tl.float32)
    weight_offset = tl.cast(weight_offset, tl.float32)
    if CHUNKS > 1:
        tl.static_assert(not HAS_RESIDUAL, "chunked rows are for the norm-only form")
        _rms_norm_quantize_chunks(
            x_ptr, weight_ptr, q_ptr, scale_ptr, M, N, num_groups, stride_x, eps, weight_offset,
            CAST_BEFORE_WEIGHT, STATIC, SCALE_UE8M0, AMAX_TIMES_RECIPROCAL, HW_FP8_CONVERT,
            BLOCK_GROUPS, BLOCK_GROUP, ROWS_PER_PROGRAM, CHUNKS, WEIGHT_FIRST,
        )  # fmt: skip
        return
    rows = tl.program_id(0) * ROWS_PER_PROGRAM + tl.arange(0, ROWS_PER_PROGRAM)
    groups = tl.arange(0, BLOCK_GROUPS)
    in_group = tl.arange(0, BLOCK_GROUP)
    cols = (groups[:, None] * group_size + in_group[None, :])[None, :, :]
    group_mask = (rows < M)[:, None] & (groups < num_groups)[None, :]  # [ROWS, GROUPS]
    mask = group_mask[:, :, None] & (in_group < group_size)[None, None, :]
    # int64 row offsets: M * N passes 2^31 elements at e.g. 300k tokens of hidden 7168.
    rows = rows.to(tl.int64)
    rows_3d = rows[:, None, None]
    dtype = x_ptr.dtype.element_ty
    w_mask = ((groups < num_groups)[:, None] & (in_group < group_size)[None, :])[None, :, :]
    w_loaded = tl.load(weight_ptr + cols, mask=w_mask, other=0.0)
    w = w_loaded.to(tl.float32)
    given = load_static_scale(scale_ptr, STATIC)

    r = tl.load(x_ptr + rows_3d * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual_ptrs = residual_ptr + rows_3d * stride_residual + cols
        residual = tl.load(residual_ptrs, mask=mask, other=0.0).to(tl.float32)
        # The model adds in x.dtype: round the fp32 sum, store it, normalise the rounded value.
        r = (r.to(tl.float32) + residual).to(dtype)
        if WEIGHT_FIRST:
            r = after_weight(r, w_loaded, N)
        tl.store(residual_out_ptr + rows_3d * N + cols, r, mask=mask)
    elif WEIGHT_FIRST:
        r = after_weight(r, w_loaded, N)
    r = r.to(tl.float32)

    rms_norm_quantize_block(
        r, w, eps, weight_offset, q_ptr, scale_ptr, given, rows, groups, rows_3d, cols, N, num_groups,
        group_mask, mask, dtype, ROWS_PER_PROGRAM, BLOCK_GROUPS, CAST_BEFORE_WEIGHT, STATIC,
        SCALE_UE8M0, AMAX_TIMES_RECIPROCAL, HW_FP8_CONVERT,
    )  # fmt: skip


# Static token counts from which the residual form takes MANY_TOKENS_WARPS warps (norm-only rows:
# from NORM_ONLY_MANY_TOKENS). Measured on one H200 (bf16, the kernel alone in a CUDA graph), 4
# warps against the default:
# - norm-only, default 16 / 8 / 8 warps at hidden 7168 / 4096 / 3072: 27.65 / 16.14 / 14.00 us
#   against 32.42 / 21.17 / 19.51 at 4096 tokens, 1.11-1.20x at 16384; at 512-2048 tokens 4 warps
#   with chunks (below) 1.03-1.56x (7168 per_token 6.08 / 9.41 / 14.78 us against 7.10 / 10.50 /
#   17.99 at 512 / 1024 / 2048, 5120 static 11.00 against 17.14 at 2048), 4 warps alone (4096,
#   7168 per_group) 0.99-1.09x; at 256 tokens 0.93-1.12x (7168 static 4.54 against 4.24), so not;
# - with the residual, 4096 / 16384 tokens: hidden 7168 (default 16) per_group 55.87 / 211.48 us
#   against 52.67 / 195.75, static and per_token within 1%; 5120 (16) 1.01-1.12x; 3072 (8)
#   1.00-1.03x. At 1024-2048 tokens 8 warps were 1.00-1.11x the default and 4 up to 0.96x; the
#   one-shot allreduce kernel (<= MAX_ROWS = 2048 rows) takes this kernel's default warps to equal
#   its fallback bit for bit, so the residual form keeps the default below MANY_TOKENS.
# At 1-64 tokens the default was best.
MANY_TOKENS = 4096
NORM_ONLY_MANY_TOKENS = 512
MANY_TOKENS_WARPS = 4


# Norm-only rows at >= NORM_ONLY_MANY_TOKENS static tokens are held in N / CHUNK exact chunks
# of CHUNK = N's largest power-of-two factor (7168 = 7 x 1024, 3072 = 3 x 1024, 5120 = 5 x 1024),
# not one padded block. Measured on one H200 (bf16, the kernel alone in a CUDA graph), chunks
# against the padded block at 4096 / 16384 tokens: 7168 per_token 1.07x / 1.09x, static 1.15x /
# 1.15x, per_group 0.95x / 0.94x (a prototype); 3072 1.17x / 1.16x, 1.25x / 1.29x, 1.12x / 1.14x;
# 5120 and 6144 1.15-1.52x; at 512-2048 tokens as in the warps comment above; at 1-64 tokens
# 0.85-1.02x (not taken there). With the residual 0.75-0.85x at 7168 (per_group 70.64 us against
# 52.67 at 4096 tokens), 0.95-1.05x at 3072 and 5120: the residual form keeps the padded block.
# Per_group takes chunks only where the padded block wastes >= 1/4 of its groups (3072's 24 of 32
# groups, not 7168's 56 of 64: 0.97x / 1.00x at 4096 / 16384 tokens, with the scales stored
# once). A chunk is at least CHUNK_MIN columns (8 bf16 a thread at 4 warps, one 16-byte load) and
# a row at most CHUNKS_MAX chunks (each chunk is unrolled code).
CHUNK_MIN = 1024
CHUNKS_MAX = 16


def norm_only_chunks(n: int, scheme: str, group_size: int, tokens: int | None) -> int:
    """Chunks the norm-only kernel holds a row of n columns in at a static token count (None:
    dynamic): 1 (one padded block) unless the comment above takes chunks."""
    if tokens is None or tokens < NORM_ONLY_MANY_TOKENS:
        return 1
    chunk = n & -n
    if (
        chunk == n
        or chunk < CHUNK_MIN
        or n // chunk > CHUNKS_MAX
        or _chunk_problem(n, scheme, group_size, n // chunk)
    ):
        return 1
    groups = n // group_size
    if scheme == "per_group" and 4 * groups > 3 * triton.next_power_of_2(groups):
        return 1
    return n // chunk


# Where the kernel makes the row depend on the weight (after_weight, WEIGHT_FIRST). Measured on
# one H200 (bf16, the kernel alone in a CUDA graph, codes equal bit for bit), with against
# without, in two runs of the Llama form:
# - with the residual: hidden 5120 (a padded block of 8192) 1.02-1.07x at 512 tokens, 1.02-1.12x
#   at 2048, 1.09-1.12x at 4096-16384 (static 41.97 -> 38.04 us at 4096); 7168 1.02-1.11x at
#   512-2048, 1.02x at 4096, 0.99-1.00x at 16384; 4096 and 3072 1.00-1.09x; 0.98-1.02x at 1 and
#   64 tokens. Taken at every token count;
# - norm-only in one padded block (hidden 4096; 7168 per_group) 1.00-1.11x at 512-4096 tokens
#   (4096 per_token 16.08 -> 15.04), 0.96-1.02x at 16384 (where the two runs spread by 5%);
#   per_group in chunks (5120, 3072) 1.00-1.06x; static and per_token in chunks (7168, 5120,
#   3072) 0.92-1.01x (3072 static 12.32 -> 13.25 at 4096), the LOP3s only adding instructions
#   where ptxas had issued most loads early. 0.97-1.01x at 1 and 64 tokens. Taken for norm-only
#   from NORM_ONLY_MANY_TOKENS static tokens, except static and per_token rows in chunks;
# - Qwen3-Next's form (fp32 weight, offset 1) at 4096 tokens: per_group 1.12x (7168 norm-only),
#   1.20-1.21x (add+norm 7168 and 5120: 65.31 -> 54.02 us at 7168); add+norm 5120 static 0.97x,
#   per_token 0.99x; the others 0.99-1.01x.


def takes_weight_first(residual: bool, scheme: str, chunks: int, tokens: int | None) -> bool:
    """Whether the kernel's rows depend on the weight's loads (the comment above): with the
    residual, or norm-only from NORM_ONLY_MANY_TOKENS static tokens unless a static or per_token
    row is held in chunks (tokens None: dynamic)."""
    if residual:
        return True
    if tokens is None or tokens < NORM_ONLY_MANY_TOKENS:
        return False
    return chunks == 1 or scheme == "per_group"


def launch_shape(
    num_groups: int, group: int, tokens: int | None = None, norm_only: bool = False
) -> tuple[int, int, int, int]:
    """(BLOCK_GROUPS, BLOCK_GROUP, ROWS_PER_PROGRAM, num_warps) for rows quantized in num_groups
    groups of group columns, with the residual or without (norm_only): the padded block's
    rms_norm_triton.launch_config, but at most MANY_TOKENS_WARPS warps at a static token count
    >= MANY_TOKENS, or >= NORM_ONLY_MANY_TOKENS for norm_only (None: dynamic)."""
    block_groups, block_group = triton.next_power_of_2(num_groups), triton.next_power_of_2(group)
    _, rows, num_warps = launch_config(block_groups * block_group)
    if tokens is not None and tokens >= (NORM_ONLY_MANY_TOKENS if norm_only else MANY_TOKENS):
        num_warps = min(num_warps, MANY_TOKENS_WARPS)
    return block_groups, block_group, rows, num_warps


def rms_norm_quant_fp8_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    weight_offset: float,
    cast_before_weight: bool,
    scheme: str,
    scale: torch.Tensor | None = None,
    group_size: int = 128,
    scale_ue8m0: bool = False,
    residual: torch.Tensor | None = None,
    *,
    wrap: Callable | None = None,
    rows: int | None = None,
    num_warps: int | None = None,
    chunks: int | None = None,
    weight_first: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """RMSNorm of x (or of x + residual) over the last dim, quantized to float8_e4m3fn, as
    rms_norm_quant_fp8_reference / add_rms_norm_quant_fp8_reference compute it. Returns
    (codes, scales, new_residual): codes a new contiguous fp8 tensor of x's shape; scales the
    given scale (static), else new fp32 [..., 1] (per_token) or [..., N / group_size] (per_group);
    new_residual = x + residual in x.dtype, or None when residual is None. `wrap` (e.g.
    torch.library.wrap_triton) is applied to the kernel before launch so make_fx can trace it.
    ``rows`` / ``num_warps`` / ``chunks`` / ``weight_first`` override the launch (rows per program,
    warps, a norm-only row's chunks: norm_only_chunks; rows made to depend on the weight:
    takes_weight_first) for sweeps (benchmarks/tune_rms_norm_quant_fp8.py) and tests; default:
    launch_shape's, norm_only_chunks' and takes_weight_first's (weight_first changes no bit of
    the results)."""
    check_rms_norm_args(x, weight, weight_offset, cast_before_weight, residual)
    check_quant_args(x, scheme, scale, group_size, scale_ue8m0)
    weight = weight.contiguous()  # the kernel reads weight at unit stride
    n = x.shape[-1]
    num_groups, group = (n // group_size, group_size) if scheme == "per_group" else (1, n)
    x_rows = as_rows(x)
    m = x_rows.shape[0]
    # The kernel writes the codes as bytes (see _fp8_e4m3fn_codes); the fp8 tensor is a view of them.
    codes = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    if scale is None:
        scales = torch.empty((*x.shape[:-1], num_groups), dtype=torch.float32, device=x.device)
    else:
        scales = scale
    if residual is None:
        # Never read or written (HAS_RESIDUAL=False): x stands in for the residual pointers.
        residual_rows, residual_out = x_rows, None
    else:
        residual_rows = as_rows(residual)
        residual_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    tokens = math.prod(x.shape[:-1])
    tokens = tokens if isinstance(tokens, int) else None  # None: a dynamic count (tracing)
    block_groups, block_group, default_rows, default_warps = launch_shape(
        num_groups, group, tokens, norm_only=residual is None
    )
    rows_per_program, num_warps = rows or default_rows, num_warps or default_warps
    if chunks is None:  # norm_only_chunks only takes splits the kernel holds
        chunks = 1 if residual is not None else norm_only_chunks(n, scheme, group_size, tokens)
    elif chunks > 1:
        _check_chunks_override(n, scheme, group_size, chunks, residual)
    if weight_first is None:
        weight_first = takes_weight_first(residual is not None, scheme, chunks, tokens)
    if chunks > 1:  # a chunk's [groups, group columns]
        chunk = n // chunks
        block_groups, block_group = (chunk // group_size, group_size) if scheme == "per_group" else (1, chunk)
    kernel = (wrap or (lambda k: k))(_rms_norm_quant_fp8_kernel)
    kernel[(triton.cdiv(m, rows_per_program),)](
        x_rows,
        residual_rows,
        weight,
        codes,
        scales,
        x_rows if residual_out is None else residual_out,
        m,
        n,
        num_groups,
        group,
        x_rows.stride(0),
        residual_rows.stride(0),
        eps,
        weight_offset,
        HAS_RESIDUAL=residual is not None,
        CAST_BEFORE_WEIGHT=cast_before_weight,
        STATIC=scheme == "static",
        SCALE_UE8M0=scale_ue8m0,
        AMAX_TIMES_RECIPROCAL=x.is_cuda,
        HW_FP8_CONVERT=x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1",
        BLOCK_GROUPS=block_groups,
        BLOCK_GROUP=block_group,
        ROWS_PER_PROGRAM=rows_per_program,
        CHUNKS=chunks,
        WEIGHT_FIRST=weight_first,
        num_warps=num_warps,
    )
    return codes.view(FP8_DTYPE), scales, residual_out


def _chunk_problem(n: int, scheme: str, group_size: int, chunks: int) -> str | None:
    """Why a norm-only row of n columns cannot be held in `chunks` exact chunks (None: it can)."""
    chunk = n // chunks
    if chunk * chunks != n or chunk & (chunk - 1):
        return f"chunks={chunks}: a row of {n} columns splits only into chunks of a power-of-two width"
    if scheme == "per_group" and (chunk % group_size or chunk == group_size):
        return f"chunks={chunks}: a per_group chunk of {chunk} columns must hold >= 2 groups of {group_size}"
    return None


def _check_chunks_override(
    n: int, scheme: str, group_size: int, chunks: int, residual: torch.Tensor | None
) -> None:
    """ValueError where a `chunks=` override asks for a split the kernel cannot hold."""
    if residual is not None:
        raise ValueError(f"chunks={chunks}: only a norm-only row (no residual) is held in chunks")
    problem = _chunk_problem(n, scheme, group_size, chunks)
    if problem:
        raise ValueError(problem)
