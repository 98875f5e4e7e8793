"""One Triton kernel for DeepSeek V3.2's index mask: the positions outside each row's top k.

Unfused (stock Inductor on transformers' indexer): torch's top-k over the cached positions (a
radix sort of the whole row: 46 / 65 / 98 us at 4096 / 8192 / 16384 cached tokens, batch 1, on one
H200 inside a CUDA graph) and the scatter of its indices into a mask of ones.
Fused: one program per row selects the k-th largest order key (reference.order_keys, as unsigned
32-bit) by radix select, RADIX (5) bits at a time from the top: per digit, one pass over the row
counts the candidates' digits (the keys that share the digits chosen so far) in a 32-bin histogram
and keeps the digit at which the count from the top reaches the k still to place. 7 passes (the
first takes the 2 bits left over), then one more writes the mask: the keys above the k-th, and of
those equal to it the lowest positions through a running count where they tie across the k-th
place (the last histogram counts them; without a tie the mask is one compare a position). No
sort, no indices. (A bisection over the keys, 32 passes, ran at 0.63x stock Inductor at 16384
cached tokens: each pass is a loop over the row in one program.)
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
    RADIX: tl.constexpr,  # bits a pass
    PASSES: tl.constexpr,  # RADIX * PASSES >= 32; the first pass takes the bits left over
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = scores_ptr + row * T
    bins = tl.arange(0, 1 << RADIX)
    prefix = tl.full((), 0, tl.int64)  # the digits of the k-th largest key chosen so far
    remaining = k  # of the top k, those not above the prefix's keys
    equal = tl.full((), 0, tl.int32)  # after the last pass: the keys equal to the k-th
    for p in tl.static_range(PASSES):
        # the digit below the prefix: bits [shift, shift + RADIX) of the key (a constexpr)
        shift = RADIX * (PASSES - 1 - p)
        hist = tl.zeros((1 << RADIX,), tl.int32)
        start = 0
        # while loops: Triton's interpreter (the CPU tests) cannot bound a for loop by an argument
        while start < T:
            offs = start + tl.arange(0, BLOCK)
            inside = offs < T
            key = _unsigned_key(tl.load(row_ptr + offs, mask=inside, other=0.0).to(tl.float32))
            candidate = inside & ((key >> (shift + RADIX)) == prefix)
            hist += tl.histogram(((key >> shift) & ((1 << RADIX) - 1)).to(tl.int32), 1 << RADIX, mask=candidate)
            start += BLOCK
        # at_or_above[d]: candidates whose digit is >= d; the k-th is at the largest d where it
        # reaches the remaining count, after the candidates above d
        at_or_above = tl.sum(hist) - tl.cumsum(hist, axis=0) + hist
        digit = tl.max(tl.where(at_or_above >= remaining, bins, -1), axis=0)
        remaining -= tl.sum(tl.where(bins > digit, hist, 0), axis=0)
        equal = tl.sum(tl.where(bins == digit, hist, 0), axis=0)
        prefix = (prefix << RADIX) | digit.to(tl.int64)
    # Keys above the k-th are kept, and `remaining` of those equal to it. Where all of those are
    # kept (no tie across the k-th place, the usual case), the mask is one compare a position;
    # otherwise the lowest positions fill the rest, through a running count.
    start = 0
    if equal == remaining:
        while start < T:
            offs = start + tl.arange(0, BLOCK)
            inside = offs < T
            key = _unsigned_key(tl.load(row_ptr + offs, mask=inside, other=0.0).to(tl.float32))
            tl.store(mask_ptr + row * T + offs, key < prefix, mask=inside)
            start += BLOCK
    else:
        equal_before = 0
        while start < T:
            offs = start + tl.arange(0, BLOCK)
            inside = offs < T
            key = _unsigned_key(tl.load(row_ptr + offs, mask=inside, other=0.0).to(tl.float32))
            is_equal = (key == prefix) & inside
            rank = equal_before + tl.cumsum(is_equal.to(tl.int32), axis=0) - is_equal.to(tl.int32)
            kept = (key > prefix) | (is_equal & (rank < remaining))
            tl.store(mask_ptr + row * T + offs, (kept == 0).to(tl.int1), mask=inside)
            equal_before += tl.sum(is_equal.to(tl.int32), axis=0)
            start += BLOCK


def sparse_index_mask_triton(index_scores: torch.Tensor, k: int, *, wrap: Callable | None = None) -> torch.Tensor:
    """bool [..., T] as ``sparse_index_mask_reference``."""
    check_sparse_index_mask_args(index_scores, k)
    scores = index_scores.contiguous()
    t = scores.shape[-1]
    rows = scores.numel() // t
    mask = torch.empty(scores.shape, dtype=torch.bool, device=scores.device)
    # 2048 positions a loop step at 8 warps, 5-bit digits (7 passes; the first takes 2 bits):
    # Triton's histogram costs each lane a share of the bins per position (256 bins: 8), so
    # fewer bins, more passes measured faster. On one H200 at batch 1, 8192 cached tokens, with
    # the running count in every mask pass: 8-bit digits at 1024 x 4 warps 47.3 us, at 2048 x 8
    # 40.6; 2 / 3 / 4 / 5 / 6-bit digits at 2048 x 8: 50.2 / 41.0 / 38.1 / 35.0 / 36.7.
    # Shorter rows take one step.
    block = min(2048, max(16, triton.next_power_of_2(t))) if isinstance(t, int) else 2048
    kernel = wrap(_index_mask_kernel) if wrap is not None else _index_mask_kernel
    kernel[(rows,)](scores, mask, t, k, BLOCK=block, RADIX=5, PASSES=7, num_warps=8 if block >= 2048 else 4)
    return mask
