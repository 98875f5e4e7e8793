"""One Triton kernel for the pre-attention path: RMSNorm of q and k (per head or over all heads of a
token) and rotate_half RoPE on the first R dims of every head, both tensors in one launch.

Unfused (stock Inductor): a norm kernel per tensor (or a reduction and a pointwise kernel for the
    whole-row norm), then the RoPE pointwise kernels: 2 to 6 launches, and q and k each written and
    read back once more between them.
Fused:   one grid; programs [0, q_programs) take q rows, the rest k rows. Each program loads its rows
    once from DRAM, as three column tiles of every head (the first and second halves of the rotary
    dims and the pass-through dims, so rotate_half needs no data movement: full RoPE, and the
    whole-row norm, whose steps of heads are all held at once), or as a whole-head tile and a
    rotary tile with shifted partner loads that L1 serves (partial RoPE); it reduces the squares
    in fp32 and writes each output element once, rounding exactly where qk_norm_rope/reference.py
    does:
        y        = to_x_dtype(scaled norm)                      (rms_norm's two rounding forms)
        out[:R/2]  = to_x_dtype(to_x_dtype(y1 * c1) - to_x_dtype(y2 * s1))
        out[R/2:R] = to_x_dtype(to_x_dtype(y2 * c2) + to_x_dtype(y1 * s2))
        out[R:]    = y[R:]
    Outputs are contiguous [B, S, H, D] (returned as their [B, H, S, D] transposes): every token's
    heads are one contiguous run, the layout a KV cache and flash attention read.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from fusion_passes.lowering.common.cache_slots import slots_mode
from fusion_passes.lowering.qk_norm_rope.reference import check_qk_norm_rope_args, check_qk_norm_rope_cache_args
from fusion_passes.lowering.common.norm_triton import scale_by_weight

# Per-head mode: elements one program handles (ROWS heads of D). Small enough that a decode step
# (1 token, 64 + 4 heads of 128) still spreads over several programs, large enough that 16k-token
# prefills do not launch one tiny program per head.
_ELEMENTS_PER_PROGRAM = 2048
_ELEMENTS_PER_THREAD = 16
_MAX_WARPS = 16
# A whole-row norm (MiniMax-M2) takes the split tiles, one token per program, its heads read once
# and held in registers: all in one step in 16 warps at a static count of up to
# WHOLE_ROW_WIDE_MAX_TOKENS tokens (a decode step: few programs, each spread wide); otherwise
# (a dynamic count too) in steps of WHOLE_ROW_STEP_HEADS heads (at most SPLIT_MAX_STEPS of them)
# in 4 warps. Measured on an H200 (bf16, CUDA graph, 48 + 8 heads of 128,
# tools/tune_qk_norm_rope.py --models minimax-m2), us:
#   tokens                       1     64    512   1024   4096   16384
#   split, 1 step, 16 warps     2.9   3.0
#   split, 1 step, 4 warps                  6.47  10.74  41.46  156.84
#   split, 3 steps of 16, 4 w         3.83  5.94   9.66  33.26  124.73
#   whole-head tile, 16 x 4 w   5.7   5.33  8.09  11.39  39.38  142.06
WHOLE_ROW_WIDE_MAX_TOKENS = 64
WHOLE_ROW_STEP_HEADS = 16
# Steps a whole-row norm of the split tiles may take (_whole_row_split_steps writes them out).
SPLIT_MAX_STEPS = 4
_WHOLE_ROW_SPLIT_WARPS = 4


@triton.jit
def _rounded(x, dtype):
    """x (fp32) rounded to the activations' dtype and back: where the model rounds."""
    return x.to(dtype).to(tl.float32)


@triton.jit
def _token_offset(token, S, stride_b, stride_s, ONE_SEQ: tl.constexpr):
    """Element offset (int64) of token's row, batch * stride_b + seq * stride_s; a batch of one
    sequence (the flattened tokens of a serving step) needs no division by S."""
    if ONE_SEQ:
        return token.to(tl.int64) * stride_s
    return (token // S).to(tl.int64) * stride_b + (token % S).to(tl.int64) * stride_s


@triton.jit
def _pair_cols(cols, HALF: tl.constexpr, INTERLEAVED: tl.constexpr):
    """The columns of each rotated pair's two elements: (j, j + R/2) for rotate_half, (2j, 2j + 1)
    for GPT-J pairs (interleaved), j < R/2. Every other step is the same for both styles."""
    if INTERLEAVED:
        return 2 * cols, 2 * cols + 1
    return cols, HALF + cols


@triton.jit
def _load_cols(ptr, cols, row_mask, col_mask, PER_ROW: tl.constexpr):
    """Columns as fp32: of each row's own pointer ([ROWS, 1]), or of one shared row loaded once
    (a per-head norm's [D] weight, a whole-row program's cos / sin) and broadcast over the rows."""
    if PER_ROW:
        return tl.load(ptr + cols, mask=row_mask & col_mask, other=0.0).to(tl.float32)
    return tl.load(ptr + cols, mask=col_mask, other=0.0).to(tl.float32)


@triton.jit
def _norm_rope_rows(
    x_ptr,  # *dtype [B, S, H, D] input rows (unit column stride)
    w_ptr,  # *w.dtype [D] (per head) or [H * D] (whole row) norm weight
    out_ptr,  # *dtype [B, S, H, D] contiguous output
    cos_ptr,  # *dtype [B or 1, S, R] (unit column stride)
    sin_ptr,  # *dtype [B or 1, S, R] (unit column stride)
    local_pid,  # this program's index among the programs of this tensor
    n_rows,  # B * S * H: head rows of this tensor
    S,  # tokens per sequence
    H: tl.constexpr,  # heads of this tensor
    stride_b,  # x strides (elements) of batch, token and head
    stride_s,
    stride_h,
    cos_stride_b,  # cos / sin strides of batch (0 when broadcast) and token
    cos_stride_s,
    sin_stride_b,
    sin_stride_s,
    eps,
    weight_offset,
    HALF: tl.constexpr,  # R / 2: rotary dims in each half
    PASS: tl.constexpr,  # D - R: dims passed through unrotated
    BLOCK_HALF: tl.constexpr,  # next_power_of_2(HALF)
    BLOCK_PASS: tl.constexpr,  # next_power_of_2(PASS), or 1 when PASS == 0
    ROWS: tl.constexpr,  # head rows per program (per head) / power of two >= H (whole row)
    NORM_PER_HEAD: tl.constexpr,  # normalise each head alone, else all heads of a token together
    CAST_BEFORE_WEIGHT: tl.constexpr,  # Llama form (see rms_norm_triton.scale_by_weight)
    ONE_SEQ: tl.constexpr,  # B == 1 (see _token_offset)
    INTERLEAVED: tl.constexpr,  # GPT-J pairs (see _pair_cols)
    cache_stride_b=0,  # SLOTS > 0: out_ptr is a cache [B, H, T, D] with these strides
    cache_stride_h=0,
    cache_stride_t=0,
    pos_ptr=None,  # SLOTS > 0: the slots (see _seq_and_token)
    T=0,
    SLOTS: tl.constexpr = 0,  # 0: out_ptr a new [B, S, H, D] tensor; 1 / 2: a cache (see _seq_and_token)
):
    D: tl.constexpr = 2 * HALF + PASS
    lanes = tl.arange(0, ROWS)
    if NORM_PER_HEAD:
        rows = local_pid * ROWS + lanes
        row_mask = rows < n_rows
    else:  # one token per program: its H heads
        rows = local_pid * H + lanes
        row_mask = lanes < H
    # int32 row arithmetic, H a constant: a division by it is a multiply and a shift (a runtime
    # divisor costs a reciprocal sequence per row).
    head = rows % H
    token = rows // H
    x_row = x_ptr + _token_offset(token, S, stride_b, stride_s, ONE_SEQ) + head * stride_h
    if NORM_PER_HEAD:
        cos_row = (cos_ptr + _token_offset(token, S, cos_stride_b, cos_stride_s, ONE_SEQ))[:, None]
        sin_row = (sin_ptr + _token_offset(token, S, sin_stride_b, sin_stride_s, ONE_SEQ))[:, None]
    else:  # one token: its cos / sin row loaded once and broadcast over the heads (loaded per
        # head row, L1 would serve it H times: as many loads as of x itself, at D = 2R)
        cos_row = cos_ptr + _token_offset(local_pid, S, cos_stride_b, cos_stride_s, ONE_SEQ)
        sin_row = sin_ptr + _token_offset(local_pid, S, sin_stride_b, sin_stride_s, ONE_SEQ)
    rows = rows.to(tl.int64)
    cols = tl.arange(0, BLOCK_HALF)
    lo, hi = _pair_cols(cols, HALF, INTERLEAVED)
    half_mask = row_mask[:, None] & (cols < HALF)[None, :]
    pcols = tl.arange(0, BLOCK_PASS)
    pass_mask = row_mask[:, None] & (pcols < PASS)[None, :]
    # Loads first (x, weight, cos, sin), so their latencies overlap before the reduction.
    x1 = tl.load(x_row[:, None] + lo[None, :], mask=half_mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_row[:, None] + hi[None, :], mask=half_mask, other=0.0).to(tl.float32)
    if NORM_PER_HEAD:  # one [D] weight shared by every head: load it once, broadcast over rows
        w1 = tl.load(w_ptr + lo, mask=cols < HALF, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + hi, mask=cols < HALF, other=0.0).to(tl.float32)[None, :]
    else:  # each head its own slice of the [H * D] weight
        w_row = (w_ptr + head * D)[:, None]
        w1 = tl.load(w_row + lo[None, :], mask=half_mask, other=0.0).to(tl.float32)
        w2 = tl.load(w_row + hi[None, :], mask=half_mask, other=0.0).to(tl.float32)
    in_half = (cols < HALF)[None, :]
    c1 = _load_cols(cos_row, lo[None, :], row_mask[:, None], in_half, NORM_PER_HEAD)
    c2 = _load_cols(cos_row, hi[None, :], row_mask[:, None], in_half, NORM_PER_HEAD)
    s1 = _load_cols(sin_row, lo[None, :], row_mask[:, None], in_half, NORM_PER_HEAD)
    s2 = _load_cols(sin_row, hi[None, :], row_mask[:, None], in_half, NORM_PER_HEAD)
    squares = tl.sum(x1 * x1 + x2 * x2, axis=1)
    if PASS > 0:
        xp_ptrs = x_row[:, None] + 2 * HALF + pcols[None, :]
        xp = tl.load(xp_ptrs, mask=pass_mask, other=0.0).to(tl.float32)
        if NORM_PER_HEAD:
            wp = tl.load(w_ptr + 2 * HALF + pcols, mask=pcols < PASS, other=0.0)
            wp = wp.to(tl.float32)[None, :]
        else:
            wp_ptrs = (w_ptr + head * D)[:, None] + 2 * HALF + pcols[None, :]
            wp = tl.load(wp_ptrs, mask=pass_mask, other=0.0).to(tl.float32)
        squares += tl.sum(xp * xp, axis=1)
    else:
        xp, wp = x1, w1  # unused (PASS == 0)

    # Masked lanes hold 0: they add nothing to the sums; divide by the true widths.
    if NORM_PER_HEAD:
        rstd = tl.rsqrt(squares / D + eps)[:, None]
    else:
        rstd = tl.rsqrt(tl.sum(squares, axis=0) / (H * D) + eps)
    if SLOTS > 0:  # rows into the cache [B, H, T, D] at their tokens' slots (see _seq_and_token)
        seq, s = _seq_and_token(token, S, ONE_SEQ)
        if SLOTS == 1:
            slot = s + tl.load(pos_ptr).to(tl.int64)
        else:
            slot = tl.load(pos_ptr + s, mask=row_mask, other=0).to(tl.int64)
        in_cache = (row_mask & (slot >= 0) & (slot < T))[:, None]
        out_row = (out_ptr + seq * cache_stride_b + head.to(tl.int64) * cache_stride_h + slot * cache_stride_t)[:, None]
        half_mask = half_mask & in_cache
        pass_mask = pass_mask & in_cache
    else:
        out_row = out_ptr + rows[:, None] * D
    _rope_store(
        x1, x2, xp, w1, w2, wp, c1, c2, s1, s2, rstd, weight_offset, out_row,
        lo[None, :], hi[None, :], pcols[None, :], half_mask, pass_mask, HALF, PASS,
        CAST_BEFORE_WEIGHT, cos_ptr.dtype.element_ty,
    )  # fmt: skip


@triton.jit
def _seq_and_token(token, S, ONE_SEQ: tl.constexpr):
    """(sequence, token within it) of flat token indices, int64."""
    if ONE_SEQ:
        return (token * 0).to(tl.int64), token.to(tl.int64)
    return (token // S).to(tl.int64), (token % S).to(tl.int64)


# A cache row's slot is loaded where the row is stored (_norm_rope_rows, _copy_rows_to_cache), not
# in a helper: Inductor's analysis of which tensors a launch writes follows a stored pointer back
# through every argument of a call that made it, and would take the slots' tensor for written.
# SLOTS 1: pos_ptr holds the first slot, token s of a sequence goes to it + s; 2: pos_ptr holds a
# slot per token (lowering/common/cache_slots.py). A slot outside [0, T) writes nothing (torch's
# index_copy raises there).


@triton.jit
def _copy_rows_to_cache(
    v_ptr, cache_ptr, local_pid, n_rows, S, H: tl.constexpr, v_stride_b, v_stride_s, v_stride_h,
    cache_stride_b, cache_stride_h, cache_stride_t, pos_ptr, T, DV: tl.constexpr, BLOCK_DV: tl.constexpr,
    ROWS: tl.constexpr, NORM_PER_HEAD: tl.constexpr, SLOTS: tl.constexpr, ONE_SEQ: tl.constexpr,
):  # fmt: skip
    """v [B, S, H, DV] copied into its cache [B, H, T, DV] at the tokens' slots: the head rows a k
    program of _norm_rope_rows takes (ROWS of them per head, a token's H per whole row)."""
    lanes = tl.arange(0, ROWS)
    if NORM_PER_HEAD:
        rows = local_pid * ROWS + lanes
        row_mask = rows < n_rows
    else:
        rows = local_pid * H + lanes
        row_mask = lanes < H
    head = rows % H
    token = rows // H
    src = (v_ptr + _token_offset(token, S, v_stride_b, v_stride_s, ONE_SEQ) + head * v_stride_h)[:, None]
    seq, s = _seq_and_token(token, S, ONE_SEQ)
    if SLOTS == 1:
        slot = s + tl.load(pos_ptr).to(tl.int64)
    else:
        slot = tl.load(pos_ptr + s, mask=row_mask, other=0).to(tl.int64)
    dst = (cache_ptr + seq * cache_stride_b + head.to(tl.int64) * cache_stride_h + slot * cache_stride_t)[:, None]
    cols = tl.arange(0, BLOCK_DV)[None, :]
    mask = (row_mask & (slot >= 0) & (slot < T))[:, None] & (cols < DV)
    tl.store(dst + cols, tl.load(src + cols, mask=mask, other=0.0), mask=mask)


@triton.jit
def _rope_store(
    x1, x2, xp, w1, w2, wp, c1, c2, s1, s2, rstd, weight_offset, out_row, lo, hi, pcols, half_mask,
    pass_mask, HALF: tl.constexpr, PASS: tl.constexpr, CAST_BEFORE_WEIGHT: tl.constexpr, rope_dtype,
):  # fmt: skip
    """The split tiles' outputs: x1, x2 (the rotary halves) and xp (pass-through, used when PASS)
    normalised by rstd, scaled by their weights, rotated and stored at out_row ([ROWS, 1]), the
    pairs' two elements at columns lo and hi (see _pair_cols).
    The RoPE rounds each product and the sum to rope_dtype, cos / sin's dtype (see the reference)."""
    dtype = out_row.dtype.element_ty
    y1 = _rounded(scale_by_weight(x1 * rstd, w1, weight_offset, dtype, CAST_BEFORE_WEIGHT), dtype)
    y2 = _rounded(scale_by_weight(x2 * rstd, w2, weight_offset, dtype, CAST_BEFORE_WEIGHT), dtype)
    # transformers' RoPE runs in x.dtype: every product and the sum are rounded (fp32 cos / sin:
    # Olmo2's and gpt-fast's fp32 math, rounded once at the store).
    o1 = _rounded(_rounded(y1 * c1, rope_dtype) - _rounded(y2 * s1, rope_dtype), rope_dtype)
    o2 = _rounded(_rounded(y2 * c2, rope_dtype) + _rounded(y1 * s2, rope_dtype), rope_dtype)
    tl.store(out_row + lo, o1.to(dtype), mask=half_mask)
    tl.store(out_row + hi, o2.to(dtype), mask=half_mask)
    if PASS > 0:
        yp = scale_by_weight(xp * rstd, wp, weight_offset, dtype, CAST_BEFORE_WEIGHT)
        tl.store(out_row + 2 * HALF + pcols, yp.to(dtype), mask=pass_mask)


@triton.jit
def _load_split_heads(x_token, heads, stride_h, H: tl.constexpr, HALF: tl.constexpr, PASS: tl.constexpr,
                      BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr, INTERLEAVED: tl.constexpr):  # fmt: skip
    """One step of a token's heads as the split tiles hold them: (x1, x2, xp) fp32 [ROWS, *] of
    heads `heads` (masked at H, masked elements 0) and their sum of squares [ROWS]."""
    x_row = (x_token + heads * stride_h)[:, None]
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    lo, hi = _pair_cols(cols, HALF, INTERLEAVED)
    half_mask = (heads < H)[:, None] & (cols < HALF)
    x1 = tl.load(x_row + lo, mask=half_mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + hi, mask=half_mask, other=0.0).to(tl.float32)
    pcols = tl.arange(0, BLOCK_PASS)[None, :]
    xp = tl.load(x_row + 2 * HALF + pcols, mask=(heads < H)[:, None] & (pcols < PASS), other=0.0)
    xp = xp.to(tl.float32)
    return x1, x2, xp, tl.sum(x1 * x1 + x2 * x2, axis=1) + tl.sum(xp * xp, axis=1)


@triton.jit
def _store_split_heads(
    x1, x2, xp, heads, w_ptr, out_token, c1, c2, s1, s2, rstd, weight_offset, H: tl.constexpr,
    HALF: tl.constexpr, PASS: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr,
    CAST_BEFORE_WEIGHT: tl.constexpr, rope_dtype, INTERLEAVED: tl.constexpr,
):  # fmt: skip
    """_load_split_heads' step normalised by the token's rstd with its heads' weights (loaded
    here, each head its slice of the [H * D] weight), rotated and stored."""
    D: tl.constexpr = 2 * HALF + PASS
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    lo, hi = _pair_cols(cols, HALF, INTERLEAVED)
    pcols = tl.arange(0, BLOCK_PASS)[None, :]
    half_mask = (heads < H)[:, None] & (cols < HALF)
    pass_mask = (heads < H)[:, None] & (pcols < PASS)
    w_row = (w_ptr + heads * D)[:, None]
    w1 = tl.load(w_row + lo, mask=half_mask, other=0.0).to(tl.float32)
    w2 = tl.load(w_row + hi, mask=half_mask, other=0.0).to(tl.float32)
    wp = tl.load(w_row + 2 * HALF + pcols, mask=pass_mask, other=0.0).to(tl.float32)
    _rope_store(
        x1, x2, xp, w1, w2, wp, c1, c2, s1, s2, rstd, weight_offset, (out_token + heads * D)[:, None],
        lo, hi, pcols, half_mask, pass_mask, HALF, PASS, CAST_BEFORE_WEIGHT, rope_dtype,
    )  # fmt: skip


@triton.jit
def _whole_row_split_steps(
    x_ptr, w_ptr, out_ptr, cos_ptr, sin_ptr, token, S, H: tl.constexpr,
    stride_b, stride_s, stride_h, cos_stride_b, cos_stride_s, sin_stride_b, sin_stride_s,
    eps, weight_offset,
    HALF: tl.constexpr, PASS: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr,
    ROWS: tl.constexpr, STEPS: tl.constexpr, CAST_BEFORE_WEIGHT: tl.constexpr, ONE_SEQ: tl.constexpr,
    INTERLEAVED: tl.constexpr,
):  # fmt: skip
    """A whole-row norm (one token a program) in the split tiles' registers, its heads taken ROWS
    at a time in STEPS <= 4 steps (48 heads: 3 steps of 16, where one tile pads them to 64):
    every step's x loaded and held, the sum of squares over all of them, then each step's
    outputs. DRAM and L1 see x once (the whole-head tile reads it twice, the second time from L1
    or L2). Steps are written out, not a loop: a loop cannot carry a step's tiles to the second
    pass."""
    D: tl.constexpr = 2 * HALF + PASS
    lanes = tl.arange(0, ROWS)
    x_token = x_ptr + _token_offset(token, S, stride_b, stride_s, ONE_SEQ)
    cos_row = cos_ptr + _token_offset(token, S, cos_stride_b, cos_stride_s, ONE_SEQ)
    sin_row = sin_ptr + _token_offset(token, S, sin_stride_b, sin_stride_s, ONE_SEQ)
    cols = tl.arange(0, BLOCK_HALF)
    lo, hi = _pair_cols(cols, HALF, INTERLEAVED)
    c1 = tl.load(cos_row + lo, mask=cols < HALF, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(cos_row + hi, mask=cols < HALF, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(sin_row + lo, mask=cols < HALF, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(sin_row + hi, mask=cols < HALF, other=0.0).to(tl.float32)[None, :]
    x1a, x2a, xpa, squares = _load_split_heads(
        x_token, lanes, stride_h, H, HALF, PASS, BLOCK_HALF, BLOCK_PASS, INTERLEAVED
    )
    if STEPS > 1:
        x1b, x2b, xpb, more = _load_split_heads(
            x_token, ROWS + lanes, stride_h, H, HALF, PASS, BLOCK_HALF, BLOCK_PASS, INTERLEAVED
        )
        squares += more
    if STEPS > 2:
        x1c, x2c, xpc, more = _load_split_heads(
            x_token, 2 * ROWS + lanes, stride_h, H, HALF, PASS, BLOCK_HALF, BLOCK_PASS, INTERLEAVED
        )
        squares += more
    if STEPS > 3:
        x1d, x2d, xpd, more = _load_split_heads(
            x_token, 3 * ROWS + lanes, stride_h, H, HALF, PASS, BLOCK_HALF, BLOCK_PASS, INTERLEAVED
        )
        squares += more
    rstd = tl.rsqrt(tl.sum(squares, axis=0) / (H * D) + eps)
    out_token = out_ptr + token.to(tl.int64) * (H * D)
    _store_split_heads(
        x1a, x2a, xpa, lanes, w_ptr, out_token, c1, c2, s1, s2, rstd, weight_offset, H, HALF, PASS,
        BLOCK_HALF, BLOCK_PASS, CAST_BEFORE_WEIGHT, cos_ptr.dtype.element_ty, INTERLEAVED,
    )  # fmt: skip
    if STEPS > 1:
        _store_split_heads(
            x1b, x2b, xpb, ROWS + lanes, w_ptr, out_token, c1, c2, s1, s2, rstd, weight_offset, H,
            HALF, PASS, BLOCK_HALF, BLOCK_PASS, CAST_BEFORE_WEIGHT, cos_ptr.dtype.element_ty, INTERLEAVED,
        )  # fmt: skip
    if STEPS > 2:
        _store_split_heads(
            x1c, x2c, xpc, 2 * ROWS + lanes, w_ptr, out_token, c1, c2, s1, s2, rstd, weight_offset,
            H, HALF, PASS, BLOCK_HALF, BLOCK_PASS, CAST_BEFORE_WEIGHT, cos_ptr.dtype.element_ty, INTERLEAVED,
        )  # fmt: skip
    if STEPS > 3:
        _store_split_heads(
            x1d, x2d, xpd, 3 * ROWS + lanes, w_ptr, out_token, c1, c2, s1, s2, rstd, weight_offset,
            H, HALF, PASS, BLOCK_HALF, BLOCK_PASS, CAST_BEFORE_WEIGHT, cos_ptr.dtype.element_ty, INTERLEAVED,
        )  # fmt: skip


@triton.jit
def _rotary_tile(
    x_row, w_row, out_row, cos_row, sin_row, row_mask, rstd, weight_offset,
    HALF: tl.constexpr, PASS: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
    NORM_HERE: tl.constexpr, W_PER_ROW: tl.constexpr, CAST_BEFORE_WEIGHT: tl.constexpr, eps,
    INTERLEAVED: tl.constexpr,
):  # fmt: skip
    """Head rows ([ROWS, 1] pointers) normalised and rotated as two tiles: the whole head
    [ROWS, BLOCK_D] (the sum of squares when NORM_HERE, else rstd is given; the pass-through
    columns R..D stored from it) and the rotary columns [ROWS, BLOCK_R] with their partners
    (j + R/2 in the first half, j - R/2 in the second), read by shifted loads of the same rows,
    which L1 serves: DRAM sees each byte once, and the RoPE arithmetic runs on R columns only.
    GPT-J pairs (INTERLEAVED): the partner of an even column is the next, of an odd one the last.
        out[j] = to_x_dtype(to_x_dtype(y[j] * cos[j]) -+ to_x_dtype(y[partner(j)] * sin[j]))  j < R
        out[j] = y[j]                                                                      j >= R
    """
    D: tl.constexpr = 2 * HALF + PASS
    R: tl.constexpr = 2 * HALF
    dtype = out_row.dtype.element_ty
    rope_dtype = cos_row.dtype.element_ty  # the RoPE's rounding: x.dtype, or fp32 (see _rope_store)
    if NORM_HERE or PASS > 0:
        cols = tl.arange(0, BLOCK_D)[None, :]
        # With rstd given, only the pass-through columns are read (R..D: no L1 / L2 reads of the
        # rotary columns, which the rotary tile reads itself).
        in_tile = (cols < D) if NORM_HERE else (cols >= R) & (cols < D)
        mask = row_mask & in_tile
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        if NORM_HERE:
            rstd = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)[:, None]
        if PASS > 0:
            w = _load_cols(w_row, cols, row_mask, in_tile, W_PER_ROW)
            y = scale_by_weight(x * rstd, w, weight_offset, dtype, CAST_BEFORE_WEIGHT)
            tl.store(out_row + cols, y.to(dtype), mask=mask & (cols >= R))
    rc = tl.arange(0, BLOCK_R)[None, :]
    if INTERLEAVED:  # partner at j + 1 (even j), at j - 1 (odd j)
        lo, hi = (rc % 2 == 0) & (rc < R), (rc % 2 == 1) & (rc < R)
        shift = 1
    else:  # partner at j + R/2, at j - R/2
        lo, hi = rc < HALF, (rc >= HALF) & (rc < R)
        shift = HALF
    first, second = row_mask & lo, row_mask & hi
    rot = first | second
    x = tl.load(x_row + rc, mask=rot, other=0.0).to(tl.float32)
    x_partner = tl.load(x_row + rc + shift, mask=first, other=0.0).to(tl.float32)
    x_partner += tl.load(x_row + rc - shift, mask=second, other=0.0).to(tl.float32)
    w = _load_cols(w_row, rc, row_mask, lo | hi, W_PER_ROW)
    w_partner = _load_cols(w_row, rc + shift, row_mask, lo, W_PER_ROW)
    w_partner += _load_cols(w_row, rc - shift, row_mask, hi, W_PER_ROW)
    c = _load_cols(cos_row, rc, row_mask, lo | hi, NORM_HERE)
    s = _load_cols(sin_row, rc, row_mask, lo | hi, NORM_HERE)
    y = _rounded(scale_by_weight(x * rstd, w, weight_offset, dtype, CAST_BEFORE_WEIGHT), dtype)
    y_partner = scale_by_weight(x_partner * rstd, w_partner, weight_offset, dtype, CAST_BEFORE_WEIGHT)
    y_partner = _rounded(y_partner, dtype)
    # rotate_half: the first half subtracts its partner's product, the second adds it (negation
    # is exact, so the rounding matches the reference's separate sub and add).
    sign = tl.where(lo, -1.0, 1.0)
    o = _rounded(_rounded(y * c, rope_dtype) + sign * _rounded(y_partner * s, rope_dtype), rope_dtype)
    tl.store(out_row + rc, o.to(dtype), mask=rot)


@triton.jit
def _norm_rope_rows_tile(
    x_ptr, w_ptr, out_ptr, cos_ptr, sin_ptr, local_pid, n_rows, S, H: tl.constexpr,
    stride_b, stride_s, stride_h, cos_stride_b, cos_stride_s, sin_stride_b, sin_stride_s,
    eps, weight_offset,
    HALF: tl.constexpr, PASS: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
    ROWS: tl.constexpr, NORM_PER_HEAD: tl.constexpr, CAST_BEFORE_WEIGHT: tl.constexpr,
    STEPS: tl.constexpr, ONE_SEQ: tl.constexpr, INTERLEAVED: tl.constexpr,
):  # fmt: skip
    """_norm_rope_rows with each head row as whole-head and rotary tiles (_rotary_tile): contiguous,
    vectorised loads whatever the split of rotary and pass-through dims (the narrow tiles of
    _norm_rope_rows load 32 bf16 at a time when the rotary half is 32 wide). Per-head norm: ROWS
    head rows per program. Whole-row norm: one token per program, its heads taken ROWS at a time
    (STEPS = cdiv(H, ROWS) steps), twice: the sum of squares first, then the outputs (the second
    reads come from L1 / L2), so a 48-head row needs no 64-row tile and a program few registers."""
    D: tl.constexpr = 2 * HALF + PASS
    lanes = tl.arange(0, ROWS)
    if NORM_PER_HEAD:
        rows = local_pid * ROWS + lanes
        row_mask = (rows < n_rows)[:, None]
        head = rows % H  # int32, H constant (see _norm_rope_rows)
        token = rows // H
        x_row = x_ptr + _token_offset(token, S, stride_b, stride_s, ONE_SEQ) + head * stride_h
        cos_row = cos_ptr + _token_offset(token, S, cos_stride_b, cos_stride_s, ONE_SEQ)
        sin_row = sin_ptr + _token_offset(token, S, sin_stride_b, sin_stride_s, ONE_SEQ)
        out_row = out_ptr + rows.to(tl.int64) * D
        _rotary_tile(
            x_row[:, None], w_ptr, out_row[:, None], cos_row[:, None], sin_row[:, None], row_mask,
            0.0, weight_offset, HALF, PASS, BLOCK_D, BLOCK_R, True, False, CAST_BEFORE_WEIGHT, eps,
            INTERLEAVED,
        )  # fmt: skip
    else:
        token = local_pid
        x_token = x_ptr + _token_offset(token, S, stride_b, stride_s, ONE_SEQ)
        cos_row = cos_ptr + _token_offset(token, S, cos_stride_b, cos_stride_s, ONE_SEQ)
        sin_row = sin_ptr + _token_offset(token, S, sin_stride_b, sin_stride_s, ONE_SEQ)
        cols = tl.arange(0, BLOCK_D)[None, :]
        squares = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
        for step in tl.static_range(STEPS):  # unrolled: every step's loads in flight at once
            heads = step * ROWS + lanes
            mask = (heads < H)[:, None] & (cols < D)
            x = tl.load(x_token + (heads * stride_h)[:, None] + cols, mask=mask, other=0.0)
            x = x.to(tl.float32)
            squares += x * x
        rstd = tl.rsqrt(tl.sum(tl.sum(squares, axis=1), axis=0) / (H * D) + eps)
        for step in tl.static_range(STEPS):
            heads = step * ROWS + lanes
            out_row = out_ptr + (token.to(tl.int64) * H + heads) * D
            _rotary_tile(
                (x_token + heads * stride_h)[:, None], (w_ptr + heads * D)[:, None], out_row[:, None],
                cos_row, sin_row, (heads < H)[:, None], rstd, weight_offset, HALF, PASS, BLOCK_D,
                BLOCK_R, False, True, CAST_BEFORE_WEIGHT, eps, INTERLEAVED,
            )  # fmt: skip


@triton.jit
def _qk_norm_rope_kernel(
    q_ptr,  # *dtype [B, S, HQ, D] queries (any strides, unit column stride)
    k_ptr,  # *dtype [B, S, HK, D] keys
    q_weight_ptr,  # *w.dtype q norm weight: [D] per head, [HQ * D] whole row
    k_weight_ptr,  # *w.dtype k norm weight: [D] per head, [HK * D] whole row
    cos_ptr,  # *dtype [B or 1, S, R]
    sin_ptr,  # *dtype [B or 1, S, R]
    q_out_ptr,  # *dtype [B, S, HQ, D] contiguous
    k_out_ptr,  # *dtype [B, S, HK, D] contiguous
    S,  # tokens per sequence
    HQ: tl.constexpr,  # q heads
    HK: tl.constexpr,  # k heads
    n_q_rows,  # B * S * HQ
    n_k_rows,  # B * S * HK
    q_programs,  # programs taking q rows; the rest of the grid takes k rows
    q_stride_b,  # q strides of batch, token, head
    q_stride_s,
    q_stride_h,
    k_stride_b,  # k strides of batch, token, head
    k_stride_s,
    k_stride_h,
    cos_stride_b,  # cos / sin strides of batch (0 when broadcast over the batch) and token
    cos_stride_s,
    sin_stride_b,
    sin_stride_s,
    eps,  # added to mean(x^2) before the rsqrt
    weight_offset,  # added to f32(weight) in the fp32-weight form (1.0 for Qwen3-Next), else 0.0
    HALF: tl.constexpr,
    PASS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_PASS: tl.constexpr,
    ROWS: tl.constexpr,  # head rows per q program (per head) or per step of a token's heads
    ROWS_K: tl.constexpr,  # the same for k (ROWS, unless a whole-row norm with fewer k heads)
    NORM_PER_HEAD: tl.constexpr,
    CAST_BEFORE_WEIGHT: tl.constexpr,
    WHOLE_HEAD_TILE: tl.constexpr,  # _norm_rope_rows_tile (BLOCK_PASS is then next_power_of_2(D))
    BLOCK_R: tl.constexpr,  # next_power_of_2(R): _norm_rope_rows_tile's rotary tile
    Q_STEPS: tl.constexpr,  # whole-row norm: cdiv(HQ, ROWS) steps over a token's q heads (else 1)
    K_STEPS: tl.constexpr,  # the same for k
    ONE_SEQ: tl.constexpr,  # B == 1: token offsets without a division by S
    INTERLEAVED: tl.constexpr,  # GPT-J pairs (2j, 2j + 1), else rotate_half's (j, j + R/2)
):
    # Inductor's launches pass Python floats as fp64: pin them to fp32 (see rms_norm_triton).
    eps = tl.cast(eps, tl.float32)
    weight_offset = tl.cast(weight_offset, tl.float32)
    pid = tl.program_id(0)
    if WHOLE_HEAD_TILE:
        if pid < q_programs:
            _norm_rope_rows_tile(
                q_ptr, q_weight_ptr, q_out_ptr, cos_ptr, sin_ptr, pid, n_q_rows, S, HQ,
                q_stride_b, q_stride_s, q_stride_h, cos_stride_b, cos_stride_s, sin_stride_b,
                sin_stride_s, eps, weight_offset, HALF, PASS, BLOCK_PASS, BLOCK_R, ROWS,
                NORM_PER_HEAD, CAST_BEFORE_WEIGHT, Q_STEPS, ONE_SEQ, INTERLEAVED,
            )  # fmt: skip
        else:
            _norm_rope_rows_tile(
                k_ptr, k_weight_ptr, k_out_ptr, cos_ptr, sin_ptr, pid - q_programs, n_k_rows, S, HK,
                k_stride_b, k_stride_s, k_stride_h, cos_stride_b, cos_stride_s, sin_stride_b,
                sin_stride_s, eps, weight_offset, HALF, PASS, BLOCK_PASS, BLOCK_R, ROWS_K,
                NORM_PER_HEAD, CAST_BEFORE_WEIGHT, K_STEPS, ONE_SEQ, INTERLEAVED,
            )  # fmt: skip
    elif not NORM_PER_HEAD and Q_STEPS > 1 and pid < q_programs:
        _whole_row_split_steps(
            q_ptr, q_weight_ptr, q_out_ptr, cos_ptr, sin_ptr, pid, S, HQ, q_stride_b, q_stride_s,
            q_stride_h, cos_stride_b, cos_stride_s, sin_stride_b, sin_stride_s, eps, weight_offset,
            HALF, PASS, BLOCK_HALF, BLOCK_PASS, ROWS, Q_STEPS, CAST_BEFORE_WEIGHT, ONE_SEQ,
            INTERLEAVED,
        )  # fmt: skip
    elif not NORM_PER_HEAD and K_STEPS > 1 and pid >= q_programs:
        _whole_row_split_steps(
            k_ptr, k_weight_ptr, k_out_ptr, cos_ptr, sin_ptr, pid - q_programs, S, HK, k_stride_b,
            k_stride_s, k_stride_h, cos_stride_b, cos_stride_s, sin_stride_b, sin_stride_s, eps,
            weight_offset, HALF, PASS, BLOCK_HALF, BLOCK_PASS, ROWS_K, K_STEPS, CAST_BEFORE_WEIGHT,
            ONE_SEQ, INTERLEAVED,
        )  # fmt: skip
    else:
        _split_tile_programs(
            pid, q_ptr, k_ptr, q_weight_ptr, k_weight_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr, S, HQ, HK,
            n_q_rows, n_k_rows, q_programs, q_stride_b, q_stride_s, q_stride_h, k_stride_b, k_stride_s, k_stride_h,
            cos_stride_b, cos_stride_s, sin_stride_b, sin_stride_s, eps, weight_offset, HALF, PASS, BLOCK_HALF,
            BLOCK_PASS, ROWS, ROWS_K, NORM_PER_HEAD, CAST_BEFORE_WEIGHT, ONE_SEQ, INTERLEAVED,
        )  # fmt: skip


@triton.jit
def _split_tile_programs(
    pid, q_ptr, k_ptr, q_weight_ptr, k_weight_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr, S, HQ: tl.constexpr,
    HK: tl.constexpr, n_q_rows, n_k_rows, q_programs, q_stride_b, q_stride_s, q_stride_h, k_stride_b, k_stride_s,
    k_stride_h, cos_stride_b, cos_stride_s, sin_stride_b, sin_stride_s, eps, weight_offset, HALF: tl.constexpr,
    PASS: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr, ROWS: tl.constexpr,
    ROWS_K: tl.constexpr, NORM_PER_HEAD: tl.constexpr, CAST_BEFORE_WEIGHT: tl.constexpr, ONE_SEQ: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    # SLOTS > 0 (qk_norm_rope_cache): k_out_ptr is the key cache, and v goes into the value cache
    kc_stride_b=0, kc_stride_h=0, kc_stride_t=0, pos_ptr=None, T=0, v_ptr=None, v_stride_b=0, v_stride_s=0,
    v_stride_h=0, v_cache_ptr=None, vc_stride_b=0, vc_stride_h=0, vc_stride_t=0, SLOTS: tl.constexpr = 0,
    DV: tl.constexpr = 1, BLOCK_DV: tl.constexpr = 1,
):  # fmt: skip
    """The split tiles' programs of both kernels: q's rows, then k's (into the cache, with v's
    copy, for qk_norm_rope_cache)."""
    if pid < q_programs:
        _norm_rope_rows(
            q_ptr, q_weight_ptr, q_out_ptr, cos_ptr, sin_ptr, pid, n_q_rows, S, HQ,
            q_stride_b, q_stride_s, q_stride_h, cos_stride_b, cos_stride_s, sin_stride_b,
            sin_stride_s, eps, weight_offset, HALF, PASS, BLOCK_HALF, BLOCK_PASS, ROWS,
            NORM_PER_HEAD, CAST_BEFORE_WEIGHT, ONE_SEQ, INTERLEAVED,
        )  # fmt: skip
    else:
        _norm_rope_rows(
            k_ptr, k_weight_ptr, k_out_ptr, cos_ptr, sin_ptr, pid - q_programs, n_k_rows, S, HK,
            k_stride_b, k_stride_s, k_stride_h, cos_stride_b, cos_stride_s, sin_stride_b,
            sin_stride_s, eps, weight_offset, HALF, PASS, BLOCK_HALF, BLOCK_PASS, ROWS_K,
            NORM_PER_HEAD, CAST_BEFORE_WEIGHT, ONE_SEQ, INTERLEAVED,
            kc_stride_b, kc_stride_h, kc_stride_t, pos_ptr, T, SLOTS,
        )  # fmt: skip
        if SLOTS > 0:
            _copy_rows_to_cache(
                v_ptr, v_cache_ptr, pid - q_programs, n_k_rows, S, HK, v_stride_b, v_stride_s, v_stride_h,
                vc_stride_b, vc_stride_h, vc_stride_t, pos_ptr, T, DV, BLOCK_DV, ROWS_K, NORM_PER_HEAD,
                SLOTS, ONE_SEQ,
            )  # fmt: skip


@triton.jit
def _qk_norm_rope_cache_kernel(
    q_ptr, k_ptr, q_weight_ptr, k_weight_ptr, cos_ptr, sin_ptr, q_out_ptr,
    k_cache_ptr,  # *dtype [B, HK, T, D]: k_out goes here, at the tokens' slots
    S, HQ: tl.constexpr, HK: tl.constexpr, n_q_rows, n_k_rows, q_programs,
    q_stride_b, q_stride_s, q_stride_h, k_stride_b, k_stride_s, k_stride_h,
    cos_stride_b, cos_stride_s, sin_stride_b, sin_stride_s, eps, weight_offset,
    kc_stride_b, kc_stride_h, kc_stride_t,
    pos_ptr,  # the slots (see _seq_and_token)
    T,  # cache slots
    v_ptr,  # *dtype [B, S, HK, DV]: copied into v_cache_ptr [B, HK, T, DV] by the k programs
    v_stride_b, v_stride_s, v_stride_h, v_cache_ptr, vc_stride_b, vc_stride_h, vc_stride_t,
    HALF: tl.constexpr, PASS: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr,
    ROWS: tl.constexpr, ROWS_K: tl.constexpr, NORM_PER_HEAD: tl.constexpr, CAST_BEFORE_WEIGHT: tl.constexpr,
    ONE_SEQ: tl.constexpr, INTERLEAVED: tl.constexpr, SLOTS: tl.constexpr, DV: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):  # fmt: skip
    """qk_norm_rope_cache: _qk_norm_rope_kernel's split tiles, one step a token (a decode step's
    form), with k_out stored into the key cache and v copied into the value cache by the k
    programs. A kernel of its own: the plain op's launch takes none of these arguments."""
    eps = tl.cast(eps, tl.float32)
    weight_offset = tl.cast(weight_offset, tl.float32)
    _split_tile_programs(
        tl.program_id(0), q_ptr, k_ptr, q_weight_ptr, k_weight_ptr, cos_ptr, sin_ptr, q_out_ptr, k_cache_ptr, S, HQ,
        HK, n_q_rows, n_k_rows, q_programs, q_stride_b, q_stride_s, q_stride_h, k_stride_b, k_stride_s, k_stride_h,
        cos_stride_b, cos_stride_s, sin_stride_b, sin_stride_s, eps, weight_offset, HALF, PASS, BLOCK_HALF,
        BLOCK_PASS, ROWS, ROWS_K, NORM_PER_HEAD, CAST_BEFORE_WEIGHT, ONE_SEQ, INTERLEAVED,
        kc_stride_b, kc_stride_h, kc_stride_t, pos_ptr, T, v_ptr, v_stride_b, v_stride_s, v_stride_h, v_cache_ptr,
        vc_stride_b, vc_stride_h, vc_stride_t, SLOTS, DV, BLOCK_DV,
    )  # fmt: skip


def launch_config(head_dim: int, rotary_dim: int, heads: int, norm_per_head: bool, whole_head_tile: bool):
    """(BLOCK_HALF, BLOCK_PASS, ROWS, num_warps): independent of the token count, so a dynamic
    token count never re-specialises the kernel. `heads` is the larger of q's and k's. With
    whole_head_tile, BLOCK_PASS is the padded head width (the tile's columns).

    Measured on an H200 (tools/tune_qk_norm_rope.py, bf16, CUDA graph, us at 1 / 64 / 4096 /
    16384 tokens): Qwen 3.5 (head 256, rotary 64) whole-head tile at 8 rows x 4 warps 2.1 / 3.0 /
    24.8 / 90.6 (the best of 4-16 rows x 2-8 warps within 6%); MiniMax-M2 (whole-row norm, 48
    heads of 128, rotary 64): the split tiles, see WHOLE_ROW_STEP_HEADS (the launcher sets their
    rows and warps beyond the decode sizes)."""
    half, pass_ = rotary_dim // 2, head_dim - rotary_dim
    block_half = triton.next_power_of_2(half)
    if whole_head_tile:
        block_pass = padded = triton.next_power_of_2(head_dim)
    else:
        block_pass = triton.next_power_of_2(pass_) if pass_ else 1
        padded = 2 * block_half + (block_pass if pass_ else 0)
    fit = max(1, _ELEMENTS_PER_PROGRAM // padded)
    rows = 1 << (fit.bit_length() - 1)  # a power of two (tl.arange), rounded down
    if not norm_per_head:  # a whole token per program: its heads in one tile, or ROWS at a time
        rows = min(rows, triton.next_power_of_2(heads)) if whole_head_tile else triton.next_power_of_2(heads)
    warps = max(1, rows * padded // (_ELEMENTS_PER_THREAD * 32))
    num_warps = min(_MAX_WARPS, 1 << (warps.bit_length() - 1))
    return block_half, block_pass, rows, num_warps


def whole_row_step_rows(heads: int) -> int:
    """Heads a step of the split tiles' whole-row norm takes beyond the decode sizes:
    WHOLE_ROW_STEP_HEADS (fewer when a token has fewer heads), more when that would need more
    than SPLIT_MAX_STEPS steps (48 heads: 3 steps of 16; 96: 3 of 32; 8: 1 of 8)."""
    fewest = triton.next_power_of_2(triton.cdiv(heads, SPLIT_MAX_STEPS))
    return max(min(WHOLE_ROW_STEP_HEADS, triton.next_power_of_2(heads)), fewest)


def _unit_columns(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def qk_norm_rope_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    weight_offset: float = 0.0,
    cast_before_weight: bool = True,
    norm_per_head: bool = True,
    interleaved: bool = False,
    *,
    wrap: Callable | None = None,
    whole_head_tile: bool | None = None,
    rows: int | None = None,
    num_warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """QK-norm + RoPE as qk_norm_rope_reference computes it, in one launch. Returns (q_out, k_out),
    [B, H, S, D] transposes of new contiguous [B, S, H, D] tensors; inputs are only read. `wrap`
    (torch.library.wrap_triton) is applied to the kernel so make_fx can trace the launch."""
    check_qk_norm_rope_args(
        q, k, q_weight, k_weight, cos, sin, weight_offset, cast_before_weight, norm_per_head,
        interleaved,
    )
    b, s, hq, d = q.shape
    q_out = torch.empty((b, s, hq, d), dtype=q.dtype, device=q.device)
    k_out = torch.empty((b, s, k.shape[2], d), dtype=k.dtype, device=k.device)
    form = (eps, weight_offset, cast_before_weight, norm_per_head, interleaved)
    _launch(q, k, q_weight, k_weight, cos, sin, form, q_out, k_out, {}, wrap, whole_head_tile, rows, num_warps)
    # permute, not transpose: inlined as a direct launch, this lands in Inductor's post-grad graph,
    # where torch 2.11 has no lowering for aten.transpose.int (its decomposition runs earlier).
    return q_out.permute(0, 2, 1, 3), k_out.permute(0, 2, 1, 3)


def qk_norm_rope_cache_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    positions: torch.Tensor,
    eps: float,
    weight_offset: float = 0.0,
    cast_before_weight: bool = True,
    norm_per_head: bool = True,
    interleaved: bool = False,
    *,
    wrap: Callable | None = None,
    rows: int | None = None,
    num_warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q_out, k_cache, v_cache) as qk_norm_rope_cache_reference, in one launch: q_out as
    qk_norm_rope_triton's; k_out stored straight into the key cache at its slots, and v copied into
    the value cache by the k programs. The caches are written in place when ``wrap`` is given
    (Inductor inlines the launch; the op's outputs are the caches), else into copies. A token's
    norm is one step of the split tiles (_norm_rope_rows) whatever the token count: the op is a
    decode step's (the pattern takes at most CACHE_MAX_TOKENS tokens)."""
    check_qk_norm_rope_cache_args(q, k, v, q_weight, k_weight, cos, sin, k_cache, v_cache, positions,
                                  weight_offset, cast_before_weight, norm_per_head, interleaved)  # fmt: skip
    b, s, hq, d = q.shape
    v = _unit_columns(v)
    k_out, v_out = (k_cache, v_cache) if wrap is not None else (k_cache.clone(), v_cache.clone())
    for name, cache in (("k_cache", k_out), ("v_cache", v_out)):
        if cache.stride(-1) != 1:
            raise ValueError(f"qk_norm_rope_cache: the {name}'s last dim must be contiguous, got strides {cache.stride()}")
    positions = positions.reshape(-1)
    q_out = torch.empty((b, s, hq, d), dtype=q.dtype, device=q.device)
    cache = dict(
        kc_stride_b=k_out.stride(0), kc_stride_h=k_out.stride(1), kc_stride_t=k_out.stride(2), pos_ptr=positions,
        T=k_out.shape[2], v_ptr=v, v_stride_b=v.stride(0), v_stride_s=v.stride(1), v_stride_h=v.stride(2),
        v_cache_ptr=v_out, vc_stride_b=v_out.stride(0), vc_stride_h=v_out.stride(1), vc_stride_t=v_out.stride(2),
        SLOTS=slots_mode(positions, s), DV=v.shape[3], BLOCK_DV=triton.next_power_of_2(v.shape[3]),
    )  # fmt: skip
    form = (eps, weight_offset, cast_before_weight, norm_per_head, interleaved)
    _launch(q, k, q_weight, k_weight, cos, sin, form, q_out, k_out, cache, wrap, False, rows, num_warps)
    return q_out.permute(0, 2, 1, 3), k_out, v_out


# The most tokens qk_norm_rope_cache takes (patterns/qk_norm_rope: the cache fusion's check): its
# one-step whole-row tiles are the decode form (see WHOLE_ROW_WIDE_MAX_TOKENS).
CACHE_MAX_TOKENS = WHOLE_ROW_WIDE_MAX_TOKENS


def _launch(q, k, q_weight, k_weight, cos, sin, form, q_out, k_out, cache: dict, wrap, whole_head_tile, rows,
            num_warps):  # fmt: skip
    """One launch writing q_out and k_out: _qk_norm_rope_kernel's ([B, S, H, D]), or, with ``cache``
    (its cache arguments), _qk_norm_rope_cache_kernel's (k_out the key cache, v into the value cache)."""
    eps, weight_offset, cast_before_weight, norm_per_head, interleaved = form
    q, k, cos, sin = (_unit_columns(t) for t in (q, k, cos, sin))
    q_weight, k_weight = q_weight.contiguous(), k_weight.contiguous()
    b, s, hq, d = q.shape
    hk = k.shape[2]
    rotary_dim = cos.shape[-1]
    tokens = b * s
    static_tokens = tokens if isinstance(tokens, int) else None
    if whole_head_tile is None:  # see launch_config's timings
        if norm_per_head:  # the split tiles for full RoPE
            whole_head_tile = rotary_dim < d
        else:
            whole_head_tile = False
    block_half, block_pass, default_rows, default_warps = launch_config(
        d, rotary_dim, max(hq, hk), norm_per_head, whole_head_tile
    )
    wide = bool(cache) or (static_tokens is not None and static_tokens <= WHOLE_ROW_WIDE_MAX_TOKENS)
    if not (norm_per_head or whole_head_tile or wide):
        default_rows, default_warps = whole_row_step_rows(max(hq, hk)), _WHOLE_ROW_SPLIT_WARPS
    # Overrides (tools/tune_qk_norm_rope.py). A whole-row norm of the split tiles takes its
    # heads in at most SPLIT_MAX_STEPS steps of `rows`.
    rows = rows or default_rows
    rows_k = rows if norm_per_head else min(rows, triton.next_power_of_2(hk))
    steps = max(triton.cdiv(hq, rows), triton.cdiv(hk, rows_k))
    if not (norm_per_head or whole_head_tile) and steps > SPLIT_MAX_STEPS:
        raise ValueError(
            f"qk_norm_rope: split tiles take {max(hq, hk)} heads in at most {SPLIT_MAX_STEPS} steps, not of {rows}"
        )
    if cache and not norm_per_head and steps > 1:
        raise ValueError(f"qk_norm_rope_cache: a token's {max(hq, hk)} heads take one step, not rows of {rows}")
    num_warps = num_warps or default_warps
    n_q, n_k = b * s * hq, b * s * hk
    if norm_per_head:
        q_programs, k_programs = triton.cdiv(n_q, rows), triton.cdiv(n_k, rows)
    else:
        q_programs = k_programs = b * s
    # A batch of one broadcast over the batch: stride 0 reads the same positions for every sequence.
    cos_stride_b = cos.stride(0) if cos.shape[0] > 1 else 0
    sin_stride_b = sin.stride(0) if sin.shape[0] > 1 else 0
    args = (
        q, k, q_weight, k_weight, cos, sin, q_out, k_out,
        s, hq, hk, n_q, n_k, q_programs,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        cos_stride_b, cos.stride(1), sin_stride_b, sin.stride(1),
        eps, weight_offset,
    )  # fmt: skip
    form = dict(
        HALF=rotary_dim // 2,
        PASS=d - rotary_dim,
        BLOCK_HALF=block_half,
        BLOCK_PASS=block_pass,
        ROWS=rows,
        ROWS_K=rows_k,
        NORM_PER_HEAD=norm_per_head,
        CAST_BEFORE_WEIGHT=cast_before_weight,
        ONE_SEQ=isinstance(b, int) and b == 1,  # a symbolic batch is >= 2 (Dynamo specialises 1)
        INTERLEAVED=interleaved,
        num_warps=num_warps,
    )
    if cache:
        kernel = (wrap or (lambda fn: fn))(_qk_norm_rope_cache_kernel)
        kernel[(q_programs + k_programs,)](*args, **cache, **form)
        return
    kernel = (wrap or (lambda fn: fn))(_qk_norm_rope_kernel)
    kernel[(q_programs + k_programs,)](
        *args, **form,
        WHOLE_HEAD_TILE=whole_head_tile,
        BLOCK_R=triton.next_power_of_2(rotary_dim),
        Q_STEPS=1 if norm_per_head else triton.cdiv(hq, rows),  # a whole-row norm's steps, either body
        K_STEPS=1 if norm_per_head else triton.cdiv(hk, rows_k),
    )  # fmt: skip
