"""One Triton kernel for SiLU-and-mul + FP8 (float8_e4m3fn) quantization over the last dim.

Unfused: silu(gate) * up writes y in the input dtype, an amax reduction reads y, and a
    scale-and-cast kernel reads y again to write the fp8 codes (the down projection's input).
Fused:   gate and up read once, codes and scales written once; all math in fp32, rounding where
    silu_mul_quant_fp8/reference.py (eager) rounds:
    s     = to_dtype(f32(gate) / (1 + exp(-f32(gate))))        F.silu's own formula
    y32   = f32(to_dtype(f32(s) * f32(up)))
    scale = the given one (static), or max(amax(|y32|) / 448, MIN_SCALE) per row (per_token) or
            per group of G columns (per_group), rounded up to a power of two under scale_ue8m0
    q     = fp8_e4m3fn(clamp(y32 / scale, -448, 448)), stored with the computed scales

The silu is silu_mul_quant_fp8/silu.py.silu_rounded: on a GPU eager's bit for bit, in one of three forms
(silu_form picks it: bf16_mufu for bf16 on sm_90, else expf with div.rn, or with silu_quotient
where registers bind), each checked on every fp32 / bf16 / fp16 input. Under the CPU
interpreter exp is numpy's, torch's CPU silu uses its own vectorised exp: the fp32 silu differs
for 17% of N(0, 9) inputs, by up to 4 ulps (3.3e-7 relative; 4M measured); rounded to
bf16 none of 65536 differed, so an fp32 y is a few ulps off, a bf16/fp16 y rarely one.

Each program holds [ROWS, GROUPS, GROUP] blocks: a per_group program GROUPS groups of G columns,
a static one a tile of up to 1024 columns (no reduction: the columns split among programs, so one
token still spreads over intermediate / width programs), a per_token one a whole row (its amax
needs every column) as a power-of-two block and a tail block, so one reduction over the last axis
gives the amax of a group or a row alike. launch_layout picks the shapes (measured on an H200).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import NamedTuple

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
    store_codes,
    store_quantized,
)
from fusion_passes.lowering.common.rows import as_rows, launch_config
from fusion_passes.lowering.silu_mul_quant_fp8.reference import check_silu_mul_args
from fusion_passes.lowering.silu_mul_quant_fp8.silu import SILU_FORMS, round_to, silu_rounded, takes_mufu_silu

# A static or per_group program: _ELEMENTS_PER_PROGRAM elements, rows of _COLUMNS_PER_PROGRAM
# columns (2 rows of 1024), 16 a thread (4 warps), unless the token count is static and small
# (launch_layout). At 4096 tokens (one H200, bf16, us) 2 rows x 4 warps took 105.4 / 106.4
# (18432 columns, static / per_group) and 13.9 / 14.1 (2048), against 111.0 / 108.6 and 14.7 /
# 14.6 at 4 rows x 8 warps (rms_norm_triton.launch_config's 4096 elements a program).
_COLUMNS_PER_PROGRAM = 1024
_ELEMENTS_PER_PROGRAM = 2048
_ELEMENTS_PER_THREAD = 16
# Small static token counts (tools/tune_rms_norm_quant_fp8.py --op silu_mul, one H200, bf16,
# us): a grid of default programs under _ONE_ROW_PROGRAMS takes one row a program (18432 columns at
# 64 tokens: 4.09 static / 4.26 per_group at 1 row x 4 warps, against 4.67 / 4.96 at 4 rows x 8);
# one still under _MIN_PROGRAMS (about two per SM) takes narrower programs, down to one group or
# _MIN_COLUMNS (1 token of 18432: 144 programs of 128 columns, 1 warp: 1.87 / 2.28 us, where
# before 18 programs of 4 rows, 3 of them masked, took 4.4 / 5.0), at 4 elements a thread and at
# most _DECODE_MAX_WARPS (2048 at 64 tokens: 512 columns, 4 warps 2.46 / 2.54; 2 warps 2.80 / 2.65).
# With the bf16_mufu silu, 256 tokens of 18432 (2304 programs of 2 rows) took 7.71 / 7.68 at one
# row a program against 8.01 / 8.09; 4096 tokens (36864 programs) keep 2 rows.
_ONE_ROW_PROGRAMS = 4096
_MIN_PROGRAMS = 256
_MIN_COLUMNS = 128
_DECODE_ELEMENTS_PER_THREAD = 4
# A per_token decode program whose silu is the cheap bf16_mufu form holds 16 elements a thread,
# not 4 (one H200, bf16, us): 2048 columns at 16 / 64 / 256 tokens took 2.53 / 2.70 / 3.37 at 4
# warps (16 a thread) against 2.72 / 2.91 / 3.51 at 16 warps (4 a thread; div.rn there: 2.54 /
# 2.70 / 3.39); 4096 at 64 tokens 2.97 at 8 warps against 3.24 at 16. Under
# _DECODE_MUFU_MIN_TOKENS it keeps 4: one row alone spreads better over more warps (2048 at 1
# token: 2.6 at 4 warps, 2.2 at 16).
_DECODE_MUFU_ELEMENTS_PER_THREAD = 16
_DECODE_MUFU_MIN_TOKENS = 16
_DECODE_MAX_WARPS = 4
# A per_token program holds a whole row: at intermediate 18432 (one H200, bf16) 16 warps took 6.10
# / 7.11 / 172.2 us at 1 / 64 / 4096 tokens, 32 warps (16 elements a thread) 6.45 / 7.25 / 185.4.
_PER_TOKEN_MAX_WARPS = 16
# From this many lanes a thread (a per_token row of >= 32 * 512 columns at 16 warps), silu's
# division takes silu_quotient, not div.rn: at 18432 columns (36 lanes) div.rn's slow-path call
# held 115 registers, one program an SM, and silu_quotient 62, two (one H200, bf16, us at 4096 /
# 16384 tokens: 174.2 / 677.0 against 134.4 / 526.3). Below, registers do not bind and div.rn's
# shorter fast path wins (2048 columns, 8 lanes: 14.9 / 56.6 against 15.4 / 61.3; static and
# per_group programs, 16 lanes: 0.90-0.96x at >= 4096 tokens with silu_quotient), and so do
# grids of fewer than _MIN_PROGRAMS, which never fill an SM (18432 columns at 1 / 64 tokens:
# 6.14 / 7.18 against 6.44 / 7.41; at 256 tokens 13.74 against 11.25).
_NO_SLOW_PATH_MIN_LANES = 32


@triton.jit
def _silu_mul_rounded(
    gate_ptr, up_ptr, rows_3d, cols, mask, stride_gate, stride_up, HW_CONVERT: tl.constexpr,
    SILU_FORM: tl.constexpr,
):
    """fp32 y = to_dtype(to_dtype(silu(gate)) * up) of a block (masked elements 0), rounded where
    eager rounds."""
    dtype = gate_ptr.dtype.element_ty
    gate = tl.load(gate_ptr + rows_3d * stride_gate + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + rows_3d * stride_up + cols, mask=mask, other=0.0).to(tl.float32)
    silu = silu_rounded(gate, dtype, HW_CONVERT, SILU_FORM)  # masked columns: gate 0 gives silu 0, y 0
    # The product of two bf16/fp16 values is exact in fp32 (8 + 8 or 11 + 11 significant bits):
    # one rounding to the dtype, as eager's multiply in opmath fp32 then rounds it.
    return round_to(silu * up, dtype, HW_CONVERT)


@triton.jit
def _silu_mul_quant_fp8_kernel(
    gate_ptr,  # *dtype [M, N]: silu's input; column stride 1, row stride stride_gate
    up_ptr,  # *dtype [M, N]: the other factor; column stride 1, row stride stride_up
    q_ptr,  # *uint8 [M, N] contiguous: the float8_e4m3fn bit patterns (the fp8 output views them)
    scale_ptr,  # *fp32: STATIC: the given scale (1 element, read); else [M, num_groups], written
    M,  # number of rows (tokens)
    N,  # row length (the MLP's intermediate size): the quantized dimension
    num_groups,  # groups a row is quantized in (per_group: N / G; per_token: 1) or tiled in (static)
    group_size,  # columns of a group: G (per_group), N (per_token), the tile (static)
    stride_gate,  # elements between the starts of consecutive rows of gate
    stride_up,  # elements between the starts of consecutive rows of up
    STATIC: tl.constexpr,  # the scale is given (static scheme); else computed per group, stored
    SCALE_UE8M0: tl.constexpr,  # round computed scales up to powers of two
    AMAX_TIMES_RECIPROCAL: tl.constexpr,  # scale = amax * fp32(1/448) (CUDA torch), else amax / 448
    HW_CONVERT: tl.constexpr,  # compiled for a GPU: libdevice exp, hardware bf16 / fp8 conversions
    SILU_FORM: tl.constexpr,  # how silu is computed with HW_CONVERT (silu_form; the same bits)
    BLOCK_GROUPS: tl.constexpr,  # groups each program covers (a power of two)
    BLOCK_GROUP: tl.constexpr,  # power of two >= group_size, or per_token with a tail: <= N
    BLOCK_TAIL: tl.constexpr,  # per_token: a second block for columns BLOCK_GROUP..N (0: none)
    ROWS_PER_PROGRAM: tl.constexpr,  # rows each program works on, as one [ROWS, GROUPS, GROUP] block
    floor,  # the computed scales' floor, fp32 (common/fp8_triton.kernel_floor)
    QUANT_FORM: tl.constexpr,  # floor site, apply form, saturation (common/fp8_triton.quant_form)
):
    floor = tl.cast(floor, tl.float32)
    rows = tl.program_id(0) * ROWS_PER_PROGRAM + tl.arange(0, ROWS_PER_PROGRAM)
    groups = tl.program_id(1) * BLOCK_GROUPS + tl.arange(0, BLOCK_GROUPS)
    in_group = tl.arange(0, BLOCK_GROUP)
    cols = (groups[:, None] * group_size + in_group[None, :])[None, :, :]
    group_mask = (rows < M)[:, None] & (groups < num_groups)[None, :]  # [ROWS, GROUPS]
    # A static tile may pass the row's end (N = 18432 is 18 tiles of 1024, N = 100 part of one).
    mask = group_mask[:, :, None] & (in_group < group_size)[None, None, :] & (cols < N)
    # int64 row offsets: M * N passes 2^31 elements at 116k tokens of intermediate 18432.
    rows = rows.to(tl.int64)
    rows_3d = rows[:, None, None]
    given = load_static_scale(scale_ptr, STATIC)

    y = _silu_mul_rounded(
        gate_ptr, up_ptr, rows_3d, cols, mask, stride_gate, stride_up, HW_CONVERT, SILU_FORM
    )
    if BLOCK_TAIL > 0:
        # A per_token row of N = 2^k + t columns as two blocks, 2^k and next_power_of_2(t), not one
        # of next_power_of_2(N): 18432 = 16384 + 2048 holds 18 values a thread at 32 warps where
        # 32768 lanes held 32 and spilled (sm_90 SASS: 56 local loads, 62 local stores).
        tail_cols = BLOCK_GROUP + tl.arange(0, BLOCK_TAIL)[None, None, :]
        tail_mask = group_mask[:, :, None] & (tail_cols < N)
        y_tail = _silu_mul_rounded(
            gate_ptr, up_ptr, rows_3d, tail_cols, tail_mask, stride_gate, stride_up, HW_CONVERT,
            SILU_FORM,
        )
        tail_amax = tl.reduce(tl.abs(y_tail), 2, max_keeping_nan)
    else:
        tail_amax = 0.0

    scale = store_quantized(
        y, q_ptr, scale_ptr, given, rows, groups, rows_3d, cols, N, num_groups, group_mask, mask,
        tail_amax, ROWS_PER_PROGRAM, BLOCK_GROUPS, STATIC, SCALE_UE8M0, AMAX_TIMES_RECIPROCAL, HW_CONVERT,
        floor, QUANT_FORM,
    )  # fmt: skip
    if BLOCK_TAIL > 0:
        store_codes(y_tail, scale, given, q_ptr, rows_3d, tail_cols, N, tail_mask, STATIC, HW_CONVERT,
                    SCALE_UE8M0, QUANT_FORM)  # fmt: skip


def _pow2_floor(v: int) -> int:
    """The largest power of two <= v, at least 1."""
    return 1 << max(0, v.bit_length() - 1)


class LaunchLayout(NamedTuple):
    """How silu_mul_quant_fp8_triton covers rows of n columns (see launch_layout)."""

    num_groups: int  # groups (per_group), 1 (per_token) or tiles (static) a row is cut in
    group: int  # columns of one: G, n, or the tile
    block_groups: int  # of them a program covers (grid axis 1: cdiv(num_groups, block_groups))
    block_group: int  # lanes of one: next_power_of_2(group), or per_token 2^k <= n with a tail
    block_tail: int  # per_token: lanes of the tail block for columns block_group..n (0: none)
    rows: int  # rows per program (grid axis 0: cdiv(tokens, rows))
    num_warps: int


def silu_form(layout: LaunchLayout, tokens: int | None, mufu_silu: bool) -> str:
    """How the launch computes silu (SILU_FORMS; every form gives eager's bits): "bf16_mufu" with
    mufu_silu (silu_mul_quant_fp8/silu.py.takes_mufu_silu); otherwise "silu_quotient" where
    divides_without_slow_path, else "div_rn"."""
    if mufu_silu:
        return "bf16_mufu"
    return "silu_quotient" if divides_without_slow_path(layout, tokens) else "div_rn"


def divides_without_slow_path(layout: LaunchLayout, tokens: int | None = None) -> bool:
    """Whether the launch's silu divides by silu_quotient: at >= _NO_SLOW_PATH_MIN_LANES lanes a
    thread, where div.rn's registers would cost programs an SM, unless a static token count
    (tokens; None: dynamic) gives a grid of fewer than _MIN_PROGRAMS."""
    lanes = (layout.block_group + layout.block_tail) * layout.block_groups * layout.rows
    if tokens is not None:
        programs = triton.cdiv(tokens, layout.rows) * triton.cdiv(layout.num_groups, layout.block_groups)
        if programs < _MIN_PROGRAMS:
            return False
    return lanes >= _NO_SLOW_PATH_MIN_LANES * 32 * layout.num_warps


def launch_layout(
    n: int,
    scheme: str,
    group_size: int = 128,
    tokens: int | None = None,
    columns: int | None = None,
    mufu_silu: bool = False,
) -> LaunchLayout:
    """The launch of rows of n columns: per_group rows in groups of group_size, a program covering
    _COLUMNS_PER_PROGRAM columns (BLOCK_GROUPS groups) of _ELEMENTS_PER_PROGRAM / that rows; a
    static row in tiles of as many; a per_token row whole, as a power-of-two block plus a tail
    block, its warps rms_norm_triton.launch_config's (16 to 32 real elements a thread).

    tokens: a static token count (None: dynamic, and the launch never depends on it). A static or
    per_group grid of fewer than _ONE_ROW_PROGRAMS programs takes one row a program, then, under
    _MIN_PROGRAMS, narrower programs (see the constants); a per_token grid under _MIN_PROGRAMS
    takes one row a program, 4 elements a thread (16 with mufu_silu, the bf16_mufu form's cheaper
    silu, from _DECODE_MUFU_MIN_TOKENS; at most _PER_TOKEN_MAX_WARPS warps).
    columns: the columns a static or per_group program covers (a power of two), for sweeps."""
    if scheme == "per_token":
        block_group, block_tail = triton.next_power_of_2(n), 0
        if block_group != n:  # 2^k + a tail block, not one block of next_power_of_2(n)
            block_group //= 2
            block_tail = triton.next_power_of_2(n - block_group)
        _, rows, num_warps = launch_config(n)
        if tokens is not None and triton.cdiv(tokens, rows) < _MIN_PROGRAMS:
            wide = mufu_silu and tokens >= _DECODE_MUFU_MIN_TOKENS
            per_thread = _DECODE_MUFU_ELEMENTS_PER_THREAD if wide else _DECODE_ELEMENTS_PER_THREAD
            rows, num_warps = 1, _pow2_floor(n // (32 * per_thread))
        return LaunchLayout(1, n, 1, block_group, block_tail, rows, min(num_warps, _PER_TOKEN_MAX_WARPS))
    width = min(triton.next_power_of_2(n), columns or _COLUMNS_PER_PROGRAM)
    rows = max(1, _ELEMENTS_PER_PROGRAM // width)
    num_warps = _pow2_floor(rows * width // (32 * _ELEMENTS_PER_THREAD))
    narrowest = group_size if scheme == "per_group" else min(width, _MIN_COLUMNS)
    if columns is None and tokens is not None:
        programs = lambda rows, width: triton.cdiv(tokens, rows) * triton.cdiv(n, width)  # noqa: E731
        if programs(rows, width) < _ONE_ROW_PROGRAMS:
            rows = 1
            while width > narrowest and programs(rows, width) < _MIN_PROGRAMS:
                width //= 2
            num_warps = min(_DECODE_MAX_WARPS, _pow2_floor(width // (32 * _DECODE_ELEMENTS_PER_THREAD)))
    if scheme == "per_group":
        num_groups, group = n // group_size, group_size
        block_group = triton.next_power_of_2(group)
        block_groups = min(max(1, width // block_group), triton.next_power_of_2(num_groups))
        return LaunchLayout(num_groups, group, block_groups, block_group, 0, rows, num_warps)
    # static: tiles of width columns, the last one masked at n
    return LaunchLayout(triton.cdiv(n, width), width, 1, width, 0, rows, num_warps)


def silu_mul_quant_fp8_triton(
    gate: torch.Tensor,
    up: torch.Tensor,
    quant: QuantFP8,
    *,
    wrap: Callable | None = None,
    rows: int | None = None,
    num_warps: int | None = None,
    columns: int | None = None,
    form: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """silu(gate) * up quantized to float8_e4m3fn over the last dim, as
    silu_mul_quant_fp8_reference computes it. Returns (codes, scales): codes a new contiguous fp8
    tensor of gate's shape; scales the given scale (static), else new fp32 [..., 1] (per_token) or
    [..., N / group_size] (per_group). gate and up may be row-strided views (the two halves of one
    gate_up projection) and are read in place. `wrap` (e.g. torch.library.wrap_triton) is applied
    to the kernel before launch so make_fx can trace it. ``rows`` / ``num_warps`` / ``columns``
    override the launch shape for sweeps (tools/tune_rms_norm_quant_fp8.py --op silu_mul);
    default: launch_layout's for the token count when it is static (an int, not a SymInt).
    ``form`` picks how silu is computed (SILU_FORMS, the same bits each; default: silu_form's
    for the launch and device)."""
    check_silu_mul_args(gate, up)
    quant.check(gate)
    problem = kernel_problem(quant)
    if problem:
        raise ValueError(f"silu_mul_quant_fp8: {problem}")
    scheme, scale, group_size, scale_ue8m0 = quant[:4]
    n = gate.shape[-1]
    tokens = math.prod(gate.shape[:-1])
    tokens = tokens if isinstance(tokens, int) else None  # a SymInt: dynamic
    if form is not None and form not in SILU_FORMS:
        raise ValueError(f"silu_mul_quant_fp8: form must be one of {list(SILU_FORMS)}, got {form!r}")
    if form == "bf16_mufu" and gate.dtype != torch.bfloat16:
        raise ValueError(f"silu_mul_quant_fp8: the bf16_mufu silu is for bf16 inputs, got {gate.dtype}")
    hw_convert = gate.is_cuda and os.environ.get("TRITON_INTERPRET") != "1"
    if form is None:
        capability = torch.cuda.get_device_capability(gate.device) if hw_convert else None
        mufu = takes_mufu_silu(gate.dtype, capability)
    else:
        mufu = form == "bf16_mufu"
    layout = launch_layout(n, scheme, group_size, tokens, columns, mufu)
    layout = layout._replace(rows=rows or layout.rows, num_warps=num_warps or layout.num_warps)
    rows_per_program, num_warps = layout.rows, layout.num_warps
    form = form or silu_form(layout, tokens, mufu)
    gate_rows, up_rows = as_rows(gate), as_rows(up)
    m = gate_rows.shape[0]
    # The kernel writes the codes as bytes (see common/fp8_triton.py's _fp8_e4m3fn_codes); the fp8 tensor is a view of them.
    codes = torch.empty(gate.shape, dtype=torch.uint8, device=gate.device)
    if scale is None:
        scales = torch.empty((*gate.shape[:-1], layout.num_groups), dtype=torch.float32, device=gate.device)
    else:
        scales = scale
    kernel = (wrap or (lambda k: k))(_silu_mul_quant_fp8_kernel)
    kernel[(triton.cdiv(m, rows_per_program), triton.cdiv(layout.num_groups, layout.block_groups))](
        gate_rows,
        up_rows,
        codes,
        scales,
        m,
        n,
        layout.num_groups,
        layout.group,
        gate_rows.stride(0),
        up_rows.stride(0),
        STATIC=scheme == "static",
        SCALE_UE8M0=scale_ue8m0,
        AMAX_TIMES_RECIPROCAL=gate.is_cuda,
        HW_CONVERT=hw_convert,
        SILU_FORM=SILU_FORMS[form],
        BLOCK_GROUPS=layout.block_groups,
        BLOCK_GROUP=layout.block_group,
        BLOCK_TAIL=layout.block_tail,
        ROWS_PER_PROGRAM=rows_per_program,
        floor=kernel_floor(quant, gate.dtype),
        QUANT_FORM=quant_form(quant, gate.dtype, gate.device),
        num_warps=num_warps,
    )
    return codes.view(FP8_DTYPE), scales
