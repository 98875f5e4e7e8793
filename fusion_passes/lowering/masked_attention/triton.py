"""Triton kernels for masked grouped-query attention (``reference``): a flash-attention forward
that skips the key blocks the mask closes and reads the mask only where it is mixed.

Unfused (stock Inductor on a StaticCache prefill): SDPA with the mask over the whole cache (cuDNN
on an H200, the boolean mask turned into a bias of 0 / -65504), every query against every cached
key, after repeat_kv's copies of the cache: at MiniMax-M2's width (48 / 8 heads of 128) and a
4096-token prompt, 1319 us (2170 us per layer in a prefill of two layers).
Fused: two kernels.
  1. _mask_blocks: per BLOCK_M x BLOCK_N tile of the additive mask, 0 (every bias at or below
     CLOSED: closed), 2 (every bias 0: open) or 1 (mixed); a mixed tile is copied out at an aligned
     row stride (the mask's rows of S + 1 keys are at an odd one).
  2. _masked_attention_kernel: per BLOCK_M query tokens of one query head, the online softmax over
     the key blocks from the first to the last one the mask does not close (a causal prompt: the
     blocks up to the diagonal, half of them), the tile's copy read and added only in mixed blocks;
     query head h reads KV head h // g from the cache as it is (no repeat). fp32 scores and
     accumulators, the probabilities rounded to the input's dtype for the product with v.
     The leading run of blocks the mask opens whole (a causal prompt: all below the diagonal) has
     its own loop with no mask logic, and the logits are in base 2 (log2(e) folded into the scale):
     against one loop in natural units, 860 -> 650 us (MiniMax-M2's widths, 4096 tokens on 4097
     slots), 1090 -> 815 (Qwen3-MoE), 762 -> 611 (Qwen 3.5, head dim 256), 3670 -> 3107 (DeepSeek
     V3.2's 128 heads of 192 / 128); 1024 tokens 1-17% (CUDA graph, one H200, 3 alternating rounds
     within 1% of each other).
  masked_attention_causal (the prompt's causal mask from its first cache position): kernel 2 alone,
  its blocks computed from the positions (query block qb sees keys up to first + its last row, and
  every row of it those up to first + its first row), the diagonal's blocks compared per key: no
  mask built, read or summarized; bit-equal to the two kernels on the mask it stands for.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from fusion_passes.lowering.masked_attention.reference import check_causal_attention_args, check_masked_attention_args


@triton.jit
def _mask_blocks(
    mask_ptr,  # *fp32/bf16/fp16 [MB, 1, S, L] (strides below): additive
    blocks_ptr,  # *int8 [MB, cdiv(S, BLOCK_M), cdiv(L, BLOCK_N)]
    tiles_ptr,  # *mask dtype [MB, cdiv(S, BLOCK_M) * BLOCK_M, cdiv(L, BLOCK_N) * BLOCK_N], contiguous
    S,
    L,
    stride_mb,
    stride_ms,
    stride_ml,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CLOSED: tl.constexpr,
):
    pid_bm = tl.program_id(0)  # mask batch x query block
    kb = tl.program_id(1)
    n_qb = tl.cdiv(S, BLOCK_M)
    b = pid_bm // n_qb
    qb = pid_bm % n_qb
    rows = qb * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = kb * BLOCK_N + tl.arange(0, BLOCK_N)
    inside = (rows[:, None] < S) & (cols[None, :] < L)
    ptrs = mask_ptr + b.to(tl.int64) * stride_mb + rows[:, None].to(tl.int64) * stride_ms + cols[None, :] * stride_ml
    tile = tl.load(ptrs, mask=inside, other=0.0).to(tl.float32)
    # positions outside the mask (a partial edge block) count as neither
    closed = tl.sum(tl.sum((inside & (tile <= CLOSED)).to(tl.int32), axis=1), axis=0)
    zero = tl.sum(tl.sum((inside & (tile == 0.0)).to(tl.int32), axis=1), axis=0)
    cells = tl.sum(tl.sum(inside.to(tl.int32), axis=1), axis=0)
    state = tl.where(closed == cells, 0, tl.where(zero == cells, 2, 1))
    tl.store(blocks_ptr + pid_bm.to(tl.int64) * tl.cdiv(L, BLOCK_N) + kb, state.to(tl.int8))
    # a mixed tile's copy, at an aligned row stride (the mask's may be odd: a cache of S + 1 keys)
    # with -inf beyond the cache: the attention kernel's vector loads of it
    if state == 1:
        row_len = tl.cdiv(L, BLOCK_N) * BLOCK_N
        copy = tiles_ptr + (b * tl.cdiv(S, BLOCK_M) * BLOCK_M + rows[:, None]).to(tl.int64) * row_len
        tl.store(copy + cols[None, :], tl.where(inside, tile, float("-inf")).to(tiles_ptr.dtype.element_ty))


@triton.jit
def _attend_block(
    q, k_base, v_base, m_base, blocks_row, kb, rows, row_last, m_i, l_i, acc, S, L, scale,
    stride_kl, stride_vl, stride_ml,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
    EDGE: tl.constexpr,
    COPY: tl.constexpr,
    OPEN: tl.constexpr,
    CAUSAL: tl.constexpr = False,
):  # fmt: skip
    """One key block of the online softmax: (m, l, acc) updated. UPCAST: the dots' operands in fp32
    (the interpreter's bf16 dots are wrong; fp32 products of bf16 / fp16 values are exact, as the
    GPU's tensor cores take them). EDGE: the block may reach past the cache's last key, so its
    loads are masked by key; every other block is read without a key mask. COPY: the bias comes from
    _mask_blocks' aligned copy of the mixed tiles (m_base: the copy's rows), where a closed block
    adds -inf; else from the mask (m_base: its rows, stride_ml apart). Why: on an odd cache length
    (the mask's rows at an odd stride) the kernel reading the mask with key masks ran 3.1x slower
    (MiniMax-M2's widths, a 4096-token prompt: 2728 us with 4097 keys, 885 us with 4112; one H200).
    OPEN: a block of the leading run the mask opens whole: no block state read, no bias.
    CAUSAL: no mask; key t is open for a row up to its cache position row_last (base-2 logits as
    COPY's, a closed key -inf)."""
    cols = kb * BLOCK_N + tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    k_ptrs = k_base + cols[None, :].to(tl.int64) * stride_kl + d[:, None]
    v_ptrs = v_base + cols[:, None].to(tl.int64) * stride_vl + dv[None, :]
    if EDGE:
        k = tl.load(k_ptrs, mask=(cols[None, :] < L) & (d[:, None] < D), other=0.0)
        v = tl.load(v_ptrs, mask=(cols[:, None] < L) & (dv[None, :] < DV), other=0.0)
    else:
        k = tl.load(k_ptrs, mask=d[:, None] < D, other=0.0)
        v = tl.load(v_ptrs, mask=dv[None, :] < DV, other=0.0)
    # COPY (the main pass): logits in base 2, log2(e) * (scale * (q . k) + bias) in fp32 (scale:
    # the softmax scale times log2(e), folded by the caller: the exponent one subtraction). Else
    # (the redo of a row whose keys are all closed, its logits near -65504): in natural units as
    # SDPA rounds them, their difference from the row's max exact before the scaling to base 2
    # (base-2 logits of that size would keep 1 bit less).
    if UPCAST:
        s = tl.dot(q.to(tl.float32), k.to(tl.float32), input_precision="ieee") * scale
    elif IEEE:
        s = tl.dot(q, k, input_precision="ieee") * scale
    else:
        s = tl.dot(q, k) * scale
    if CAUSAL and not OPEN:  # the diagonal's blocks, and the cache's partial last one
        s = tl.where((cols[None, :] <= row_last[:, None]) & (cols[None, :] < L), s, float("-inf"))
    elif not OPEN:  # (OPEN: a block of the leading run the mask opens whole, no bias to add)
        state = tl.load(blocks_row + kb)
        if COPY:  # from _mask_blocks' copy: a mixed block its tile, a closed one -inf (exp: exactly 0)
            if state != 2:
                bias = tl.load(m_base + cols[None, :], mask=(rows[:, None] >= 0) & (state == 1), other=float("-inf"))
                s = s + bias.to(tl.float32) * 1.4426950408889634
            elif EDGE:
                s = tl.where(cols[None, :] < L, s, float("-inf"))
        elif state != 2:  # the mask itself (every block of a row whose keys are all closed)
            bias = tl.load(m_base + cols[None, :] * stride_ml, mask=(rows[:, None] < S) & (cols[None, :] < L),
                           other=float("-inf"))  # fmt: skip
            s = s + bias.to(tl.float32)
        else:
            s = tl.where(cols[None, :] < L, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    # a row without an open key so far keeps m = -inf: subtract 0 there (exp2(-inf) = 0, no NaN)
    m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    if COPY or CAUSAL:
        p = tl.math.exp2(s - m_sub[:, None])
        alpha = tl.math.exp2(m_i - m_sub)
    else:
        p = tl.math.exp2((s - m_sub[:, None]) * 1.4426950408889634)
        alpha = tl.math.exp2((m_i - m_sub) * 1.4426950408889634)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if UPCAST:
        pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision="ieee")
        acc = acc * alpha[:, None] + pv
    elif IEEE:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _masked_attention_kernel(
    q_ptr, k_ptr, v_ptr, mask_ptr, blocks_ptr, tiles_ptr, out_ptr,
    first_ptr,  # CAUSAL: *int, the cache position of the prompt's first token (else None)
    S, L, HQ, GROUPS, MASK_BATCHES, scale,
    stride_qb, stride_qh, stride_qs,
    stride_kb, stride_kh, stride_kl,
    stride_vb, stride_vh, stride_vl,
    stride_mb, stride_ms, stride_ml,
    stride_ob, stride_oh, stride_os,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, N_KB: tl.constexpr,
    IEEE: tl.constexpr,
    REDO_BELOW: tl.constexpr,  # a row's best base-2 logit below it: the row redone (REDO_BELOW below)
    INTERPRET: tl.constexpr,  # Triton's CPU interpreter (the tests): see below
    CAUSAL: tl.constexpr = False,  # the causal mask from first_ptr: no mask, no block summary read
):  # fmt: skip
    scale = tl.cast(scale, tl.float32)  # Inductor passes Python floats as fp64
    scale2 = scale * 1.4426950408889634  # the main pass's base-2 logits (_attend_block)
    qb = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // HQ
    h = bh % HQ
    kvh = h // GROUPS
    mb = tl.where(MASK_BATCHES == 1, 0, b)
    n_kb = tl.cdiv(L, BLOCK_N)
    rows = qb * BLOCK_M + tl.arange(0, BLOCK_M)
    # the key blocks this query block's mask opens: [first, last]
    kbs = tl.arange(0, N_KB)
    blocks_row = blocks_ptr + (mb * tl.cdiv(S, BLOCK_M) + qb).to(tl.int64) * n_kb
    if CAUSAL:  # row i sees the positions up to first + i: the blocks up to the block row's last
        pos0 = tl.load(first_ptr).to(tl.int32)
        row_last = pos0 + rows
        first = 0
        last = tl.minimum((pos0 + tl.minimum(qb * BLOCK_M + BLOCK_M, S) - 1) // BLOCK_N, n_kb - 1)
    else:
        row_last = rows  # not read
        states = tl.load(blocks_row + kbs, mask=kbs < n_kb, other=0)
        opened = states != 0
        first = tl.min(tl.where(opened, kbs, N_KB), axis=0)
        last = tl.max(tl.where(opened, kbs, -1), axis=0)

    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh + rows[:, None].to(tl.int64) * stride_qs
                + d[None, :], mask=(rows[:, None] < S) & (d[None, :] < D), other=0.0)  # fmt: skip
    k_base = k_ptr + b.to(tl.int64) * stride_kb + kvh.to(tl.int64) * stride_kh
    v_base = v_ptr + b.to(tl.int64) * stride_vb + kvh.to(tl.int64) * stride_vh
    m_base = mask_ptr + mb.to(tl.int64) * stride_mb + rows[:, None].to(tl.int64) * stride_ms
    row_len = n_kb * BLOCK_N  # the tile copy's row stride
    t_base = tiles_ptr + (mb * tl.cdiv(S, BLOCK_M) * BLOCK_M + rows[:, None]).to(tl.int64) * row_len
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_DV), tl.float32)
    # Three runs of key blocks: the leading run the mask opens whole (a causal prompt: every block
    # below the diagonal) with no mask logic at all; the rest wholly inside the cache (the
    # diagonal's mixed blocks); the cache's last block if it is partial and open.
    full = L // BLOCK_N
    end = tl.minimum(last + 1, full)
    if CAUSAL:  # the blocks every row of the block sees whole: up to the first row's position
        lead = tl.minimum((pos0 + qb * BLOCK_M + 1) // BLOCK_N, end)
    else:
        lead = tl.minimum(tl.min(tl.where((kbs >= first) & (states != 2), kbs, N_KB), axis=0), end)
    if not INTERPRET:  # software-pipelined on the GPU
        for kb in range(first, lead):
            m_i, l_i, acc = _attend_block(
                q, k_base, v_base, t_base, blocks_row, kb, rows, row_last, m_i, l_i, acc, S, L, scale2,
                stride_kl, stride_vl, stride_ml, D, DV, BLOCK_D, BLOCK_DV, BLOCK_N, IEEE, False, False, True, True, CAUSAL,
            )  # fmt: skip
        for kb in range(tl.maximum(lead, first), end):
            m_i, l_i, acc = _attend_block(
                q, k_base, v_base, t_base, blocks_row, kb, rows, row_last, m_i, l_i, acc, S, L, scale2,
                stride_kl, stride_vl, stride_ml, D, DV, BLOCK_D, BLOCK_DV, BLOCK_N, IEEE, False, False, True, False, CAUSAL,
            )  # fmt: skip
    else:  # the interpreter cannot bound a for loop by a loaded value
        kb = first
        while kb < lead:
            m_i, l_i, acc = _attend_block(
                q, k_base, v_base, t_base, blocks_row, kb, rows, row_last, m_i, l_i, acc, S, L, scale2,
                stride_kl, stride_vl, stride_ml, D, DV, BLOCK_D, BLOCK_DV, BLOCK_N, IEEE, True, False, True, True, CAUSAL,
            )  # fmt: skip
            kb += 1
        kb = tl.maximum(lead, first)
        while kb < end:
            m_i, l_i, acc = _attend_block(
                q, k_base, v_base, t_base, blocks_row, kb, rows, row_last, m_i, l_i, acc, S, L, scale2,
                stride_kl, stride_vl, stride_ml, D, DV, BLOCK_D, BLOCK_DV, BLOCK_N, IEEE, True, False, True, False, CAUSAL,
            )  # fmt: skip
            kb += 1
    if last >= full:  # last == full: the partial block (the loops' bounds keep first <= it)
        m_i, l_i, acc = _attend_block(
            q, k_base, v_base, t_base, blocks_row, full, rows, row_last, m_i, l_i, acc, S, L, scale2,
            stride_kl, stride_vl, stride_ml, D, DV, BLOCK_D, BLOCK_DV, BLOCK_N, IEEE, INTERPRET, True, True, False, CAUSAL,
        )  # fmt: skip
    # A row whose every key is closed (its best logit at a closed key's level, or no key at all)
    # takes the whole row, the closed blocks too: SDPA's softmax over biases of -65504 is not 0
    # there (all -inf: zeros either way). Rare (padding rows), so a second pass of the block.
    # Only rows of the prompt count: the block's rows past S (a 4-token prompt in a block of 16)
    # see no key: redoing for them made 4 tokens on a 4084-slot cache take 151 us against 12 us
    # without (MiniMax-M2's widths, in a CUDA graph on one H200; stock Inductor 129 us).
    # (CAUSAL: every row sees position 0, never redone)
    if not CAUSAL and tl.max(((m_i < REDO_BELOW) & (rows < S)).to(tl.int32), axis=0) > 0:
        m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_DV), tl.float32)
        kb = 0
        while kb < n_kb:
            m_i, l_i, acc = _attend_block(
                q, k_base, v_base, m_base, blocks_row, kb, rows, row_last, m_i, l_i, acc, S, L, scale,
                stride_kl, stride_vl, stride_ml, D, DV, BLOCK_D, BLOCK_DV, BLOCK_N, IEEE, INTERPRET, True, False, False,
            )  # fmt: skip
            kb += 1
    # a row the mask closes entirely: zeros (SDPA's math)
    out = tl.where(l_i[:, None] > 0, acc / tl.where(l_i > 0, l_i, 1.0)[:, None], 0.0)
    o_ptrs = (out_ptr + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh + rows[:, None].to(tl.int64) * stride_os
              + dv[None, :])  # fmt: skip
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=(rows[:, None] < S) & (dv[None, :] < DV))


# A closed key: a bias at or below the lowest fp16 (-65504, what SDPA's cuDNN path writes for a
# boolean mask's False; -inf and the lowest bf16 / fp32 too). Its exp after the row's max is
# subtracted underflows to exactly 0 in fp32 while the row holds a key above REDO_BELOW and no
# logit exceeds 64000, so a block of closed keys is skipped; a row without such a key is redone
# over the whole row.
CLOSED = -65504.0
# A row whose best logit (natural units) is below it is redone over the whole row in natural units,
# where SDPA's own rounding of logits that size is kept: every key closed, or biased as far (masks
# of -10000 for closed keys: base-2 logits of that size keep 1 bit less of the row's softmax).
REDO_BELOW = -1000.0


def masked_attention_triton(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    *,
    causal_first: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    wrap: Callable | None = None,
) -> torch.Tensor:
    """[B, Hq, S, Dv] laid out [B, S, Hq, Dv], as ``masked_attention_reference``; with
    ``causal_first`` in place of the mask, as ``masked_attention_causal_reference`` (the mask
    compared in the kernel, no block summary)."""
    if causal_first is not None:
        check_causal_attention_args(query, key, value, causal_first)
    else:
        check_masked_attention_args(query, key, value, mask)
    bsz, heads, s, d = query.shape
    kv_heads, length, dv = key.shape[1], key.shape[2], value.shape[3]
    # the head dim contiguous (the kernels' loads); a no-op for the cache and the projections' views
    query, key, value = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value))
    # [B, S, Hq, Dv] viewed [B, Hq, S, Dv] (permute: a direct launch traces it, transpose.int it cannot lower)
    out = torch.empty((bsz, s, heads, dv), dtype=query.dtype, device=query.device).permute(0, 2, 1, 3)
    fp32 = query.dtype == torch.float32
    # bf16 / fp16 on an H200: 128 query tokens x 64 keys a step, 8 warps, 3 stages; where a tile
    # row is wider (fp32, or a head dim above 128) half the query tokens and 2 stages, so that the
    # stages' key and value tiles fit the 227 KiB of shared memory
    wide = fp32 or max(d, dv) > 128
    block_m = block_m or min(64 if wide else 128, max(16, triton.next_power_of_2(s)))
    block_n = block_n or (32 if fp32 else 64)
    num_stages = num_stages or (2 if wide else 3)
    n_qb, n_kb = triton.cdiv(s, block_m), triton.cdiv(length, block_n)
    if causal_first is None:
        mask_batches = mask.shape[0]
        blocks = torch.empty((mask_batches, n_qb, n_kb), dtype=torch.int8, device=query.device)
        # written only where a tile is mixed (a causal prompt: the diagonal's, 2-3 of a query block's)
        tiles = torch.empty((mask_batches, n_qb * block_m, n_kb * block_n), dtype=mask.dtype, device=query.device)
        summarize = wrap(_mask_blocks) if wrap is not None else _mask_blocks
        summarize[(mask_batches * n_qb, n_kb)](mask, blocks, tiles, s, length, mask.stride(0), mask.stride(2),
                                               mask.stride(3), BLOCK_M=block_m, BLOCK_N=block_n, CLOSED=CLOSED,
                                               num_warps=4)  # fmt: skip
        mask_strides = (mask.stride(0), mask.stride(2), mask.stride(3))
    else:  # nothing to summarize: the mask, the block states and the tiles' pointers are never read
        mask_batches, mask_strides = 1, (0, 0, 0)
        mask = blocks = tiles = query
    attend = wrap(_masked_attention_kernel) if wrap is not None else _masked_attention_kernel
    attend[(n_qb, bsz * heads)](
        query, key, value, mask, blocks, tiles, out, causal_first,
        s, length, heads, heads // kv_heads, mask_batches, scale,
        query.stride(0), query.stride(1), query.stride(2),
        key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2),
        *mask_strides,
        out.stride(0), out.stride(1), out.stride(2),
        D=d, DV=dv, BLOCK_D=triton.next_power_of_2(d), BLOCK_DV=triton.next_power_of_2(dv),
        BLOCK_M=block_m, BLOCK_N=block_n, N_KB=triton.next_power_of_2(n_kb), IEEE=fp32,
        REDO_BELOW=REDO_BELOW * 1.4426950408889634,
        INTERPRET=os.environ.get("TRITON_INTERPRET") == "1", CAUSAL=causal_first is not None,
        num_warps=num_warps or (8 if block_m >= 128 else 4), num_stages=num_stages,
    )  # fmt: skip
    return out
