"""Spawn harness for the tensor-parallel tests: a process group of ``world_size`` spawned
processes (gloo on CPUs, or NCCL with one GPU per rank), bounded by a timeout so that a hang (a
rank stuck in a collective) fails the test instead of stalling CI."""

from __future__ import annotations

import os
import pickle
import queue as queue_module
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# The marks of a test module that needs two GPUs of one host (the 2-GPU tensor-parallel tests).
TWO_GPUS = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
]


def run_world(
    fn: Callable[..., Any],
    *args: Any,
    world_size: int = 2,
    timeout: float = 120.0,
    backend: str = "gloo",
    collective_timeout: float = 60.0,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on every rank of a fresh ``backend`` group (spawned
    processes; ``fn`` must be importable, and its result picklable); return the results in rank
    order. Raises TimeoutError after ``timeout`` seconds (the ranks are killed), or the first
    rank's exception with its traceback. NCCL ranks each take GPU ``rank``."""
    with tempfile.TemporaryDirectory() as tmp:
        context = mp.start_processes(
            _rank_main,
            args=(world_size, tmp, fn, args, backend, collective_timeout),
            nprocs=world_size,
            join=False,
            start_method="spawn",  # fork would copy the parent's threads and Inductor state
        )
        deadline = time.monotonic() + timeout
        try:
            while not context.join(timeout=max(0.1, deadline - time.monotonic())):
                if time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"{fn.__name__} did not finish on {world_size} ranks in {timeout:.0f} s"
                    )
        finally:
            for process in context.processes:  # only the processes this call started
                if process.is_alive():
                    process.kill()
                    process.join()
        results = []
        for rank in range(world_size):
            with open(os.path.join(tmp, f"rank{rank}.pkl"), "rb") as f:
                results.append(pickle.load(f))
        return results


def _init_group(rank: int, world_size: int, tmp: str, backend: str, collective_timeout: float) -> None:
    extra = {}
    if backend == "nccl":
        # No NVLink multicast on shared machines (NCCL NVLS, symmetric-memory multicast objects).
        os.environ["NCCL_NVLS_ENABLE"] = "0"
        os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
        torch.cuda.set_device(rank)
        extra["device_id"] = torch.device("cuda", rank)
    # A collective that waits longer than collective_timeout raises in the rank (the outer
    # timeout kills it anyway); the file store needs no free port.
    dist.init_process_group(
        backend,
        init_method=f"file://{os.path.join(tmp, 'store')}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=collective_timeout),
        **extra,
    )


def _rank_main(
    rank: int, world_size: int, tmp: str, fn: Callable[..., Any], args: tuple, backend: str,
    collective_timeout: float,
) -> None:  # fmt: skip
    _init_group(rank, world_size, tmp, backend, collective_timeout)
    try:
        result = fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()
    with open(os.path.join(tmp, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)


class World:
    """A gloo group of ``world_size`` spawned processes that runs several jobs, one after the
    other: a module's tests start one (a spawn costs ~9 s on 2 cores) and give it each job, as
    a module-scoped fixture::

        @pytest.fixture(scope="module")
        def world():
            with World() as w:
                yield w

    ``run(fn, *args)`` is run_world's call on the same ranks (``fn(rank, world_size, *args)``,
    importable, its result picklable; the results in rank order). Each job starts from a reset
    Dynamo, in the group the earlier jobs leave (their subgroups and module globals stay).
    ``timeout`` bounds each job, the group's start included for the first: a rank that does not
    answer in time, or dies, kills the world (a later run raises), as does a rank's exception,
    which run re-raises with the rank's traceback."""

    def __init__(self, world_size: int = 2, timeout: float = 120.0, collective_timeout: float = 60.0):
        self.world_size, self.timeout = world_size, timeout
        self._tmp = tempfile.TemporaryDirectory()
        ctx = mp.get_context("spawn")  # fork would copy the parent's threads and Inductor state
        self._jobs = [ctx.SimpleQueue() for _ in range(world_size)]
        self._done = ctx.Queue()
        self._processes = [
            ctx.Process(
                target=_world_rank_main,
                args=(rank, world_size, self._tmp.name, collective_timeout, self._jobs[rank], self._done),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for process in self._processes:
            process.start()
        self._count = 0
        self._broken: str | None = None

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None) -> list[Any]:
        if self._broken:
            raise RuntimeError(f"the world of {self.world_size} ranks is gone: {self._broken}")
        self._count += 1
        job = self._count
        for queue in self._jobs:
            queue.put((job, fn, args))
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        done: set[int] = set()  # the ranks that finished the job
        while len(done) < self.world_size:
            try:
                wait = min(1.0, max(0.01, deadline - time.monotonic()))
                rank, finished, error = self._done.get(timeout=wait)
            except queue_module.Empty:
                dead = [r for r, p in enumerate(self._processes) if not p.is_alive() and r not in done]
                if dead or time.monotonic() >= deadline:
                    why = (
                        f"rank {dead[0]} died (exit code {self._processes[dead[0]].exitcode})"
                        if dead
                        else f"{fn.__name__} did not finish on {self.world_size} ranks in {timeout:.0f} s"
                    )
                    self._kill(why)
                    raise (RuntimeError if dead else TimeoutError)(why) from None
                continue
            if finished != job:
                continue
            if error is not None:  # the first to raise: the others may wait on it in a collective
                self._kill(f"rank {rank} raised in {fn.__name__}")
                raise RuntimeError(f"rank {rank} raised in {fn.__name__}:\n{error}")
            done.add(rank)
        results = []
        for rank in range(self.world_size):
            with open(os.path.join(self._tmp.name, f"job{job}_rank{rank}.pkl"), "rb") as f:
                results.append(pickle.load(f))
        return results

    def _kill(self, why: str) -> None:
        self._broken = why
        for process in self._processes:  # only the processes this world started
            if process.is_alive():
                process.kill()
            process.join()

    def close(self) -> None:
        if not self._broken:
            for queue in self._jobs:
                queue.put(None)
            for process in self._processes:
                process.join(timeout=30)
            self._kill("closed")
        self._tmp.cleanup()

    def __enter__(self) -> World:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _world_rank_main(rank: int, world_size: int, tmp: str, collective_timeout: float, jobs, done) -> None:
    import traceback

    _init_group(rank, world_size, tmp, "gloo", collective_timeout)
    try:
        while (item := jobs.get()) is not None:
            job, fn, args = item
            torch._dynamo.reset()
            try:
                result = fn(rank, world_size, *args)
                with open(os.path.join(tmp, f"job{job}_rank{rank}.pkl"), "wb") as f:
                    pickle.dump(result, f)
                done.put((rank, job, None))
            except BaseException:  # noqa: BLE001 - sent to the test, which raises it
                done.put((rank, job, traceback.format_exc()))
                raise
    finally:
        dist.destroy_process_group()


def bits(t: torch.Tensor) -> torch.Tensor:
    """t's bytes, flat (a 0-dim tensor too): equal bits, not equal values (-0.0 differs from 0.0)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def same_on_every_rank(t: torch.Tensor, world_size: int) -> bool:
    """Inside a rank of run_world: gather t's bits from every rank of the default group and
    compare them."""
    t = bits(t)
    gathered = [torch.empty_like(t) for _ in range(world_size)]
    dist.all_gather(gathered, t)
    return all(torch.equal(g, gathered[0]) for g in gathered[1:])


# --- checks run inside the ranks of one job, asserted per check by the tests ---


def guarded(failures: dict[str, list[str]], checks: tuple[str, ...], fn: Callable[[], None]) -> None:
    """Run ``fn`` (inside a rank); an exception becomes a failure of each of ``checks`` and the job
    goes on with the next check (all ranks run the same checks, so their collectives pair up)."""
    import traceback

    try:
        fn()
    except Exception:  # noqa: BLE001 - report it as these checks' failure, go on with the others
        for check in checks:
            failures[check].append(traceback.format_exc(limit=6))


def assert_no_failures(results: list[dict], check: str) -> None:
    """Every rank's ``failures[check]`` list (of a job's result) is empty."""
    failures = [f"rank {rank}: {msg}" for rank, r in enumerate(results) for msg in r["failures"][check]]
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:20])


def assert_sums_equal_nccl(info: dict) -> None:
    """At 2 ranks a one-shot sum and NCCL's are both one rounding of x0 + x1: equal bit for bit.
    ``info`` counts the compared elements and those that differed."""
    assert info["sum_elements"], "the one-shot path never ran: no sums to compare with NCCL's"
    print(
        f"sum elements differing from NCCL: {info['sum_elements_differing_from_nccl']} of {info['sum_elements']}"
    )
    assert info["sum_elements_differing_from_nccl"] == 0


def compile_case(fn: Callable[..., Any], args: tuple, fusions: list[str]) -> dict[str, Any]:
    """Inside a rank: compile ``fn`` with ``fusions`` (strict) and run it on ``args`` against eager;
    what the report says (matches, spellings of these fusions, ops before/after of the one graph,
    errors, run-time fallbacks, summary, near misses) and whether each output equals eager's bit for
    bit (stock Inductor's where a canonical op was lowered back)."""
    import fusion_passes

    report = fusion_passes.Report()
    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(fn, backend=fusion_passes.backend(fusions, report=report, strict=True))(*args)
        expected = fn(*args)
        if report.lowered_back():
            # A norm left standalone is lowered back: the graph is then stock Inductor's, and
            # Inductor's, not eager's, are the bits to equal.
            torch._dynamo.reset()
            expected = torch.compile(fn, backend="inductor")(*args)
    out = out if isinstance(out, tuple) else (out,)
    expected = expected if isinstance(expected, tuple) else (expected,)
    (graph,) = report.graphs
    return {
        "matches": {k: v for k, v in report.matches.items() if v},
        "spellings": [s.spelling for s in report.sites if s.fusion in fusions],
        "before": dict(graph.ops_before),
        "after": dict(graph.ops_after),
        "equal": [
            a.dtype == e.dtype and torch.equal(bits(a), bits(e)) for a, e in zip(out, expected, strict=True)
        ],
        "errors": list(report.errors),
        "fallbacks": report.runtime_fallbacks(),
        "summary": report.summary(),
        "near_misses": [(m.fusion, m.spelling, m.reason) for m in report.near_misses],
    }


def rank_inputs(rows: int, hidden: int, dtype: torch.dtype, rank: int, seed: int, residual: bool = True):
    """(x, residual or None, weight) on this rank's GPU: x differs per rank (each holds a partial
    sum); residual and weight are replicated."""
    shared = torch.Generator(device="cuda").manual_seed(seed)
    own = torch.Generator(device="cuda").manual_seed(seed * 1000 + 17 + rank)
    x = torch.randn(rows, hidden, device="cuda", generator=own).to(dtype)
    res = torch.randn(rows, hidden, device="cuda", generator=shared).to(dtype) if residual else None
    weight = (1 + 0.3 * torch.randn(hidden, device="cuda", generator=shared)).to(dtype)
    return x, res, weight


def refill_inputs(static: list[tuple], rank: int, seed: int) -> None:
    """Write new rank_inputs (seeds seed, seed + 1, ...) into the captured (x, residual, weight)
    sets in place, keeping each set's shape, dtype and residual-or-not."""
    for i, (x, res, w) in enumerate(static):
        fx, fres, fw = rank_inputs(x.shape[0], x.shape[-1], x.dtype, rank, seed + i, res is not None)
        x.copy_(fx)
        w.copy_(fw)
        if res is not None:
            res.copy_(fres)


def capture(calls: Callable[[], Any]) -> tuple[torch.cuda.CUDAGraph, Any]:
    """(graph, outputs) of ``calls`` captured in one CUDA graph, after a warm-up off the capture
    stream (as torch.cuda.graphs asks)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        calls()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = calls()
    return graph, captured


def fail_every_check(failures: dict[str, list[str]], reason: str) -> None:
    """The one-shot path is the subject of every check: without it, each check fails with why."""
    for check in failures:
        failures[check].append(f"one-shot path not eligible on this machine: {reason}")
