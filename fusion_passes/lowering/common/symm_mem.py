"""Symmetric memory for the one-shot allreduce kernels: each group's workspace (a symmetric
buffer of two halves of MAX_ROWS rows, the peers' addresses, the signal pads), whether a group and a
call may use it, and the device code every one-shot kernel shares: the copy-in of a rank's rows,
the barrier between ranks, the sum over the peers' rows in rank order.

Unfused: NCCL's allreduce writes the sum to HBM, and the next kernel reads it back.
Fused:   a one-shot kernel (allreduce_rms_norm/symm_mem.py, allreduce_rms_norm_quant_fp8/symm_mem.py)
copies its rows into its own buffer, meets the peers at the barrier (per program), and reads every
peer's rows over NVLink; the protocol (liveness, CUDA-graph safety, the two halves) is stated in
allreduce_rms_norm/symm_mem.py's docstring.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from fusion_passes.lowering.common.rows import as_rows, launch_config

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
        "fusion_passes.lowering.common.symm_mem.prepare_workspace(group_name, "
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


def require_eligible(x: torch.Tensor, group_name: str, op: str = "allreduce_add_rms_norm") -> None:
    """Raise RuntimeError (one line, naming ``op``) when symm_mem_eligible gives a reason."""
    reason = symm_mem_eligible(x, group_name)
    if reason is not None:
        raise RuntimeError(f"one-shot {op} not usable: {reason}")
