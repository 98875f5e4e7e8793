"""What the two-GPU benchmarks share (bench_allreduce_rms_norm, bench_tp_decoder_layer): starting
the ranks, timing collectives, comparing outputs across ranks.

Importing this module keeps NVLink multicast off (NCCL NVLS and symmetric-memory multicast: shared
machines) and, on a --smoke run without a GPU, puts Triton in its CPU interpreter; import it before
anything imports triton.

Timing: every rank makes the same fixed number of calls between barriers (a collective must be
called as often on every rank: adaptive repeat counts such as do_bench's would hang); rank 0 reports.
  plain  median over PLAIN_ITERS calls of CUDA events around each call, after a synchronize and a
         dist.barrier; includes the host's launch time where the host is the bottleneck
  graph  the calls (GRAPH_CALLS of them, each on its own input set) captured in one CUDA graph; the
         median over GRAPH_REPLAYS replays, per call
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from datetime import timedelta

import torch

from benchmarks import common

INTERPRETED = common.interpret_smoke_run()
os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"

import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from benchmarks.timing import capture  # noqa: E402

PLAIN_ITERS, PLAIN_WARMUP = 200, 20
# Calls per captured graph, each on its own input set (decode-sized sets stay in L2 together, as a
# model's activations do), and replays timed; the same fixed counts on every rank.
GRAPH_CALLS, GRAPH_REPLAYS, GRAPH_WARMUP = 20, 30, 3
SMOKE_ITERS = 3  # a CPU smoke run: a host clock over this many calls
# The counts above, as the results' JSON records them.
SETTINGS = {"plain_iters": PLAIN_ITERS, "graph_calls": GRAPH_CALLS, "graph_replays": GRAPH_REPLAYS}


def time_plain_us(fn, device) -> float:
    """Median microseconds per call: CUDA events around each of PLAIN_ITERS calls (host clock on
    a CPU smoke run). Every rank makes the same calls between two barriers."""
    cuda = device.type == "cuda"
    iters, warmup = (PLAIN_ITERS, PLAIN_WARMUP) if cuda else (SMOKE_ITERS, 1)
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
    dist.barrier()
    if not cuda:
        samples = []
        for _ in range(iters):
            start = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - start) * 1e6)
        dist.barrier()
        return statistics.median(samples)
    us = _events_us([fn] * iters)
    dist.barrier()
    return us


def time_graph_us(calls, device) -> float | None:
    """Median microseconds per call of the calls replayed from one CUDA graph (None on a CPU)."""
    if device.type != "cuda":
        return None
    graph = capture(calls, warmup=calls)
    for _ in range(GRAPH_WARMUP):
        graph.replay()
    torch.cuda.synchronize()
    dist.barrier()
    us = _events_us([graph.replay] * GRAPH_REPLAYS)
    dist.barrier()
    del graph
    return us / len(calls)


def _events_us(fns) -> float:
    """Median microseconds of CUDA events around each of fns, run back to back."""
    starts = [torch.cuda.Event(enable_timing=True) for _ in fns]
    ends = [torch.cuda.Event(enable_timing=True) for _ in fns]
    for fn, start, end in zip(fns, starts, ends, strict=True):
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)) * 1e3


def same_on_every_rank(t) -> bool:
    """t holds the same bits on every rank."""
    gathered = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, t.contiguous())
    bits = [g.view(torch.uint8) for g in gathered]
    return all(torch.equal(b, bits[0]) for b in bits[1:])


def device_name(device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (gloo)"


def parser(doc: str, name: str, smoke: str, on_a_cpu: str):
    """common.parser for a two-GPU benchmark: --smoke runs ``smoke`` and, on a CPU, 2 gloo ranks
    (``on_a_cpu`` says what it leaves out there)."""
    cpu = f"on a CPU: gloo, 2 ranks (spawned unless under torchrun), {on_a_cpu}"
    return common.parser(doc, name, smoke=f"{smoke}; {cpu}")


def finish(args, text: str, device, world_size: int, payload: dict) -> None:
    """Rank 0's end of a run: common.finish, the JSON naming the device, the world and the counts."""
    world = {"device": device_name(device), "world_size": world_size, **SETTINGS}
    common.finish(args, text, {**world, **payload})


def init_distributed(rank, world_size, init_method) -> torch.device:
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", init_method=init_method, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=300), device_id=device)  # fmt: skip
        return device
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=120))  # fmt: skip
    return torch.device("cpu")


def _spawned_rank(rank, world_size, tmp, run, args) -> None:
    """A rank of the smoke run's own 2-process world (when not started by torchrun)."""
    device = init_distributed(rank, world_size, f"file://{os.path.join(tmp, 'store')}")
    try:
        status = run(rank, world_size, args, device)
    finally:
        dist.destroy_process_group()
    if status:
        raise SystemExit(status)


def launch_ranks(run, args, parser) -> int:
    """Run ``run(rank, world_size, args, device)`` on every rank and return the exit status: the
    ranks torchrun started (NCCL on GPUs; gloo only with --smoke), or, for a --smoke run outside
    torchrun, 2 spawned gloo ranks."""
    if "RANK" in os.environ:  # started by torchrun
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if not torch.cuda.is_available() and not args.smoke:
            parser.error("no CUDA device: only --smoke runs on a CPU")
        device = init_distributed(rank, world_size, "env://")
        try:
            return run(rank, world_size, args, device)
        finally:
            dist.destroy_process_group()
    if not args.smoke:
        parser.error("run under torchrun --nproc-per-node 2 -m ... (only --smoke spawns its own ranks)")
    with tempfile.TemporaryDirectory() as tmp:
        try:
            mp.spawn(_spawned_rank, args=(2, tmp, run, args), nprocs=2, join=True)
        except mp.ProcessExitedException:
            return 1
    return 0
