"""Spawn harness for the tensor-parallel tests: a gloo process group of ``world_size`` CPU
processes, bounded by a timeout so that a hang (a rank stuck in a collective) fails the test
instead of stalling CI."""

from __future__ import annotations

import os
import pickle
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp


def run_world(fn: Callable[..., Any], *args: Any, world_size: int = 2, timeout: float = 120.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on every rank of a fresh gloo group (spawned processes;
    ``fn`` must be importable, and its result picklable); return the results in rank order.
    Raises TimeoutError after ``timeout`` seconds (the ranks are killed), or the first rank's
    exception with its traceback."""
    with tempfile.TemporaryDirectory() as tmp:
        context = mp.start_processes(
            _rank_main,
            args=(world_size, tmp, fn, args),
            nprocs=world_size,
            join=False,
            start_method="spawn",  # fork would copy the parent's threads and Inductor state
        )
        deadline = time.monotonic() + timeout
        try:
            while not context.join(timeout=max(0.1, deadline - time.monotonic())):
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"{fn.__name__} did not finish on {world_size} ranks in {timeout:.0f} s")
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


def _rank_main(rank: int, world_size: int, tmp: str, fn: Callable[..., Any], args: tuple) -> None:
    # A collective that waits longer than this raises in the rank (the outer timeout kills it
    # anyway); the file store needs no free port.
    dist.init_process_group(
        "gloo",
        init_method=f"file://{os.path.join(tmp, 'store')}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=60),
    )
    try:
        result = fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()
    with open(os.path.join(tmp, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
