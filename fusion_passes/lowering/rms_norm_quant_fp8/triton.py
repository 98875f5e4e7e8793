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

from fusion_passes.lowering.common.fp8 import FP8_DTYPE, QuantFP8
from fusion_passes.lowering.common.fp8_triton import (
    kernel_floor,
    kernel_problem,
    load_static_scale,
    max_keeping_nan,
    quant_form,
    scales_of,
    store_codes,
    store_quantized,
    store_scales,
)
from fusion_passes.lowering.rms_norm.reference import RMSNormForm, check_rms_norm_args
from fusion_passes.lowering.rms_norm_quant_fp8.launch import (
    NormQuantLaunch,
    check_chunks_override,
    launch_policy,
    launch_shape,
    norm_only_chunks,
    takes_weight_first,
)
from fusion_passes.lowering.common.rows import as_rows
from fusion_passes.lowering.common.norm_triton import scale_by_weight

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
    floor,  # fp32: the computed scales' floor (common/fp8_triton.kernel_floor)
    QUANT_FORM: tl.constexpr,  # floor site, apply form, saturation (common/fp8_triton.quant_form)
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
        ROWS, BLOCK_GROUPS, STATIC, SCALE_UE8M0, AMAX_TIMES_RECIPROCAL, HW_CONVERT, floor, QUANT_FORM,
    )  # fmt: skip


@triton.jit
def _rms_norm_quantize_chunks(
    x_ptr, weight_ptr, q_ptr, scale_ptr, M, N, num_groups, stride_x, eps, weight_offset,
    CAST_BEFORE_WEIGHT: tl.constexpr, STATIC: tl.constexpr, SCALE_UE8M0: tl.constexpr,
    AMAX_TIMES_RECIPROCAL: tl.constexpr, HW_CONVERT: tl.constexpr, BLOCK_GROUPS: tl.constexpr,
    BLOCK_GROUP: tl.constexpr, ROWS: tl.constexpr, CHUNKS: tl.constexpr, WEIGHT_FIRST: tl.constexpr,
    floor, QUANT_FORM: tl.constexpr,
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
                tl.reduce(tl.abs(ys[c]), 2, max_keeping_nan), SCALE_UE8M0, AMAX_TIMES_RECIPROCAL, floor,
                QUANT_FORM,
            )
            scales = tl.where(chunk_ids == c, scale[:, :, None], scales)
            store_codes(ys[c], scale, given, q_ptr, rows_3d, c * CHUNK + local, N, mask, STATIC, HW_CONVERT,
                        SCALE_UE8M0, QUANT_FORM)  # fmt: skip
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
                                 AMAX_TIMES_RECIPROCAL, floor, QUANT_FORM)  # fmt: skip
        for c in tl.static_range(CHUNKS):
            store_codes(ys[c], scale, given, q_ptr, rows_3d, c * CHUNK + local, N, mask, STATIC, HW_CONVERT,
                        SCALE_UE8M0, QUANT_FORM)  # fmt: skip


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
    floor,  # the computed scales' floor, fp32 (common/fp8_triton.kernel_floor)
    QUANT_FORM: tl.constexpr,  # floor site, apply form, saturation (common/fp8_triton.quant_form)
):
    # Inductor's launches pass Python floats as fp64: pin the scalars to fp32 (see rms_norm_triton).
    eps = tl.cast(eps, tl.float32)
    weight_offset = tl.cast(weight_offset, tl.float32)
    floor = tl.cast(floor, tl.float32)
    if CHUNKS > 1:
        tl.static_assert(not HAS_RESIDUAL, "chunked rows are for the norm-only form")
        _rms_norm_quantize_chunks(
            x_ptr, weight_ptr, q_ptr, scale_ptr, M, N, num_groups, stride_x, eps, weight_offset,
            CAST_BEFORE_WEIGHT, STATIC, SCALE_UE8M0, AMAX_TIMES_RECIPROCAL, HW_FP8_CONVERT,
            BLOCK_GROUPS, BLOCK_GROUP, ROWS_PER_PROGRAM, CHUNKS, WEIGHT_FIRST, floor, QUANT_FORM,
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
        SCALE_UE8M0, AMAX_TIMES_RECIPROCAL, HW_FP8_CONVERT, floor, QUANT_FORM,
    )  # fmt: skip


def rms_norm_quant_fp8_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    norm: RMSNormForm,
    quant: QuantFP8,
    residual: torch.Tensor | None = None,
    *,
    wrap: Callable | None = None,
    rows: int | None = None,
    num_warps: int | None = None,
    chunks: int | None = None,
    weight_first: bool | None = None,
    policy: NormQuantLaunch | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """RMSNorm of x (or of x + residual) over the last dim, quantized to float8_e4m3fn, as
    reference.rms_norm_quant_fp8_reference / add_rms_norm_quant_fp8_reference compute it. Returns
    (codes, scales, new_residual): codes a new contiguous fp8 tensor of x's shape; scales the
    given scale (static), else new fp32 [..., 1] (per_token) or [..., N / group_size] (per_group);
    new_residual = x + residual in x.dtype, or None when residual is None. `wrap` (e.g.
    torch.library.wrap_triton) is applied to the kernel before launch so make_fx can trace it.
    ``rows`` / ``num_warps`` / ``chunks`` / ``weight_first`` override the launch (rows per program,
    warps, a norm-only row's chunks: norm_only_chunks; rows made to depend on the weight:
    takes_weight_first) for sweeps (tools/tune_rms_norm_quant_fp8.py) and tests; default:
    launch_shape's, norm_only_chunks' and takes_weight_first's under ``policy``, the launch table
    row of x's device (launch.launch_policy) unless given (weight_first changes no bit of
    the results)."""
    eps, weight_offset, cast_before_weight = norm
    scheme, scale, group_size, scale_ue8m0 = quant[:4]
    check_rms_norm_args(x, weight, weight_offset, cast_before_weight, residual)
    quant.check(x)
    problem = kernel_problem(quant)
    if problem:
        raise ValueError(f"rms_norm_quant_fp8: {problem}")
    weight = weight.contiguous()  # the kernel reads weight at unit stride
    n = x.shape[-1]
    num_groups, group = quant.groups(n)
    x_rows = as_rows(x)
    m = x_rows.shape[0]
    # The kernel writes the codes as bytes (see common/fp8_triton.py's _fp8_e4m3fn_codes); the fp8 tensor is a view of them.
    codes = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    if scale is None:
        scales = torch.empty((*x.shape[:-1], num_groups), dtype=torch.float32, device=x.device)
    else:
        scales = scale
    if residual is None:
        # Never read or written (HAS_RESIDUAL=False): None for their pointers (constants, no launch
        # arguments; tensors standing in would cost host time at every launch).
        residual_rows, residual_out = None, None
    else:
        residual_rows = as_rows(residual)
        residual_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    tokens = math.prod(x.shape[:-1])
    tokens = tokens if isinstance(tokens, int) else None  # None: a dynamic count (tracing)
    policy = policy or launch_policy(x.device)
    block_groups, block_group, default_rows, default_warps = launch_shape(
        num_groups, group, tokens, residual is None, policy
    )
    rows_per_program, num_warps = rows or default_rows, num_warps or default_warps
    if chunks is None:  # norm_only_chunks only takes splits the kernel holds
        chunks = 1 if residual is not None else norm_only_chunks(n, scheme, group_size, tokens, policy)
    elif chunks > 1:
        check_chunks_override(n, scheme, group_size, chunks, residual)
    if weight_first is None:
        weight_first = takes_weight_first(residual is not None, scheme, chunks, tokens, policy)
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
        residual_out,
        m,
        n,
        num_groups,
        group,
        x_rows.stride(0),
        0 if residual_rows is None else residual_rows.stride(0),
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
        floor=kernel_floor(quant, x.dtype),
        QUANT_FORM=quant_form(quant, x.dtype, x.device),
        num_warps=num_warps,
    )
    return codes.view(FP8_DTYPE), scales, residual_out
