"""Rows of a [..., N] tensor as the row kernels see them: a [M, N] view with unit column stride,
and the launch of a padded row block (how many rows a program holds, how many warps it runs).
Shared by the norm, norm + FP8, SiLU + FP8 and one-shot allreduce kernels.
"""

from __future__ import annotations

import torch
import triton

# Elements one program works on at once (ROWS_PER_PROGRAM * BLOCK_N): rows narrower than 4096 are
# packed several to a program, so small hidden sizes do not launch one tiny program per row.
_ELEMENTS_PER_PROGRAM = 4096
# Threads per program: the most warps that still leave each thread 16 to 32 real (unmasked)
# elements. Measured on an H200 (bf16 Llama-form RMSNorm, 4096 tokens, CUDA graph): hidden 7168
# ran 30.8 us at 8 warps (28 per thread) against 32.4 at 16; hidden 3072 13.8 us at 4 warps (24)
# against 14.6 at 8; hidden 4096 18.5 us at 8 warps (16) against 18.7 at 4.
_ELEMENTS_PER_WARP = 16 * 32
_MAX_WARPS = 32  # 1024 threads, the most a program may have


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
