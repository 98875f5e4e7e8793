"""Triton kernels of the DeepSeek V3 / V3.2 pre-attention ops (see mla_rope/reference.py).

Unfused (stock Inductor): the kv branch is an RMSNorm kernel on the latent plus a RoPE kernel on
    k_pe (each reading its slice of kv_a_proj_with_mqa's output); the q branch a RoPE + cat kernel
    writing query_states; the indexer key a LayerNorm kernel, then a RoPE + cat kernel.
Fused: one kernel per branch, each reading its inputs once and writing its outputs once:
    mla_kv_norm_rope        row of kv -> normed latent [.., R] and rotated k_pe [.., P]
    mla_q_rope              q [T, H, D] -> query [B, H, S, D] (or [T, H, D]), rope slice rotated
    mla_indexer_k_norm_rope row of k -> LayerNorm, RoPE on its first P dims, [.., D]

All math in fp32, rounded to x.dtype exactly where the eager model rounds (each RoPE product and
sum; the norm's output). ``_round`` rounds to bf16 with integer steps (to nearest, ties to even):
Triton's interpreter truncates fp32 -> bf16 casts, and the integer steps give the same bits
compiled and interpreted, so the CPU tests are bit-exact. (NaN inputs are not preserved.)
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from fusion_passes.lowering.common.cache_slots import slots_mode
from fusion_passes.lowering.rms_norm.reference import check_rms_norm_args
from fusion_passes.lowering.mla_rope.reference import (
    check_indexer_k_args,
    check_indexer_k_cache_args,
    check_mla_indexer_qk_args,
    check_mla_kv_cache_write_args,
    check_mla_kv_args,
    check_mla_q_args,
    check_mla_q_kv_pair,
)

# Elements one program works on at once: narrow rows are packed several to a program.
# kv and q: 1024 (one kv row of 576, four q heads of 192) at 2 warps. Measured on an H200 with
# tools/tune_mla_rope.py (DeepSeek V3 widths, bf16, CUDA graph, us at 1 / 64 / 4096 tokens):
# kv 1 row x 2 warps 2.14 / 2.29 / 5.29 against 4 rows x 4 warps 2.65 / 2.96 / 5.41; q 4 heads x
# 2 warps 2.65 / 3.88 / 106.6 against 16 heads x 4 warps 2.92 / 4.93 / 114.9 (the best at each
# size was within 0.5 us of these). The indexer key keeps 4096 x 4 warps (not measured).
_ELEMENTS_PER_PROGRAM = 1024
_WARPS = 2
_INDEXER_ELEMENTS_PER_PROGRAM = 4096
# Compiled kernels spell the RoPE products as PTX mul.rn (see _product); the interpreter has no
# inline assembly and no contraction either, so it multiplies plainly.
_INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")


@triton.jit
def _round(v, dtype: tl.constexpr):
    """fp32 v rounded to dtype (to nearest, ties to even), returned as fp32."""
    if dtype == tl.bfloat16:
        bits = v.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    elif dtype == tl.float16:
        return v.to(tl.float16).to(tl.float32)
    else:
        return v


@triton.jit
def _product(a, b):
    """a * b (fp32), rounded on its own. The compiler would otherwise contract a product and the
    sum after it into one FMA -- in fp32, and in fp16 too, where LLVM first narrows
    fp16(f32(a) * f32(b)) to a half multiply and then fuses it with the half subtraction --
    one rounding fewer than eager's mul then sub (measured on an H200: outputs an ulp off in fp32
    and fp16, bf16 exact). mul.rn.f32 is the PTX multiply that is never contracted or narrowed."""
    if _INTERPRETED:
        return a * b
    else:
        return tl.inline_asm_elementwise(
            "mul.rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32, is_pure=True, pack=1
        )


@triton.jit
def _rope(x1, x2, c1, s1, c2, s2, dtype: tl.constexpr):
    """The two halves of the rotated slice, each product and sum rounded as HF rounds them:
    o1 = x1 * c1 - x2 * s1, o2 = x2 * c2 + x1 * s2 (rotate_half: -x2 * s1 rounds to -(x2 * s1))."""
    o1 = _round(_round(_product(x1, c1), dtype) - _round(_product(x2, s1), dtype), dtype)
    o2 = _round(_round(_product(x2, c2), dtype) + _round(_product(x1, s2), dtype), dtype)
    return o1, o2


@triton.jit
def _load_rope_operands(x_ptr, cos_ptr, sin_ptr, j, mask, HALF: tl.constexpr, INTERLEAVE: tl.constexpr):
    """x1, x2 (the rotated pair of each j < HALF) and c1, s1, c2, s2, as fp32.
    x_ptr / cos_ptr / sin_ptr point at the start of the rope slice / of the token's cos row."""
    if INTERLEAVE:
        x1 = tl.load(x_ptr + 2 * j, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_ptr + 2 * j + 1, mask=mask, other=0.0).to(tl.float32)
        c1 = tl.load(cos_ptr + j, mask=mask, other=0.0).to(tl.float32)
        s1 = tl.load(sin_ptr + j, mask=mask, other=0.0).to(tl.float32)
        c2 = c1
        s2 = s1
    else:
        x1 = tl.load(x_ptr + j, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_ptr + HALF + j, mask=mask, other=0.0).to(tl.float32)
        c1 = tl.load(cos_ptr + j, mask=mask, other=0.0).to(tl.float32)
        s1 = tl.load(sin_ptr + j, mask=mask, other=0.0).to(tl.float32)
        c2 = tl.load(cos_ptr + HALF + j, mask=mask, other=0.0).to(tl.float32)
        s2 = tl.load(sin_ptr + HALF + j, mask=mask, other=0.0).to(tl.float32)
    return x1, x2, c1, s1, c2, s2


@triton.jit
def _kv_norm_rope_rows(
    program,  # which block of ROWS rows this program works on
    kv_ptr,  # *dtype [M, R + P]: kv_a_proj_with_mqa's output rows; column stride 1
    weight_ptr,  # *weight.dtype [R]: kv_a_layernorm's weight
    cos_ptr,  # *dtype [M, C]: cos per token (C = P, or P / 2 interleaved); column stride 1
    sin_ptr,  # *dtype [M, C]: sin, as cos
    normed_ptr,  # *dtype [M, R] contiguous: the normalised latent
    pe_ptr,  # *dtype [M, P] contiguous: the rotated k_pe
    M,  # rows (tokens)
    R,  # latent width (kv_lora_rank)
    stride_kv,  # elements between rows of kv
    stride_cos,  # elements between rows of cos
    stride_sin,  # elements between rows of sin
    eps,  # RMSNorm eps
    weight_offset,  # added to f32(weight) in the fp32-weight form, else 0.0
    HALF: tl.constexpr,  # P / 2
    INTERLEAVE: tl.constexpr,  # DeepSeek's even/odd pairs (else rotate_half)
    CAST_BEFORE_WEIGHT: tl.constexpr,  # Llama form: round n to dtype before scaling by weight
    BLOCK_R: tl.constexpr,  # next_power_of_2(R)
    BLOCK_HALF: tl.constexpr,  # next_power_of_2(HALF)
    ROWS: tl.constexpr,  # rows per program
):
    """mla_kv_norm_rope on rows [program * ROWS, program * ROWS + ROWS) of kv."""
    eps = tl.cast(eps, tl.float32)  # Inductor passes Python floats as fp64
    weight_offset = tl.cast(weight_offset, tl.float32)
    dtype = normed_ptr.dtype.element_ty
    rows = program * ROWS + tl.arange(0, ROWS)
    row_mask = (rows < M)[:, None]
    rows = rows.to(tl.int64)[:, None]
    cols = tl.arange(0, BLOCK_R)
    mask = row_mask & (cols < R)[None, :]
    w = tl.load(weight_ptr + cols, mask=cols < R, other=0.0).to(tl.float32)[None, :]
    x = tl.load(kv_ptr + rows * stride_kv + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    # Every load before the reduction, so their latencies overlap (a decode step is one row).
    j = tl.arange(0, BLOCK_HALF)[None, :]
    pmask = row_mask & (j < HALF)
    x1, x2, c1, s1, c2, s2 = _load_rope_operands(
        kv_ptr + rows * stride_kv + R, cos_ptr + rows * stride_cos, sin_ptr + rows * stride_sin,
        j, pmask, HALF, INTERLEAVE,
    )  # fmt: skip
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / R + eps)
    n = x * rstd[:, None]
    if CAST_BEFORE_WEIGHT:  # Llama form: weight * n.to(dtype), in dtype
        y = _round(_round(n, dtype) * w, dtype)
    else:
        y = _round(n * (w + weight_offset), dtype)
    tl.store(normed_ptr + rows * R + cols[None, :], y.to(dtype), mask=mask)
    o1, o2 = _rope(x1, x2, c1, s1, c2, s2, dtype)
    out = pe_ptr + rows * (2 * HALF) + j
    tl.store(out, o1.to(dtype), mask=pmask)
    tl.store(out + HALF, o2.to(dtype), mask=pmask)


@triton.jit
def _q_rope_heads(
    t,  # int64: the token this program works on
    head_block,  # which block of BLOCK_H heads
    q_ptr,  # *dtype [T, H, D]: q per token and head; column stride 1
    cos_ptr,  # *dtype [T, C]: cos per token; column stride 1
    sin_ptr,  # *dtype [T, C]
    out_ptr,  # *dtype: [B, H, S, D] contiguous (HEADS_FIRST) or [T, H, D] contiguous
    H,  # heads
    S,  # tokens per batch row (T = B * S): the transpose needs it
    stride_qt,  # elements between tokens of q
    stride_qh,  # elements between heads of q
    stride_cos,  # elements between rows of cos
    stride_sin,  # elements between rows of sin
    D: tl.constexpr,  # head dim
    HALF: tl.constexpr,  # P / 2
    ROPE_FIRST: tl.constexpr,  # the rope slice is q[..., :P] (indexer), else q[..., D-P:] (MLA)
    INTERLEAVE: tl.constexpr,
    HEADS_FIRST: tl.constexpr,  # write [B, H, S, D] (MLA's query_states), else [B, S, H, D]
    BLOCK_H: tl.constexpr,  # heads per program
    BLOCK_PASS: tl.constexpr,  # next_power_of_2(D - P) (>= 1)
    BLOCK_HALF: tl.constexpr,  # next_power_of_2(HALF)
):
    """mla_q_rope on heads [head_block * BLOCK_H, ...) of token t."""
    dtype = out_ptr.dtype.element_ty
    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    head_mask = (heads < H)[:, None]
    heads = heads.to(tl.int64)[:, None]
    src = q_ptr + t * stride_qt + heads * stride_qh
    if HEADS_FIRST:  # out[b, h, s, :], t = b * S + s
        dst = out_ptr + ((t // S) * H + heads) * S * D + (t % S) * D
    else:
        dst = out_ptr + (t * H + heads) * D
    P: tl.constexpr = 2 * HALF
    PASS: tl.constexpr = D - P
    ROPE_AT: tl.constexpr = 0 if ROPE_FIRST else PASS
    PASS_AT: tl.constexpr = P if ROPE_FIRST else 0
    if PASS > 0:  # the pass-through slice is copied as is
        k = tl.arange(0, BLOCK_PASS)[None, :]
        kmask = head_mask & (k < PASS)
        tl.store(dst + PASS_AT + k, tl.load(src + PASS_AT + k, mask=kmask), mask=kmask)
    j = tl.arange(0, BLOCK_HALF)[None, :]
    pmask = head_mask & (j < HALF)
    x1, x2, c1, s1, c2, s2 = _load_rope_operands(
        src + ROPE_AT, cos_ptr + t * stride_cos, sin_ptr + t * stride_sin, j, pmask, HALF, INTERLEAVE
    )
    o1, o2 = _rope(x1, x2, c1, s1, c2, s2, dtype)
    tl.store(dst + ROPE_AT + j, o1.to(dtype), mask=pmask)
    tl.store(dst + ROPE_AT + HALF + j, o2.to(dtype), mask=pmask)


@triton.jit
def _mla_kv_norm_rope_kernel(
    kv_ptr, weight_ptr, cos_ptr, sin_ptr, normed_ptr, pe_ptr, M, R, stride_kv, stride_cos,
    stride_sin, eps, weight_offset, HALF: tl.constexpr, INTERLEAVE: tl.constexpr,
    CAST_BEFORE_WEIGHT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_HALF: tl.constexpr,
    ROWS: tl.constexpr,
):  # fmt: skip
    """mla_kv_norm_rope: one program per ROWS rows (arguments: see _kv_norm_rope_rows)."""
    _kv_norm_rope_rows(
        tl.program_id(0), kv_ptr, weight_ptr, cos_ptr, sin_ptr, normed_ptr, pe_ptr, M, R, stride_kv,
        stride_cos, stride_sin, eps, weight_offset, HALF, INTERLEAVE, CAST_BEFORE_WEIGHT, BLOCK_R,
        BLOCK_HALF, ROWS,
    )  # fmt: skip


@triton.jit
def _mla_q_rope_kernel(
    q_ptr, cos_ptr, sin_ptr, out_ptr, H, S, stride_qt, stride_qh, stride_cos, stride_sin,
    D: tl.constexpr, HALF: tl.constexpr, ROPE_FIRST: tl.constexpr, INTERLEAVE: tl.constexpr,
    HEADS_FIRST: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_PASS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):  # fmt: skip
    """mla_q_rope: a grid of (tokens, head blocks) (arguments: see _q_rope_heads)."""
    _q_rope_heads(
        tl.program_id(0).to(tl.int64), tl.program_id(1), q_ptr, cos_ptr, sin_ptr, out_ptr, H, S,
        stride_qt, stride_qh, stride_cos, stride_sin, D, HALF, ROPE_FIRST, INTERLEAVE, HEADS_FIRST,
        BLOCK_H, BLOCK_PASS, BLOCK_HALF,
    )  # fmt: skip


@triton.jit
def _mla_q_kv_rope_kernel(
    q_ptr, kv_ptr, weight_ptr, cos_ptr, sin_ptr, out_ptr, normed_ptr, pe_ptr, M, R, H, S,
    stride_kv, stride_qt, stride_qh, stride_cos, stride_sin, eps, weight_offset,
    kv_programs,  # programs of the kv branch (the first ones); the rest work on q
    head_blocks,  # q programs per token
    D: tl.constexpr, HALF: tl.constexpr, INTERLEAVE: tl.constexpr,
    CAST_BEFORE_WEIGHT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_HALF: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_PASS: tl.constexpr,
):  # fmt: skip
    """mla_q_kv_rope: MLA's kv branch and q branch (rope last, written heads first) in one
    launch; each program does the work of one program of _mla_kv_norm_rope_kernel or of
    _mla_q_rope_kernel, so the outputs are theirs bit for bit. q and kv share cos and sin."""
    program = tl.program_id(0)
    if program < kv_programs:
        _kv_norm_rope_rows(
            program, kv_ptr, weight_ptr, cos_ptr, sin_ptr, normed_ptr, pe_ptr, M, R, stride_kv,
            stride_cos, stride_sin, eps, weight_offset, HALF, INTERLEAVE, CAST_BEFORE_WEIGHT,
            BLOCK_R, BLOCK_HALF, ROWS,
        )  # fmt: skip
    else:
        q_program = program - kv_programs
        _q_rope_heads(
            (q_program // head_blocks).to(tl.int64), q_program % head_blocks, q_ptr, cos_ptr,
            sin_ptr, out_ptr, H, S, stride_qt, stride_qh, stride_cos, stride_sin, D, HALF, False,
            INTERLEAVE, True, BLOCK_H, BLOCK_PASS, BLOCK_HALF,
        )  # fmt: skip


@triton.jit
def _mla_indexer_k_norm_rope_kernel(
    k_ptr, weight_ptr, bias_ptr, cos_ptr, sin_ptr,
    out_ptr,  # *dtype [M, D] contiguous
    M, stride_k, stride_cos, stride_sin, eps, D: tl.constexpr, HALF: tl.constexpr, INTERLEAVE: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_PASS: tl.constexpr, BLOCK_HALF: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    """mla_indexer_k_norm_rope: each program ROWS rows (_indexer_k_rows) into a new tensor."""
    _indexer_k_rows(
        tl.program_id(0), k_ptr, weight_ptr, bias_ptr, cos_ptr, sin_ptr, out_ptr, None, M, M, M, stride_k,
        stride_cos, stride_sin, 0, D, eps, D, HALF, INTERLEAVE, BLOCK_D, BLOCK_PASS, BLOCK_HALF, ROWS, 0,
    )  # fmt: skip


@triton.jit
def _mla_indexer_k_norm_rope_cache_kernel(
    k_ptr, weight_ptr, bias_ptr, cos_ptr, sin_ptr, out_ptr, pos_ptr, M, S, T, stride_k, stride_cos, stride_sin,
    stride_ob, stride_os, eps, D: tl.constexpr, HALF: tl.constexpr, INTERLEAVE: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_PASS: tl.constexpr, BLOCK_HALF: tl.constexpr, ROWS: tl.constexpr,
    POSITIONS: tl.constexpr,
):  # fmt: skip
    """mla_indexer_k_norm_rope_cache: each program ROWS rows (_indexer_k_rows) into the cache at
    their slots. A kernel of its own: the plain op's launch takes none of the cache's arguments."""
    _indexer_k_rows(
        tl.program_id(0), k_ptr, weight_ptr, bias_ptr, cos_ptr, sin_ptr, out_ptr, pos_ptr, M, S, T, stride_k,
        stride_cos, stride_sin, stride_ob, stride_os, eps, D, HALF, INTERLEAVE, BLOCK_D, BLOCK_PASS, BLOCK_HALF,
        ROWS, POSITIONS,
    )  # fmt: skip


@triton.jit
def _mla_indexer_qk_rope_kernel(
    q_ptr, k_ptr, weight_ptr, bias_ptr, cos_ptr, sin_ptr, q_out_ptr, out_ptr, pos_ptr, M, H, S, T, stride_k,
    stride_qt, stride_qh, stride_cos, stride_sin, stride_ob, stride_os, eps,
    k_programs,  # programs of the key branch (the first ones); the rest work on q
    head_blocks,  # q programs per token
    D: tl.constexpr, HALF: tl.constexpr, INTERLEAVE: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_PASS: tl.constexpr, BLOCK_HALF: tl.constexpr, ROWS: tl.constexpr, POSITIONS: tl.constexpr,
    BLOCK_H: tl.constexpr, Q_BLOCK_PASS: tl.constexpr,
):  # fmt: skip
    """mla_indexer_qk_rope: the indexer's key (LayerNorm + RoPE, into its cache where POSITIONS)
    and query (RoPE first, [B, S, H, D]) in one launch, sharing cos and sin; each program does the
    work of one program of _mla_indexer_k_norm_rope_kernel or of _mla_q_rope_kernel, so the
    outputs are theirs bit for bit."""
    _indexer_qk_program(
        tl.program_id(0), q_ptr, k_ptr, weight_ptr, bias_ptr, cos_ptr, sin_ptr, q_out_ptr, out_ptr, pos_ptr, M, H, S,
        T, stride_k, stride_qt, stride_qh, stride_cos, stride_sin, stride_ob, stride_os, eps, k_programs, head_blocks,
        D, HALF, INTERLEAVE, BLOCK_D, BLOCK_PASS, BLOCK_HALF, ROWS, POSITIONS, BLOCK_H, Q_BLOCK_PASS,
    )  # fmt: skip


@triton.jit
def _indexer_qk_program(
    program, q_ptr, k_ptr, weight_ptr, bias_ptr, cos_ptr, sin_ptr, q_out_ptr, out_ptr, pos_ptr, M, H, S, T, stride_k,
    stride_qt, stride_qh, stride_cos, stride_sin, stride_ob, stride_os, eps, k_programs, head_blocks,
    D: tl.constexpr, HALF: tl.constexpr, INTERLEAVE: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_PASS: tl.constexpr, BLOCK_HALF: tl.constexpr, ROWS: tl.constexpr, POSITIONS: tl.constexpr,
    BLOCK_H: tl.constexpr, Q_BLOCK_PASS: tl.constexpr,
):  # fmt: skip
    """One program of the indexer's launch: key rows (the first k_programs), else query heads."""
    if program < k_programs:
        _indexer_k_rows(
            program, k_ptr, weight_ptr, bias_ptr, cos_ptr, sin_ptr, out_ptr, pos_ptr, M, S, T, stride_k,
            stride_cos, stride_sin, stride_ob, stride_os, eps, D, HALF, INTERLEAVE, BLOCK_D, BLOCK_PASS,
            BLOCK_HALF, ROWS, POSITIONS,
        )  # fmt: skip
    else:
        q_program = program - k_programs
        _q_rope_heads(
            (q_program // head_blocks).to(tl.int64), q_program % head_blocks, q_ptr, cos_ptr, sin_ptr, q_out_ptr,
            H, S, stride_qt, stride_qh, stride_cos, stride_sin, D, HALF, True, INTERLEAVE, False, BLOCK_H,
            Q_BLOCK_PASS, BLOCK_HALF,
        )  # fmt: skip


@triton.jit
def _indexer_k_rows(
    program,  # this program's rows: [program * ROWS, (program + 1) * ROWS)
    k_ptr,  # *dtype [M, D]: indexer keys (wk's output); column stride 1
    weight_ptr,  # *dtype [D]: LayerNorm weight
    bias_ptr,  # *dtype [D]: LayerNorm bias
    cos_ptr,  # *dtype [M, C]
    sin_ptr,  # *dtype [M, C]
    out_ptr,  # *dtype: row (b, s) of k, M = B * S rows, goes to out_ptr + b * stride_ob + slot * stride_os
    pos_ptr,  # POSITIONS 1: *int the first slot (slot = it + s); 2: *int [S] each token's slot
    M,  # rows
    S,  # tokens per sequence
    T,  # slots per sequence (POSITIONS > 0: rows whose slot is outside [0, T) are not written)
    stride_k,  # elements between rows of k
    stride_cos,
    stride_sin,
    stride_ob,  # elements between sequences of out
    stride_os,  # elements between slots of out
    eps,  # LayerNorm eps
    D: tl.constexpr,  # row width
    HALF: tl.constexpr,  # P / 2
    INTERLEAVE: tl.constexpr,
    BLOCK_D: tl.constexpr,  # next_power_of_2(D)
    BLOCK_PASS: tl.constexpr,  # next_power_of_2(D - P) (>= 1)
    BLOCK_HALF: tl.constexpr,
    ROWS: tl.constexpr,
    POSITIONS: tl.constexpr,  # 0: slot = s (a new tensor); 1: the first slot given; 2: a slot per token
):
    eps = tl.cast(eps, tl.float32)
    dtype = out_ptr.dtype.element_ty
    rows = program * ROWS + tl.arange(0, ROWS)
    row_mask = rows < M
    rows = rows.to(tl.int64)
    if POSITIONS == 0:  # a new [M, D] tensor: row r at r (stride_os: D)
        dst = out_ptr + (rows * stride_os)[:, None]
    else:
        seq = rows // S
        slot = rows - seq * S
        if POSITIONS == 1:
            slot += tl.load(pos_ptr).to(tl.int64)
        else:
            slot = tl.load(pos_ptr + slot, mask=row_mask, other=0).to(tl.int64)
        row_mask = row_mask & (slot >= 0) & (slot < T)  # a slot past the cache: no memory of it
        dst = out_ptr + (seq * stride_ob + slot * stride_os)[:, None]
    row_mask = row_mask[:, None]
    rows = rows[:, None]
    src = k_ptr + rows * stride_k
    # Statistics over the whole row (biased variance, as layer_norm), in fp32.
    cols = tl.arange(0, BLOCK_D)[None, :]
    mask = row_mask & (cols < D)
    x = tl.load(src + cols, mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=1)[:, None] / D
    centered = tl.where(mask, x - mean, 0.0)
    rstd = tl.rsqrt(tl.sum(centered * centered, axis=1)[:, None] / D + eps)
    # RoPE pairs its operands across the row: re-read them (from cache: DRAM sees one read) at
    # the offsets each needs, normalised and rounded to dtype as the LayerNorm output is.
    P: tl.constexpr = 2 * HALF
    PASS: tl.constexpr = D - P
    if PASS > 0:
        c = P + tl.arange(0, BLOCK_PASS)[None, :]
        cmask = row_mask & (c < D)
        y = _round(_layer_norm_at(src, weight_ptr, bias_ptr, c, cmask, mean, rstd), dtype)
        tl.store(dst + c, y.to(dtype), mask=cmask)
    j = tl.arange(0, BLOCK_HALF)[None, :]
    pmask = row_mask & (j < HALF)
    if INTERLEAVE:
        i1 = 2 * j
        i2 = 2 * j + 1
        c1 = tl.load(cos_ptr + rows * stride_cos + j, mask=pmask, other=0.0).to(tl.float32)
        s1 = tl.load(sin_ptr + rows * stride_sin + j, mask=pmask, other=0.0).to(tl.float32)
        c2 = c1
        s2 = s1
    else:
        i1 = j
        i2 = HALF + j
        c1 = tl.load(cos_ptr + rows * stride_cos + j, mask=pmask, other=0.0).to(tl.float32)
        s1 = tl.load(sin_ptr + rows * stride_sin + j, mask=pmask, other=0.0).to(tl.float32)
        c2 = tl.load(cos_ptr + rows * stride_cos + HALF + j, mask=pmask, other=0.0).to(tl.float32)
        s2 = tl.load(sin_ptr + rows * stride_sin + HALF + j, mask=pmask, other=0.0).to(tl.float32)
    x1 = _round(_layer_norm_at(src, weight_ptr, bias_ptr, i1, pmask, mean, rstd), dtype)
    x2 = _round(_layer_norm_at(src, weight_ptr, bias_ptr, i2, pmask, mean, rstd), dtype)
    o1, o2 = _rope(x1, x2, c1, s1, c2, s2, dtype)
    tl.store(dst + j, o1.to(dtype), mask=pmask)
    tl.store(dst + HALF + j, o2.to(dtype), mask=pmask)


@triton.jit
def _layer_norm_at(src, weight_ptr, bias_ptr, c, mask, mean, rstd):
    """LayerNorm of the row's columns c, in fp32 and the decomposition's order:
    ((x - mean) * rstd) * w + b."""
    x = tl.load(src + c, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(weight_ptr + c, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(bias_ptr + c, mask=mask, other=0.0).to(tl.float32)
    return (x - mean) * rstd * w + b


def _rows(t: torch.Tensor, lead: tuple) -> torch.Tensor:
    """t ([*lead or broadcastable, C]) as [prod(lead), C] with unit column stride."""
    rows = t.expand(*lead, t.shape[-1]).reshape(-1, t.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _rows_per_program(width: int, elements: int = _ELEMENTS_PER_PROGRAM) -> int:
    return max(1, elements // triton.next_power_of_2(width))


def _identity(kernel):
    return kernel


def _kv_plan(kv, weight, cos, sin, eps, weight_offset, cast_before_weight, interleave, rows):
    """((normed, k_pe), the kv kernel's arguments by name, its program count). cos / sin as one
    row per token are its cos_ptr / sin_ptr (the q plan may reuse them: the same tokens)."""
    r = check_mla_kv_args(kv, weight, cos, sin, interleave)
    lead = tuple(kv.shape[:-1])
    p = kv.shape[-1] - r
    kv_rows = _rows(kv, lead)
    cos_rows, sin_rows = _rows(cos, lead), _rows(sin, lead)
    m = kv_rows.shape[0]
    normed = torch.empty((*lead, r), dtype=kv.dtype, device=kv.device)
    k_pe = torch.empty((*lead, p), dtype=kv.dtype, device=kv.device)
    rows = rows or _rows_per_program(kv.shape[-1])
    args = dict(
        kv_ptr=kv_rows, weight_ptr=weight.contiguous(), cos_ptr=cos_rows, sin_ptr=sin_rows,
        normed_ptr=normed, pe_ptr=k_pe, M=m, R=r, stride_kv=kv_rows.stride(0),
        stride_cos=cos_rows.stride(0), stride_sin=sin_rows.stride(0), eps=eps,
        weight_offset=weight_offset, HALF=p // 2, INTERLEAVE=interleave,
        CAST_BEFORE_WEIGHT=cast_before_weight, BLOCK_R=triton.next_power_of_2(r),
        BLOCK_HALF=triton.next_power_of_2(p // 2), ROWS=rows,
    )  # fmt: skip
    return (normed, k_pe), args, triton.cdiv(m, rows)


def _q_plan(q, cos, sin, rope_first, interleave, heads_first, block_h, cos_sin_rows=None):
    """(query, the q kernel's arguments by name, (tokens, head blocks)); cos_sin_rows: cos and sin
    as one row per token, when the caller has them already."""
    p = check_mla_q_args(q, cos, sin, interleave)
    lead, (h, d) = tuple(q.shape[:-2]), q.shape[-2:]
    if heads_first and len(lead) < 1:
        raise ValueError("mla_q_rope: heads_first needs a token dim before the heads")
    q_rows = q.reshape(-1, h, d)
    if q_rows.stride(-1) != 1:
        q_rows = q_rows.contiguous()
    cos_rows, sin_rows = cos_sin_rows or (_rows(cos, lead), _rows(sin, lead))
    t = q_rows.shape[0]
    s = lead[-1] if lead else 1
    if heads_first:
        out = torch.empty((*lead[:-1], h, s, d), dtype=q.dtype, device=q.device)
    else:
        out = torch.empty((*lead, h, d), dtype=q.dtype, device=q.device)
    block_h = block_h or min(
        triton.next_power_of_2(h), max(1, _ELEMENTS_PER_PROGRAM // triton.next_power_of_2(d))
    )
    args = dict(
        q_ptr=q_rows, cos_ptr=cos_rows, sin_ptr=sin_rows, out_ptr=out, H=h, S=s,
        stride_qt=q_rows.stride(0), stride_qh=q_rows.stride(1), stride_cos=cos_rows.stride(0),
        stride_sin=sin_rows.stride(0), D=d, HALF=p // 2, ROPE_FIRST=rope_first,
        INTERLEAVE=interleave, HEADS_FIRST=heads_first, BLOCK_H=block_h,
        BLOCK_PASS=triton.next_power_of_2(max(1, d - p)), BLOCK_HALF=triton.next_power_of_2(p // 2),
    )  # fmt: skip
    return out, args, (t, triton.cdiv(h, block_h))


def mla_kv_norm_rope_triton(
    kv, weight, cos, sin, eps, weight_offset=0.0, cast_before_weight=True, interleave=True,
    *, wrap: Callable | None = None, rows: int | None = None, num_warps: int = _WARPS,
):  # fmt: skip
    """(normed [*lead, R], k_pe [*lead, P]) as mla_kv_norm_rope_reference, new contiguous
    tensors; `wrap` (torch.library.wrap_triton) is applied to the kernel before launch."""
    outputs, args, programs = _kv_plan(
        kv, weight, cos, sin, eps, weight_offset, cast_before_weight, interleave, rows
    )
    (wrap or _identity)(_mla_kv_norm_rope_kernel)[(programs,)](**args, num_warps=num_warps)
    return outputs


def mla_q_rope_triton(
    q, cos, sin, rope_first=False, interleave=True, heads_first=True, *, wrap: Callable | None = None,
    block_h: int | None = None, num_warps: int = _WARPS,
):  # fmt: skip
    """q with RoPE on its rope slice, as mla_q_rope_reference, in a new contiguous tensor
    ([..., H, S, D] when heads_first, else q's shape)."""
    out, args, grid = _q_plan(q, cos, sin, rope_first, interleave, heads_first, block_h)
    (wrap or _identity)(_mla_q_rope_kernel)[grid](**args, num_warps=num_warps)
    return out


def mla_q_kv_rope_triton(
    q, kv, weight, cos, sin, eps, weight_offset=0.0, cast_before_weight=True, interleave=True,
    *, wrap: Callable | None = None,
):  # fmt: skip
    """(query, normed, k_pe) as mla_q_kv_rope_reference, in one launch: the kv programs of
    mla_kv_norm_rope_triton, then the q programs of mla_q_rope_triton (MLA's form: rope last,
    heads first), with the launch shapes each uses alone (both run 2 warps). Each plan checks its
    branch's arguments."""
    check_mla_q_kv_pair(q, kv)
    (normed, k_pe), kv_args, kv_programs = _kv_plan(
        kv, weight, cos, sin, eps, weight_offset, cast_before_weight, interleave, None
    )
    query, q_args, (tokens, head_blocks) = _q_plan(
        q, cos, sin, False, interleave, True, None, (kv_args["cos_ptr"], kv_args["sin_ptr"])
    )
    for name in ("ROPE_FIRST", "HEADS_FIRST"):
        del q_args[name]
    args = {**kv_args, **q_args, "kv_programs": kv_programs, "head_blocks": head_blocks}
    grid = (kv_programs + tokens * head_blocks,)
    (wrap or _identity)(_mla_q_kv_rope_kernel)[grid](**args, num_warps=_WARPS)
    return query, normed, k_pe


def mla_indexer_k_norm_rope_triton(
    k, weight, bias, cos, sin, eps, interleave=False, *, wrap: Callable | None = None
):
    """LayerNorm + RoPE of the indexer keys, as mla_indexer_k_norm_rope_reference."""
    p = check_indexer_k_args(k, weight, bias, cos, sin, interleave)
    lead = tuple(k.shape[:-1])
    k_rows = _rows(k, lead)
    cos_rows, sin_rows = _rows(cos, lead), _rows(sin, lead)
    m = k_rows.shape[0]
    out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    form = _indexer_k_form(k.shape[-1], p, interleave)
    (wrap or _identity)(_mla_indexer_k_norm_rope_kernel)[(triton.cdiv(m, form["ROWS"]),)](
        k_rows, weight.contiguous(), bias.contiguous(), cos_rows, sin_rows, out, m, k_rows.stride(0),
        cos_rows.stride(0), sin_rows.stride(0), eps, **form, num_warps=4,
    )  # fmt: skip
    return out


def mla_indexer_k_norm_rope_cache_triton(
    k, weight, bias, cos, sin, cache, positions, eps, interleave=False, *, wrap: Callable | None = None
):
    """The cache with the indexer keys written at their slots, as
    mla_indexer_k_norm_rope_cache_reference: in place when ``wrap`` is given (Inductor inlines the
    launch; the op's output is the cache), else into a copy."""
    p = check_indexer_k_cache_args(k, weight, bias, cos, sin, cache, positions, interleave)
    b, s, d = k.shape
    k_rows = _rows(k, (b, s))
    cos_rows, sin_rows = _rows(cos, (b, s)), _rows(sin, (b, s))
    out, positions, mode, (s_rows, t, stride_ob, stride_os) = _indexer_k_target(
        k, cache, positions, wrap, "mla_indexer_k_norm_rope_cache"
    )
    form = _indexer_k_form(d, p, interleave)
    (wrap or _identity)(_mla_indexer_k_norm_rope_cache_kernel)[(triton.cdiv(b * s, form["ROWS"]),)](
        k_rows, weight.contiguous(), bias.contiguous(), cos_rows, sin_rows, out, positions, b * s, s_rows, t,
        k_rows.stride(0), cos_rows.stride(0), sin_rows.stride(0), stride_ob, stride_os, eps, POSITIONS=mode, **form,
        num_warps=4,
    )  # fmt: skip
    return out


def _indexer_k_form(d: int, p: int, interleave: bool) -> dict:
    """The indexer key kernels' constants (rows a program from _INDEXER_ELEMENTS_PER_PROGRAM)."""
    return dict(D=d, HALF=p // 2, INTERLEAVE=interleave, BLOCK_D=triton.next_power_of_2(d),
                BLOCK_PASS=triton.next_power_of_2(max(1, d - p)), BLOCK_HALF=triton.next_power_of_2(p // 2),
                ROWS=_rows_per_program(d, _INDEXER_ELEMENTS_PER_PROGRAM))  # fmt: skip


def _indexer_k_target(k, cache, positions, wrap, op: str):
    """Where the key rows (b, s) of k [B, S, D] go: (out, positions, POSITIONS, (S, T, stride_ob,
    stride_os)) for _indexer_k_rows. No cache: a new [B, S, D] tensor (row r at r, one "sequence");
    a cache: itself when the launch is inlined (``wrap``), else a copy, at the tokens' slots."""
    b, s, d = k.shape
    if cache is None:
        return torch.empty(k.shape, dtype=k.dtype, device=k.device), None, 0, (b * s, b * s, 0, d)
    out = cache if wrap is not None else cache.clone()
    if out.stride(-1) != 1:
        raise ValueError(f"{op}: the cache's last dim must be contiguous, got strides {out.stride()}")
    positions = positions.reshape(-1)
    return out, positions, slots_mode(positions, s), (s, cache.shape[1], out.stride(0), out.stride(1))


@triton.jit
def _kv_write_rows(
    program,  # this program's rows: [program * ROWS, (program + 1) * ROWS)
    k_nope_ptr,  # *dtype [B, H, S, NOPE] (strides kn_*; unit column stride)
    k_pe_ptr,  # *dtype [B, 1 or H, S, R]: the rotated key part every head shares (strides kp_*)
    v_ptr,  # *dtype [B, H, S, V] (strides v_*)
    k_cache_ptr,  # *dtype [B, H, T, NOPE + R] (strides kc_*)
    v_cache_ptr,  # *dtype [B, H, T, V] (strides vc_*)
    pos_ptr,  # SLOTS 1: *int the first slot (token s at it + s); 2: *int [S] each token's slot
    n_rows,  # B * H * S: (sequence, head, token) rows, tokens fastest
    S,
    T,  # cache slots: a row whose slot is outside [0, T) is not written
    kn_stride_b, kn_stride_h, kn_stride_s,
    kp_stride_b, kp_stride_h, kp_stride_s,  # kp_stride_h 0 where k_pe is shared
    v_stride_b, v_stride_h, v_stride_s,
    kc_stride_b, kc_stride_h, kc_stride_t,
    vc_stride_b, vc_stride_h, vc_stride_t,
    H: tl.constexpr, NOPE: tl.constexpr, R: tl.constexpr, V: tl.constexpr, BLOCK_NOPE: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr, ROWS: tl.constexpr,
    SLOTS: tl.constexpr,  # 1: consecutive slots from one; 2: a slot per token
):  # fmt: skip
    rows = program * ROWS + tl.arange(0, ROWS)
    row_mask = rows < n_rows
    rows = rows.to(tl.int64)
    s = rows % S
    bh = rows // S
    b = bh // H
    h = bh % H
    if SLOTS == 1:
        slot = s + tl.load(pos_ptr).to(tl.int64)
    else:
        slot = tl.load(pos_ptr + s, mask=row_mask, other=0).to(tl.int64)
    row_mask = (row_mask & (slot >= 0) & (slot < T))[:, None]  # a slot past the cache: no memory of it
    k_row = (k_cache_ptr + b * kc_stride_b + h * kc_stride_h + slot * kc_stride_t)[:, None]
    cols = tl.arange(0, BLOCK_NOPE)[None, :]
    src = (k_nope_ptr + b * kn_stride_b + h * kn_stride_h + s * kn_stride_s)[:, None]
    tl.store(k_row + cols, tl.load(src + cols, mask=row_mask & (cols < NOPE)), mask=row_mask & (cols < NOPE))
    cols = tl.arange(0, BLOCK_R)[None, :]
    src = (k_pe_ptr + b * kp_stride_b + h * kp_stride_h + s * kp_stride_s)[:, None]
    tl.store(k_row + NOPE + cols, tl.load(src + cols, mask=row_mask & (cols < R)), mask=row_mask & (cols < R))
    cols = tl.arange(0, BLOCK_V)[None, :]
    src = (v_ptr + b * v_stride_b + h * v_stride_h + s * v_stride_s)[:, None]
    v_row = (v_cache_ptr + b * vc_stride_b + h * vc_stride_h + slot * vc_stride_t)[:, None]
    tl.store(v_row + cols, tl.load(src + cols, mask=row_mask & (cols < V)), mask=row_mask & (cols < V))


@triton.jit
def _mla_kv_cache_write_kernel(
    k_nope_ptr, k_pe_ptr, v_ptr, k_cache_ptr, v_cache_ptr, pos_ptr, n_rows, S, T,
    kn_stride_b, kn_stride_h, kn_stride_s, kp_stride_b, kp_stride_h, kp_stride_s, v_stride_b, v_stride_h, v_stride_s,
    kc_stride_b, kc_stride_h, kc_stride_t, vc_stride_b, vc_stride_h, vc_stride_t,
    H: tl.constexpr, NOPE: tl.constexpr, R: tl.constexpr, V: tl.constexpr, BLOCK_NOPE: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr, ROWS: tl.constexpr, SLOTS: tl.constexpr,
):  # fmt: skip
    """mla_kv_cache_write: the rows of _kv_write_rows, ROWS a program."""
    _kv_write_rows(
        tl.program_id(0), k_nope_ptr, k_pe_ptr, v_ptr, k_cache_ptr, v_cache_ptr, pos_ptr, n_rows, S, T,
        kn_stride_b, kn_stride_h, kn_stride_s, kp_stride_b, kp_stride_h, kp_stride_s, v_stride_b, v_stride_h,
        v_stride_s, kc_stride_b, kc_stride_h, kc_stride_t, vc_stride_b, vc_stride_h, vc_stride_t,
        H, NOPE, R, V, BLOCK_NOPE, BLOCK_R, BLOCK_V, ROWS, SLOTS,
    )  # fmt: skip


# Rows (a head of a token) a program copies: 2048 elements of key and value (DeepSeek V3.2: 192 +
# 128 a row, so 4 rows; a decode step's 128 heads take 32 programs).
_KV_WRITE_ELEMENTS = 2048


def _kv_write_plan(k_nope, k_pe, value, k_cache, v_cache, positions, wrap, op: str):
    """(runtime arguments, constexprs, programs, (k_out, v_out)) of a launch of _kv_write_rows:
    the caches written in place when ``wrap`` is given (Inductor inlines the launch), else copies."""
    check_mla_kv_cache_write_args(k_nope, k_pe, value, k_cache, v_cache, positions)
    b, h, s, nope = k_nope.shape
    r, v = k_pe.shape[-1], value.shape[-1]
    k_nope, k_pe, value = (t if t.stride(-1) == 1 else t.contiguous() for t in (k_nope, k_pe, value))
    k_out, v_out = (k_cache, v_cache) if wrap is not None else (k_cache.clone(), v_cache.clone())
    for name, cache in (("k_cache", k_out), ("v_cache", v_out)):
        if cache.stride(-1) != 1:
            raise ValueError(f"{op}: the {name}'s last dim must be contiguous, got strides {cache.stride()}")
    positions = positions.reshape(-1)
    slots = slots_mode(positions, s)
    padded = triton.next_power_of_2(nope) + triton.next_power_of_2(r) + triton.next_power_of_2(v)
    rows = max(1, triton.next_power_of_2(max(1, _KV_WRITE_ELEMENTS // padded)) // 2) if padded > 0 else 1
    n_rows = b * h * s
    kp_stride_h = k_pe.stride(1) if k_pe.shape[1] > 1 else 0
    args = (
        k_nope, k_pe, value, k_out, v_out, positions, n_rows, s, k_cache.shape[2],
        k_nope.stride(0), k_nope.stride(1), k_nope.stride(2), k_pe.stride(0), kp_stride_h, k_pe.stride(2),
        value.stride(0), value.stride(1), value.stride(2), k_out.stride(0), k_out.stride(1), k_out.stride(2),
        v_out.stride(0), v_out.stride(1), v_out.stride(2),
    )  # fmt: skip
    constexprs = {"H": h, "NOPE": nope, "R": r, "V": v, "BLOCK_NOPE": triton.next_power_of_2(nope),
                  "BLOCK_R": triton.next_power_of_2(r), "BLOCK_V": triton.next_power_of_2(v), "ROWS": rows,
                  "SLOTS": slots}  # fmt: skip
    return args, constexprs, triton.cdiv(n_rows, rows), (k_out, v_out)


def mla_kv_cache_write_triton(k_nope, k_pe, value, k_cache, v_cache, positions, *, wrap: Callable | None = None):
    """(k_cache, v_cache) as mla_kv_cache_write_reference: written in place when ``wrap`` is
    given (Inductor inlines the launch; the op's outputs are the caches), else into copies."""
    args, constexprs, programs, outs = _kv_write_plan(
        k_nope, k_pe, value, k_cache, v_cache, positions, wrap, "mla_kv_cache_write"
    )
    (wrap or _identity)(_mla_kv_cache_write_kernel)[(programs,)](*args, **constexprs, num_warps=4)
    return outs


def _indexer_qk_plan(q, k, weight, bias, cos, sin, cache, positions, eps, interleave, wrap, op: str):
    """(positional arguments of _mla_indexer_qk_rope_kernel, its constexprs, its program count,
    (query, key or cache)): the key programs of mla_indexer_k_norm_rope(_cache)_triton, then the q
    programs of mla_q_rope_triton (the indexer's form: rope first, [B, S, H, D]), each with its
    launch shape. The merged launches below start with these arguments and programs."""
    check_mla_indexer_qk_args(q, k, weight, bias, cos, sin, cache, positions, interleave)
    p = check_indexer_k_args(k, weight, bias, cos, sin, interleave)
    b, s, d = k.shape
    k_rows = _rows(k, (b, s))
    query, q_args, (tokens, head_blocks) = _q_plan(q, cos, sin, True, interleave, False, None)
    cos_rows, sin_rows = q_args["cos_ptr"], q_args["sin_ptr"]
    out, positions, mode, (s_rows, t, stride_ob, stride_os) = _indexer_k_target(k, cache, positions, wrap, op)
    form = _indexer_k_form(d, p, interleave)
    k_programs = triton.cdiv(b * s, form["ROWS"])
    args = [
        q_args["q_ptr"], k_rows, weight.contiguous(), bias.contiguous(), cos_rows, sin_rows, query, out, positions,
        b * s, q_args["H"], s_rows, t, k_rows.stride(0), q_args["stride_qt"], q_args["stride_qh"],
        cos_rows.stride(0), sin_rows.stride(0), stride_ob, stride_os, eps, k_programs, head_blocks,
    ]  # fmt: skip
    constexprs = {"POSITIONS": mode, "BLOCK_H": q_args["BLOCK_H"], "Q_BLOCK_PASS": q_args["BLOCK_PASS"], **form}
    return args, constexprs, k_programs + tokens * head_blocks, (query, out)


def mla_indexer_qk_rope_triton(
    q, k, weight, bias, cos, sin, cache, positions, eps, interleave=False, *, wrap: Callable | None = None
):
    """(q_out, k_out or the cache) as mla_indexer_qk_rope_reference, in one launch (_indexer_qk_plan);
    one warp count for both branches (4, the key kernel's: the two were timed apart only). The
    cache, given, is written in place when ``wrap`` is given, else into a copy."""
    args, constexprs, programs, outs = _indexer_qk_plan(
        q, k, weight, bias, cos, sin, cache, positions, eps, interleave, wrap, "mla_indexer_qk_rope"
    )
    (wrap or _identity)(_mla_indexer_qk_rope_kernel)[(programs,)](*args, **constexprs, num_warps=4)
    return outs


@triton.jit
def _mla_indexer_qk_rope_kv_kernel(
    q_ptr, k_ptr, weight_ptr, bias_ptr, cos_ptr, sin_ptr, q_out_ptr, out_ptr, pos_ptr, M, H, S, T, stride_k,
    stride_qt, stride_qh, stride_cos, stride_sin, stride_ob, stride_os, eps,
    k_programs,  # programs of the indexer key branch (the first ones)
    head_blocks,  # indexer q programs per token
    qk_programs,  # programs of both indexer branches; the rest write the KV cache
    k_nope_ptr, k_pe_ptr, v_ptr, k_cache_ptr, v_cache_ptr, kv_pos_ptr, kv_rows, KV_S, KV_T,
    kn_stride_b, kn_stride_h, kn_stride_s, kp_stride_b, kp_stride_h, kp_stride_s, v_stride_b, v_stride_h, v_stride_s,
    kc_stride_b, kc_stride_h, kc_stride_t, vc_stride_b, vc_stride_h, vc_stride_t,
    D: tl.constexpr, HALF: tl.constexpr, INTERLEAVE: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_PASS: tl.constexpr, BLOCK_HALF: tl.constexpr, ROWS: tl.constexpr, POSITIONS: tl.constexpr,
    BLOCK_H: tl.constexpr, Q_BLOCK_PASS: tl.constexpr,
    KV_H: tl.constexpr, NOPE: tl.constexpr, R: tl.constexpr, V: tl.constexpr, BLOCK_NOPE: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr, KV_ROWS: tl.constexpr, KV_SLOTS: tl.constexpr,
):  # fmt: skip
    """mla_indexer_qk_rope_kv_cache: _mla_indexer_qk_rope_kernel's programs (the indexer's key into
    its cache, its query), then _mla_kv_cache_write_kernel's (MLA's key and value into the KV
    cache), each program doing one program's work of those kernels: their outputs bit for bit."""
    program = tl.program_id(0)
    if program < qk_programs:
        _indexer_qk_program(
            program, q_ptr, k_ptr, weight_ptr, bias_ptr, cos_ptr, sin_ptr, q_out_ptr, out_ptr, pos_ptr, M, H, S, T,
            stride_k, stride_qt, stride_qh, stride_cos, stride_sin, stride_ob, stride_os, eps, k_programs,
            head_blocks, D, HALF, INTERLEAVE, BLOCK_D, BLOCK_PASS, BLOCK_HALF, ROWS, POSITIONS, BLOCK_H, Q_BLOCK_PASS,
        )  # fmt: skip
    else:
        _kv_write_rows(
            program - qk_programs, k_nope_ptr, k_pe_ptr, v_ptr, k_cache_ptr, v_cache_ptr, kv_pos_ptr, kv_rows,
            KV_S, KV_T, kn_stride_b, kn_stride_h, kn_stride_s, kp_stride_b, kp_stride_h, kp_stride_s, v_stride_b,
            v_stride_h, v_stride_s, kc_stride_b, kc_stride_h, kc_stride_t, vc_stride_b, vc_stride_h, vc_stride_t,
            KV_H, NOPE, R, V, BLOCK_NOPE, BLOCK_R, BLOCK_V, KV_ROWS, KV_SLOTS,
        )  # fmt: skip


def mla_indexer_qk_rope_kv_cache_triton(
    q, k, weight, bias, cos, sin, cache, positions, k_nope, k_pe, value, k_cache, v_cache, kv_positions, eps,
    interleave=False, *, wrap: Callable | None = None,
):  # fmt: skip
    """(query, cache, k_cache, v_cache) as mla_indexer_qk_rope_kv_cache_reference, in one launch:
    mla_indexer_qk_rope_triton's programs (into the indexer cache), then mla_kv_cache_write_triton's,
    each with its launch shape (4 warps, both kernels'). The caches are written in place when
    ``wrap`` is given, else into copies."""
    op = "mla_indexer_qk_rope_kv_cache"
    args, constexprs, qk_programs, outs = _indexer_qk_plan(
        q, k, weight, bias, cos, sin, cache, positions, eps, interleave, wrap, op
    )
    kv_args, kv_form, kv_programs, kv_outs = _kv_write_plan(k_nope, k_pe, value, k_cache, v_cache, kv_positions, wrap, op)
    (wrap or _identity)(_mla_indexer_qk_rope_kv_kernel)[(qk_programs + kv_programs,)](
        *args, qk_programs, *kv_args, **constexprs, **_merged_kv_form(kv_form), num_warps=4
    )
    return (*outs, *kv_outs)


def _merged_kv_form(kv_form: dict) -> dict:
    """_kv_write_plan's constexprs as the merged kernels name them (the indexer's H, ROWS: KV_*)."""
    return {("KV_" + name if name in ("H", "ROWS", "SLOTS") else name): v for name, v in kv_form.items()}


@triton.jit
def _mla_q_a_kv_norm_rope_kernel(
    kv_ptr, weight_ptr, cos_ptr, sin_ptr, normed_ptr, pe_ptr, M, R, stride_kv, stride_cos, stride_sin, eps,
    weight_offset,
    x_ptr, x_weight_ptr, x_normed_ptr, x_rows, x_width, stride_x, x_eps, x_weight_offset,
    kv_programs,  # programs of the kv branch (the first ones); the rest normalise x (q_a)
    HALF: tl.constexpr, INTERLEAVE: tl.constexpr, CAST_BEFORE_WEIGHT: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_HALF: tl.constexpr, ROWS: tl.constexpr,
    X_CAST_BEFORE_WEIGHT: tl.constexpr, X_BLOCK: tl.constexpr, X_ROWS: tl.constexpr,
):  # fmt: skip
    """mla_q_a_kv_norm_rope: MLA's kv branch (_mla_kv_norm_rope_kernel's programs) and the RMSNorm
    of q_a_proj's output (q_a_layernorm) in one launch; the norm rows are the kv branch's norm
    without a rope part (HALF 0: its loads and stores masked off)."""
    program = tl.program_id(0)
    if program < kv_programs:
        _kv_norm_rope_rows(
            program, kv_ptr, weight_ptr, cos_ptr, sin_ptr, normed_ptr, pe_ptr, M, R, stride_kv,
            stride_cos, stride_sin, eps, weight_offset, HALF, INTERLEAVE, CAST_BEFORE_WEIGHT,
            BLOCK_R, BLOCK_HALF, ROWS,
        )  # fmt: skip
    else:
        _kv_norm_rope_rows(
            program - kv_programs, x_ptr, x_weight_ptr, cos_ptr, sin_ptr, x_normed_ptr, x_normed_ptr, x_rows, x_width,
            stride_x, 0, 0, x_eps, x_weight_offset, 0, INTERLEAVE, X_CAST_BEFORE_WEIGHT, X_BLOCK, 1, X_ROWS,
        )  # fmt: skip


def mla_q_a_kv_norm_rope_triton(
    x, x_weight, x_eps, x_weight_offset, x_cast_before_weight, kv, weight, cos, sin, eps, weight_offset=0.0,
    cast_before_weight=True, interleave=True, *, wrap: Callable | None = None,
):  # fmt: skip
    """(x normed, kv normed, k_pe) as mla_q_a_kv_norm_rope_reference, in one launch: the kv
    programs of mla_kv_norm_rope_triton, then rows of x normalised as its latent is."""
    check_rms_norm_args(x, x_weight, x_weight_offset, x_cast_before_weight)
    (normed, k_pe), kv_args, kv_programs = _kv_plan(
        kv, weight, cos, sin, eps, weight_offset, cast_before_weight, interleave, None
    )
    width = x.shape[-1]
    x_rows = _rows(x, tuple(x.shape[:-1]))
    x_normed = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rows = _rows_per_program(width)
    args = {
        **kv_args, "x_ptr": x_rows, "x_weight_ptr": x_weight.contiguous(), "x_normed_ptr": x_normed,
        "x_rows": x_rows.shape[0], "x_width": width, "stride_x": x_rows.stride(0), "x_eps": x_eps,
        "x_weight_offset": x_weight_offset, "kv_programs": kv_programs, "X_CAST_BEFORE_WEIGHT": x_cast_before_weight,
        "X_BLOCK": triton.next_power_of_2(width), "X_ROWS": rows,
    }  # fmt: skip
    grid = (kv_programs + triton.cdiv(x_rows.shape[0], rows),)
    (wrap or _identity)(_mla_q_a_kv_norm_rope_kernel)[grid](**args, num_warps=_WARPS)
    return x_normed, normed, k_pe


@triton.jit
def _mla_q_indexer_kv_kernel(
    q_ptr, k_ptr, weight_ptr, bias_ptr, cos_ptr, sin_ptr, q_out_ptr, out_ptr, pos_ptr, M, H, S, T, stride_k,
    stride_qt, stride_qh, stride_cos, stride_sin, stride_ob, stride_os, eps, k_programs, head_blocks, qk_programs,
    k_nope_ptr, k_pe_ptr, v_ptr, k_cache_ptr, v_cache_ptr, kv_pos_ptr, kv_rows, KV_S, KV_T,
    kn_stride_b, kn_stride_h, kn_stride_s, kp_stride_b, kp_stride_h, kp_stride_s, v_stride_b, v_stride_h, v_stride_s,
    kc_stride_b, kc_stride_h, kc_stride_t, vc_stride_b, vc_stride_h, vc_stride_t,
    kv_end,  # qk_programs + the KV write's programs; the rest rotate MLA's query
    mq_ptr, mq_cos_ptr, mq_sin_ptr, mq_out_ptr, MQ_H, MQ_S, mq_stride_qt, mq_stride_qh, mq_stride_cos, mq_stride_sin,
    mq_head_blocks,
    D: tl.constexpr, HALF: tl.constexpr, INTERLEAVE: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_PASS: tl.constexpr, BLOCK_HALF: tl.constexpr, ROWS: tl.constexpr, POSITIONS: tl.constexpr,
    BLOCK_H: tl.constexpr, Q_BLOCK_PASS: tl.constexpr,
    KV_H: tl.constexpr, NOPE: tl.constexpr, R: tl.constexpr, V: tl.constexpr, BLOCK_NOPE: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr, KV_ROWS: tl.constexpr, KV_SLOTS: tl.constexpr,
    MQ_D: tl.constexpr, MQ_HALF: tl.constexpr, MQ_INTERLEAVE: tl.constexpr, MQ_BLOCK_H: tl.constexpr,
    MQ_BLOCK_PASS: tl.constexpr, MQ_BLOCK_HALF: tl.constexpr,
):  # fmt: skip
    """mla_q_indexer_kv_cache: _mla_indexer_qk_rope_kv_kernel's programs, then MLA's query RoPE
    (_mla_q_rope_kernel's programs: rope last, heads first), each program one program's work of
    those kernels, so the outputs are theirs bit for bit."""
    program = tl.program_id(0)
    if program < qk_programs:
        _indexer_qk_program(
            program, q_ptr, k_ptr, weight_ptr, bias_ptr, cos_ptr, sin_ptr, q_out_ptr, out_ptr, pos_ptr, M, H, S, T,
            stride_k, stride_qt, stride_qh, stride_cos, stride_sin, stride_ob, stride_os, eps, k_programs,
            head_blocks, D, HALF, INTERLEAVE, BLOCK_D, BLOCK_PASS, BLOCK_HALF, ROWS, POSITIONS, BLOCK_H, Q_BLOCK_PASS,
        )  # fmt: skip
    elif program < kv_end:
        _kv_write_rows(
            program - qk_programs, k_nope_ptr, k_pe_ptr, v_ptr, k_cache_ptr, v_cache_ptr, kv_pos_ptr, kv_rows,
            KV_S, KV_T, kn_stride_b, kn_stride_h, kn_stride_s, kp_stride_b, kp_stride_h, kp_stride_s, v_stride_b,
            v_stride_h, v_stride_s, kc_stride_b, kc_stride_h, kc_stride_t, vc_stride_b, vc_stride_h, vc_stride_t,
            KV_H, NOPE, R, V, BLOCK_NOPE, BLOCK_R, BLOCK_V, KV_ROWS, KV_SLOTS,
        )  # fmt: skip
    else:
        q_program = program - kv_end
        _q_rope_heads(
            (q_program // mq_head_blocks).to(tl.int64), q_program % mq_head_blocks, mq_ptr, mq_cos_ptr, mq_sin_ptr,
            mq_out_ptr, MQ_H, MQ_S, mq_stride_qt, mq_stride_qh, mq_stride_cos, mq_stride_sin, MQ_D, MQ_HALF, False,
            MQ_INTERLEAVE, True, MQ_BLOCK_H, MQ_BLOCK_PASS, MQ_BLOCK_HALF,
        )  # fmt: skip


def mla_q_indexer_kv_cache_triton(
    mq, mq_cos, mq_sin, mq_interleave, q, k, weight, bias, cos, sin, cache, positions, k_nope, k_pe, value, k_cache,
    v_cache, kv_positions, eps, interleave=False, *, wrap: Callable | None = None,
):  # fmt: skip
    """(MLA's query, the indexer's query, its cache, k_cache, v_cache) as
    mla_q_indexer_kv_cache_reference, in one launch: mla_indexer_qk_rope_kv_cache_triton's
    programs, then mla_q_rope_triton's for MLA's query (rope last, heads first), each with its
    launch shape (4 warps)."""
    op = "mla_q_indexer_kv_cache"
    args, constexprs, qk_programs, outs = _indexer_qk_plan(
        q, k, weight, bias, cos, sin, cache, positions, eps, interleave, wrap, op
    )
    kv_args, kv_form, kv_programs, kv_outs = _kv_write_plan(k_nope, k_pe, value, k_cache, v_cache, kv_positions, wrap, op)
    mla_query, mq_args, (mq_tokens, mq_head_blocks) = _q_plan(mq, mq_cos, mq_sin, False, mq_interleave, True, None)
    kv_end = qk_programs + kv_programs
    mq_values = [mq_args[name] for name in ("q_ptr", "cos_ptr", "sin_ptr", "out_ptr", "H", "S", "stride_qt",
                                             "stride_qh", "stride_cos", "stride_sin")]  # fmt: skip
    mq_form = {f"MQ_{name}": mq_args[name] for name in ("D", "HALF", "BLOCK_H", "BLOCK_PASS", "BLOCK_HALF")}
    (wrap or _identity)(_mla_q_indexer_kv_kernel)[(kv_end + mq_tokens * mq_head_blocks,)](
        *args, qk_programs, *kv_args, kv_end, *mq_values, mq_head_blocks, **constexprs, **_merged_kv_form(kv_form),
        **mq_form, MQ_INTERLEAVE=mq_interleave, num_warps=4,
    )  # fmt: skip
    return (mla_query, *outs, *kv_outs)
