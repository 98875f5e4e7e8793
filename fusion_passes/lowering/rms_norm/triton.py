"""One Triton kernel for RMSNorm and residual-add + RMSNorm over the last dim.

Unfused: r = x + residual (rounded to x.dtype), then rms_norm(r): two passes over the rows,
    reading x, residual, writing r, then reading r again and writing y.
Fused:   one pass per row, all math in fp32, rounding exactly where rms_norm_reference.py does:
    r   = to_x_dtype(f32(x) + f32(residual))          stored as new_residual (add form only)
    n   = f32(r) * rsqrt(sum(f32(r)^2) / N + eps)
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

from fusion_passes.lowering.rms_norm.reference import check_rms_norm_args

# Elements one program works on at once (ROWS_PER_PROGRAM * BLOCK_N): rows narrower than 4096 are
# packed several to a program, so small hidden sizes do not launch one tiny program per row.
_ELEMENTS_PER_PROGRAM = 4096
# Threads per program: the most warps that still leave each thread 16 to 32 real (unmasked)
# elements. Measured on an H200 (bf16 Llama-form RMSNorm, 4096 tokens, CUDA graph): hidden 7168
# ran 30.8 us at 8 warps (28 per thread) against 32.4 at 16; hidden 3072 13.8 us at 4 warps (24)
# against 14.6 at 8; hidden 4096 18.5 us at 8 warps (16) against 18.7 at 4.
_ELEMENTS_PER_WARP = 16 * 32
_MAX_WARPS = 32  # 1024 threads, the most a program may have


@triton.jit
def scale_by_weight(n, w, weight_offset, dtype, CAST_BEFORE_WEIGHT: tl.constexpr):
    """The two rounding forms of the reference, in fp32 (shared by every norm kernel):
    Llama rounds n to x.dtype before scaling; the fp32-weight form scales by w + weight_offset."""
    if CAST_BEFORE_WEIGHT:
        return n.to(dtype).to(tl.float32) * w
    return n * (w + weight_offset)


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
        # The model adds in x.dtype: round the fp32 sum, store it, normalise the rounded value.
        r_rounded = (r + residual).to(dtype)
        tl.store(residual_out_ptr + rows * N + cols[None, :], r_rounded, mask=mask)
        r = r_rounded.to(tl.float32)

    # Masked columns hold 0, so they add nothing to the sum; divide by the true N.
    rstd = tl.rsqrt(tl.sum(r * r, axis=1) / N + eps)
    y = scale_by_weight(r * rstd[:, None], w, weight_offset, dtype, CAST_BEFORE_WEIGHT)
    tl.store(out_ptr + rows * N + cols[None, :], y.to(dtype), mask=mask)


def launch_config(n: int) -> tuple[int, int, int]:
    """(BLOCK_N, ROWS_PER_PROGRAM, num_warps) for rows of n elements; independent of the row count,
    so a dynamic token count never re-specialises the kernel."""
    block_n = triton.next_power_of_2(n)
    rows_per_program = max(1, _ELEMENTS_PER_PROGRAM // block_n)
    warps_for_16_per_thread = max(1, rows_per_program * n // _ELEMENTS_PER_WARP)
    # Round down to a power of two: between 16 and 32 real elements per thread.
    num_warps = min(_MAX_WARPS, 1 << (warps_for_16_per_thread.bit_length() - 1))
    return block_n, rows_per_program, num_warps


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """View t as [M, N] rows with unit column stride (copying only when no such view exists)."""
    rows = t.reshape(-1, t.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def rms_norm_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    weight_offset: float = 0.0,
    cast_before_weight: bool = False,
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
        # Never read or written (HAS_RESIDUAL=False): x stands in for the residual pointers.
        residual_rows, residual_out = x_rows, None
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
        x_rows if residual_out is None else residual_out,
        m,
        n,
        x_rows.stride(0),
        residual_rows.stride(0),
        eps,
        weight_offset,
        HAS_RESIDUAL=residual is not None,
        CAST_BEFORE_WEIGHT=cast_before_weight,
        BLOCK_N=block_n,
        ROWS_PER_PROGRAM=rows_per_program,
        num_warps=num_warps,
    )
    return out, residual_out
