"""Timing helpers shared by the kernel benchmarks: plain launches, CUDA-graph replay, copy bandwidth,
kernels per call.

plain: triton.testing.do_bench's median, which flushes L2 before each call (on a CPU smoke run,
       a host clock's median of three calls).
graph: the calls (one per input set) captured back to back in one CUDA graph; the replay's median
       over the number of calls: no launch gaps, and inputs that fit in L2 together stay there.
"""

from __future__ import annotations

import statistics
import time

import torch
import triton.testing


def time_plain_us(fn) -> float:
    """Median microseconds of one call: do_bench on a GPU, a host clock in CPU smoke runs."""
    if torch.cuda.is_available():
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3
    fn()
    samples = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e6


def host_us(fn, iters: int = 2000, warmup: int = 50) -> float:
    """Mean wall-clock microseconds per call of back-to-back calls with one synchronize at the end:
    where the host is slower than the kernels, the GPU queue never runs dry and this is the host's
    cost per call."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)  # CPU smoke runs
    for _ in range(warmup):
        fn()
    sync()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    return (time.perf_counter() - start) / iters * 1e6


def capture(calls: list, warmup: list) -> torch.cuda.CUDAGraph:
    """The calls captured back to back in one CUDA graph, after the warmup calls ran on a side
    stream, as torch.cuda.graphs asks (compiles, allocations, communicators happen there)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in warmup:
            call()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    return graph


def time_graph_us(calls: list) -> float | None:
    """Median microseconds per call of the calls (one per input set) replayed from one graph."""
    if not torch.cuda.is_available():
        return None
    graph = capture(calls, warmup=calls[:3])
    ms = triton.testing.do_bench(graph.replay, warmup=25, rep=100, return_mode="median")
    return ms * 1e3 / len(calls)


def copy_bandwidth_gbps(nbytes: int, device: str) -> float:
    """Device copy bandwidth, bytes read + written over time: the ceiling a memory-bound op can reach."""
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / time_plain_us(lambda: dst.copy_(src)) / 1e3


def kernels_per_call(fn) -> int | None:
    """CUDA kernels one call of ``fn`` launches (None without a GPU); call it once before, to warm."""
    if not torch.cuda.is_available():
        return None
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
