"""One-shot allreduce + (residual add +) RMSNorm over ``torch.distributed._symmetric_memory``: the
CUDA kernel of ``fusion_passes::allreduce_add_rms_norm`` / ``allreduce_rms_norm`` for a group
whose GPUs can address each other's memory.

Unfused (the NCCL fallback in allreduce_add_rms_norm.py: two launches, a round trip through HBM):
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
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from fusion_passes.lowering.allreduce_rms_norm.reference import check_allreduce_rms_norm_args
from fusion_passes.lowering.common.fast_launch import FastLauncher, specialization_key
from fusion_passes.lowering.rms_norm.triton import as_rows, launch_config, scale_by_weight

try:  # torch >= 2.5 on every platform; absent from builds without distributed
    import torch.distributed._symmetric_memory as symm_mem
    from torch._C._distributed_c10d import _SymmetricMemory
except ImportError as error:  # pragma: no cover - depends on the torch build
    symm_mem = None
    _SymmetricMemory = None
    _SYMM_MEM_MISSING: str | None = f"symmetric memory unavailable in this torch ({error})"
else:
    _missing = [n for n in ("empty", "rendezvous") if not hasattr(symm_mem, n)]
    _missing += [n for n in ("buffer_ptrs", "signal_pad_ptrs") if not hasattr(_SymmetricMemory, n)]
    _SYMM_MEM_MISSING = (
        f"symmetric memory unavailable in this torch (no {', '.join(_missing)})" if _missing else None
    )

# Rows of one workspace half: its memory, 2 * MAX_ROWS * hidden elements per rank (58.7 MB at
# hidden 7168 in bf16). A call with more rows runs in launches of MAX_ROWS rows where the group has
# at most CHUNKED_MAX_WORLD_SIZE ranks, else takes the NCCL fallback.
MAX_ROWS = 2048
# Largest group that takes the one-shot kernel above MAX_ROWS rows (in chunks). Measured at W = 2
# (two H200, hidden 7168): faster than NCCL + Inductor at every size up to 16384 rows. Larger groups
# read (W - 1) / (2 (W - 1) / W) = W / 2 times the ring's bytes, and were not measured.
CHUNKED_MAX_WORLD_SIZE = 2
# Larger groups are not one NVLink domain on the machines this targets, and W partial rows per
# program would not fit in registers.
MAX_WORLD_SIZE = 8
# Programs per SM the grid may use: two 8-warp programs (hidden 4097..8192 at 8..16 warps, see
# rms_norm_triton.launch_config) usually fit on an SM at once, so the grid is one resident wave;
# where they do not, progress relies on in-order dispatch (see "Liveness" above).
_PROGRAMS_PER_SM = 2
# Signal pad bytes when torch does not say (the smallest any torch >= 2.5 allocates).
_MIN_SIGNAL_PAD_BYTES = 2048
_SIGNAL_BYTES = 4  # one uint32 slot per (program, peer)


@triton.jit
def one_shot_half_offset(epochs_ptr, pid, max_rows, N):
    """Step 1 of the protocol: count this program's use and return the element offset of the
    buffer half it works on (use parity). The same on every rank, since each rank's program pid
    has run exactly as often; no host state. A scalar atomic runs once per program and its old
    value reaches every thread."""
    epoch = tl.atomic_add(epochs_ptr + pid, 1, sem="relaxed", scope="gpu")
    # int64: 2 * max_rows * N passes 2^31 only for hidden > 512k, but keep every offset 64-bit.
    return (epoch & 1).to(tl.int64) * max_rows * N


@triton.jit
def one_shot_peer_buffer(peer_buffers_ptr, peer, dtype: tl.constexpr):
    """Rank ``peer``'s workspace buffer as a typed pointer. The workspace is granularity-aligned
    and its offset checked to be a multiple of 16 bytes on the host: tell Triton, or loads through
    an integer-made pointer are not vectorised."""
    return tl.multiple_of(tl.load(peer_buffers_ptr + peer).to(tl.pointer_type(dtype)), 16)


@triton.jit
def one_shot_copy_in(
    x_ptr, stride_x, my_buffer, half_offset, pid, num_programs, M, N,
    BLOCK_N: tl.constexpr, ROWS_PER_PROGRAM: tl.constexpr,
):  # fmt: skip
    """Step 2: copy this program's rows of x into this rank's buffer half. Row block i is always
    handled by program i % num_programs (num_programs is the fixed cap whenever blocks exceed it),
    so each buffer region has exactly one program index."""
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < N
    for block in range(pid, tl.cdiv(M, ROWS_PER_PROGRAM), num_programs):
        rows = block * ROWS_PER_PROGRAM + tl.arange(0, ROWS_PER_PROGRAM)
        mask = (rows < M)[:, None] & col_mask[None, :]
        rows = rows.to(tl.int64)[:, None]
        x = tl.load(x_ptr + rows * stride_x + cols[None, :], mask=mask)
        tl.store(my_buffer + half_offset + rows * N + cols[None, :], x, mask=mask)


@triton.jit
def one_shot_barrier(peer_signals_ptr, rank, pid, WORLD: tl.constexpr):
    """Step 3: meet program pid of every peer. All threads' stores before the call complete (CTA
    scope) before the one thread that runs the scalar atomics releases at system scope; every
    thread's loads after the call come after the acquire."""
    tl.debug_barrier()
    signal_slot = pid * WORLD  # this program's WORLD slots on every pad: [pid, sender]
    for peer in tl.static_range(WORLD):
        if peer != rank:
            peer_pad = tl.load(peer_signals_ptr + peer).to(tl.pointer_type(tl.int32))
            # Wait for the slot to be free (the peer consumed the previous use's signal), set it.
            while tl.atomic_cas(peer_pad + signal_slot + rank, 0, 1, sem="release", scope="sys") != 0:
                pass
    my_pad = tl.load(peer_signals_ptr + rank).to(tl.pointer_type(tl.int32))
    for peer in tl.static_range(WORLD):
        if peer != rank:
            # Consume the peer's signal (resetting the slot to 0): its copy-in is now visible.
            while tl.atomic_cas(my_pad + signal_slot + peer, 1, 0, sem="acquire", scope="sys") != 1:
                pass
    tl.debug_barrier()


@triton.jit
def one_shot_sum(peer_buffers_ptr, offsets, mask, WORLD: tl.constexpr, dtype: tl.constexpr):
    """Step 4's reduction: the elements at ``offsets`` (any block shape) of every rank's buffer,
    summed in fp32 in rank order (the same additions in the same order on every rank), then rounded
    to the dtype as the collective's result is. Masked elements are 0."""
    for peer in tl.static_range(WORLD):
        part = tl.load(
            one_shot_peer_buffer(peer_buffers_ptr, peer, dtype) + offsets, mask=mask, other=0.0
        ).to(tl.float32)
        if peer == 0:
            acc = part  # not 0 + part: keeps the sign of a -0.0 sum, as NCCL does
        else:
            acc = acc + part
    return acc.to(dtype)


# M and rank are not specialised (Triton would make a value of 1 a constant): every rank then runs
# the very same binary, so the reduction's code, and its rounding, cannot differ between ranks.
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


@dataclass
class GroupInfo:
    """What every rank of a group agreed on (one all_gather, at the first call)."""

    rank: int
    world_size: int
    max_programs: int  # the same on every rank: the grid must match program for program


@dataclass
class Workspace:
    buffer: torch.Tensor  # symmetric [2, MAX_ROWS, hidden]; kept alive with its handle
    handle: object  # the _SymmetricMemory of buffer
    epochs: torch.Tensor  # int32 [max_programs]
    peer_buffers: torch.Tensor  # int64 [W]: address of every rank's buffer (offset applied)
    peer_signals: torch.Tensor  # int64 [W]: address of every rank's signal pad
    info: GroupInfo
    launch: tuple[int, int, int]  # rms_norm_triton.launch_config(hidden): block, rows, warps


# (group_name, device index) -> GroupInfo, or the reason the group cannot use symmetric memory.
_groups: dict[tuple[str, int], GroupInfo | str] = {}
# (group_name, device index, dtype, hidden) -> Workspace, or the reason it could not be made.
workspaces: dict[tuple[str, int, torch.dtype, int], Workspace | str] = {}


def _capture_error(what: str, group_name: str) -> RuntimeError:
    return RuntimeError(
        f"allreduce_add_rms_norm: the one-shot {what} for group {group_name!r} would be created "
        "during CUDA-graph capture (it is collective and allocates): call "
        "fusion_passes.lowering.allreduce_rms_norm.symm_mem.prepare_workspace(group_name, "
        "dtype, hidden, device) on every rank, or run the op once, before capturing"
    )


def _signal_pad_bytes() -> int:
    """Bytes of each rank's signal pad for new allocations (torch says in newer versions)."""
    getter = getattr(symm_mem, "get_signal_pad_size", None)
    if getter is not None:
        return int(getter())
    return int(getattr(_SymmetricMemory, "signal_pad_size", _MIN_SIGNAL_PAD_BYTES))


def _group_info(group_name: str, device: torch.device) -> GroupInfo | str:
    """The group's agreed launch facts, or why it cannot use the one-shot kernel. Collective at the
    first call per (group, device) (an all_gather_object), cached after."""
    key = (group_name, device.index)
    cached = _groups.get(key)
    if cached is not None:
        return cached
    from torch.distributed.distributed_c10d import _resolve_process_group

    group = _resolve_process_group(group_name)
    backend = str(dist.get_backend(group))
    world_size = group.size()
    # Decided from facts every rank shares: every rank returns here together (no collective yet).
    if backend != "nccl" and "cuda:nccl" not in backend:
        _groups[key] = f"group backend is {backend}, not NCCL"
        return _groups[key]
    if world_size > MAX_WORLD_SIZE:
        _groups[key] = f"world size {world_size} > {MAX_WORLD_SIZE}"
        return _groups[key]
    if torch.cuda.is_current_stream_capturing():
        raise _capture_error("group check", group_name)
    props = torch.cuda.get_device_properties(device)
    mine = (socket.gethostname(), str(props.uuid), props.multi_processor_count, _signal_pad_bytes())
    everyone: list = [None] * world_size
    with torch.cuda.device(device):
        dist.all_gather_object(everyone, mine, group=group)
    # From here every rank decides on the same gathered list: the same answer everywhere.
    hosts = {host for host, *_ in everyone}
    uuids = [uuid for _, uuid, *_ in everyone]
    if len(hosts) > 1:
        _groups[key] = f"group spans {len(hosts)} hosts"
        return _groups[key]
    if len(set(uuids)) < world_size:
        _groups[key] = "two ranks of the group share one GPU"
        return _groups[key]
    # Peer access is queried locally and may differ between ranks: gather every rank's answer
    # (every rank reaches this second gather) and refuse if any rank refused.
    refusals: list = [None] * world_size
    with torch.cuda.device(device):
        dist.all_gather_object(refusals, _peer_access_reason(device, uuids), group=group)
    refused = [r for r in refusals if r is not None]
    if refused:
        _groups[key] = refused[0]
        return _groups[key]
    slots = min(pad for *_, pad in everyone) // _SIGNAL_BYTES
    max_programs = min(
        slots // world_size, _PROGRAMS_PER_SM * min(sms for _, _, sms, _ in everyone)
    )
    _groups[key] = GroupInfo(group.rank(), world_size, max(1, max_programs))
    return _groups[key]


def _peer_access_reason(device: torch.device, uuids: list[str]) -> str | None:
    """Why this rank's GPU cannot address a peer's memory, or None. A peer GPU not visible to
    this process (CUDA_VISIBLE_DEVICES) cannot be queried; the rendezvous then decides."""
    local = {
        str(torch.cuda.get_device_properties(i).uuid): i for i in range(torch.cuda.device_count())
    }
    for uuid in uuids:
        peer = local.get(uuid)
        if peer is None or peer == device.index:
            continue
        if not torch.cuda.can_device_access_peer(device.index, peer):
            return f"peer access missing between cuda:{device.index} and cuda:{peer}"
    return None


def prepare_workspace(
    group_name: str, dtype: torch.dtype, hidden: int, device: torch.device | str
) -> str | None:
    """Create (once) the symmetric workspace of (group, device, dtype, hidden); None when it is
    ready, else the one-line reason the one-shot kernel cannot serve this group. Collective: every
    rank of the group must call it, in the same order, and outside CUDA-graph capture (call it
    before capturing a graph that runs the op; inside a capture it raises if work remains)."""
    if _SYMM_MEM_MISSING is not None:
        return _SYMM_MEM_MISSING
    device = torch.device(device)
    if device.type != "cuda":
        return f"x is on {device.type}, not CUDA"
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (group_name, device.index, dtype, hidden)
    workspace = workspaces.get(key)
    if workspace is not None:
        return workspace if isinstance(workspace, str) else None
    info = _group_info(group_name, device)
    if isinstance(info, str):
        return info
    if torch.cuda.is_current_stream_capturing():
        raise _capture_error(f"workspace ({dtype}, hidden {hidden})", group_name)
    workspaces[key] = _create_workspace(group_name, dtype, hidden, device, info)
    workspace = workspaces[key]
    return workspace if isinstance(workspace, str) else None


def _create_workspace(
    group_name: str, dtype: torch.dtype, hidden: int, device: torch.device, info: GroupInfo
) -> Workspace | str:
    """Allocate and rendezvous the buffer; the reason instead if torch refuses (on every rank: the
    allocation and rendezvous fail alike everywhere, and the offsets are checked on gathered
    values)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    group = _resolve_process_group(group_name)
    with torch.cuda.device(device):
        try:
            buffer = symm_mem.empty((2, MAX_ROWS, hidden), dtype=dtype, device=device)
            handle = symm_mem.rendezvous(buffer, group_name)
        except Exception as error:  # noqa: BLE001 - any refusal means: use the fallback
            return f"symmetric memory rendezvous failed: {type(error).__name__}: {error}"
        buffer_ptrs = [int(p) for p in handle.buffer_ptrs]
        signal_ptrs = [int(p) for p in handle.signal_pad_ptrs]
        # The tensor may sit inside a pooled allocation: buffer_ptrs are the allocation's bases.
        offset = buffer.data_ptr() - buffer_ptrs[handle.rank]
        offsets: list = [None] * info.world_size
        dist.all_gather_object(offsets, offset, group=group)
    if handle.world_size != info.world_size or handle.rank != info.rank:
        return f"symmetric memory handle is rank {handle.rank} of {handle.world_size}"
    if len(set(offsets)) > 1:
        return f"symmetric buffer offsets differ across ranks ({offsets})"
    if offset < 0 or offset % 16:
        return f"symmetric buffer offset {offset} is not a 16-byte multiple"
    if 0 in buffer_ptrs or 0 in signal_ptrs:
        return "a peer's symmetric buffer is not directly addressable (no P2P mapping)"
    return Workspace(
        buffer=buffer,
        handle=handle,
        epochs=torch.zeros(info.max_programs, dtype=torch.int32, device=device),
        peer_buffers=torch.tensor([p + offset for p in buffer_ptrs], dtype=torch.int64, device=device),
        peer_signals=torch.tensor(signal_ptrs, dtype=torch.int64, device=device),
        info=info,
        launch=launch_config(hidden),
    )


def symm_mem_eligible(x: torch.Tensor, group_name: str, chunked: bool = False) -> str | None:
    """None when the one-shot kernel can reduce x over the group (its workspace is then ready),
    else the one-line reason it cannot. ``chunked``: the caller launches rows beyond the
    workspace's in several launches (``launch_eligible`` does), so more rows are eligible in
    groups of at most CHUNKED_MAX_WORLD_SIZE ranks. Every check depends only on facts all ranks
    share (x's shape, dtype and layout are the same on every rank), so every rank takes the same
    path. The first call per group and per (dtype, hidden) is collective (see prepare_workspace)."""
    if _SYMM_MEM_MISSING is not None:
        return _SYMM_MEM_MISSING
    if x.device.type != "cuda":
        return f"x is on {x.device.type}, not CUDA"
    hidden = x.shape[-1] if x.dim() else 0
    if hidden == 0:
        return "x has no hidden dimension"
    if x.stride(-1) != 1:
        return f"hidden dimension not contiguous (stride {x.stride(-1)})"
    key = (group_name, x.device.index, x.dtype, hidden)
    workspace = workspaces.get(key)
    if not isinstance(workspace, Workspace):  # the first call (collective), or a refusal
        reason = prepare_workspace(group_name, x.dtype, hidden, x.device)
        if reason is not None:
            return reason
        workspace = workspaces[key]
    rows = x.numel() // hidden
    capacity = workspace.buffer.shape[1]  # MAX_ROWS when the workspace was made
    if rows > capacity:
        if not chunked:
            return f"{rows} rows > MAX_ROWS ({capacity})"
        if workspace.info.world_size > CHUNKED_MAX_WORLD_SIZE:
            return (
                f"{rows} rows > MAX_ROWS ({capacity}) at world size {workspace.info.world_size} "
                f"(one-shot beyond it only up to {CHUNKED_MAX_WORLD_SIZE} ranks)"
            )
    return None


def _rows_and_stride(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    rows = as_rows(t)
    return rows, rows.stride(0)


def caller_rows(
    x: torch.Tensor, residual: torch.Tensor | None
) -> tuple[torch.Tensor, int, torch.Tensor, int]:
    """(x_rows, stride_x, residual_rows, stride_residual) for a one-shot launch: a contiguous
    tensor is already rows of stride N (no reshape: host time, on every call); without a residual
    x stands in for it (never read: HAS_RESIDUAL=False)."""
    n = x.shape[-1]
    x_rows, stride_x = (x, n) if x.is_contiguous() else _rows_and_stride(x)
    if residual is None:
        return x_rows, stride_x, x_rows, stride_x
    if residual.is_contiguous():
        return x_rows, stride_x, residual, n
    return (x_rows, stride_x, *_rows_and_stride(residual))


def launch_eligible(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    weight_offset: float,
    cast_before_weight: bool,
    group_name: str,
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
    launch = (workspace, weight, eps, weight_offset, cast_before_weight, residual is not None)
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


def require_eligible(x: torch.Tensor, group_name: str, op: str = "allreduce_add_rms_norm") -> None:
    """Raise RuntimeError (one line, naming ``op``) when symm_mem_eligible gives a reason."""
    reason = symm_mem_eligible(x, group_name)
    if reason is not None:
        raise RuntimeError(f"one-shot {op} not usable: {reason}")


def one_shot(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    weight_offset: float,
    cast_before_weight: bool,
    group_name: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The one-shot kernel on its own (no fallback): (rms_norm(r), r) with r = s + residual, or
    r = s without one, s = sum of x over the group. Raises ValueError for arguments the ops do
    not define, RuntimeError when ``symm_mem_eligible(x, group_name)`` gives a reason."""
    check_allreduce_rms_norm_args(x, weight, weight_offset, cast_before_weight, residual)
    require_eligible(x, group_name)
    return launch_eligible(x, residual, weight, eps, weight_offset, cast_before_weight, group_name)
