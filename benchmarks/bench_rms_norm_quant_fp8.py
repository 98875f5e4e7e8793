"""Time RMSNorm (+ residual add) + FP8 quantization (Llama form, bf16 in, float8_e4m3fn out) on one
GPU, side by side, for the three schemes.

    norm+quant:      y = RMSNorm(x); q, s = quant(y)
    add+norm+quant:  r = x + residual; y = RMSNorm(r); q, s = quant(y); returns (q, s, r)
    quant: static (given scale), per_token (one scale per row), per_group (one per 128 columns)

Implementations:
- eager: the Hugging Face norm, then the quantization as serving engines write their native
  fallback (amax, clamp, divide, cast): the spellings of fusion_passes.patterns.rms_norm_quant_fp8;
- inductor: torch.compile of that with stock Inductor (static shapes, one compile per shape);
- fusion_passes: torch.compile of that with the fusion_passes backend, the norm+quant fusions
  enabled (the rewritten graph, our kernel launched from Inductor's code) -- checked to match once;
- kernel: our Triton kernel called from Python (its launcher's host cost included);
- same_traffic: stock Inductor's one kernel for the same bytes with no norm and no amax: the cast
  x.to(float8_e4m3fn) (add+norm: r = x + residual, then r and r's cast written). What a
  bandwidth-bound elementwise kernel of this traffic reaches here, beside the copy bandwidth;
- no_math: the same bytes in one flat Triton kernel of our own (benchmarks/no_math.py): a second
  measure of what a kernel of these bytes reaches, independent of Inductor's choices. The
  table's "no-math / fusion_passes" takes the faster of same_traffic and no_math.

Times as in benchmarks/timing.py (plain: do_bench median, L2 flushed; graph: GRAPH_CALLS calls on
their own input sets in one CUDA graph, per call). Kernels per call from the CUDA profiler. The
fewest bytes: read x (and residual) and weight, write the fp8 codes, the scales (and r); at >= 4096
tokens that over the time is given in GB/s and as a percent of the device's copy bandwidth.
Every shape first checks the kernel against the reference: codes at most one fp8 code apart,
scales and r to bf16 rounding.

    python benchmarks/bench_rms_norm_quant_fp8.py [--out PATH.md] [--json PATH.json]
    python benchmarks/bench_rms_norm_quant_fp8.py --smoke    # tiny sizes; CPU via the interpreter
    python benchmarks/bench_rms_norm_quant_fp8.py --shard 0/2 --json a.json   # half the shapes
    python benchmarks/bench_rms_norm_quant_fp8.py --merge a.json b.json       # one report of both

--compile-only fills Inductor's caches first, several shards at once (benchmarks/sweep.py).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

if "--smoke" in sys.argv and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must be set before triton is imported
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

import triton  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # timing.py

import fusion_passes  # noqa: E402
from fusion_passes.numerics import fp8_codes_apart  # noqa: E402
from fusion_passes.lowering.rms_norm_quant_fp8.reference import (  # noqa: E402
    FP8_DTYPE,
    add_rms_norm_quant_fp8_reference,
    rms_norm_quant_fp8_reference,
)
from fusion_passes.lowering.rms_norm_quant_fp8.triton import rms_norm_quant_fp8_triton  # noqa: E402
from fusion_passes.patterns.rms_norm import llama_rms_norm  # noqa: E402
from fusion_passes.patterns.rms_norm_quant_fp8 import (  # noqa: E402
    GROUP_SIZE,
    quant_per_group,
    quant_per_token,
    quant_static,
)
from no_math import no_math_fn  # noqa: E402
from sweep import add_sweep_args, failures, merged, run_shapes, shard_of  # noqa: E402
from timing import copy_bandwidth_gbps, kernels_per_call, time_graph_us, time_plain_us  # noqa: E402

HIDDEN = (7168, 4096, 3072)  # DeepSeek V3, Qwen 3 8B, Llama 3.2 3B
TOKENS = (1, 4, 16, 64, 256, 1024, 4096, 16384)
SMOKE_HIDDEN, SMOKE_TOKENS = (256,), (1, 64)
SCHEMES = ("static", "per_token", "per_group")
OPS = ("rms_norm", "add_rms_norm")
IMPLS = ("eager", "inductor", "fusion_passes", "kernel", "same_traffic", "no_math")
BANDWIDTH_MIN_TOKENS = 4096
DTYPE, EPS = torch.bfloat16, 1e-6
GRAPH_CALLS = 20  # calls per captured graph (see bench_rms_norm.py: >= 4096 tokens come from HBM)
COPY_BYTES, SMOKE_COPY_BYTES = 2 * 10**9, 2 * 10**6


def eager_fn(op: str, scheme: str):
    """The unfused spelling: (x, [residual,] weight, scale) -> (q, scales[, r])."""

    def quant(y, scale):
        if scheme == "static":
            return quant_static(y, scale), scale
        return quant_per_token(y) if scheme == "per_token" else quant_per_group(y)

    if op == "rms_norm":
        return lambda x, weight, scale: quant(llama_rms_norm(x, weight, EPS), scale)

    def add_norm_quant(x, residual, weight, scale):
        r = residual + x
        return (*quant(llama_rms_norm(r, weight, EPS), scale), r)

    return add_norm_quant


def same_traffic_fn(op: str):
    """The bytes of op without its math: (x, [residual,] weight, scale) -> fp8 cast (and r)."""
    if op == "rms_norm":
        return lambda x, weight, scale: x.to(FP8_DTYPE)

    def add_cast(x, residual, weight, scale):
        r = residual + x
        return r.to(FP8_DTYPE), r

    return add_cast


def kernel_fn(op: str, scheme: str):
    """Our kernel called directly (Llama form: weight_offset 0, cast before the weight)."""

    def call(x, *rest):
        residual = rest[0] if op == "add_rms_norm" else None
        weight, scale = rest[-2], rest[-1] if scheme == "static" else None
        q, s, r = rms_norm_quant_fp8_triton(
            x, weight, EPS, 0.0, True, scheme, scale, GROUP_SIZE, False, residual
        )
        return (q, s) if r is None else (q, s, r)

    return call


def fusion_name(op: str, scheme: str) -> str:
    return f"{'add_' if op == 'add_rms_norm' else ''}rms_norm_quant_fp8_{scheme}"


def random_inputs(op: str, scheme: str, hidden: int, tokens: int, device: str) -> tuple:
    x = torch.randn(tokens, hidden, device=device).to(DTYPE)
    weight = (1 + 0.1 * torch.randn(hidden, device=device)).to(DTYPE)
    # A static scale a calibration would give: amax of y over the scale 448 (y ~ N(0, 1): ~5 / 448).
    scale = torch.tensor(5.0 / 448, device=device) if scheme == "static" else None
    if op == "add_rms_norm":
        return x, torch.randn(tokens, hidden, device=device).to(DTYPE), weight, scale
    return x, weight, scale


def check_kernel(op: str, scheme: str, args: tuple) -> dict:
    """Kernel vs reference: codes at most one code apart (y may differ by an ulp: the kernel sums
    the squares in another order), scales to bf16's rounding of y, r bit for bit. The CPU
    interpreter truncates each bf16 cast instead of rounding it: one more ulp there."""
    x, *rest = args
    ref = (add_rms_norm_quant_fp8_reference if op == "add_rms_norm" else rms_norm_quant_fp8_reference)(
        x, *rest[:-1], EPS, 0.0, True, scheme, rest[-1], GROUP_SIZE, False
    )
    out = kernel_fn(op, scheme)(*args)
    max_code_diff = fp8_codes_apart(out[0], ref[0])
    scale_rel = ((out[1] - ref[1]).abs() / ref[1].abs()).max().item()
    ulps = 2 if INTERPRETED else 1
    ok = max_code_diff <= 1 and scale_rel <= 2 * ulps * torch.finfo(DTYPE).eps
    if op == "add_rms_norm":
        r_err = ((out[2].double() - ref[2].double()).abs() / ref[2].double().abs().clamp_min(1e-30)).max()
        ok = ok and r_err.item() <= (ulps - 1) * torch.finfo(DTYPE).eps
    return {"correct": ok, "max_code_diff": max_code_diff, "max_scale_rel_err": scale_rel}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == FP8_DTYPE else t


def min_bytes(op: str, scheme: str, tokens: int, hidden: int) -> int:
    rows = tokens * hidden
    read = rows * DTYPE.itemsize * (2 if op == "add_rms_norm" else 1) + hidden * DTYPE.itemsize
    written = rows * FP8_DTYPE.itemsize + (rows * DTYPE.itemsize if op == "add_rms_norm" else 0)
    scales = {"static": 0, "per_token": tokens, "per_group": rows // GROUP_SIZE}[scheme]
    return read + written + 4 * scales


def bench_shape(op: str, scheme: str, hidden: int, tokens: int, device: str, timed: bool = True) -> dict:
    sets = [
        random_inputs(op, scheme, hidden, tokens, device)
        for _ in range(GRAPH_CALLS if device == "cuda" and timed else 1)
    ]
    record = {"op": op, "scheme": scheme, "hidden": hidden, "tokens": tokens}
    record.update(check_kernel(op, scheme, sets[0]))
    torch._dynamo.reset()  # static shapes: one compile per shape, clear of the recompile limit
    report = fusion_passes.Report()
    eager = eager_fn(op, scheme)
    fns = {
        "eager": eager,
        "inductor": torch.compile(eager, dynamic=False),
        "fusion_passes": torch.compile(
            eager,
            dynamic=False,
            backend=fusion_passes.backend(
                fusions=["add_rms_norm", "rms_norm", fusion_name(op, scheme)], report=report
            ),
        ),
        "kernel": kernel_fn(op, scheme),
        "same_traffic": torch.compile(same_traffic_fn(op), dynamic=False),
        "no_math": no_math_fn(op),
    }
    record["plain_us"], record["graph_us"], record["kernels"] = {}, {}, {}
    for impl, fn in fns.items():
        calls = [lambda s=s, fn=fn: fn(*s) for s in sets]
        out = calls[0]()  # compiles
        if impl == "fusion_passes":
            record["fused"] = report.matches[fusion_name(op, scheme)]
            # On a GPU both run the same kernel: equal bit for bit. On a CPU the compiled graph
            # runs the reference and the kernel the interpreter (checked above instead).
            record["fusion_passes_equals_kernel"] = device != "cuda" or all(
                torch.equal(_bits(a), _bits(b)) for a, b in zip(out, fns["kernel"](*sets[0]), strict=True)
            )
        if not timed:
            continue
        record["kernels"][impl] = kernels_per_call(calls[0])
        record["plain_us"][impl] = time_plain_us(calls[0])
        record["graph_us"][impl] = time_graph_us(calls)
    if not timed:  # a record without times: compiled and checked only (sweep.py's --compile-only)
        del record["plain_us"], record["graph_us"], record["kernels"]
    record["bytes"] = min_bytes(op, scheme, tokens, hidden)
    return record


def _us(v) -> str:
    return "—" if v is None else f"{v:.1f}"


def table(records: list[dict], mode: str, copy_gbps: float) -> list[str]:
    lines = [
        "| hidden | tokens | kernels (inductor / ours) | "
        + " | ".join(IMPLS)
        + " | inductor / fusion_passes | no-math / fusion_passes | fusion_passes % of copy |",
        "|---:|---:|---:|" + "---:|" * (len(IMPLS) + 3),
    ]
    for r in records:
        t = r[f"{mode}_us"]
        ratio = "—" if t["fusion_passes"] is None else f"{t['inductor'] / t['fusion_passes']:.2f}x"
        fastest_no_math = None if t["fusion_passes"] is None else min(t["same_traffic"], t["no_math"])
        traffic = "—" if fastest_no_math is None else f"{fastest_no_math / t['fusion_passes']:.2f}x"
        bw = "—"
        if r["tokens"] >= BANDWIDTH_MIN_TOKENS and t["fusion_passes"] is not None:
            bw = f"{100 * r['bytes'] / t['fusion_passes'] / 1e3 / copy_gbps:.0f}%"
        k = r["kernels"]
        lines.append(
            f"| {r['hidden']} | {r['tokens']} | {k['inductor']} / {k['fusion_passes']} | "
            + " | ".join(_us(t[i]) for i in IMPLS)
            + f" | {ratio} | {traffic} | {bw} |"
        )
    return lines


def summary(records: list[dict], copy_gbps: float) -> list[str]:
    """One line per op, scheme and hidden size, one column per token count: the speedup over stock
    Inductor inside a CUDA graph, and the percent of copy bandwidth where it is counted."""
    tokens = sorted({r["tokens"] for r in records})
    lines = [
        "| op | scheme | hidden | " + " | ".join(map(str, tokens)) + " |",
        "|---|---|---:|" + "---|" * len(tokens),
    ]
    for op in OPS:
        for scheme in SCHEMES:
            for hidden in sorted({r["hidden"] for r in records}, reverse=True):
                key = (op, scheme, hidden)
                cells = {r["tokens"]: r for r in records if (r["op"], r["scheme"], r["hidden"]) == key}
                if not cells:
                    continue
                row = []
                for t in tokens:
                    r = cells.get(t)
                    g = r and r["graph_us"]
                    if not g or g["fusion_passes"] is None:
                        row.append("—")
                        continue
                    cell = f"{g['inductor'] / g['fusion_passes']:.2f}x"
                    if t >= BANDWIDTH_MIN_TOKENS:
                        cell += f" ({100 * r['bytes'] / g['fusion_passes'] / 1e3 / copy_gbps:.0f}%)"
                    row.append(cell)
                lines.append(f"| {op} | {scheme} | {hidden} | " + " | ".join(row) + " |")
    return lines


def report(records: list[dict], copy_gbps: float, device_name: str) -> str:
    failed = failures(records)
    lines = [
        "# RMSNorm + FP8 quantization benchmark (Llama form, bf16 -> float8_e4m3fn)",
        "",
        f"Device: {device_name}; torch {torch.__version__}; triton {triton.__version__}; "
        f"copy bandwidth {copy_gbps:.0f} GB/s; eps {EPS}; group size {GROUP_SIZE}.",
        "",
        "- us per call, median. plain: do_bench (L2 flushed before each call); graph: "
        f"{GRAPH_CALLS} calls in one CUDA graph, each on its own inputs, per call.",
        "- fusion_passes: torch.compile with the fusion (our kernel launched from Inductor's code); "
        "kernel: our launcher called from Python. kernels: CUDA kernels per call (profiler).",
        f"- Checks (kernel vs reference; one fused site per compile; compiled output equal to the "
        f"kernel's): {'all shapes pass' if not failed else f'{len(failed)} FAILURES'}.",
    ]
    lines += ["", "## Summary: CUDA graph, stock Inductor / fusion_passes (% of copy from 4096 tokens)", ""]
    lines += summary(records, copy_gbps)
    for op in OPS:
        for scheme in SCHEMES:
            rows = [r for r in records if r["op"] == op and r["scheme"] == scheme]
            if not rows:
                continue
            lines += ["", f"## {fusion_name(op, scheme)}"]
            for mode, title in (("graph", "CUDA graph"), ("plain", "Plain launches")):
                lines += ["", f"### {title}", "", *table(rows, mode, copy_gbps)]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench_rms_norm_quant_fp8.md")
    parser.add_argument("--json", default="bench_rms_norm_quant_fp8.json")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes; CPU under TRITON_INTERPRET=1")
    parser.add_argument("--hidden", type=int, nargs="+")
    parser.add_argument("--tokens", type=int, nargs="+")
    parser.add_argument("--schemes", nargs="+", choices=SCHEMES, default=list(SCHEMES))
    parser.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS))
    add_sweep_args(parser)
    args = parser.parse_args()
    if args.merge:
        records, copy_gbps, device_name = merged(args.merge)
        return write_report(records, copy_gbps, device_name, args.out)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.smoke:
        parser.error("no CUDA device: only --smoke runs on a CPU")
    hidden = args.hidden or (SMOKE_HIDDEN if args.smoke else HIDDEN)
    tokens = args.tokens or (SMOKE_TOKENS if args.smoke else TOKENS)
    shapes = shard_of(
        [(op, s, h, t) for op in args.ops for s in args.schemes for h in hidden for t in tokens], args.shard
    )
    device_name = torch.cuda.get_device_name() if device == "cuda" else "CPU (Triton interpreter)"
    torch.manual_seed(0)
    copy_gbps = copy_bandwidth_gbps(COPY_BYTES if device == "cuda" else SMOKE_COPY_BYTES, device)
    with torch.no_grad():
        records = run_shapes(
            shapes,
            lambda op, scheme, h, t, timed: bench_shape(op, scheme, h, t, device, timed),
            lambda r: f"{fusion_name(r['op'], r['scheme'])} hidden={r['hidden']} tokens={r['tokens']} "
            f"correct={r['correct']} fused={r['fused']} equal={r['fusion_passes_equals_kernel']}",
            IMPLS,
            args.json,
            {"device": device_name, "copy_gbps": copy_gbps},
            timed=not args.compile_only,
        )
    if args.compile_only:
        return 1 if failures(records) else 0
    return write_report(records, copy_gbps, device_name, args.out)


def write_report(records: list[dict], copy_gbps: float, device_name: str, out: str) -> int:
    """The report of records (in the sweep's order: hidden as listed, then tokens) to out and stdout."""
    records = sorted(records, key=lambda r: (-r["hidden"], r["tokens"]))
    text = report(records, copy_gbps, device_name)
    Path(out).write_text(text)
    print(text)
    return 1 if failures(records) else 0


if __name__ == "__main__":
    sys.exit(main())
