"""The bytes of RMSNorm (+ residual add) + FP8 quantization without the math, in one flat Triton
kernel: what a kernel moving these bytes and doing nothing else reaches, beside the copy bandwidth.

    norm form:  q = fp8(x)                                  reads x, writes q
    add form:   r = to_bf16(x + residual); q = fp8(r)       reads x and residual, writes r and q

No row reduction, no weight, no scale: BLOCK contiguous elements a program, so the number does
not depend on Inductor's choices (bench_rms_norm_quant_fp8.py's same_traffic column). Measured on
one H200 (bf16, 4096 tokens, CUDA graph, us), 2048 elements on 4 warps was the fastest or within
1% of it among 1024 / 2048 / 4096 / 8192 elements on 4 or 8 warps: hidden 7168 21.84, 4096 12.70,
3072 9.93; the add form at 7168 50.00 against 49.93 at 1024.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK, NUM_WARPS = 2048, 4


@triton.jit
def _no_math_kernel(
    x_ptr, residual_ptr, r_ptr, q_ptr, numel, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr
):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < numel
    r = tl.load(x_ptr + offsets, mask=mask)
    if HAS_RESIDUAL:
        r = (r.to(tl.float32) + tl.load(residual_ptr + offsets, mask=mask).to(tl.float32)).to(r.dtype)
        tl.store(r_ptr + offsets, r, mask=mask)
    q = r.to(tl.float32).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    tl.store(q_ptr + offsets, q, mask=mask)


def no_math_fn(op: str):
    """(x, [residual,] weight, scale) -> q (norm form) or (q, r) (add form), from contiguous x."""

    def call(x, *rest):
        residual = rest[0] if op == "add_rms_norm" else None
        q = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
        r = torch.empty_like(x) if residual is not None else x
        _no_math_kernel[(triton.cdiv(x.numel(), BLOCK),)](
            x, x if residual is None else residual, r, q, x.numel(),
            HAS_RESIDUAL=residual is not None, BLOCK=BLOCK, num_warps=NUM_WARPS,
        )  # fmt: skip
        return q if residual is None else (q, r)

    return call
