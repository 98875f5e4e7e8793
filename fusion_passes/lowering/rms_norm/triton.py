"""One Triton kernel for RMSNorm and residual-add + RMSNorm over the last dim.

Unfused: r = x + residual (rounded to x.dtype), then rms_norm(r): two passes over the rows,
    reading x, residual, writing r, then reading r again and writing y.
Fused:   one pass per row, all math in fp32, rounding exactly where rms_norm/reference.py does:
    r   = to_x_dtype(f32(x) + f32(residual))          stored as new_residual (add form only)
    n   = f32(r) * rsqrt(sum(f32(r)^2) / N + eps)     (residual_in_fp32: of the unrounded sum)
    cast_before_weight (Llama form):  y = to_x_dtype(f32(to_x_dtype(n)) * f32(weight))
    otherwise:                        y = to_x_dtype(n * (f32(weight) + weight_offset))

Each program holds whole rows in registers (BLOCK_N = next_power_of_2(N) columns, masked), so x
and residual are read once and y, r written once: the kernel moves the minimum number of bytes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from fusion_passes.lowering.common.norm_triton import scale_by_weight
from fusion_passes.lowering.common.rows import as_rows, launch_config
from fusion_passes.lowering.rms_norm.reference import check_rms_norm_args

@triton.jit
def _rms_norm_kernel(
    x_ptr,  # *x.dtype [M, N]: rows to normalise; column stride 1, row stride stride_x
    residual_ptr,  # *x.dtype [M, N]: residual added to x (read only when HAS_RESIDUAL)
    weight_ptr,  # *weight.dtype [N]: per-column scale
    out_ptr,  # *x.dtype [M, N] contiguous: the normalised, scaled rows y
    residual_out_ptr,  # *x.dtype [M, N] contiguous: r = x + residual (only when HAS_RESIDUAL)
    M,  # number of rows (tokens)
    N,  # row length (hidden size): the reduced dimension
    stride_x,  # elements between the starts of consecutive rows of x
    stride_residual,  # elements between the starts of consecutive rows of residual
    eps,  # added to mean(r^2) before the rsqrt
    weight_offset,  # added to f32(weight) in the fp32-weight form (1.0 for Qwen3-Next), else 0.0
    HAS_RESIDUAL: tl.constexpr,  # add residual first and store r (the add_rms_norm form)
    RESIDUAL_IN_FP32: tl.constexpr,  # normalise the fp32 sum, not its rounding (vLLM's form)
    CAST_BEFORE_WEIGHT: tl.constexpr,  # Llama form: round n to x.dtype before scaling by weight
    BLOCK_N: tl.constexpr,  # next_power_of_2(N): one block holds a whole row
    ROWS_PER_PROGRAM: tl.constexpr,  # rows each program normalises, as a [ROWS, BLOCK_N] block
):
    # Inductor's launches pass Python floats as fp64 (the JIT's own launches pass fp32): pin the
    # scalars to fp32, or mean + eps is computed in fp64 (measured 0.4 us slower per call on an
    # H200 at decode sizes, and not the reference's fp32 rounding).
    eps = tl.cast(eps, tl.float32)
    weight_offset = tl.cast(weight_offset, tl.float32)
    rows = tl.program_id(0) * ROWS_PER_PROGRAM + tl.arange(0, ROWS_PER_PROGRAM)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    # int64 row offsets: M * N passes 2^31 elements at e.g. 300k tokens of hidden 7168.
    rows = rows.to(tl.int64)[:, None]
    dtype = out_ptr.dtype.element_ty
    # Load the weight first: issued after the reduction, its latency would add to every row's.
    w = tl.load(weight_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]

    r = tl.load(x_ptr + rows * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        residual_ptrs = residual_ptr + rows * stride_residual + cols[None, :]
        residual = tl.load(residual_ptrs, mask=mask, other=0.0).to(tl.float32)
        # The model adds in x.dtype: round the fp32 sum, store it, normalise the rounded value
        # (or, adding in fp32, the sum itself).
        total = r + residual
        r_rounded = total.to(dtype)
        tl.store(residual_out_ptr + rows * N + cols[None, :], r_rounded, mask=mask)
        r = total if RESIDUAL_IN_FP32 else r_rounded.to(tl.float32)

    # Masked columns hold 0, so they add nothing to the sum; divide by the true N.
    rstd = tl.rsqrt(tl.sum(r * r, axis=1) / N + eps)
    y = scale_by_weight(r * rstd[:, None], w, weight_offset, dtype, CAST_BEFORE_WEIGHT)
    tl.store(out_ptr + rows * N + cols[None, :], y.to(dtype), mask=mask)


def rms_norm_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    weight_offset: float = 0.0,
    cast_before_weight: bool = False,
    residual_in_fp32: bool = False,
    residual: torch.Tensor | None = None,
    *,
    wrap: Callable | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RMSNorm of x (or of x + residual) over the last dim, as rms_norm_reference /
    add_rms_norm_reference compute it. Returns (normed, new_residual); new_residual = x + residual
    rounded to x.dtype, or None when residual is None. Outputs are new contiguous tensors of x's
    shape and dtype. `wrap` (e.g. torch.library.wrap_triton) is applied to the kernel before launch
    so make_fx can trace the call into a graph."""
    check_rms_norm_args(x, weight, weight_offset, cast_before_weight, residual)
    weight = weight.contiguous()  # the kernel reads weight at unit stride
    n = x.shape[-1]
    x_rows = as_rows(x)
    m = x_rows.shape[0]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if residual is None:
        # Never read or written (HAS_RESIDUAL=False): None for their pointers (constants, no launch
        # arguments; tensors standing in would cost host time at every launch).
        residual_rows, residual_out = None, None
    else:
        residual_rows = as_rows(residual)
        residual_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    block_n, rows_per_program, num_warps = launch_config(n)
    kernel = (wrap or (lambda k: k))(_rms_norm_kernel)
    kernel[(triton.cdiv(m, rows_per_program),)](
        x_rows,
        residual_rows,
        weight,
        out,
        residual_out,
        m,
        n,
        x_rows.stride(0),
        0 if residual_rows is None else residual_rows.stride(0),
        eps,
        weight_offset,
        HAS_RESIDUAL=residual is not None,
        RESIDUAL_IN_FP32=residual_in_fp32,
        CAST_BEFORE_WEIGHT=cast_before_weight,
        BLOCK_N=block_n,
        ROWS_PER_PROGRAM=rows_per_program,
        num_warps=num_warps,
    )
    return out, residual_out
