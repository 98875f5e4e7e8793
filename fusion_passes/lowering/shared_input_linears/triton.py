"""One Triton kernel for several bias-free linears of one input (``reference``).

Unfused (stock Inductor on a model's sibling projections): one cuBLAS GEMM launch per weight. At
decode a small weight's GEMM is a launch's latency: Qwen 3.5's ``in_proj_b`` and ``in_proj_a``
read 128 KB each (32 rows x 2048) in ~1.5 us a launch inside a CUDA graph, where streaming their
bytes takes 0.03 us at 4.3 TB/s.
Fused: one launch over all the weights' rows. A program takes BLOCK_N rows of one weight (the
weights' rows laid one after another: each weight has its own tiles, so no tile straddles two
weights) for BLOCK_T tokens: router_logits' loop (lowering/common/skinny_gemm.py), the exact fp32
products of the loaded bf16 / fp16 values summed and stored rounded to the output dtype once, as
a GEMM does. The rows are spread thin (1 to 8 a program) so that every SM streams a part of
the weights, as router_logits' kernel does. (Named a GEMM: the decode benchmark classes kernels
by name.)
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from fusion_passes.lowering.common.skinny_gemm import weight_rows_times_input as _rows
from fusion_passes.lowering.shared_input_linears.reference import MAX_WEIGHTS, check_shared_input_linears_args


@triton.jit
def _shared_input_gemm_kernel(
    x_ptr,  # *bf16/fp16 [T, K] (row stride stride_xt, K contiguous)
    w0_ptr, w1_ptr, w2_ptr, w3_ptr,  # *x.dtype [N_i, K] contiguous (w1..w3: None past WEIGHTS)
    y0_ptr, y1_ptr, y2_ptr, y3_ptr,  # *x.dtype [T, N_i] contiguous
    N0, N1, N2, N3,  # rows of each weight
    S1, S2, S3,  # the first tile of weights 1..3 (tiles of weight i: [S_i, S_i+1))
    T,
    K,
    stride_xt,
    WEIGHTS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    tile = tl.program_id(0)
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    if WEIGHTS == 1 or tile < S1:
        _rows(x_ptr, w0_ptr, y0_ptr, tile, t, T, N0, K, stride_xt, K, BLOCK_N, BLOCK_K)
    elif WEIGHTS == 2 or tile < S2:
        _rows(x_ptr, w1_ptr, y1_ptr, tile - S1, t, T, N1, K, stride_xt, K, BLOCK_N, BLOCK_K)
    elif WEIGHTS == 3 or tile < S3:
        _rows(x_ptr, w2_ptr, y2_ptr, tile - S2, t, T, N2, K, stride_xt, K, BLOCK_N, BLOCK_K)
    else:
        _rows(x_ptr, w3_ptr, y3_ptr, tile - S3, t, T, N3, K, stride_xt, K, BLOCK_N, BLOCK_K)


def launch_blocks(tokens: int, rows: int, k: int) -> tuple[int, int, int]:
    """(BLOCK_T, BLOCK_N, BLOCK_K) for ``tokens`` x ``rows`` outputs over an input size ``k``.

    Up to 4 tokens a program. Rows a program: about 256 programs over all rows at one token (1 to
    8 rows: every SM of an H200's 132 streams a part of the weights). The [BLOCK_T, BLOCK_N,
    BLOCK_K] product tile at most 8192 fp32 values (64 registers a thread at 4 warps), BLOCK_K
    256 to 1024 (fewer loop steps where a program takes few rows)."""
    block_t = min(4, triton.next_power_of_2(max(1, tokens)))
    t_blocks = triton.cdiv(max(1, tokens), block_t)
    block_n = 1
    while block_n < 8 and (2 * block_n) * 256 <= rows * t_blocks:
        block_n *= 2
    block_k = min(1024, 8192 // (block_t * block_n), max(16, triton.next_power_of_2(k)))
    return block_t, block_n, block_k


def shared_input_linears_triton(
    x: torch.Tensor, weights: list[torch.Tensor], *, wrap: Callable | None = None
) -> list[torch.Tensor]:
    """[x @ w.T for w in weights] as ``shared_input_linears_reference``."""
    check_shared_input_linears_args(x, weights)
    x = x if x.stride(1) == 1 else x.contiguous()
    ws = [w if w.is_contiguous() else w.contiguous() for w in weights]
    tokens, k = x.shape
    outs = [torch.empty((tokens, w.shape[0]), dtype=x.dtype, device=x.device) for w in ws]
    rows = [w.shape[0] for w in ws]
    if tokens == 0 or sum(rows) == 0:
        return outs
    block_t, block_n, block_k = launch_blocks(tokens, sum(rows), k)
    tiles = [triton.cdiv(n, block_n) for n in rows]
    starts = [sum(tiles[:i]) for i in range(1, MAX_WEIGHTS)]  # S1..S3 (past the last weight: the total)
    starts = [min(s, sum(tiles)) for s in starts]
    pad = MAX_WEIGHTS - len(ws)
    kernel = wrap(_shared_input_gemm_kernel) if wrap is not None else _shared_input_gemm_kernel
    kernel[(sum(tiles), triton.cdiv(tokens, block_t))](
        x, *ws, *([None] * pad), *outs, *([None] * pad), *rows, *([0] * pad), *starts, tokens, k, x.stride(0),
        WEIGHTS=len(ws), BLOCK_T=block_t, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4,
    )  # fmt: skip
    return outs
