"""One-shot allreduce + (residual add +) RMSNorm + FP8 quantization over symmetric memory: the CUDA
kernel of ``fusion_passes::allreduce_add_rms_norm_quant_fp8`` / ``allreduce_rms_norm_quant_fp8``.

Unfused (the NCCL fallback in allreduce_rms_norm_quant_fp8/op.py: two launches, s through HBM):
    s = all_reduce(x, "sum")                                NCCL kernel; s written to HBM
    q, scales, r = the norm + quantization kernel of rms_norm_quant_fp8_triton, reading s back
Fused (one launch, ``_one_shot_allreduce_add_rms_norm_quant_fp8_kernel``): the protocol of
allreduce_rms_norm/symm_mem.py (copy-in, per-program barrier, rank-order fp32 sum: its
@triton.jit helpers, not a copy), then the epilogue of rms_norm_quant_fp8_triton, in registers:
    s   = to_dtype(sum over ranks 0..W-1, in that order, of f32(x_rank))
    r   = to_dtype(f32(s) + f32(residual))              add form; stored (new_residual), else s
    n   = f32(r) * rsqrt(sum(f32(r)^2) / N + eps)
    y   = to_dtype(f32(to_dtype(n)) * f32(weight))                   Llama form
    y   = to_dtype(n * (f32(weight) + weight_offset))                fp32-weight form
    scale = the given one (static), or max(amax(|f32(y)|) * fp32(1/448), MIN_SCALE) per row
            (per_token) or per group of G columns (per_group), rounded up to a power of two under
            scale_ue8m0 (CUDA torch computes amax / 448 as a multiply by the fp32 reciprocal)
    q   = fp8_e4m3fn(clamp(f32(y) / scale, -448, 448))             round to nearest even
    returns (q, scales, r), or (q, scales, s) with no residual
All rounding is where allreduce_add_rms_norm_quant_fp8's reference rounds (``scale_by_weight`` and
``store_quantized`` are the very helpers of the single-GPU kernels). Every rank sums the same
values in the same order, so codes, scales and r are bit-identical on every rank. At W = 2 the sum
equals NCCL's bit for bit (both are one rounding of x_0 + x_1), and the rest is the fallback
kernel's code on the same block layout and warps: the one-shot and fallback paths are expected to
agree bit for bit (the GPU test measures it); against the torch reference the codes agree within
one fp8 code (its sum of squares runs in another order, as for the single-GPU kernel).

Block layout: the reduction loop holds rows as [ROWS, GROUPS, GROUP] blocks, rms_norm_quant_fp8's
layout (a per_group row is GROUPS = N / G groups of G columns, a per_token or static row one group
of N columns), so one reduction over the last axis gives a group's or a row's amax alike; the sum
for the block comes from ``one_shot_sum`` with 3-D offsets into the buffer half, whose row stride
is N. The copy-in stays 2-D ([ROWS, next_power_of_2(N)], ``one_shot_copy_in``).

Workspace: allreduce_rms_norm/symm_mem.py's, the same object (``workspaces[(group_name, device
index, dtype, hidden)]``: buffer halves, per-program epochs, peer addresses). Sharing it with the
non-quantizing kernel is safe only because both map rows to programs alike: its protocol argument
needs every buffer region to belong to one program index for any mix of calls. Row block i
(ROWS_PER_PROGRAM rows) is always handled by program i % max_programs, so ROWS_PER_PROGRAM is the
non-quantizing kernel's, the workspace's ``launch`` (``launch_config(N)``), whatever the quant
layout: for a group size that is not a power of two the padded [GROUPS, GROUP] block is up to ~2x
wider than next_power_of_2(N), the same rows, only more registers. The number of warps is
rms_norm_quant_fp8_triton's (``launch_shape``: ``launch_config`` of the padded block at every row
count this kernel takes), so the norm's reduction tree is the fallback kernel's. One exception:
without a residual, from the launch table's ``norm_only_many_tokens`` (512 on an H200) rows, the
fallback kernel holds a row in exact chunks at 4 warps (another summation order: a code apart now and then), so there this kernel
equals that kernel's padded launch (``chunks=1`` and the default warps), not its default one.

Liveness, CUDA-graph safety and the barrier are as allreduce_rms_norm/symm_mem.py's docstring
states them: same helpers, same grid (min(blocks, max_programs), grid-stride loop). Rows beyond
one workspace half (MAX_ROWS) take the NCCL fallback (``symm_mem_eligible`` without ``chunked``).
The launch goes through ``fast_launch.FastLauncher`` (the op is a dispatcher call on every step,
so its host time counts). No multicast / multimem instruction is used.
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch
import triton
import triton.language as tl

from fusion_passes.lowering.allreduce_rms_norm_quant_fp8.reference import (
    check_allreduce_rms_norm_quant_fp8_args,
)
from fusion_passes.lowering.allreduce_rms_norm.symm_mem import (
    caller_rows,
    Workspace,
    workspaces,
    one_shot_barrier,
    one_shot_copy_in,
    one_shot_half_offset,
    one_shot_peer_buffer,
    one_shot_sum,
    require_eligible,
)
from fusion_passes.lowering.common.fast_launch import FastLauncher, specialization_key
from fusion_passes.lowering.common.fp8 import FP8_DTYPE, MIN_SCALE, QuantFP8
from fusion_passes.lowering.rms_norm.reference import RMSNormForm
from fusion_passes.lowering.common.fp8_triton import load_static_scale
from fusion_passes.lowering.rms_norm_quant_fp8.launch import launch_shape
from fusion_passes.lowering.rms_norm_quant_fp8.triton import rms_norm_quantize_block


# M and rank are not specialised (Triton would make a value of 1 a constant): every rank then runs
# the very same binary, so the reduction's code, and its rounding, cannot differ between ranks.
@triton.jit(do_not_specialize=["rank", "M"])
def _one_shot_allreduce_add_rms_norm_quant_fp8_kernel(
    x_ptr,  # *dtype [M, N]: this rank's partial sums; column stride 1, row stride stride_x
    residual_ptr,  # *dtype [M, N]: residual added to the sum (read only when HAS_RESIDUAL)
    weight_ptr,  # *weight.dtype [N]: per-column scale of the norm
    q_ptr,  # *uint8 [M, N] contiguous: the float8_e4m3fn bit patterns (the fp8 output views them)
    scale_ptr,  # *fp32: STATIC: the given scale (1 element, read); else [M, num_groups], written
    sum_out_ptr,  # *dtype [M, N] contiguous: r = s + residual (HAS_RESIDUAL), else the sum s
    peer_buffers_ptr,  # *int64 [WORLD]: address of every rank's workspace buffer [2, max_rows, N]
    peer_signals_ptr,  # *int64 [WORLD]: address of every rank's uint32 signal pad
    epochs_ptr,  # *int32 [>= grid]: uses of each program index so far (the same on every rank)
    rank,  # this rank's index in the group
    M,  # rows (tokens), <= max_rows
    N,  # row length (hidden size)
    num_groups,  # groups a row is quantized in: N / group_size (per_group), else 1
    group_size,  # columns of a group: G (per_group), else N
    stride_x,  # elements between consecutive rows of x
    stride_residual,  # elements between consecutive rows of residual
    max_rows,  # rows of one half of the workspace buffer
    eps,  # added to mean(r^2) before the rsqrt
    weight_offset,  # added to f32(weight) in the fp32-weight form, else 0.0
    WORLD: tl.constexpr,  # ranks in the group: the reduction is a static loop over them
    HAS_RESIDUAL: tl.constexpr,  # add residual to the sum (allreduce_add_rms_norm_quant_fp8)
    CAST_BEFORE_WEIGHT: tl.constexpr,  # Llama form: round n to dtype before scaling by weight
    STATIC: tl.constexpr,  # the scale is given (static scheme); else computed per group, stored
    SCALE_UE8M0: tl.constexpr,  # round computed scales up to powers of two
    AMAX_TIMES_RECIPROCAL: tl.constexpr,  # scale = amax * fp32(1/448) (CUDA torch), else amax / 448
    HW_FP8_CONVERT: tl.constexpr,  # convert with the GPU's fp8 instruction (not in the interpreter)
    BLOCK_N: tl.constexpr,  # next_power_of_2(N): the copy-in's row block
    BLOCK_GROUPS: tl.constexpr,  # next_power_of_2(num_groups)
    BLOCK_GROUP: tl.constexpr,  # next_power_of_2(group_size)
    ROWS_PER_PROGRAM: tl.constexpr,  # rows in one block of rows: launch_config(N)'s (see above)
):
    # Pin the scalars to fp32 (Inductor passes Python floats as fp64), as rms_norm_triton does.
    eps = tl.cast(eps, tl.float32)
    weight_offset = tl.cast(weight_offset, tl.float32)
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    dtype = sum_out_ptr.dtype.element_ty

    half_offset = one_shot_half_offset(epochs_ptr, pid, max_rows, N)
    my_buffer = one_shot_peer_buffer(peer_buffers_ptr, rank, dtype)
    one_shot_copy_in(
        x_ptr, stride_x, my_buffer, half_offset, pid, num_programs, M, N, BLOCK_N, ROWS_PER_PROGRAM
    )
    groups = tl.arange(0, BLOCK_GROUPS)
    in_group = tl.arange(0, BLOCK_GROUP)
    cols = (groups[:, None] * group_size + in_group[None, :])[None, :, :]  # [1, GROUPS, GROUP]
    col_mask = ((groups < num_groups)[:, None] & (in_group < group_size)[None, :])[None, :, :]
    # The weight and a static scale do not depend on the peers: load them before the barrier.
    w = tl.load(weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    given = load_static_scale(scale_ptr, STATIC)
    one_shot_barrier(peer_signals_ptr, rank, pid, WORLD)

    # Reduce in rank order, round, add, normalise, quantize: the same row blocks the copy-in wrote.
    for block in range(pid, tl.cdiv(M, ROWS_PER_PROGRAM), num_programs):
        rows = block * ROWS_PER_PROGRAM + tl.arange(0, ROWS_PER_PROGRAM)
        group_mask = (rows < M)[:, None] & (groups < num_groups)[None, :]  # [ROWS, GROUPS]
        mask = group_mask[:, :, None] & col_mask
        rows = rows.to(tl.int64)
        rows_3d = rows[:, None, None]
        r = one_shot_sum(peer_buffers_ptr, half_offset + rows_3d * N + cols, mask, WORLD, dtype)
        if HAS_RESIDUAL:
            residual_ptrs = residual_ptr + rows_3d * stride_residual + cols
            residual = tl.load(residual_ptrs, mask=mask, other=0.0).to(tl.float32)
            # The model adds in the dtype: one rounding of the fp32 sum.
            r = (r.to(tl.float32) + residual).to(dtype)
        tl.store(sum_out_ptr + rows_3d * N + cols, r, mask=mask)
        rms_norm_quantize_block(
            r.to(tl.float32), w, eps, weight_offset, q_ptr, scale_ptr, given, rows, groups, rows_3d, cols,
            N, num_groups, group_mask, mask, dtype, ROWS_PER_PROGRAM, BLOCK_GROUPS,
            CAST_BEFORE_WEIGHT, STATIC, SCALE_UE8M0, AMAX_TIMES_RECIPROCAL, HW_FP8_CONVERT,
            _MIN_SCALE, 0,  # QuantFP8's default floor and form: the only one these ops take
        )  # fmt: skip


# Every call of the op launches this kernel: the launch's host time counts (see fast_launch).
_MIN_SCALE = tl.constexpr(MIN_SCALE)
_launch_one_shot = FastLauncher(_one_shot_allreduce_add_rms_norm_quant_fp8_kernel)
# The GPU's fp8 conversion instruction, except under the interpreter (rms_norm_quant_fp8_triton's
# rule; the environment is read once, as triton reads it at import).
_HW_FP8_CONVERT = os.environ.get("TRITON_INTERPRET") != "1"


@functools.lru_cache(maxsize=None)
def _quant_layout(num_groups: int, group: int) -> tuple[int, int, int]:
    """(BLOCK_GROUPS, BLOCK_GROUP, num_warps) of rows quantized in num_groups groups of group
    columns: rms_norm_quant_fp8_triton's layout and warps, so the norm's reduction is its tree (at
    every row count this kernel takes: <= MAX_ROWS, below MANY_TOKENS)."""
    block_groups, block_group, _, num_warps = launch_shape(num_groups, group)
    return block_groups, block_group, num_warps


def launch_on_workspace(
    workspace: Workspace,
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    norm: RMSNormForm,
    quant: QuantFP8,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the kernel on ``workspace`` (the group's, see launch_eligible) for checked arguments:
    returns (codes, scales, r): codes a new fp8 tensor of x's shape; scales the given scale
    (static) or new fp32 [..., 1] / [..., N / group_size]; r the new residual (residual given) or
    the reduced sum (residual None), a new tensor of x's shape and dtype. A seam for the CPU test,
    which runs the kernel under the Triton interpreter on workspaces of CPU tensors."""
    eps, weight_offset, cast_before_weight = norm
    scheme, scale, _, scale_ue8m0 = quant[:4]
    n = x.shape[-1]
    num_groups, group = quant.groups(n)
    weight = weight.contiguous()  # read at unit stride
    x_rows, stride_x, residual_rows, stride_residual = caller_rows(x, residual)
    m = x.numel() // n
    # The kernel writes the codes as bytes (common/fp8_triton.py's _fp8_e4m3fn_codes).
    codes = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    scales = scale
    if scale is None:
        scales = torch.empty((*x.shape[:-1], num_groups), dtype=torch.float32, device=x.device)
    sum_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if m == 0:  # every rank has no rows: nothing to exchange
        return codes.view(FP8_DTYPE), scales, sum_out
    max_rows = workspace.buffer.shape[1]  # rows of one half: MAX_ROWS for a group's workspace
    if m > max_rows:  # symm_mem_eligible refuses these; a direct caller must not overrun the buffer
        raise ValueError(f"one-shot allreduce_add_rms_norm_quant_fp8: {m} rows > the workspace's {max_rows}")
    # The row blocks are the workspace's (the non-quantizing kernel's): see the module docstring.
    block_n, rows_per_program, _ = workspace.launch
    block_groups, block_group, num_warps = _quant_layout(num_groups, group)
    grid = min(triton.cdiv(m, rows_per_program), workspace.info.max_programs)
    # What can change between calls on one workspace and decides Triton's specialization: the
    # alignment of the caller's pointers and of the new outputs, the row strides, the weight's
    # dtype, the flags and the quant layout (scheme, group size). The rest (workspace tensors,
    # rank, N, max_rows, WORLD, the row blocks) is fixed per workspace; M is not specialized.
    key = specialization_key(
        (x_rows, residual_rows, weight, codes, scales, sum_out),
        (stride_x, stride_residual),
        id(workspace),
        weight.dtype,
        residual is not None,
        cast_before_weight,
        scheme,
        group,
        scale_ue8m0,
    )
    # Triton launches on the current device: switch only when x is elsewhere (it costs host time).
    switch = x.is_cuda and x.device.index != torch.cuda.current_device()
    with torch.cuda.device(x.device) if switch else contextlib.nullcontext():
        _launch_one_shot(
            grid,
            (
                x_rows,
                residual_rows,
                weight,
                codes,
                scales,
                sum_out,
                workspace.peer_buffers,
                workspace.peer_signals,
                workspace.epochs,
                workspace.info.rank,
                m,
                n,
                num_groups,
                group,
                stride_x,
                stride_residual,
                max_rows,
                eps,
                weight_offset,
                workspace.info.world_size,  # WORLD
                residual is not None,  # HAS_RESIDUAL
                cast_before_weight,  # CAST_BEFORE_WEIGHT
                scheme == "static",  # STATIC
                scale_ue8m0,  # SCALE_UE8M0
                x.is_cuda,  # AMAX_TIMES_RECIPROCAL: as torch divides on the device
                x.is_cuda and _HW_FP8_CONVERT,  # HW_FP8_CONVERT
                block_n,  # BLOCK_N
                block_groups,  # BLOCK_GROUPS
                block_group,  # BLOCK_GROUP
                rows_per_program,  # ROWS_PER_PROGRAM
            ),
            num_warps,
            key,
        )
    return codes.view(FP8_DTYPE), scales, sum_out


def launch_eligible(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    norm: RMSNormForm,
    quant: QuantFP8,
    group_name: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The launch behind both ops, for a caller that has checked the arguments and got None from
    ``symm_mem_eligible(x, group_name)`` (which made the workspace): see launch_on_workspace."""
    workspace = workspaces[(group_name, x.device.index, x.dtype, x.shape[-1])]
    return launch_on_workspace(workspace, x, residual, weight, norm, quant)


def one_shot(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    norm: RMSNormForm,
    quant: QuantFP8,
    group_name: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The one-shot kernel on its own (no fallback): (codes, scales, r) of the quantized
    rms_norm(r), r = s + residual or r = s without one, s = sum of x over the group (the static
    scheme's scales are the given tensor, not a copy). Raises ValueError for arguments the ops
    do not define, RuntimeError when ``symm_mem_eligible(x, group_name)`` gives a reason."""
    check_allreduce_rms_norm_quant_fp8_args(x, weight, norm, quant, residual)
    require_eligible(x, group_name, "allreduce_add_rms_norm_quant_fp8")
    return launch_eligible(x, residual, weight, norm, quant, group_name)
