"""One Triton kernel for a Gated DeltaNet decode step: gating, q/k l2norm, the delta-rule update
of the fp32 state and the output, the state read once and written once.

Unfused (stock Inductor on transformers' gating + recurrent step): sigmoid and softplus gating
kernels, q / k repeat + l2norm, a decay-and-read reduction over the state, the update + output
reduction, the output's cast, and a copy of the new state into the cache: 4 kernels, 1.9x the
state-traffic floor at batch 128 (one read and one write of the 64 KiB fp32 state of each
sequence and value head; measured on one H200).
Fused: each program owns one (sequence b, value head h) and BLOCK_V of the V columns of its state
[K, V]; it loads q and k of key head h // (HV / Hk) (no repeat), normalises them, computes
beta and the decay from b, a, A_log and dt_bias, and with the state block in registers reduces
the old state against k and q at once (the reference's decayed, updated state is linear in it):
    sk = sum_k S * k;  sq = sum_k S * q;  d = exp(g);  delta = (v - d * sk) * beta
    S' = d * S + k delta^T;  out = d * sq + delta * (k . q)
then stores S' over S and out. All in fp32; sigmoid(b) rounded to b.dtype as the model does. The
two reductions do not wait on each other: 2.4-3.4% faster at batch 8-128 than reducing the
updated state for the output (40.8 vs 41.8 us at batch 32, 143.3 vs 148.3 at 128; 3 runs each,
a spread of 0.1 us; measured on one H200). Rounding differs from the reference's order in fp32 ulps.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from fusion_passes.lowering.gated_delta_step.reference import check_gated_delta_step_args


@triton.jit
def _gated_delta_step_kernel(
    q_ptr,  # *q.dtype [B, 1, Hk, K] (strides stride_qb, stride_qh; K contiguous)
    k_ptr,  # *k.dtype [B, 1, Hk, K] (strides stride_kb, stride_kh; K contiguous)
    v_ptr,  # *v.dtype [B, 1, HV, V] (strides stride_vb, stride_vh; V contiguous)
    a_ptr,  # *a.dtype [B, 1, HV] (strides stride_ab, stride_ah)
    b_ptr,  # *b.dtype [B, 1, HV] (strides stride_bb, stride_bh)
    A_log_ptr,  # *A_log.dtype [HV]
    dt_bias_ptr,  # *dt_bias.dtype [HV]
    state_ptr,  # *fp32 [B, HV, K, V] contiguous: read, then overwritten with the new state
    out_ptr,  # *v.dtype [B, 1, HV, V] contiguous
    stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh,
    stride_ab, stride_ah, stride_bb, stride_bh,
    scale,  # the query scale (divided by or multiplied with, DIVIDE_SCALE)
    l2norm_eps,  # added to sum(x * x) before the rsqrt
    HV: tl.constexpr,  # value heads
    GROUP: tl.constexpr,  # value heads per key head (HV / Hk)
    K: tl.constexpr,  # key head dim
    V: tl.constexpr,  # value head dim
    BLOCK_K: tl.constexpr,  # next_power_of_2(K): the whole key dim in one block
    BLOCK_V: tl.constexpr,  # state columns per program
    DIVIDE_SCALE: tl.constexpr,
    QK_L2NORM: tl.constexpr,
):
    """A program per (sequence, value head) and block of BLOCK_V state columns (_step_tile)."""
    pid = tl.program_id(0)
    _step_tile(
        (pid // HV).to(tl.int64), pid % HV, tl.program_id(1), q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, A_log_ptr,
        dt_bias_ptr, state_ptr, out_ptr, stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh,
        stride_ab, stride_ah, stride_bb, stride_bh, scale, l2norm_eps, HV, GROUP, K, V, BLOCK_K, BLOCK_V,
        DIVIDE_SCALE, QK_L2NORM,
    )  # fmt: skip


@triton.jit
def _gated_delta_step_persistent_kernel(
    q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, state_ptr, out_ptr,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh, stride_ab, stride_ah, stride_bb, stride_bh,
    scale, l2norm_eps,
    tiles,  # B * HV * V_BLOCKS: the (sequence, value head, column block) tiles
    HV: tl.constexpr, GROUP: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr, DIVIDE_SCALE: tl.constexpr, QK_L2NORM: tl.constexpr,
    V_BLOCKS: tl.constexpr,  # cdiv(V, BLOCK_V)
    ITERS: tl.constexpr,  # cdiv(tiles, programs): the tiles a program takes, programs apart (a
    # constant: a decode graph's batch is static, and Triton's interpreter takes no argument as a bound)
    STAGES: tl.constexpr,  # the loop's software pipelining: the next tile's state loads in flight
):  # fmt: skip
    """The same tiles, a fixed grid of programs each walking them programs apart: no last wave of
    a few programs, and the next tile's loads overlapping this one's math. For batch 32, where the
    grid kernel's 4096 programs (32 value heads, 32 columns a program) reach 75% of the
    state-traffic floor against 88% at batch 128 on one H200; the form itself is not timed yet."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    for i in tl.range(0, ITERS, num_stages=STAGES):
        tile = pid + i * programs
        if tile < tiles:
            pair = tile // V_BLOCKS
            _step_tile(
                (pair // HV).to(tl.int64), pair % HV, tile % V_BLOCKS, q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, A_log_ptr,
                dt_bias_ptr, state_ptr, out_ptr, stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh,
                stride_ab, stride_ah, stride_bb, stride_bh, scale, l2norm_eps, HV, GROUP, K, V, BLOCK_K, BLOCK_V,
                DIVIDE_SCALE, QK_L2NORM,
            )  # fmt: skip


@triton.jit
def _step_tile(
    b, h, v_block, q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, state_ptr, out_ptr,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh, stride_ab, stride_ah, stride_bb, stride_bh,
    scale, l2norm_eps, HV: tl.constexpr, GROUP: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, DIVIDE_SCALE: tl.constexpr, QK_L2NORM: tl.constexpr,
):  # fmt: skip
    """One (sequence b, value head h) and its state columns [v_block * BLOCK_V, ...): the step,
    its output stored in out's dtype."""
    out = step_update(
        b, h, v_block, q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, state_ptr,
        stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh, stride_ab, stride_ah, stride_bb, stride_bh,
        scale, l2norm_eps, HV, GROUP, K, V, BLOCK_K, BLOCK_V, DIVIDE_SCALE, QK_L2NORM,
    )  # fmt: skip
    vs = v_block * BLOCK_V + tl.arange(0, BLOCK_V)
    tl.store(out_ptr + (b * HV + h) * V + vs, out.to(out_ptr.dtype.element_ty), mask=vs < V)


@triton.jit
def step_update(
    b, h, v_block, q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, state_ptr,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh, stride_ab, stride_ah, stride_bb, stride_bh,
    scale, l2norm_eps, HV: tl.constexpr, GROUP: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, DIVIDE_SCALE: tl.constexpr, QK_L2NORM: tl.constexpr,
):  # fmt: skip
    """The step of one (sequence b, value head h) on its state columns [v_block * BLOCK_V, ...):
    stores the new state block and returns the output's columns in fp32 (the caller stores them,
    or normalises the row first: gated_delta_step_norm)."""
    # Inductor passes Python floats as fp64: pin them to fp32, the reference's precision.
    scale = tl.cast(scale, tl.float32)
    l2norm_eps = tl.cast(l2norm_eps, tl.float32)
    hk = h // GROUP
    ks = tl.arange(0, BLOCK_K)
    vs = v_block * BLOCK_V + tl.arange(0, BLOCK_V)
    km, vm = ks < K, vs < V
    # The state block first: the largest load, its latency overlaps the gating math below.
    s_ptrs = state_ptr + ((b * HV + h) * K + ks[:, None]) * V + vs[None, :]
    smask = km[:, None] & vm[None, :]
    s = tl.load(s_ptrs, mask=smask, other=0.0)
    q = tl.load(q_ptr + b * stride_qb + hk * stride_qh + ks, mask=km, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + b * stride_kb + hk * stride_kh + ks, mask=km, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + b * stride_vb + h * stride_vh + vs, mask=vm, other=0.0).to(tl.float32)
    if QK_L2NORM:
        q = q * tl.math.rsqrt(tl.sum(q * q, axis=0) + l2norm_eps)
        k = k * tl.math.rsqrt(tl.sum(k * k, axis=0) + l2norm_eps)
    if DIVIDE_SCALE:
        q = q / scale
    else:
        q = q * scale
    # beta = sigmoid(b) in b.dtype (the model rounds it there), then fp32.
    bb = tl.load(b_ptr + b * stride_bb + h * stride_bh).to(tl.float32)
    beta = (1.0 / (1.0 + tl.exp(-bb))).to(b_ptr.dtype.element_ty).to(tl.float32)
    # g = -exp(A_log) * softplus(a + dt_bias), softplus with torch's threshold 20 (beta 1) as
    # log(1 + e^x): torch's log1p differs by <= 6e-8 absolute (1e-3 relative at x = -10, where
    # the decay exp(g) is 1 to fp32's precision either way).
    x = tl.load(a_ptr + b * stride_ab + h * stride_ah).to(tl.float32) + tl.load(dt_bias_ptr + h).to(tl.float32)
    softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(x)))
    decay = tl.exp(-tl.exp(tl.load(A_log_ptr + h).to(tl.float32)) * softplus)
    sk = tl.sum(s * k[:, None], axis=0)
    sq = tl.sum(s * q[:, None], axis=0)
    delta = (v - sk * decay) * beta
    s = s * decay + k[:, None] * delta[None, :]
    out = sq * decay + delta * tl.sum(k * q, axis=0)
    # The state stored after the output's math, not as soon as it is known: 2.6-3.7% faster at
    # batch 32-128, 1.6% slower at 8 (measured on one H200).
    tl.store(s_ptrs, s, mask=smask)
    return out


def _launch(state: torch.Tensor, batch: int, heads: int, dv: int) -> tuple[int, int]:
    """(state columns per program, warps) from the GPU's launch table (lowering/launch_tables.py)."""
    from fusion_passes.lowering.common.launch_policy import select
    from fusion_passes.lowering.launch_tables import GATED_DELTA_STEP

    pairs = batch * heads
    for bound, block, warps in select(GATED_DELTA_STEP, state.device).rules:
        if bound is None or pairs < bound:
            if block:
                return min(block, triton.next_power_of_2(dv)), warps
            # the default: halve the whole row until there are 512 programs, down to 32 columns
            block = triton.next_power_of_2(dv)
            while block > 32 and pairs * triton.cdiv(dv, block) < 512:
                block //= 2
            return block, warps
    raise AssertionError("a launch table's last rule has no bound")


def step_inputs(q, k, v, state, in_place: bool):
    """(q, k, v, state) as the kernels index them: unit stride along the head dims, and a
    contiguous state to update, the input's own where ``in_place`` (and it is contiguous), else a
    copy (the dispatcher's call is functional)."""
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        q, k, v = (t.contiguous() for t in (q, k, v))
    if not in_place:
        state = state.clone(memory_format=torch.contiguous_format)
    elif not state.is_contiguous():  # the kernel indexes a contiguous state: update a copy (returned)
        state = state.contiguous()
    return q, k, v, state


def step_args(q, k, v, a, b, A_log, dt_bias, state, out, scale, l2norm_eps) -> tuple:
    """The step kernels' leading arguments, in their order (pointers, strides, scalars)."""
    return (
        q, k, v, a, b, A_log, dt_bias, state, out,
        q.stride(0), q.stride(2), k.stride(0), k.stride(2), v.stride(0), v.stride(2),
        a.stride(0), a.stride(2), b.stride(0), b.stride(2),
        scale, l2norm_eps,
    )  # fmt: skip


def gated_delta_step_triton(
    q, k, v, a, b, A_log, dt_bias, state, scale, divide_scale, qk_l2norm, l2norm_eps, *,
    wrap: Callable | None = None, block_v: int | None = None, num_warps: int | None = None,
    programs: int | None = None, stages: int = 2,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, new_state) as ``gated_delta_step_reference``. With ``wrap`` (an inlined launch) the
    state is updated in place and returned; without, a copy is (the op is functional).
    ``block_v`` / ``num_warps``: launch overrides for the benchmark's sweep; ``programs`` (with
    ``stages``): the persistent form, that many programs walking the tiles (not yet timed: the
    sweep's, not the table's)."""
    check_gated_delta_step_args(q, k, v, a, b, A_log, dt_bias, state)
    bsz, _, hk, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    q, k, v, state = step_inputs(q, k, v, state, in_place=wrap is not None)
    out = torch.empty((bsz, 1, hv, dv), dtype=v.dtype, device=v.device)
    table_block, table_warps = _launch(state, bsz, hv, dv)
    block_v, num_warps = block_v or table_block, num_warps or table_warps
    args = step_args(q, k, v, a, b, A_log, dt_bias, state, out, scale, l2norm_eps)
    form = dict(HV=hv, GROUP=hv // hk, K=dk, V=dv, BLOCK_K=triton.next_power_of_2(dk), BLOCK_V=block_v,
                DIVIDE_SCALE=divide_scale, QK_L2NORM=qk_l2norm, num_warps=num_warps)  # fmt: skip
    if programs is not None:
        v_blocks = triton.cdiv(dv, block_v)
        tiles = bsz * hv * v_blocks
        programs = max(1, min(programs, tiles))
        kernel = wrap(_gated_delta_step_persistent_kernel) if wrap is not None else _gated_delta_step_persistent_kernel
        kernel[(programs,)](*args, tiles, V_BLOCKS=v_blocks, ITERS=triton.cdiv(tiles, programs), STAGES=stages, **form)
        return out, state
    kernel = wrap(_gated_delta_step_kernel) if wrap is not None else _gated_delta_step_kernel
    kernel[(bsz * hv, triton.cdiv(dv, block_v))](*args, **form)
    return out, state
