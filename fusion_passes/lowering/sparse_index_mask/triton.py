"""One Triton kernel for DeepSeek V3.2's index mask: the positions outside each row's top k.

Unfused (stock Inductor on transformers' indexer): torch's top-k over the cached positions (a
radix sort of the whole row: 46 / 65 / 98 us at 4096 / 8192 / 16384 cached tokens, batch 1, on one
H200 inside a CUDA graph) and the scatter of its indices into a mask of ones.
Fused: one program per row selects the k-th largest order key (reference.order_keys, as unsigned
32-bit) by radix select, 8 bits at a time from the top: per digit, one pass over the row counts
the candidates' digits (the keys that share the digits chosen so far) in a 256-bin histogram and
keeps the digit at which the count from the top reaches the k still to place. 4 passes, then one
more writes the mask, taking the keys equal to the k-th by lowest position through a running
count. No sort, no indices. (A bisection over the keys, 32 passes, ran at 0.63x stock Inductor at
16384 cached tokens: each pass is a loop over the row in one program.)
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from fusion_passes.lowering.sparse_index_mask.reference import check_sparse_index_mask_args

@triton.jit
def _unsigned_key(x):
    # reference.order_keys (the float's bits, negatives' magnitude flipped; NaN above +inf), moved
    # to [0, 2^32) so that its bytes order as the key: int64, which Triton shifts and compares
    # as signed
    bits = x.to(tl.int32, bitcast=True)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return tl.where(x != x, 2147483647, key).to(tl.int64) + 2147483648


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
    bins = tl.arange(0, 256)
    prefix = tl.full((), 0, tl.int64)  # the digits of the k-th largest key chosen so far
    remaining = k  # of the top k, those not above the prefix's keys
    for p in tl.static_range(4):
        shift = 24 - 8 * p  # a constexpr: p is one (static_range unrolls)
        hist = tl.zeros((256,), tl.int32)
        start = 0
        # while loops: Triton's interpreter (the CPU tests) cannot bound a for loop by an argument
        while start < T:
            offs = start + tl.arange(0, BLOCK)
            inside = offs < T
            key = _unsigned_key(tl.load(row_ptr + offs, mask=inside, other=0.0).to(tl.float32))
            candidate = inside & ((key >> (shift + 8)) == prefix)
            hist += tl.histogram(((key >> shift) & 0xFF).to(tl.int32), 256, mask=candidate)
            start += BLOCK
        # at_or_above[d]: candidates whose digit is >= d; the k-th is at the largest d where it
        # reaches the remaining count, after the candidates above d
        at_or_above = tl.sum(hist) - tl.cumsum(hist, axis=0) + hist
        digit = tl.max(tl.where(at_or_above >= remaining, bins, -1), axis=0)
        remaining -= tl.sum(tl.where(bins > digit, hist, 0), axis=0)
        prefix = (prefix << 8) | digit.to(tl.int64)
    # Keys above the k-th are kept; of those equal to it, the lowest positions fill the rest.
    equal_before = 0
    start = 0
    while start < T:
        offs = start + tl.arange(0, BLOCK)
        inside = offs < T
        key = _unsigned_key(tl.load(row_ptr + offs, mask=inside, other=0.0).to(tl.float32))
        equal = (key == prefix) & inside
        rank = equal_before + tl.cumsum(equal.to(tl.int32), axis=0) - equal.to(tl.int32)
        kept = (key > prefix) | (equal & (rank < remaining))
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
