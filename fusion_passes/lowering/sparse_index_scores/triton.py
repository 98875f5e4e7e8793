"""One Triton kernel for DeepSeek V3.2's indexer scores: both matmuls, the scale and the relu.

Unfused (stock Inductor on transformers' indexer): the key cache transposed and upcast into an
fp32 copy (8.8 us per layer at 8192 cached tokens, batch 1, on one H200), an fp32 GEMM of the H
query heads against it, the scale and relu, and a second GEMM summing the heads with their
weights: [B, S, H, T] fp32 written and read back between them.
Fused: each program owns one query token (b, s) and BLOCK_T cached positions: it loads the token's
heads q [H, D] and the keys k [BLOCK_T, D] as they are in the cache (no copy), and computes
    dots = q k^T  [H, BLOCK_T];   out = sum_h weights[h] * relu(dots[h] * scale)
storing out [BLOCK_T] in fp32 (-inf where the optional keep mask is False: the model's
masked_fill before its top-k, or past the token's position for causal_first: the causal mask
computed from one position; the weights upcast and times weights_scale as they load). bf16 / fp16 q and k go through the tensor cores as TF32, which
holds their values exactly (8 / 11 significant bits of TF32's 11): their products are exact and
accumulate in fp32, as in the reference's fp32 matmul of their upcasts (only the order of the
sums differs); fp32 ones through IEEE fp32 dots.
Above TILED_ABOVE query tokens (a prefill) that kernel would read the keys once per token: there
each program owns BLOCK_S tokens x BLOCK_T positions, loads its key tile once and walks the heads,
    acc[s, t] += weights[s, h] * relu(scale * q[s, h] . k[t])       (h = 0 .. H-1)
with q and k of one 16-bit dtype dotted as they are (exact products, fp32 accumulation), so the
[B, S, H, T] fp32 scores the unfused form writes and reads back (4.3 GB at DeepSeek V3.2's 64
heads and a 4096-token prompt) never exist.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from fusion_passes.lowering.sparse_index_scores.reference import check_sparse_index_scores_args


@triton.jit
def _relu(x):
    return tl.where(x > 0.0, x, tl.where(x != x, x, 0.0))  # F.relu keeps NaN


@triton.jit
def _index_scores_kernel(
    q_ptr,  # *q.dtype [B, S, H, D] (strides stride_qb, stride_qs, stride_qh; D contiguous)
    k_ptr,  # *k.dtype [B, T, D] (strides stride_kb, stride_kt; D contiguous)
    w_ptr,  # *weights.dtype [B, S, H] (strides stride_wb, stride_ws, stride_wh)
    keep_ptr,  # *bool [B, S, T] (strides stride_mb, stride_ms, stride_mt), read where HAS_KEEP
    first_ptr,  # *int: the position of query token 0, read where CAUSAL (token s sees t <= it + s)
    out_ptr,  # *fp32 [B, S, T] contiguous
    S,  # query tokens per sequence
    T,  # cached positions
    stride_qb, stride_qs, stride_qh, stride_kb, stride_kt, stride_wb, stride_ws, stride_wh,
    stride_mb, stride_ms, stride_mt,
    scale,
    weights_scale,
    H: tl.constexpr,
    D: tl.constexpr,
    BLOCK_H: tl.constexpr,  # next_power_of_2(H), >= 16 (a dot's smallest side)
    BLOCK_D: tl.constexpr,  # next_power_of_2(D), >= 16
    BLOCK_T: tl.constexpr,  # positions per program, >= 16
    EXACT_IN_TF32: tl.constexpr,  # q and k of 16-bit dtypes: TF32 dots, exact products
    HAS_KEEP: tl.constexpr,
    CAUSAL: tl.constexpr,
):
    scale = tl.cast(scale, tl.float32)  # Inductor passes Python floats as fp64
    weights_scale = tl.cast(weights_scale, tl.float32)
    row = tl.program_id(0)
    b = (row // S).to(tl.int64)
    s = row % S
    ts = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    hs = tl.arange(0, BLOCK_H)
    ds = tl.arange(0, BLOCK_D)
    hm, dm, tm = hs < H, ds < D, ts < T
    q = tl.load(q_ptr + b * stride_qb + s * stride_qs + hs[:, None] * stride_qh + ds[None, :],
                mask=hm[:, None] & dm[None, :], other=0.0)  # fmt: skip
    kt = tl.load(k_ptr + b * stride_kb + ts[None, :].to(tl.int64) * stride_kt + ds[:, None],
                 mask=dm[:, None] & tm[None, :], other=0.0)  # fmt: skip
    if EXACT_IN_TF32:
        dots = tl.dot(q.to(tl.float32), kt.to(tl.float32), input_precision="tf32")
    else:
        dots = tl.dot(q.to(tl.float32), kt.to(tl.float32), input_precision="ieee")
    x = dots * scale
    relu = _relu(x)
    w = tl.load(w_ptr + b * stride_wb + s * stride_ws + hs * stride_wh, mask=hm, other=0.0)
    w = w.to(tl.float32) * weights_scale  # the model's weights.float() * H^-1/2, rounded as it rounds
    out = tl.sum(relu * w[:, None], axis=0)
    if HAS_KEEP:
        keep = tl.load(keep_ptr + b * stride_mb + s * stride_ms + ts.to(tl.int64) * stride_mt, mask=tm, other=0)
        out = tl.where(keep != 0, out, float("-inf"))
    if CAUSAL:
        out = tl.where(ts.to(tl.int64) <= tl.load(first_ptr).to(tl.int64) + s, out, float("-inf"))
    tl.store(out_ptr + row.to(tl.int64) * T + ts, out, mask=tm)


@triton.jit
def _index_scores_tiled_kernel(
    q_ptr,  # *q.dtype [B, S, H, D] (strides stride_qb, stride_qs, stride_qh; D contiguous)
    k_ptr,  # *k.dtype [B, T, D] (strides stride_kb, stride_kt; D contiguous)
    w_ptr,  # *weights.dtype [B, S, H] (strides stride_wb, stride_ws, stride_wh)
    keep_ptr,  # *bool [B, S, T] (strides stride_mb, stride_ms, stride_mt), read where HAS_KEEP
    first_ptr,  # *int: the position of query token 0, read where CAUSAL
    out_ptr,  # *fp32 [B, S, T] contiguous
    S,
    T,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_kt, stride_wb, stride_ws, stride_wh,
    stride_mb, stride_ms, stride_mt,
    scale,
    weights_scale,
    H: tl.constexpr,
    D: tl.constexpr,
    BLOCK_S: tl.constexpr,  # query tokens per program, >= 16
    BLOCK_D: tl.constexpr,  # next_power_of_2(D), >= 16
    BLOCK_T: tl.constexpr,  # positions per program, >= 16
    DOT: tl.constexpr,  # "native": q and k of one 16-bit dtype, dotted as they are; "tf32" / "ieee": upcast
    HAS_KEEP: tl.constexpr,
    CAUSAL: tl.constexpr,
):  # fmt: skip
    """A prefill's scores: one program owns BLOCK_S query tokens x BLOCK_T positions and walks the
    heads, its key tile loaded once: acc += weights[:, h] * relu(scale * q_h k^T)."""
    scale = tl.cast(scale, tl.float32)
    weights_scale = tl.cast(weights_scale, tl.float32)
    b = tl.program_id(2).to(tl.int64)
    ss = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    ts = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    ds = tl.arange(0, BLOCK_D)
    sm, dm, tm = ss < S, ds < D, ts < T
    kt = tl.load(k_ptr + b * stride_kb + ts[None, :].to(tl.int64) * stride_kt + ds[:, None],
                 mask=dm[:, None] & tm[None, :], other=0.0)  # fmt: skip
    if DOT != "native":
        kt = kt.to(tl.float32)
    q_rows = q_ptr + b * stride_qb + ss[:, None].to(tl.int64) * stride_qs + ds[None, :]
    w_rows = w_ptr + b * stride_wb + ss.to(tl.int64) * stride_ws
    acc = tl.zeros((BLOCK_S, BLOCK_T), tl.float32)
    for h in range(H):
        q = tl.load(q_rows + h * stride_qh, mask=sm[:, None] & dm[None, :], other=0.0)
        if DOT == "native":  # bf16 / fp16 products are exact in the fp32 accumulator
            dots = tl.dot(q, kt)
        elif DOT == "tf32":  # 16-bit values of two dtypes: exact in TF32
            dots = tl.dot(q.to(tl.float32), kt, input_precision="tf32")
        else:
            dots = tl.dot(q.to(tl.float32), kt, input_precision="ieee")
        x = dots * scale
        relu = _relu(x)
        w = tl.load(w_rows + h * stride_wh, mask=sm, other=0.0).to(tl.float32) * weights_scale
        acc += relu * w[:, None]
    if HAS_KEEP:
        keep = tl.load(keep_ptr + b * stride_mb + ss[:, None].to(tl.int64) * stride_ms + ts[None, :].to(tl.int64) * stride_mt,
                       mask=sm[:, None] & tm[None, :], other=0)  # fmt: skip
        acc = tl.where(keep != 0, acc, float("-inf"))
    if CAUSAL:
        last = tl.load(first_ptr).to(tl.int64) + ss.to(tl.int64)
        acc = tl.where(ts[None, :].to(tl.int64) <= last[:, None], acc, float("-inf"))
    out = out_ptr + (b * S + ss[:, None]).to(tl.int64) * T + ts[None, :]
    tl.store(out, acc, mask=sm[:, None] & tm[None, :])


# Query tokens per sequence above which the tiled kernel takes the scores (a prefill, a long
# speculative block): the per-token kernel reads the keys once per token.
TILED_ABOVE = 16


def sparse_index_scores_triton(
    q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, scale: float, weights_scale: float = 1.0,
    keep: torch.Tensor | None = None, causal_first: torch.Tensor | None = None, *, wrap: Callable | None = None,
    block_t: int | None = None, num_warps: int | None = None,
) -> torch.Tensor:
    """fp32 [B, S, T] as ``sparse_index_scores_reference``. ``block_t`` / ``num_warps``: launch
    overrides for the benchmark's sweep."""
    check_sparse_index_scores_args(q, k, weights, keep, causal_first)
    first = None if causal_first is None else causal_first.reshape(1)  # None: the kernels compile without it
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    bsz, s, h, d = q.shape
    t = k.shape[1]
    out = torch.empty((bsz, s, t), dtype=torch.float32, device=q.device)
    exact_in_tf32 = q.dtype in (torch.bfloat16, torch.float16) and k.dtype in (torch.bfloat16, torch.float16)
    # 32 positions a program at 2 warps: on one H200 at 64 x 128 heads, 13.8 / 22.7 us at batch 8
    # and 8192 / 16384 cached tokens against 14.6 / 24.2 at 64 x 4 (a timing spread of 0.1-0.2 us);
    # at batch 1 within 0.1-0.3 us of each other (5.4 us at 8192).
    if isinstance(s, int) and s > TILED_ABOVE:  # (a symbolic token count: the per-token kernel, no guard)
        return _tiled(q, k, weights, scale, weights_scale, keep, first, out, wrap=wrap, block_t=block_t,
                      num_warps=num_warps)  # fmt: skip
    block_t = block_t or 32
    kernel = wrap(_index_scores_kernel) if wrap is not None else _index_scores_kernel
    kernel[(bsz * s, triton.cdiv(t, block_t))](
        q, k, weights, keep, first, out, s, t,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1),
        weights.stride(0), weights.stride(1), weights.stride(2), *_keep_strides(keep),
        scale, weights_scale,
        H=h, D=d, BLOCK_H=max(16, triton.next_power_of_2(h)), BLOCK_D=max(16, triton.next_power_of_2(d)),
        BLOCK_T=block_t, EXACT_IN_TF32=exact_in_tf32, HAS_KEEP=keep is not None, CAUSAL=first is not None,
        num_warps=num_warps or 2,
    )  # fmt: skip
    return out


def _keep_strides(keep):
    # Without a mask the kernels compile without its loads and take None for its pointer (a
    # constant, no launch argument: a tensor standing in costs host time at every launch).
    return keep.stride() if keep is not None else (0, 0, 0)


def _tiled(q, k, weights, scale, weights_scale, keep, first, out, *, wrap, block_t, num_warps):
    bsz, s, h, d = q.shape
    t = k.shape[1]
    sixteen_bit = (torch.bfloat16, torch.float16)
    dot = "native" if q.dtype == k.dtype and q.dtype in sixteen_bit else (
        "tf32" if q.dtype in sixteen_bit and k.dtype in sixteen_bit else "ieee")  # fmt: skip
    if dot == "native" and os.environ.get("TRITON_INTERPRET") == "1":
        dot = "tf32"  # the interpreter's 16-bit dots are wrong; TF32 holds the values exactly
    # 64 tokens x 128 positions, 8 warps: the key tile and the accumulator fit the registers at
    # D = 128 (DeepSeek V3.2's indexer); fp32 operands half the positions (not timed yet)
    block_s = 64
    block_t = block_t or (128 if dot == "native" else 64)
    kernel = wrap(_index_scores_tiled_kernel) if wrap is not None else _index_scores_tiled_kernel
    kernel[(triton.cdiv(s, block_s), triton.cdiv(t, block_t), bsz)](
        q, k, weights, keep, first, out, s, t,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1),
        weights.stride(0), weights.stride(1), weights.stride(2), *_keep_strides(keep),
        scale, weights_scale,
        H=h, D=d, BLOCK_S=block_s, BLOCK_D=max(16, triton.next_power_of_2(d)), BLOCK_T=block_t, DOT=dot,
        HAS_KEEP=keep is not None, CAUSAL=first is not None, num_warps=num_warps or 8, num_stages=2,
    )  # fmt: skip
    return out
