"""The masked attention op at one query token (a decode step): programs per query head that read
only the keys and values the mask opens.

Unfused (stock Inductor on DeepSeek V3.2's decode step): SDPA with the index mask over the whole
static cache (cuDNN on an H200): every cached key and value of every head is read, the 3 of 4 that
the indexer's top-k closes too. At real width (128 heads of 192 / 128) and 8192 cached tokens that
is 671 MB a layer at batch 1, 265 us of a 720 us layer (measured on one H200).
Fused: per query head, the online softmax over key blocks whose key and value rows are loaded
under the mask's row predicate: a closed key costs no memory traffic, so a top-k of 2048 of 8192
reads a quarter of the cache. Where the batch's heads do not fill the GPU (DeepSeek's 128 heads at
batch 1 on 132 SMs) each row's keys are split over several programs (flash-decoding), whose
(max, sum, accumulator) a second kernel merges: one program a row would hold a chain of dependent
loads (the mask, then the rows it opens) as long as the cache. fp32 logits (exact products of the bf16 / fp16 inputs, fp32 sums) in
base 2 with log2(e) folded into the scale, fp32 probabilities times v (no rounding to the input's
dtype between: within the reference's fp32 math more closely than the prefill kernel).
A row whose every key is closed (or biased below REDO_BELOW) is redone over the whole row in
natural units, as the prefill kernel does, so that SDPA's softmax over -65504 biases is kept.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from fusion_passes.lowering.masked_attention.reference import check_masked_attention_args

LOG2E = 1.4426950408889634


@triton.jit
def _block_bias(bias_base, n0, L, stride_ml, BLOCK_N: tl.constexpr):
    """The mask's biases of the key block at n0 (fp32; -inf past the cache's end)."""
    cols = n0 + tl.arange(0, BLOCK_N)
    return tl.load(bias_base + cols.to(tl.int64) * stride_ml, mask=cols < L, other=float("-inf")).to(tl.float32)


@triton.jit
def _decode_block(
    q, k_base, v_base, bias, n0, L, m_i, l_i, acc, scale,
    stride_kl, stride_vl,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr,
    CLOSED: tl.constexpr, SKIP_CLOSED: tl.constexpr, BASE2: tl.constexpr,
):  # fmt: skip
    """One key block of the online softmax of one query row, its biases given (_block_bias: the
    caller loads the next block's before this one's keys, so that the two loads overlap).
    SKIP_CLOSED: the rows of keys whose bias is at or below CLOSED are neither loaded nor counted
    (exp of their logit is exactly 0 while the row holds an open key: see CLOSED). BASE2: scale
    holds log2(e), the bias is scaled to base 2."""
    cols = n0 + tl.arange(0, BLOCK_N)
    inside = cols < L
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    if SKIP_CLOSED:
        rows = inside & (bias > CLOSED)
    else:
        rows = inside
    # keys and values both requested before either is used: one memory round trip a block
    k = tl.load(k_base + cols[:, None].to(tl.int64) * stride_kl + d[None, :], mask=rows[:, None] & (d[None, :] < D),
                other=0.0).to(tl.float32)  # fmt: skip
    v = tl.load(v_base + cols[:, None].to(tl.int64) * stride_vl + dv[None, :], mask=rows[:, None] & (dv[None, :] < DV),
                other=0.0).to(tl.float32)  # fmt: skip
    s = tl.sum(k * q[None, :], axis=1) * scale
    if BASE2:
        s = s + bias * 1.4426950408889634
    else:
        s = s + bias
    s = tl.where(rows, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=0))
    # no open key so far: m stays -inf, subtract 0 (exp2(-inf) = 0, no NaN)
    m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    if BASE2:
        p = tl.math.exp2(s - m_sub)
        alpha = tl.math.exp2(m_i - m_sub)
    else:
        p = tl.math.exp2((s - m_sub) * 1.4426950408889634)
        alpha = tl.math.exp2((m_i - m_sub) * 1.4426950408889634)
    l_i = l_i * alpha + tl.sum(p, axis=0)
    acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
    return m_new, l_i, acc


@triton.jit
def _query_row(
    q_ptr, k_ptr, v_ptr, mask_ptr, b, h, GROUPS, MASK_BATCHES, stride_qb, stride_qh, stride_kb, stride_kh,
    stride_vb, stride_vh, stride_mb, D: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Query head h of sequence b: its query (fp32), and where its KV head's keys and values and
    its mask row start (h // GROUPS; the mask's batch 0 where one mask serves the batch)."""
    kvh = h // GROUPS
    mb = tl.where(MASK_BATCHES == 1, 0, b)
    d = tl.arange(0, BLOCK_D)
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh + d, mask=d < D, other=0.0)
    k_base = k_ptr + b.to(tl.int64) * stride_kb + kvh.to(tl.int64) * stride_kh
    v_base = v_ptr + b.to(tl.int64) * stride_vb + kvh.to(tl.int64) * stride_vh
    return q.to(tl.float32), k_base, v_base, mask_ptr + mb.to(tl.int64) * stride_mb


@triton.jit
def _masked_decode_kernel(
    q_ptr, k_ptr, v_ptr, mask_ptr, out_ptr, part_ptr,
    L, HQ, GROUPS, MASK_BATCHES, scale, keys_per_split,
    stride_qb, stride_qh,
    stride_kb, stride_kh, stride_kl,
    stride_vb, stride_vh, stride_vl,
    stride_mb, stride_ml,
    stride_ob, stride_oh,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr,
    CLOSED: tl.constexpr, REDO_BELOW: tl.constexpr,
    SPLIT: tl.constexpr,  # several programs a row: each writes (m, l, acc) of its keys to part_ptr
):  # fmt: skip
    scale = tl.cast(scale, tl.float32)  # Inductor passes Python floats as fp64
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b = bh // HQ
    h = bh % HQ
    dv = tl.arange(0, BLOCK_DV)
    q, k_base, v_base, bias_base = _query_row(q_ptr, k_ptr, v_ptr, mask_ptr, b, h, GROUPS, MASK_BATCHES, stride_qb,
                                              stride_qh, stride_kb, stride_kh, stride_vb, stride_vh, stride_mb, D,
                                              BLOCK_D)  # fmt: skip
    m_i = tl.full((), float("-inf"), tl.float32)
    l_i = tl.zeros((), tl.float32)
    acc = tl.zeros((BLOCK_DV,), tl.float32)
    scale2 = scale * 1.4426950408889634
    start = split * keys_per_split
    stop = tl.minimum(start + keys_per_split, L)
    bias = _block_bias(bias_base, start, stop, stride_ml, BLOCK_N)
    # A while loop (Triton's interpreter, the CPU tests, cannot bound a for loop by an argument);
    # a for loop would gain nothing on the GPU: its loads are not software-pipelined (see the launcher)
    n0 = start
    while n0 < stop:
        bias_next = _block_bias(bias_base, n0 + BLOCK_N, stop, stride_ml, BLOCK_N)
        m_i, l_i, acc = _decode_block(q, k_base, v_base, bias, n0, stop, m_i, l_i, acc, scale2,
                                      stride_kl, stride_vl, D, DV, BLOCK_D, BLOCK_DV, BLOCK_N,
                                      CLOSED, True, True)  # fmt: skip
        bias = bias_next
        n0 += BLOCK_N
    if SPLIT:
        # (m, l, acc[DV]) of this split, base 2; _combine_splits_kernel merges a row's splits
        row = part_ptr + (bh * tl.num_programs(1) + split).to(tl.int64) * (BLOCK_DV + 2)
        tl.store(row + dv, acc)
        tl.store(row + BLOCK_DV, m_i)
        tl.store(row + BLOCK_DV + 1, l_i)
    else:
        m_i, l_i, acc = _redo_closed_row(q, k_base, v_base, bias_base, L, m_i, l_i, acc, scale,
                                         stride_kl, stride_vl, stride_ml, D, DV, BLOCK_D, BLOCK_DV, BLOCK_N,
                                         CLOSED, REDO_BELOW)  # fmt: skip
        out = tl.where(l_i > 0, acc / tl.where(l_i > 0, l_i, 1.0), 0.0)
        o_ptrs = out_ptr + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh + dv
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=dv < DV)


@triton.jit
def _redo_closed_row(
    q, k_base, v_base, bias_base, L, m_i, l_i, acc, scale,
    stride_kl, stride_vl, stride_ml,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr,
    CLOSED: tl.constexpr, REDO_BELOW: tl.constexpr,
):  # fmt: skip
    """A row whose every key is closed (or biased as far: best base-2 logit below REDO_BELOW) again
    over the whole row in natural units, SDPA's rounding of such logits (rare: padding rows)."""
    if m_i < REDO_BELOW:
        m_i = tl.full((), float("-inf"), tl.float32)
        l_i = tl.zeros((), tl.float32)
        acc = tl.zeros((BLOCK_DV,), tl.float32)
        n0 = 0
        while n0 < L:
            bias = _block_bias(bias_base, n0, L, stride_ml, BLOCK_N)
            m_i, l_i, acc = _decode_block(q, k_base, v_base, bias, n0, L, m_i, l_i, acc, scale,
                                          stride_kl, stride_vl, D, DV, BLOCK_D, BLOCK_DV, BLOCK_N,
                                          CLOSED, False, False)  # fmt: skip
            n0 += BLOCK_N
    return m_i, l_i, acc


@triton.jit
def _combine_splits_kernel(
    q_ptr, k_ptr, v_ptr, mask_ptr, out_ptr, part_ptr,
    L, HQ, GROUPS, MASK_BATCHES, scale, SPLITS,
    stride_qb, stride_qh,
    stride_kb, stride_kh, stride_kl,
    stride_vb, stride_vh, stride_vl,
    stride_mb, stride_ml,
    stride_ob, stride_oh,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_S: tl.constexpr, CLOSED: tl.constexpr, REDO_BELOW: tl.constexpr,
):  # fmt: skip
    """One row's splits merged: m = max m_s, l = sum l_s 2^(m_s - m), acc likewise; the row redone
    whole (from q, the cache and the mask) where every key is closed."""
    scale = tl.cast(scale, tl.float32)
    bh = tl.program_id(0)
    b = bh // HQ
    h = bh % HQ
    ss = tl.arange(0, BLOCK_S)
    dv = tl.arange(0, BLOCK_DV)
    rows = part_ptr + (bh * SPLITS + ss).to(tl.int64) * (BLOCK_DV + 2)
    m_s = tl.load(rows + BLOCK_DV, mask=ss < SPLITS, other=float("-inf"))
    l_s = tl.load(rows + BLOCK_DV + 1, mask=ss < SPLITS, other=0.0)
    acc_s = tl.load(rows[:, None] + dv[None, :], mask=ss[:, None] < SPLITS, other=0.0)
    m_i = tl.max(m_s, axis=0)
    m_sub = tl.where(m_i == float("-inf"), 0.0, m_i)
    w = tl.math.exp2(m_s - m_sub)
    l_i = tl.sum(l_s * w, axis=0)
    acc = tl.sum(acc_s * w[:, None], axis=0)
    if m_i < REDO_BELOW:
        q, k_base, v_base, bias_base = _query_row(q_ptr, k_ptr, v_ptr, mask_ptr, b, h, GROUPS, MASK_BATCHES, stride_qb,
                                                  stride_qh, stride_kb, stride_kh, stride_vb, stride_vh, stride_mb, D,
                                                  BLOCK_D)  # fmt: skip
        m_i, l_i, acc = _redo_closed_row(q, k_base, v_base, bias_base, L, m_i, l_i, acc, scale, stride_kl, stride_vl,
                                         stride_ml, D, DV, BLOCK_D, BLOCK_DV, BLOCK_N, CLOSED, REDO_BELOW)  # fmt: skip
    out = tl.where(l_i > 0, acc / tl.where(l_i > 0, l_i, 1.0), 0.0)
    tl.store(out_ptr + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh + dv, out.to(out_ptr.dtype.element_ty),
             mask=dv < DV)  # fmt: skip


def _splits(rows: int, length: int, block_n: int, device: torch.device) -> int:
    """Programs a row: enough for about four per SM over the batch's rows (one program a row holds a
    chain of dependent loads as long as the cache: the mask, then the rows it opens), each at least
    four key blocks; 1 where the rows alone fill the GPU."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    if rows >= 2 * sms:
        return 1
    return max(1, min(triton.cdiv(4 * sms, rows), length // (4 * block_n), 64))


def masked_decode_attention_triton(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    *,
    block_n: int | None = None,
    num_warps: int | None = None,
    splits: int | None = None,
    wrap: Callable | None = None,
) -> torch.Tensor:
    """``masked_attention_reference`` at one query token: [B, Hq, 1, Dv] laid out [B, 1, Hq, Dv]."""
    from fusion_passes.lowering.masked_attention.triton import CLOSED, REDO_BELOW

    check_masked_attention_args(query, key, value, mask)
    bsz, heads, s, d = query.shape
    if s != 1:
        raise ValueError(f"masked_decode_attention: one query token expected, got {s}")
    kv_heads, length, dv = key.shape[1], key.shape[2], value.shape[3]
    query, key, value = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value))
    out = torch.empty((bsz, 1, heads, dv), dtype=query.dtype, device=query.device).permute(0, 2, 1, 3)
    # 64 keys a step at 8 warps: 64 key elements a thread (DeepSeek's head dim of 192 padded to
    # 256). Compiled for sm_90 (ptxas): no spills, 16-byte loads of the key and value rows. The
    # loads are not software-pipelined (their predicate is the mask), so the kernel loads the next
    # block's biases before this block's keys and values, and a program's time is still its chain
    # of blocks: hence the splits. Not yet timed.
    block_n = block_n or 64
    splits = splits or _splits(bsz * heads, length, block_n, query.device)
    # keys a split: whole key blocks, so that only the last split's last block is partial
    keys_per_split = triton.cdiv(triton.cdiv(length, splits), block_n) * block_n
    splits = triton.cdiv(length, keys_per_split)
    block_dv = triton.next_power_of_2(dv)
    # (acc[block_dv], m, l) per split; unused (one element) without splits
    parts = torch.empty((bsz * heads * splits * (block_dv + 2) if splits > 1 else 1), dtype=torch.float32,
                        device=query.device)  # fmt: skip
    args = (query, key, value, mask, out, parts, length, heads, heads // kv_heads, mask.shape[0], scale)
    strides = (query.stride(0), query.stride(1), key.stride(0), key.stride(1), key.stride(2),
               value.stride(0), value.stride(1), value.stride(2), mask.stride(0), mask.stride(3),
               out.stride(0), out.stride(1))  # fmt: skip
    dims = dict(D=d, DV=dv, BLOCK_D=triton.next_power_of_2(d), BLOCK_DV=block_dv, BLOCK_N=block_n, CLOSED=CLOSED,
                REDO_BELOW=REDO_BELOW * LOG2E)  # fmt: skip
    kernel = wrap(_masked_decode_kernel) if wrap is not None else _masked_decode_kernel
    kernel[(bsz * heads, splits)](
        *args, keys_per_split, *strides, **dims, SPLIT=splits > 1, num_warps=num_warps or 8,
    )  # fmt: skip
    if splits > 1:
        combine = wrap(_combine_splits_kernel) if wrap is not None else _combine_splits_kernel
        combine[(bsz * heads,)](*args, splits, *strides, **dims, BLOCK_S=triton.next_power_of_2(splits), num_warps=4)
    return out
