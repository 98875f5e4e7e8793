"""Triton kernel of ``advance_lengths``: a step's cache write counters in one launch.

One program loads every start, then stores every new length: the loads come before the stores, so
a counter that is both a start and a length (transformers' ``cumulative_length`` advancing itself)
reads its old value whatever the order of the counters. A launch takes up to ``PER_LAUNCH``
counters (Triton kernels take a fixed number of pointers); more take more launches.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from fusion_passes.lowering.cache_lengths.reference import check_advance_lengths_args

PER_LAUNCH = 16  # a 61-layer DeepSeek V3.2's 122 counters: 8 launches


@triton.jit
def _advance_lengths_kernel(
    s0, s1, s2, s3, s4, s5, s6, s7, s8, s9, s10, s11, s12, s13, s14, s15,  # *int starts (None past N)
    o0, o1, o2, o3, o4, o5, o6, o7, o8, o9, o10, o11, o12, o13, o14, o15,  # *int new lengths
    k0, k1, k2, k3, k4, k5, k6, k7, k8, k9, k10, k11, k12, k13, k14, k15,  # the steps (None past N)
    N: tl.constexpr,  # counters in this launch
):
    # every load before any store (module docstring); int64 sums, stored in each output's dtype
    v0 = tl.load(s0).to(tl.int64) + k0
    v1 = tl.load(s1).to(tl.int64) + k1 if N > 1 else 0
    v2 = tl.load(s2).to(tl.int64) + k2 if N > 2 else 0
    v3 = tl.load(s3).to(tl.int64) + k3 if N > 3 else 0
    v4 = tl.load(s4).to(tl.int64) + k4 if N > 4 else 0
    v5 = tl.load(s5).to(tl.int64) + k5 if N > 5 else 0
    v6 = tl.load(s6).to(tl.int64) + k6 if N > 6 else 0
    v7 = tl.load(s7).to(tl.int64) + k7 if N > 7 else 0
    v8 = tl.load(s8).to(tl.int64) + k8 if N > 8 else 0
    v9 = tl.load(s9).to(tl.int64) + k9 if N > 9 else 0
    v10 = tl.load(s10).to(tl.int64) + k10 if N > 10 else 0
    v11 = tl.load(s11).to(tl.int64) + k11 if N > 11 else 0
    v12 = tl.load(s12).to(tl.int64) + k12 if N > 12 else 0
    v13 = tl.load(s13).to(tl.int64) + k13 if N > 13 else 0
    v14 = tl.load(s14).to(tl.int64) + k14 if N > 14 else 0
    v15 = tl.load(s15).to(tl.int64) + k15 if N > 15 else 0
    tl.store(o0, v0.to(o0.dtype.element_ty))
    if N > 1:
        tl.store(o1, v1.to(o1.dtype.element_ty))
    if N > 2:
        tl.store(o2, v2.to(o2.dtype.element_ty))
    if N > 3:
        tl.store(o3, v3.to(o3.dtype.element_ty))
    if N > 4:
        tl.store(o4, v4.to(o4.dtype.element_ty))
    if N > 5:
        tl.store(o5, v5.to(o5.dtype.element_ty))
    if N > 6:
        tl.store(o6, v6.to(o6.dtype.element_ty))
    if N > 7:
        tl.store(o7, v7.to(o7.dtype.element_ty))
    if N > 8:
        tl.store(o8, v8.to(o8.dtype.element_ty))
    if N > 9:
        tl.store(o9, v9.to(o9.dtype.element_ty))
    if N > 10:
        tl.store(o10, v10.to(o10.dtype.element_ty))
    if N > 11:
        tl.store(o11, v11.to(o11.dtype.element_ty))
    if N > 12:
        tl.store(o12, v12.to(o12.dtype.element_ty))
    if N > 13:
        tl.store(o13, v13.to(o13.dtype.element_ty))
    if N > 14:
        tl.store(o14, v14.to(o14.dtype.element_ty))
    if N > 15:
        tl.store(o15, v15.to(o15.dtype.element_ty))


def advance_lengths_triton(
    starts: list[torch.Tensor], lengths: list[torch.Tensor], steps: list[int], *, wrap: Callable | None = None
) -> list[torch.Tensor]:
    """advance_lengths_reference's values. With ``wrap`` (Inductor's launch) the lengths are
    written in place and returned; without it, new tensors (the op is functional)."""
    check_advance_lengths_args(starts, lengths, steps)
    outs = list(lengths) if wrap is not None else [torch.empty_like(length) for length in lengths]
    kernel = wrap(_advance_lengths_kernel) if wrap is not None else _advance_lengths_kernel
    for first in range(0, len(lengths), PER_LAUNCH):
        part = slice(first, first + PER_LAUNCH)
        n = len(outs[part])
        pad = [None] * (PER_LAUNCH - n)  # constants, not launch arguments
        kernel[(1,)](*starts[part], *pad, *outs[part], *pad, *steps[part], *pad, N=n, num_warps=1)
    return outs
