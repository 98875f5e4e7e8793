"""What the FP8 benchmarks share (bench_rms_norm_quant_fp8, bench_silu_mul_quant_fp8): the
quantization as serving engines write it, the variants they compile and time, and their sweep of
shapes, run in parts.

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

import torch
import triton

import fusion_passes
from benchmarks import common
from benchmarks.timing import copy_bandwidth_gbps, kernels_per_call, time_graph_us, time_plain_us
from benchmarks.spellings import quant_per_group, quant_per_token, quant_static

FP8_DTYPE = torch.float8_e4m3fn
SCHEMES = ("static", "per_token", "per_group")
TOKENS = (1, 4, 16, 64, 256, 1024, 4096, 16384)
SMOKE_TOKENS = (1, 64)
BANDWIDTH_MIN_TOKENS = 4096  # below this, launch latency, not HBM, sets the time
GRAPH_CALLS = 20  # calls per captured graph (see bench_rms_norm.py: >= 4096 tokens come from HBM)
COPY_BYTES, SMOKE_COPY_BYTES = 2 * 10**9, 2 * 10**6


def quantize(scheme: str):
    """(y, scale) -> (codes, scales): the FP8 quantization of ``scheme`` as serving engines write
    their native fallback (amax, clamp, divide, cast); the static scheme takes the given scale."""

    def quant(y, scale):
        if scheme == "static":
            return quant_static(y, scale), scale
        return quant_per_token(y) if scheme == "per_token" else quant_per_group(y)

    return quant


def bits(t: torch.Tensor) -> torch.Tensor:
    """t's bits, comparable with torch.equal (fp8 codes as bytes)."""
    return t.view(torch.uint8) if t.dtype == FP8_DTYPE else t


def input_sets(make: Callable[[], tuple], device: str, timed: bool) -> list[tuple]:
    """make()'s input sets for one shape: GRAPH_CALLS of them for a timed GPU run (each call of the
    captured graph on its own), else one."""
    return [make() for _ in range(GRAPH_CALLS if device == "cuda" and timed else 1)]


def _fuse_every_shape() -> None:
    """The benchmark times the fused kernel at every shape, those the launch tables leave to stock
    Inductor (FP8RegionRule) included: its numbers are the evidence for those rows."""
    from fusion_passes.lowering import launch_tables

    for table in (launch_tables.RMS_NORM_QUANT_FP8_REGION, launch_tables.SILU_MUL_QUANT_FP8_REGION):
        for key in table:
            table[key] = launch_tables.FP8RegionRule()


def compiled_variants(eager, fusions: list[str]) -> tuple[fusion_passes.Report, dict]:
    """The unfused spelling three ways: eager, stock Inductor, and fusion_passes with ``fusions``
    (filling the report returned); static shapes, one compile per shape (compiled at the first call,
    after Dynamo's caches are reset here: clear of the recompile limit)."""
    _fuse_every_shape()
    torch._dynamo.reset()
    report = fusion_passes.Report()
    backend = fusion_passes.backend(fusions=fusions, report=report)
    return report, {
        "eager": eager,
        "inductor": torch.compile(eager, dynamic=False),
        "fusion_passes": torch.compile(eager, dynamic=False, backend=backend),
    }


def measure(record: dict, fns: dict, sets: list, fusion: str, report, device: str, timed: bool) -> dict:
    """Run every implementation of fns once on each input set (compiling it), note for
    fusion_passes the sites ``fusion`` rewrote and whether its outputs equal the kernel's bit for
    bit (on a GPU both run the same kernel; on a CPU the compiled graph runs the reference, the
    kernel the interpreter), then, when timed, its kernels per call and its plain and CUDA-graph
    times. A record without times was compiled and checked only (--compile-only)."""
    record["plain_us"], record["graph_us"], record["kernels"] = {}, {}, {}
    for impl, fn in fns.items():
        calls = [lambda s=s, fn=fn: fn(*s) for s in sets]
        out = calls[0]()  # compiles
        if impl == "fusion_passes":
            record["fused"] = report.matches[fusion]
            record["fusion_passes_equals_kernel"] = device != "cuda" or all(
                torch.equal(bits(a), bits(b)) for a, b in zip(out, fns["kernel"](*sets[0]), strict=True)
            )
        if not timed:
            continue
        record["kernels"][impl] = kernels_per_call(calls[0])
        record["plain_us"][impl] = time_plain_us(calls[0])
        record["graph_us"][impl] = time_graph_us(calls)
    if not timed:
        del record["plain_us"], record["graph_us"], record["kernels"]
    return record


def pct_of_copy(record: dict, us: float | None, copy_gbps: float) -> str:
    """The fewest bytes over the time as a percent of the copy bandwidth, from 4096 tokens on."""
    if us is None or record["tokens"] < BANDWIDTH_MIN_TOKENS:
        return "—"
    return f"{100 * record['bytes'] / us / 1e3 / copy_gbps:.0f}%"


def report_head(title: str, records: list[dict], copy_gbps: float, device_name: str, settings: str,
                checks: str = "") -> list[str]:  # fmt: skip
    """The opening of an FP8 benchmark's report: the setup, what the columns are, the checks."""
    failed = failures(records)
    return [
        f"# {title}",
        "",
        f"Device: {device_name}; torch {torch.__version__}; triton {triton.__version__}; "
        f"copy bandwidth {copy_gbps:.0f} GB/s; {settings}.",
        "",
        "- us per call, median. plain: do_bench (L2 flushed before each call); graph: "
        f"{GRAPH_CALLS} calls in one CUDA graph, each on its own inputs, per call.",
        "- fusion_passes: torch.compile with the fusion (our kernel launched from Inductor's code); "
        "kernel: our launcher called from Python. kernels: CUDA kernels per call (profiler).",
        f"- Checks (kernel vs reference; one fused site per compile; compiled output equal to the "
        f"kernel's): {'all shapes pass' if not failed else f'{len(failed)} FAILURES'}{checks}.",
    ]


def table(records: list[dict], mode: str, copy_gbps: float, size: str, impls: Sequence[str],
          extra: tuple[str, Callable[[dict], str]] | None = None) -> list[str]:  # fmt: skip
    """One row per shape: kernels per call, the times of impls in ``mode`` (plain or graph), stock
    Inductor's time over fusion_passes', extra's column (its header, and its cell from the times),
    fusion_passes' % of copy."""
    more = [extra[0]] if extra else []
    lines = [
        f"| {size} | tokens | kernels (inductor / ours) | " + " | ".join(impls)
        + " | " + " | ".join(["inductor / fusion_passes", *more, "fusion_passes % of copy"]) + " |",
        "|---:|---:|---:|" + "---:|" * (len(impls) + len(more) + 2),
    ]  # fmt: skip
    for r in records:
        t, k = r[f"{mode}_us"], r["kernels"]
        cells = [common.ratio(t["inductor"], t["fusion_passes"]), *([extra[1](t)] if extra else [])]
        cells.append(pct_of_copy(r, t["fusion_passes"], copy_gbps))
        lines.append(
            f"| {r[size]} | {r['tokens']} | {k['inductor']} / {k['fusion_passes']} | "
            + " | ".join([*(common.us(t[i]) for i in impls), *cells]) + " |"
        )  # fmt: skip
    return lines


def report_section(heading: str, rows: list[dict], make_table: Callable, copy_gbps: float) -> list[str]:
    """One fusion's section of a report: its CUDA-graph table, then its plain-launch table."""
    if not rows:
        return []
    lines = ["", f"## {heading}"]
    for mode, title in (("graph", "CUDA graph"), ("plain", "Plain launches")):
        lines += ["", f"### {title}", "", *make_table(rows, mode, copy_gbps)]
    return lines


def parser(doc: str, name: str, size_flag: str, sizes: Sequence[int], smoke_sizes: Sequence[int],
           what: str) -> argparse.ArgumentParser:  # fmt: skip
    """An FP8 benchmark's command line: common.parser's, its sizes (``size_flag``, ``what``), token
    counts, schemes, and the sweep's parts (--shard, --compile-only, --merge)."""
    result = common.parser(doc, name, smoke="tiny sizes; CPU under TRITON_INTERPRET=1")
    common.add_sizes(result, size_flag, sizes, smoke_sizes, what)
    common.add_sizes(result, "--tokens", TOKENS, SMOKE_TOKENS, "token counts")
    result.add_argument("--schemes", nargs="+", choices=SCHEMES, default=list(SCHEMES))
    result.add_argument("--shard", default="0/1", help="I/N: the I-th of N interleaved parts")
    result.add_argument(
        "--compile-only", action="store_true", help="compile and check every shape, time nothing"
    )
    result.add_argument("--merge", nargs="+", metavar="JSON", help="one report from these runs' records")
    return result


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
    measure_shape: Callable[..., dict],
    describe: Callable[[dict], str],
    impls: Sequence[str],
    json_path: str,
    meta: dict,
    timed: bool,
) -> list[dict]:
    """measure_shape(*shape, timed=timed) for every shape, one line printed for each (describe's,
    then the CUDA-graph times of impls), and the records written to json_path (with meta and the
    provenance) after every shape: a run cut short by a time limit keeps what it measured."""
    records = []
    for shape in shapes:
        record = measure_shape(*shape, timed=timed)
        records.append(record)
        times = ""
        if timed:
            times = " graph_us=" + ", ".join(f"{i} {common.us(record['graph_us'][i])}" for i in impls)
        print(describe(record) + times, flush=True)
        common.write_json(json_path, {**meta, "records": records})
    return records


def main(
    parser: argparse.ArgumentParser,
    args: argparse.Namespace,
    shapes: list[tuple],
    measure_shape: Callable[..., dict],
    describe: Callable[[dict], str],
    impls: Sequence[str],
    report: Callable[[list[dict], float, str], str],
    size: str,
) -> int:
    """An FP8 benchmark's run: the report of --merge's records; or every shape of its --shard
    measured (measure_shape(*shape, device, timed)) and checked, and, unless --compile-only, its
    report (records in the sweep's order: ``size`` as listed, then tokens) to args.out and
    stdout. The exit status is 1 where a shape failed a check."""
    if args.merge:
        records, copy_gbps, device_name = merged(args.merge)
    else:
        device = common.device(parser, args.smoke)
        device_name = common.device_name(device)
        torch.manual_seed(0)
        copy_gbps = copy_bandwidth_gbps(COPY_BYTES if device == "cuda" else SMOKE_COPY_BYTES, device)
        with torch.no_grad():
            records = run_shapes(
                shard_of(shapes, args.shard),
                lambda *shape, timed: measure_shape(*shape, device, timed),
                describe,
                impls,
                args.json,
                {"device": device_name, "copy_gbps": copy_gbps},
                timed=not args.compile_only,
            )
        if args.compile_only:
            return 1 if failures(records) else 0
    records = sorted(records, key=lambda r: (-r[size], r["tokens"]))
    text = report(records, copy_gbps, device_name)
    Path(args.out).write_text(text)
    print(text)
    return 1 if failures(records) else 0
