"""The Gated DeltaNet decode step with the layer's gated RMSNorm: gated_delta_step_norm's kernels.

Unfused (gated_delta_step, then Inductor on Qwen3_5RMSNormGated): the step kernel writes the
output [B, 1, HV, V] in v.dtype; a second kernel reads it back with the gate z, normalises each
value head's row and multiplies by silu(z): 2 launches a layer.
Fused, from GATED_DELTA_STEP_NORM's ``epilogue_from`` pairs: one program per (sequence, value
head) holds the whole row (BLOCK_V = next_power_of_2(V)): the step as gated_delta_step's
(``step_update``), then on its output rounded to v.dtype, as the model rounds it,
    n = rms_norm(out) in the norm's form;  y = (f32(n) * silu(f32(z))).to(v.dtype)
stored where the step's output would be: 1 launch. Under that bound the step keeps its own narrow
tiles (4-8x the programs of whole rows at batch 1) and ``_gated_rms_norm_kernel`` normalises its
output rows: still 2 launches, and the same math.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from fusion_passes.lowering.common.norm_triton import scale_by_weight
from fusion_passes.lowering.common.rows import launch_config
from fusion_passes.lowering.gated_delta_step.reference import check_gated_delta_step_norm_args
from fusion_passes.lowering.gated_delta_step.triton import gated_delta_step_triton, step_args, step_inputs, step_update


@triton.jit
def _gate_row(o, z_ptrs, w_ptrs, mask, norm_eps, weight_offset, V: tl.constexpr, dtype,
              CAST_BEFORE_WEIGHT: tl.constexpr):  # fmt: skip
    """y = (f32(rms_norm(o)) * silu(f32(z))) in fp32, for rows o [R, BLOCK_V] (fp32 values of
    v.dtype, 0 where masked): Qwen3_5RMSNormGated's rounding, rounded to ``dtype`` by the caller."""
    norm_eps = tl.cast(norm_eps, tl.float32)  # Inductor passes Python floats as fp64
    weight_offset = tl.cast(weight_offset, tl.float32)
    w = tl.load(w_ptrs, mask=mask, other=0.0).to(tl.float32)
    z = tl.load(z_ptrs, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(o * o, axis=1) / V + norm_eps)
    n = scale_by_weight(o * rstd[:, None], w, weight_offset, dtype, CAST_BEFORE_WEIGHT).to(dtype).to(tl.float32)
    # silu as eager computes it in fp32, x / (1 + exp(-x))
    return n * (z / (1.0 + tl.exp(-z)))


@triton.jit
def _gated_delta_step_norm_kernel(
    q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, state_ptr, out_ptr,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh, stride_ab, stride_ah, stride_bb, stride_bh,
    scale, l2norm_eps,
    z_ptr,  # *v.dtype [B * HV, V] (row stride stride_z, unit column stride)
    w_ptr,  # *norm_weight.dtype [V]
    stride_z, norm_eps, weight_offset,
    HV: tl.constexpr, GROUP: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,  # next_power_of_2(V): the whole row
    DIVIDE_SCALE: tl.constexpr, QK_L2NORM: tl.constexpr, CAST_BEFORE_WEIGHT: tl.constexpr,
):  # fmt: skip
    """A program per (sequence, value head): the step on its whole state, then the gated norm of
    its output row, stored in out [B * HV, V]."""
    pid = tl.program_id(0)
    b, h = (pid // HV).to(tl.int64), pid % HV
    out = step_update(
        b, h, 0, q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, state_ptr,
        stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh, stride_ab, stride_ah, stride_bb, stride_bh,
        scale, l2norm_eps, HV, GROUP, K, V, BLOCK_K, BLOCK_V, DIVIDE_SCALE, QK_L2NORM,
    )  # fmt: skip
    dtype = out_ptr.dtype.element_ty
    vs = tl.arange(0, BLOCK_V)
    vm = vs < V
    row = b * HV + h
    o = tl.where(vm, out.to(dtype).to(tl.float32), 0.0)[None, :]  # the model's rounding of the output
    y = _gate_row(o, z_ptr + row * stride_z + vs[None, :], w_ptr + vs[None, :], vm[None, :], norm_eps,
                  weight_offset, V, dtype, CAST_BEFORE_WEIGHT)  # fmt: skip
    tl.store(out_ptr + row * V + vs[None, :], y.to(dtype), mask=vm[None, :])


@triton.jit
def _gated_rms_norm_kernel(
    x_ptr,  # *v.dtype [M, V] contiguous: the step's output rows
    z_ptr, w_ptr,
    y_ptr,  # *v.dtype [M, V] contiguous
    M, stride_z, norm_eps, weight_offset,
    V: tl.constexpr, BLOCK_V: tl.constexpr, ROWS: tl.constexpr, CAST_BEFORE_WEIGHT: tl.constexpr,
):  # fmt: skip
    """ROWS rows a program: y = the gated norm of x's rows."""
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)[:, None]
    vs = tl.arange(0, BLOCK_V)[None, :]
    mask = (rows < M) & (vs < V)
    dtype = x_ptr.dtype.element_ty
    o = tl.load(x_ptr + rows * V + vs, mask=mask, other=0.0).to(tl.float32)
    y = _gate_row(o, z_ptr + rows * stride_z + vs, w_ptr + vs + 0 * rows, mask, norm_eps, weight_offset, V, dtype,
                  CAST_BEFORE_WEIGHT)  # fmt: skip
    tl.store(y_ptr + rows * V + vs, y.to(dtype), mask=mask)


def _epilogue(device: torch.device, pairs: int) -> tuple[bool, int]:
    """(whole rows with the norm in the step's launch, its warps) from GATED_DELTA_STEP_NORM."""
    from fusion_passes.lowering.common.launch_policy import select
    from fusion_passes.lowering.launch_tables import GATED_DELTA_STEP_NORM

    rule = select(GATED_DELTA_STEP_NORM, device)
    return pairs >= rule.epilogue_from, rule.warps


def gated_delta_step_norm_triton(
    q, k, v, a, b, A_log, dt_bias, state, z, norm_weight, scale, divide_scale, qk_l2norm, l2norm_eps,
    norm_eps, weight_offset, cast_before_weight, *, wrap: Callable | None = None, epilogue: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y [B * HV, V], new_state) as ``gated_delta_step_norm_reference``; the state in place with
    ``wrap`` as gated_delta_step_triton's. ``epilogue``: the launch form, overriding the table's
    (the tests' and the benchmark's)."""
    check_gated_delta_step_norm_args(q, k, v, a, b, A_log, dt_bias, state, z, norm_weight, weight_offset,
                                     cast_before_weight)  # fmt: skip
    bsz, _, hk, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    if z.stride(-1) != 1:
        z = z.contiguous()
    norm_weight = norm_weight.contiguous()
    table_epilogue, warps = _epilogue(v.device, bsz * hv)
    if not (table_epilogue if epilogue is None else epilogue):
        out, state = gated_delta_step_triton(q, k, v, a, b, A_log, dt_bias, state, scale, divide_scale, qk_l2norm,
                                             l2norm_eps, wrap=wrap)  # fmt: skip
        y = torch.empty((bsz * hv, dv), dtype=v.dtype, device=v.device)
        block_v, rows, norm_warps = launch_config(dv)
        kernel = wrap(_gated_rms_norm_kernel) if wrap is not None else _gated_rms_norm_kernel
        kernel[(triton.cdiv(bsz * hv, rows),)](
            out, z, norm_weight, y, bsz * hv, z.stride(0), norm_eps, weight_offset,
            V=dv, BLOCK_V=block_v, ROWS=rows, CAST_BEFORE_WEIGHT=cast_before_weight, num_warps=norm_warps,
        )  # fmt: skip
        return y, state
    q, k, v, state = step_inputs(q, k, v, state, in_place=wrap is not None)
    out = torch.empty((bsz * hv, dv), dtype=v.dtype, device=v.device)
    kernel = wrap(_gated_delta_step_norm_kernel) if wrap is not None else _gated_delta_step_norm_kernel
    kernel[(bsz * hv,)](
        *step_args(q, k, v, a, b, A_log, dt_bias, state, out, scale, l2norm_eps),
        z, norm_weight, z.stride(0), norm_eps, weight_offset,
        HV=hv, GROUP=hv // hk, K=dk, V=dv, BLOCK_K=triton.next_power_of_2(dk), BLOCK_V=triton.next_power_of_2(dv),
        DIVIDE_SCALE=divide_scale, QK_L2NORM=qk_l2norm, CAST_BEFORE_WEIGHT=cast_before_weight, num_warps=warps,
    )  # fmt: skip
    return out, state
