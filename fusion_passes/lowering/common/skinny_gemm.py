"""The inner loop of the decode-size GEMM kernels (router_logits, shared_input_linears): a few
tokens times a few weight rows, the weight streamed once.

    y[t, n] = sum_k f32(x[t, k]) * f32(w[n, k])      fp32 sums of the loaded values' products

Every product of two bf16 / fp16 values is exact in fp32; the sums are stored rounded once to y's
dtype (fp32: as they are). No tensor cores: at 1-4 tokens a program the products are a
[BLOCK_T, BLOCK_N, BLOCK_K] broadcast, and the kernel is its weight's bytes.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def weight_rows_times_input(
    x_ptr, w_ptr, y_ptr, tile, t, T, N, K, stride_xt, stride_wn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr
):  # fmt: skip
    """y[t, n] (module docstring) for the tokens t (a vector) and the rows n of ``tile`` (BLOCK_N a
    tile): x [T, K] with row stride stride_xt, w [N, K] with row stride stride_wn (K contiguous in
    both), y [T, N] contiguous. The stores are made here: see docs/adding-a-fusion.md on helpers."""
    n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((t.shape[0], BLOCK_N), dtype=tl.float32)
    k0 = 0
    # A while loop: Triton's interpreter (the CPU tests) cannot bound a for loop by an argument.
    while k0 < K:
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + t[:, None].to(tl.int64) * stride_xt + k[None, :], mask=(t[:, None] < T) & (k[None, :] < K),
                    other=0.0).to(tl.float32)  # fmt: skip
        w = tl.load(w_ptr + n[:, None].to(tl.int64) * stride_wn + k[None, :], mask=(n[:, None] < N) & (k[None, :] < K),
                    other=0.0).to(tl.float32)  # fmt: skip
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
        k0 += BLOCK_K
    tl.store(y_ptr + t[:, None].to(tl.int64) * N + n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(t[:, None] < T) & (n[None, :] < N))  # fmt: skip
