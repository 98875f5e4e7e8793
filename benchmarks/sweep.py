"""Running a benchmark's sweep of shapes in parts, shared by bench_rms_norm_quant_fp8.py and
bench_silu_mul_quant_fp8.py.

A full sweep is 72-144 shapes, each compiled three times. On the H200 machine a shape took
about 18 s of one process to compile cold (72 shapes in 2.8 minutes over 8 processes, beside the
GPU tests) and 2.1 s to time from warm caches, so one process doing both for 144 shapes would run
past a 10-minute limit. Three options split it:

    --compile-only   compile and check every shape, time nothing. Run as several processes at
                     once (--shard 0/4 ... 3/4), it fills Inductor's on-disk caches in parallel, so
                     the timed run that follows only looks its kernels up.
    --shard I/N      the I-th of N interleaved parts of the shape list (every shape lands in one).
    --merge A.json B.json ...   no GPU work: one report from the records of several runs.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from pathlib import Path


def add_sweep_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shard", default="0/1", help="I/N: the I-th of N interleaved parts")
    parser.add_argument(
        "--compile-only", action="store_true", help="compile and check every shape, time nothing"
    )
    parser.add_argument("--merge", nargs="+", metavar="JSON", help="one report from these runs' records")


def shard_of(shapes: list, shard: str) -> list:
    """The I-th of N interleaved parts of shapes ("I/N"); a malformed shard is a one-line error."""
    try:
        index, count = (int(part) for part in shard.split("/"))
    except ValueError:
        raise SystemExit(f"--shard takes I/N (e.g. 0/4), got {shard!r}") from None
    if not 0 <= index < count:
        raise SystemExit(f"--shard {shard}: I must be in 0..N-1")
    return shapes[index::count]


def merged(paths: list[str]) -> tuple[list[dict], float, str]:
    """The records of several runs' JSON files, the fastest copy bandwidth among them and the device.

    The fastest copy bandwidth is the ceiling: a "% of copy" figure is never inflated by a run
    whose copy measured slower."""
    runs = [json.loads(Path(p).read_text()) for p in paths]
    devices = {run["device"] for run in runs}
    if len(devices) != 1:
        raise SystemExit(f"--merge: the runs come from different devices: {sorted(devices)}")
    records = [r for run in runs for r in run["records"] if "graph_us" in r]
    return records, max(run["copy_gbps"] for run in runs), devices.pop()


def failures(records: list[dict]) -> list[dict]:
    """The records whose shape failed a check: the kernel against the reference, one fused site,
    the compiled output equal to the kernel's."""
    return [r for r in records if not r["correct"] or r["fused"] != 1 or not r["fusion_passes_equals_kernel"]]


def run_shapes(
    shapes: list[tuple],
    measure: Callable[..., dict],
    describe: Callable[[dict], str],
    impls: Sequence[str],
    json_path: str,
    meta: dict,
    timed: bool,
) -> list[dict]:
    """measure(*shape, timed=timed) for every shape, one line printed for each (describe's, then
    the CUDA-graph times of impls), and the records written to json_path (with meta) after every
    shape: a run cut short by a time limit keeps what it measured."""
    records = []
    for shape in shapes:
        record = measure(*shape, timed=timed)
        records.append(record)
        times = ""
        if timed:
            times = " graph_us=" + ", ".join(f"{i} {_us(record['graph_us'][i])}" for i in impls)
        print(describe(record) + times, flush=True)
        Path(json_path).write_text(json.dumps({**meta, "records": records}, indent=1))
    return records


def _us(v: float | None) -> str:
    return "—" if v is None else f"{v:.1f}"
