"""One Triton kernel for DeepSeek V3.2's index mask: the positions outside each row's top k.

Unfused (stock Inductor on transformers' indexer): torch's top-k over the cached positions (a
radix sort of the whole row: 46 / 65 / 98 us at 4096 / 8192 / 16384 cached tokens, batch 1, on one
H200 inside a CUDA graph) and the scatter of its indices into a mask of ones.
Fused: the k-th largest order key (reference.order_keys, as unsigned 32-bit) by radix select,
RADIX (5) bits at a time from the top: per digit, one pass over the row counts the candidates'
digits (the keys that share the digits chosen so far) in a 32-bin histogram and keeps the digit at
which the count from the top reaches the k still to place. 7 passes (the first takes the 2 bits
left over), then one more writes the mask: the keys above the k-th, and of those equal to it the
lowest positions through a running count where they tie across the k-th place (the last histogram
counts them; without a tie the mask is one compare a position). No sort, no indices.
A row is one program, or SPLIT programs over parts of it where the GPU has the SMs to spare (a
decode step's few rows): each pass, every part adds its histogram to the row's in a zeroed work
buffer and waits until all have (an arrival count); where the k-th place ties, each part also
counts its equal keys, so that a part knows how many lie before it. At batch 1 and 8192 cached
tokens, 33 programs a row take 15 us against one program's 33.
(A bisection over the keys, 32 passes, ran at 0.63x stock Inductor at 16384 cached tokens: each
pass is a loop over the row in one program.)
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from fusion_passes.lowering.sparse_index_mask.reference import (
    check_sparse_attention_mask_args,
    check_sparse_index_mask_args,
)


@triton.jit
def _unsigned_key(x):
    # reference.order_keys (the float's bits, negatives' magnitude flipped; NaN above +inf), moved
    # to [0, 2^32) so that its bytes order as the key: int64, which Triton shifts and compares
    # as signed
    bits = x.to(tl.int32, bitcast=True)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return tl.where(x != x, 2147483647, key).to(tl.int64) + 2147483648


@triton.jit
def _split_barrier(count_ptr, SPLIT: tl.constexpr):
    # Every program of a row arrives (the count's add releases this program's earlier atomics to
    # the others), then waits until all SPLIT have: the row's programs run at once (the launcher
    # keeps rows * SPLIT within the GPU's SMs), so the wait ends.
    tl.debug_barrier()
    tl.atomic_add(count_ptr, 1, sem="release")
    while tl.atomic_add(count_ptr, 0, sem="acquire") < SPLIT:
        pass
    tl.debug_barrier()


@triton.jit
def _store_kept(mask_ptr, offs, inside, kept, attn_row_ptr, stride_at, fill, last, ADDITIVE: tl.constexpr,
                CAUSAL: tl.constexpr):  # fmt: skip
    """The row's mask at offs: True where dropped (sparse_index_mask), or (ADDITIVE,
    sparse_attention_mask) 0 where the attention mask and the top k both keep the position and
    fill elsewhere, in the output's dtype. CAUSAL: the attention mask keeps the positions up to
    ``last`` (the row's token's cache position), and is not read."""
    if ADDITIVE:
        if CAUSAL:
            attn = offs.to(tl.int64) <= last
        else:
            attn = tl.load(attn_row_ptr + offs.to(tl.int64) * stride_at, mask=inside, other=0) != 0
        value = tl.where(attn & kept, 0.0, fill)
        tl.store(mask_ptr + offs, value.to(mask_ptr.dtype.element_ty), mask=inside)
    else:
        tl.store(mask_ptr + offs, (kept == 0).to(tl.int1), mask=inside)


@triton.jit
def _index_mask_kernel(
    scores_ptr,  # *fp32/bf16/fp16 [rows, T], rows contiguous
    mask_ptr,  # *bool [rows, T] (ADDITIVE: *out dtype [rows, T])
    attn_ptr,  # ADDITIVE: *bool [B, S, T] (strides stride_ab, stride_as, stride_at; rows = B * S); else None
    first_ptr,  # CAUSAL: *int the cache position of each sequence's first token (row's: + row % S); else None
    S, stride_ab, stride_as, stride_at,
    fill,  # ADDITIVE: the bias of a closed position (-inf, or cuDNN's -65504)
    work_ptr,  # *int32 [rows, WORK], zeroed: the row's histograms and counts (SPLIT > 1 only)
    T,  # positions per row
    k,  # positions kept per row, 1 <= k <= T
    CHUNK,  # positions a program takes: [part * CHUNK, (part + 1) * CHUNK)
    WORK,  # int32s of work_ptr per row
    BLOCK: tl.constexpr,
    RADIX: tl.constexpr,  # bits a pass
    PASSES: tl.constexpr,  # RADIX * PASSES >= 32; the first pass takes the bits left over
    SPLIT: tl.constexpr,  # programs a row
    PARTS: tl.constexpr,  # SPLIT rounded up to a power of two
    LOWEST: tl.constexpr,  # unsplit rows: the first pass also finds the lowest key (see below)
    ADDITIVE: tl.constexpr,  # the additive attention mask (sparse_attention_mask), not the bool one
    CAUSAL: tl.constexpr,  # ADDITIVE: the causal mask from first_ptr, not one read at attn_ptr
):
    pid = tl.program_id(0)
    row = (pid // SPLIT).to(tl.int64)
    if ADDITIVE and not CAUSAL:
        attn_row_ptr = attn_ptr + (row // S) * stride_ab + (row % S) * stride_as
    else:
        attn_row_ptr = attn_ptr  # None: never read
    if CAUSAL:
        last = tl.load(first_ptr).to(tl.int64) + row % S
    else:
        last = 0
    fill = tl.cast(fill, tl.float32)  # Inductor passes Python floats as fp64
    part = pid % SPLIT
    lo = part * CHUNK
    hi = tl.minimum(T, lo + CHUNK)
    row_ptr = scores_ptr + row * T
    # the row's work: PASSES histograms, then PASSES + 1 arrival counts, then SPLIT tie counts
    hist_ptr = work_ptr + row * WORK
    count_ptr = hist_ptr + PASSES * (1 << RADIX)
    ties_ptr = count_ptr + PASSES + 1
    bins = tl.arange(0, 1 << RADIX)
    prefix = tl.full((), 0, tl.int64)  # the digits of the k-th largest key chosen so far
    remaining = k  # of the top k, those not above the prefix's keys
    equal = tl.full((), 0, tl.int32)  # after the last pass: the keys equal to the k-th
    # A row of one program also finds its lowest key and how many equal it in the first pass: where
    # fewer than k keys lie above it (a prefill's early rows: their causal past, at most k scores
    # above the masked -inf), the k-th is the lowest and the other passes are skipped.
    done = tl.full((), 0, tl.int32)
    for p in tl.static_range(PASSES):
        # the digit below the prefix: bits [shift, shift + RADIX) of the key (a constexpr)
        shift = RADIX * (PASSES - 1 - p)
        if done == 0:
            hist = tl.zeros((1 << RADIX,), tl.int32)
            low = tl.full((), 1 << 32, tl.int64)  # above every key
            n_low = tl.full((), 0, tl.int32)
            start = lo
            # while loops: Triton's interpreter (the CPU tests) cannot bound a for loop by an argument
            while start < hi:
                offs = start + tl.arange(0, BLOCK)
                inside = offs < hi
                key = _unsigned_key(tl.load(row_ptr + offs, mask=inside, other=0.0).to(tl.float32))
                candidate = inside & ((key >> (shift + RADIX)) == prefix)
                hist += tl.histogram(((key >> shift) & ((1 << RADIX) - 1)).to(tl.int32), 1 << RADIX, mask=candidate)
                if LOWEST:
                    block_low = tl.min(tl.where(inside, key, 1 << 32), axis=0)
                    block_n = tl.sum((inside & (key == block_low)).to(tl.int32), axis=0)
                    n_low = tl.where(block_low < low, block_n, tl.where(block_low == low, n_low + block_n, n_low))
                    low = tl.minimum(low, block_low)
                start += BLOCK
            if SPLIT > 1:  # the row's histogram: every part's summed
                tl.atomic_add(hist_ptr + p * (1 << RADIX) + bins, hist, sem="relaxed")
                _split_barrier(count_ptr + p, SPLIT)
                hist = tl.atomic_add(hist_ptr + p * (1 << RADIX) + bins, 0, sem="relaxed")
            # at_or_above[d]: candidates whose digit is >= d; the k-th is at the largest d where it
            # reaches the remaining count, after the candidates above d
            at_or_above = tl.sum(hist) - tl.cumsum(hist, axis=0) + hist
            digit = tl.max(tl.where(at_or_above >= remaining, bins, -1), axis=0)
            remaining -= tl.sum(tl.where(bins > digit, hist, 0), axis=0)
            equal = tl.sum(tl.where(bins == digit, hist, 0), axis=0)
            prefix = (prefix << RADIX) | digit.to(tl.int64)
            if LOWEST:
                if T - n_low < k:  # the k-th largest is the lowest key
                    prefix = low
                    remaining = k - (T - n_low)
                    equal = n_low
                    done = 1
    # Keys above the k-th are kept, and `remaining` of those equal to it. Where all of those are
    # kept (no tie across the k-th place, the usual case), the mask is one compare a position;
    # otherwise the lowest positions fill the rest, through a running count (from the row's
    # earlier parts' counts of keys equal to the k-th).
    start = lo
    if equal == remaining:
        while start < hi:
            offs = start + tl.arange(0, BLOCK)
            inside = offs < hi
            key = _unsigned_key(tl.load(row_ptr + offs, mask=inside, other=0.0).to(tl.float32))
            _store_kept(mask_ptr + row * T, offs, inside, key >= prefix, attn_row_ptr, stride_at, fill, last, ADDITIVE, CAUSAL)
            start += BLOCK
    else:
        equal_before = 0
        if SPLIT > 1:
            while start < hi:
                offs = start + tl.arange(0, BLOCK)
                key = _unsigned_key(tl.load(row_ptr + offs, mask=offs < hi, other=0.0).to(tl.float32))
                equal_before += tl.sum(((key == prefix) & (offs < hi)).to(tl.int32), axis=0)
                start += BLOCK
            tl.atomic_add(ties_ptr + part, equal_before, sem="relaxed")
            _split_barrier(count_ptr + PASSES, SPLIT)
            parts = tl.arange(0, PARTS)
            before = tl.atomic_add(ties_ptr + parts, 0, mask=parts < part, sem="relaxed")
            equal_before = tl.sum(tl.where(parts < part, before, 0), axis=0)
            start = lo
        while start < hi:
            offs = start + tl.arange(0, BLOCK)
            inside = offs < hi
            key = _unsigned_key(tl.load(row_ptr + offs, mask=inside, other=0.0).to(tl.float32))
            is_equal = (key == prefix) & inside
            rank = equal_before + tl.cumsum(is_equal.to(tl.int32), axis=0) - is_equal.to(tl.int32)
            kept = (key > prefix) | (is_equal & (rank < remaining))
            _store_kept(mask_ptr + row * T, offs, inside, kept, attn_row_ptr, stride_at, fill, last, ADDITIVE, CAUSAL)
            equal_before += tl.sum(is_equal.to(tl.int32), axis=0)
            start += BLOCK


# Positions a program takes where a row is split. On one H200 inside a CUDA graph, batch 1, by
# programs a row (8 warps): 8192 cached tokens 1 / 4 / 16 / 32 / 64: 32.8 / 24.1 / 16.2 / 15.7 /
# 15.5 us; 16384: 56.7 / 32.6 / 19.3 / 17.2 / 15.9 us. Smaller parts gain < 1 us more.
SPLIT_POSITIONS = 256


LOWEST_ROWS = 256  # the most rows the shortcut stays off at (a decode batch's; see the launcher)


def _split(rows: int, t, device: torch.device) -> int:
    """Programs a row: enough that each takes about SPLIT_POSITIONS positions, while every program
    of the launch fits on the GPU at once (a row's programs wait for each other)."""
    if device.type != "cuda" or not isinstance(t, int) or t <= SPLIT_POSITIONS:
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(-(-t // SPLIT_POSITIONS), sms // rows))


def _rounded_to(value: float, dtype: torch.dtype) -> float:
    """value as torch stores it in a constant of dtype (to fp32, then to the 16-bit dtype, each to
    the nearest, ties to even), in plain Python: the launch is traced under fake tensors."""
    if math.isinf(value) or math.isnan(value):
        return value
    try:
        fp32 = struct.unpack("<f", struct.pack("<f", value))[0]
        if dtype == torch.float16:
            return struct.unpack("<e", struct.pack("<e", fp32))[0]
    except OverflowError:  # beyond the dtype's range: infinite, as torch's cast gives it
        return math.copysign(math.inf, value)
    if dtype == torch.bfloat16:
        bits = struct.unpack("<I", struct.pack("<f", fp32))[0]
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return struct.unpack("<f", struct.pack("<I", bits))[0]
    return fp32


def sparse_index_mask_triton(
    index_scores: torch.Tensor,
    k: int,
    attention_mask: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
    fill: float = float("-inf"),
    *,
    causal_first: torch.Tensor | None = None,
    split: int | None = None,
    lowest: bool | None = None,
    num_warps: int | None = None,
    radix: int = 5,
    wrap: Callable | None = None,
) -> torch.Tensor:
    """bool [..., T] as ``sparse_index_mask_reference``. ``split``: programs a row (default: from
    the rows, T and the GPU's SMs; more than one only where all of the launch's programs fit on the
    GPU at once); ``lowest``: the lowest-key shortcut (default: on for unsplit launches of more
    than LOWEST_ROWS rows); ``num_warps``: default from the positions a loop step takes.
    With ``attention_mask`` (bool [B, 1, S, T]) and ``dtype``: ``sparse_attention_mask_reference``'s
    additive [B, 1, S, T] mask instead, written by the same pass; with ``causal_first`` in place of
    the mask, the causal one from that first position (compared in the kernel, nothing read).
    ``radix``: bits of the key a pass takes (ceil(32 / radix) passes; see below)."""
    check_sparse_index_mask_args(index_scores, k)
    additive = attention_mask is not None or causal_first is not None
    if additive:
        check_sparse_attention_mask_args(index_scores, k, attention_mask, dtype, fill, causal_first)
    scores = index_scores.contiguous()
    t = scores.shape[-1]
    rows = scores.numel() // t
    if additive:
        b, s_len, _ = scores.shape
        mask = torch.empty((b, 1, s_len, t), dtype=dtype, device=scores.device)
        # the bias as the dtype holds it (bf16 rounds -65504 to -65536, as a constant of it does):
        # stored exactly, whatever rounding the kernel's cast would take
        fill = _rounded_to(fill, dtype)
        if causal_first is None:
            attn_strides = (attention_mask.stride(0), attention_mask.stride(2), attention_mask.stride(3))
        else:  # never read: None for the pointer
            attn_strides = (0, 0, 0)
        attn = attention_mask
    else:
        mask = torch.empty(scores.shape, dtype=torch.bool, device=scores.device)
        # never read: None for the pointer (a constant, no launch argument; a tensor standing in
        # would cost host time at every launch)
        attn, s_len, attn_strides = None, 1, (0, 0, 0)
    split = _split(rows, t, scores.device) if split is None else split
    if split < 1:
        raise ValueError(f"sparse_index_mask: split must be >= 1, got {split}")
    if lowest and split > 1:
        raise ValueError("sparse_index_mask: the lowest-key shortcut takes unsplit rows (split 1)")
    if split > 1 and wrap is None:  # a row's programs wait for each other: all must run at once
        if scores.device.type != "cuda":
            raise ValueError("sparse_index_mask: split > 1 needs a GPU (the interpreter runs programs one at a time)")
        sms = torch.cuda.get_device_properties(scores.device).multi_processor_count
        if rows * split > sms:
            raise ValueError(f"sparse_index_mask: {rows} rows x {split} programs a row exceed the GPU's {sms} SMs")
    if not 1 <= radix <= 8:
        raise ValueError(f"sparse_index_mask: radix must be in 1..8 bits a pass, got {radix}")
    passes = -(-32 // radix)
    # Unsplit: 2048 positions a loop step at 8 warps, 5-bit digits (7 passes; the first takes 2
    # bits): Triton's histogram costs each lane a share of the bins per position (256 bins: 8), so
    # fewer bins, more passes measured faster. On one H200 at batch 1, 8192 cached tokens, with
    # the running count in every mask pass: 8-bit digits at 1024 x 4 warps 47.3 us, at 2048 x 8
    # 40.6; 2 / 3 / 4 / 5 / 6-bit digits at 2048 x 8: 50.2 / 41.0 / 38.1 / 35.0 / 36.7.
    # Shorter rows take one step. Split, a row's programs sum their histograms in a zeroed work
    # buffer (a pass ends when every program has added its own), one step each at the default, 8
    # warps: at batch 8 with 16 programs a row, 16.0 / 17.2 / 19.8 us at 4096 / 8192 / 16384
    # cached tokens against 16.1 / 18.2 / 23.2 at 4 warps (batch 1: within 0.6 us either way).
    chunk = -(-t // split)
    if split > 1:
        chunk = -(-chunk // 16) * 16
    block = min(2048, max(16, triton.next_power_of_2(chunk))) if isinstance(chunk, int) else 2048
    work_size = passes * (1 << radix) + passes + 1 + split
    # torch.full, not torch.zeros: Inductor decomposes aten.zeros before its post-grad passes, so
    # a launch traced with it into the graph (launch="direct") could not be lowered there
    work = (torch.full((rows, work_size), 0, dtype=torch.int32, device=scores.device) if split > 1
            else torch.empty((1,), dtype=torch.int32, device=scores.device))  # fmt: skip
    num_warps = num_warps or (8 if block >= 2048 or split > 1 else 4)
    # The lowest-key shortcut (rows with fewer than k keys above their lowest take 2 passes, not
    # 8) pays where rows are a prompt's causal ones and costs its min and count per block where
    # none is: one H200, CUDA graph, k 2048: a 4096-token prefill's 4096 x 4097 rows 604 -> 461 us
    # with it; 256 decode rows of 8192 positions 49.6 -> 52.7 us. So on above LOWEST_ROWS rows.
    lowest = split == 1 and rows > LOWEST_ROWS if lowest is None else lowest
    kernel = wrap(_index_mask_kernel) if wrap is not None else _index_mask_kernel
    kernel[(rows * split,)](scores, mask, attn, causal_first, s_len, *attn_strides, fill, work, t, k, chunk, work_size,
                            BLOCK=block, RADIX=radix, PASSES=passes, SPLIT=split, PARTS=triton.next_power_of_2(split),
                            LOWEST=lowest, ADDITIVE=additive, CAUSAL=causal_first is not None,
                            num_warps=num_warps)  # fmt: skip
    return mask
