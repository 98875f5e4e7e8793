"""One-shot allreduce + (residual add +) RMSNorm over ``torch.distributed._symmetric_memory``: the
CUDA kernel of ``fusion_passes::allreduce_add_rms_norm`` / ``allreduce_rms_norm`` for a group
whose GPUs can address each other's memory.

Unfused (the NCCL fallback in allreduce_rms_norm/op.py: two launches, a round trip through HBM):
    s = all_reduce(x, "sum")                       NCCL kernel; s written to HBM
    r = to_dtype(f32(s) + f32(residual))            add form (the fused norm kernel reads s back)
    y = rms_norm(r)                                 in the rounding form the two flags select
Fused (one launch, ``_one_shot_allreduce_add_rms_norm_kernel``): every rank copies its rows of x
into its own symmetric buffer, the ranks meet at a barrier (per program), then every rank reads the
rows from every rank's buffer and computes, in registers:
    s = to_dtype(sum over ranks 0..W-1, in that order, of f32(x_rank))
    r = to_dtype(f32(s) + f32(residual))            add form; stored as new_residual
    n = f32(r) * rsqrt(sum(f32(r)^2) / N + eps)
    y = to_dtype(f32(to_dtype(n)) * f32(weight))                     Llama form
    y = to_dtype(n * (f32(weight) + weight_offset))                  fp32-weight form
    returns (y, r), or (y, s) for allreduce_rms_norm
All rounding is where allreduce_add_rms_norm_reference rounds (``scale_by_weight`` is shared with
rms_norm_triton). Every rank sums the same values in the same order, so every rank's outputs are
bit-identical (the hard requirement: the ranks' residual streams must never drift apart). NCCL sums
in its own order (ring/tree, per-step rounding to the dtype for W > 2), so the fused op equals
"NCCL + reference" only within one rounding of the dtype of the sum (for W = 2 both are one
rounding of the exact x_0 + x_1, so the sums should agree bit for bit; the GPU test reports it).

One-shot means each rank reads all W buffers: (W - 1) * M * N elements over NVLink per rank,
against the ring's 2 * (W - 1) / W * M * N: the same bytes at W = 2, where it is faster at every
size measured (two H200: 2.4x NCCL + Inductor at 1 token, 1.38x at 16384 tokens of hidden 7168,
see BENCHMARKS.md), and up to 2x the bytes at W = 8. The workspace holds MAX_ROWS rows (a memory
bound, not a switch point); more rows run as several launches of MAX_ROWS rows each at W <=
CHUNKED_MAX_WORLD_SIZE, and take the NCCL fallback in larger groups (not measured: one host here
has two GPUs).

Workspace (per group, device, dtype, hidden; created once, outside CUDA-graph capture):
    buffer  symmetric [2, MAX_ROWS, hidden] (x.dtype): two halves, alternated per use (below)
    epochs  int32 [max_programs], zeros: how many times each program index has run
    peers   int64 [W] addresses of every rank's buffer, signals int64 [W] of every signal pad

Synchronisation, per program b (the same b on every rank works on the same rows):
    1. e = atomic_add(epochs[b], 1); half p = e & 1. Each program counts its own uses, so every
       rank's program b picks the same half without host state (CUDA-graph replay safe).
    2. copy its rows of x into its own buffer, half p;
    3. barrier: send = spin CAS 0 -> 1 on every peer's signal pad at [b, my_rank] (release, system
       scope), wait = spin CAS 1 -> 0 on its own pad at [b, peer] for every peer (acquire, system
       scope). The pad returns to zero by itself, so repeated calls and graph replays need no reset,
       and a CAS that finds the slot still 1 (the peer has not consumed the previous use's signal)
       retries: each slot is a one-bit semaphore, consumed in order, so the k-th wait on a slot
       always takes the k-th signal sent to it (all ranks run the same sequence of calls);
    4. sum the W buffers' half p in fp32, rank order, then add + norm as above.
    No closing barrier: the halves alternate instead. Rank q writes its half p again at use e + 2
    of program b; that kernel starts after q's kernel of use e + 1 finished, in which q's program b
    passed the barrier, which needed my program b's signal of use e + 1, which my stream issued
    only after my kernel of use e (the one that read q's half p) had completed. This holds per
    program index because a buffer region belongs to one program index (see below).
    With the pooled allocator of newer torch, other symmetric tensors of the same pool segment
    (torch's own symm_mem ops) may share the signal pad; that is safe: they use the same
    self-resetting CAS protocol on the same [block, rank] slots, and every rank runs the same
    sequence of kernels, so the k-th signal on a slot still meets the k-th wait.

Deviations from the brief, and why:
  - Programs are capped at ``max_programs`` (min over ranks of 2 per SM, and what the signal pad
    holds: get_signal_pad_size() / 4 / W slots). The pad is 2048 bytes in older torch (512 slots:
    256 programs at W=2, 64 at W=8), 9216 in newer; one program per block of rows would need 2048
    programs at hidden 7168 and MAX_ROWS 2048. Row block i is always handled by program
    i % max_programs (grid = min(blocks, max_programs), a grid-stride loop), so a buffer region is
    only ever touched by one program index and the per-program epoch argument above holds for any
    mix of row counts. A program copies all of its blocks in, meets the barrier once, then reduces
    them.
  - The kernel reads peer addresses from its own int64 tensor (``hdl.buffer_ptrs`` + the
    workspace's offset) rather than ``buffer_ptrs_dev``: newer torch allocates ``symm_mem.empty``
    tensors from a pool, and ``buffer_ptrs`` are then the bases of the pool's allocation, not of the
    tensor (the handle's offset is not applied; ``get_buffer`` does not add it either). The offset
    is measured (data_ptr - buffer_ptrs[rank]) and checked equal on every rank.
  - The barrier uses ``tl.atomic_cas(..., sem, scope="sys")`` on a scalar pointer, not inline PTX:
    Triton executes a scalar atomic in exactly one thread of the program and broadcasts its result
    to all threads (through shared memory), so ``while atomic_cas(...) != v`` spins uniformly, with
    no thread-id tricks or layout assumptions; the emitted instruction is the
    ``atom.global.{release,acquire}.sys.cas.b32`` of the recipe. ``tl.debug_barrier()`` before the
    send orders the program's copy-in stores (all threads) before thread 0's release; the one after
    the wait orders every thread's peer loads after thread 0's acquire (bar.sync has membar.cta
    semantics). The epoch is a scalar ``atomic_add`` for the same reason (a load then a store would
    race between warps of the program).
  - A rank does not signal itself (its own copy-in is ordered by ``tl.debug_barrier()``).

Liveness: a program spins until its partners on the other ranks arrive. If more programs than fit
on the GPU at once are launched, progress relies on the hardware dispatching programs in index
order (then the lowest waiting program's partners are always resident), the same assumption CUB's
single-pass decoupled look-back scan makes; the cap of 2 per SM keeps the grid within one wave for
the usual launch configs. Calls must be stream-ordered on each rank, like NCCL's (one stream, or
graph replays on one stream); a rank that never calls hangs its peers, as in a NCCL collective.

No multicast / multimem instruction is used: plain loads and stores over NVLink P2P.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from fusion_passes.lowering.allreduce_rms_norm.reference import check_allreduce_rms_norm_args
from fusion_passes.lowering.rms_norm.reference import RMSNormForm
from fusion_passes.lowering.common.fast_launch import FastLauncher, specialization_key
from fusion_passes.lowering.common.norm_triton import scale_by_weight
from fusion_passes.lowering.common.symm_mem import (  # noqa: F401  (the op's callers' names)
    CHUNKED_MAX_WORLD_SIZE,
    MAX_ROWS,
    MAX_WORLD_SIZE,
    GroupInfo,
    Workspace,
    caller_rows,
    one_shot_barrier,
    one_shot_copy_in,
    one_shot_half_offset,
    one_shot_peer_buffer,
    one_shot_sum,
    prepare_workspace,
    require_eligible,
    symm_mem_eligible,
    workspaces,
)


@triton.jit(do_not_specialize=["rank", "M"])
def _one_shot_allreduce_add_rms_norm_kernel(
    x_ptr,  # *dtype [M, N]: this rank's partial sums; column stride 1, row stride stride_x
    residual_ptr,  # *dtype [M, N]: residual added to the sum (read only when HAS_RESIDUAL)
    weight_ptr,  # *weight.dtype [N]: per-column scale
    out_ptr,  # *dtype [M, N] contiguous: the normalised, scaled rows y
    sum_out_ptr,  # *dtype [M, N] contiguous: r = s + residual (HAS_RESIDUAL), else the sum s
    peer_buffers_ptr,  # *int64 [WORLD]: address of every rank's workspace buffer [2, max_rows, N]
    peer_signals_ptr,  # *int64 [WORLD]: address of every rank's uint32 signal pad
    epochs_ptr,  # *int32 [>= grid]: uses of each program index so far (the same on every rank)
    rank,  # this rank's index in the group
    M,  # rows (tokens), <= max_rows
    N,  # row length (hidden size)
    stride_x,  # elements between consecutive rows of x
    stride_residual,  # elements between consecutive rows of residual
    max_rows,  # rows of one half of the workspace buffer
    eps,  # added to mean(r^2) before the rsqrt
    weight_offset,  # added to f32(weight) in the fp32-weight form, else 0.0
    WORLD: tl.constexpr,  # ranks in the group: the reduction is a static loop over them
    HAS_RESIDUAL: tl.constexpr,  # add residual to the sum (allreduce_add_rms_norm)
    CAST_BEFORE_WEIGHT: tl.constexpr,  # Llama form: round n to dtype before scaling by weight
    BLOCK_N: tl.constexpr,  # next_power_of_2(N): one block holds a whole row
    ROWS_PER_PROGRAM: tl.constexpr,  # rows in one block of rows
):
    # Pin the scalars to fp32 (Inductor passes Python floats as fp64), as rms_norm_triton does.
    eps = tl.cast(eps, tl.float32)
    weight_offset = tl.cast(weight_offset, tl.float32)
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    dtype = out_ptr.dtype.element_ty

    half_offset = one_shot_half_offset(epochs_ptr, pid, max_rows, N)
    my_buffer = one_shot_peer_buffer(peer_buffers_ptr, rank, dtype)
    one_shot_copy_in(
        x_ptr, stride_x, my_buffer, half_offset, pid, num_programs, M, N, BLOCK_N, ROWS_PER_PROGRAM
    )
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < N
    # The weight does not depend on the peers: load it before the barrier, off the critical path.
    w = tl.load(weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    one_shot_barrier(peer_signals_ptr, rank, pid, WORLD)

    # 4. Reduce in rank order, round, add, normalise.
    for block in range(pid, tl.cdiv(M, ROWS_PER_PROGRAM), num_programs):
        rows = block * ROWS_PER_PROGRAM + tl.arange(0, ROWS_PER_PROGRAM)
        mask = (rows < M)[:, None] & col_mask[None, :]
        rows = rows.to(tl.int64)[:, None]
        r = one_shot_sum(peer_buffers_ptr, half_offset + rows * N + cols[None, :], mask, WORLD, dtype)
        if HAS_RESIDUAL:
            residual = tl.load(
                residual_ptr + rows * stride_residual + cols[None, :], mask=mask, other=0.0
            ).to(tl.float32)
            # The model adds in the dtype: one rounding of the fp32 sum.
            r = (r.to(tl.float32) + residual).to(dtype)
        tl.store(sum_out_ptr + rows * N + cols[None, :], r, mask=mask)
        r = r.to(tl.float32)
        # Masked columns hold 0: they add nothing; divide by the true N.
        rstd = tl.rsqrt(tl.sum(r * r, axis=1) / N + eps)
        y = scale_by_weight(r * rstd[:, None], w, weight_offset, dtype, CAST_BEFORE_WEIGHT)
        tl.store(out_ptr + rows * N + cols[None, :], y.to(dtype), mask=mask)


# Every call of the op launches this kernel: the launch's host time counts (see fast_launch).
_launch_one_shot = FastLauncher(_one_shot_allreduce_add_rms_norm_kernel)


def launch_eligible(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, norm: RMSNormForm, group_name: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """The launch behind both ops, for a caller that has checked the arguments and got None from
    ``symm_mem_eligible(x, group_name)`` (the CUDA kernels of the ops): returns (normed, r) with r
    the new residual (residual given) or the reduced sum (residual None)."""
    n = x.shape[-1]
    workspace = workspaces[(group_name, x.device.index, x.dtype, n)]
    weight = weight.contiguous()  # read at unit stride
    x_rows, stride_x, residual_rows, stride_residual = caller_rows(x, residual)
    m = x.numel() // n
    # empty_like takes half the host time of empty(shape, dtype=, device=) (1.1 against 2.4 us on
    # a CPU host: no parsing of shape, dtype and device); contiguous_format: the fake kernel's strides.
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    sum_out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if m == 0:  # every rank has no rows: nothing to exchange
        return out, sum_out
    launch = (workspace, weight, *norm, residual is not None)
    capacity = workspace.buffer.shape[1]
    # Triton launches on the current device: switch only when x is elsewhere (it costs host time).
    switch = x.device.index != torch.cuda.current_device()
    with torch.cuda.device(x.device) if switch else contextlib.nullcontext():
        if m <= capacity:
            _launch_rows(*launch, x_rows, stride_x, residual_rows, stride_residual, out, sum_out, m)
            return out, sum_out
        # Beyond one workspace half (symm_mem_eligible(chunked=True) allowed it): launches of
        # `capacity` rows, each a complete use of the protocol, in the same order on every rank.
        x_rows, residual_rows = x_rows.view(-1, n), residual_rows.view(-1, n)
        out_rows, sum_rows = out.view(-1, n), sum_out.view(-1, n)
        for start in range(0, m, capacity):
            stop = min(start + capacity, m)
            _launch_rows(
                *launch,
                x_rows[start:stop],
                stride_x,
                residual_rows[start:stop],
                stride_residual,
                out_rows[start:stop],
                sum_rows[start:stop],
                stop - start,
            )
    return out, sum_out


def _launch_rows(
    workspace: Workspace,
    weight: torch.Tensor,
    eps: float,
    weight_offset: float,
    cast_before_weight: bool,
    has_residual: bool,
    x_rows: torch.Tensor,
    stride_x: int,
    residual_rows: torch.Tensor,
    stride_residual: int,
    out: torch.Tensor,
    sum_out: torch.Tensor,
    m: int,
) -> None:
    """One launch of the kernel over m <= workspace rows (out and sum_out: contiguous rows)."""
    block_n, rows_per_program, num_warps = workspace.launch
    grid = min(triton.cdiv(m, rows_per_program), workspace.info.max_programs)
    # What can change between calls on one workspace and decides Triton's specialization: the
    # alignment of the pointers (x, residual and weight are the caller's; out and sum_out too when
    # chunked), the row strides, the weight's dtype and the two flags. The rest (workspace tensors,
    # rank, N, max_rows, WORLD, block shape) is fixed per workspace; M is not specialized (< 2^31).
    key = specialization_key(
        (x_rows, residual_rows, weight, out, sum_out),
        (stride_x, stride_residual),
        id(workspace),
        weight.dtype,
        has_residual,
        cast_before_weight,
    )
    _launch_one_shot(
        grid,
        (
            x_rows,
            residual_rows,
            weight,
            out,
            sum_out,
            workspace.peer_buffers,
            workspace.peer_signals,
            workspace.epochs,
            workspace.info.rank,
            m,
            workspace.buffer.shape[2],  # N
            stride_x,
            stride_residual,
            workspace.buffer.shape[1],  # max_rows: the rows of one half
            eps,
            weight_offset,
            workspace.info.world_size,  # WORLD
            has_residual,  # HAS_RESIDUAL
            cast_before_weight,  # CAST_BEFORE_WEIGHT
            block_n,  # BLOCK_N
            rows_per_program,  # ROWS_PER_PROGRAM
        ),
        num_warps,
        key,
    )


def one_shot(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, norm: RMSNormForm, group_name: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """The one-shot kernel on its own (no fallback): (rms_norm(r), r) with r = s + residual, or
    r = s without one, s = sum of x over the group. Raises ValueError for arguments the ops do
    not define, RuntimeError when ``symm_mem_eligible(x, group_name)`` gives a reason."""
    check_allreduce_rms_norm_args(x, weight, norm, residual)
    require_eligible(x, group_name)
    return launch_eligible(x, residual, weight, norm, group_name)
