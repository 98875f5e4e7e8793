"""One Triton kernel for DeepSeek V3.2's index mask: the positions outside each row's top k.

Unfused (stock Inductor on transformers' indexer): torch's top-k over the cached positions (a
radix sort of the whole row: 21.7 us per layer at batch 1 and 1040 cached tokens on one H200,
inside a CUDA graph) and the scatter of its indices into a mask of ones.
Fused: one program per row finds the k-th largest order key (reference.order_keys) by bisection
over the 2^32 keys, counting the keys at or above each midpoint (32 passes over the row, read
from L1 / L2: 8192 fp32 scores are 32 KiB), then writes the mask in one more pass, taking the
equal keys at the k-th place by lowest position through a running count. No sort, no indices.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from fusion_passes.lowering.sparse_index_mask.reference import check_sparse_index_mask_args

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


@triton.jit
def _order_key(x):
    # reference.order_keys: the float's bits, negatives' magnitude flipped; NaN above +inf
    bits = x.to(tl.int32, bitcast=True)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return tl.where(x != x, 2147483647, key).to(tl.int64)


@triton.jit
def _count_at_or_above(row_ptr, T, threshold, BLOCK: tl.constexpr):
    count = 0
    start = 0
    # while loops: Triton's interpreter (the CPU tests) cannot bound a for loop by an argument
    while start < T:
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(row_ptr + offs, mask=offs < T, other=0.0).to(tl.float32)
        key = _order_key(x)
        count += tl.sum(((key >= threshold) & (offs < T)).to(tl.int32), axis=0)
        start += BLOCK
    return count


@triton.jit
def _index_mask_kernel(
    scores_ptr,  # *fp32/bf16/fp16 [rows, T], rows contiguous
    mask_ptr,  # *bool [rows, T]
    T,  # positions per row
    k,  # positions kept per row, 1 <= k <= T
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = scores_ptr + row * T
    # The largest key t with #{key >= t} >= k: the k-th largest key.
    lo = tl.full((), -2147483648, tl.int64)
    hi = tl.full((), 2147483647, tl.int64)
    step = 0
    while step < 32:
        mid = lo + (hi - lo + 1) // 2
        if _count_at_or_above(row_ptr, T, mid, BLOCK) >= k:
            lo = mid
        else:
            hi = mid - 1
        step += 1
    # Keys above the k-th are kept; of those equal to it, the lowest positions fill the rest.
    ties_kept = k - _count_at_or_above(row_ptr, T, lo + 1, BLOCK)
    equal_before = 0
    start = 0
    while start < T:
        offs = start + tl.arange(0, BLOCK)
        inside = offs < T
        key = _order_key(tl.load(row_ptr + offs, mask=inside, other=0.0).to(tl.float32))
        equal = (key == lo) & inside
        rank = equal_before + tl.cumsum(equal.to(tl.int32), axis=0) - equal.to(tl.int32)
        kept = (key > lo) | (equal & (rank < ties_kept))
        tl.store(mask_ptr + row * T + offs, (kept == 0).to(tl.int1), mask=inside)
        equal_before += tl.sum(equal.to(tl.int32), axis=0)
        start += BLOCK


def sparse_index_mask_triton(index_scores: torch.Tensor, k: int, *, wrap: Callable | None = None) -> torch.Tensor:
    """bool [..., T] as ``sparse_index_mask_reference``."""
    check_sparse_index_mask_args(index_scores, k)
    scores = index_scores.contiguous()
    t = scores.shape[-1]
    rows = scores.numel() // t
    mask = torch.empty(scores.shape, dtype=torch.bool, device=scores.device)
    # 1024 positions a pass at 4 warps (8 per thread); shorter rows take one pass.
    block = min(1024, max(16, triton.next_power_of_2(t))) if isinstance(t, int) else 1024
    kernel = wrap(_index_mask_kernel) if wrap is not None else _index_mask_kernel
    kernel[(rows,)](scores, mask, t, k, BLOCK=block, num_warps=4)
    return mask
