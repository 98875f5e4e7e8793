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

    python -m benchmarks.bench_rms_norm_quant_fp8 [--out PATH.md] [--json PATH.json]
    python -m benchmarks.bench_rms_norm_quant_fp8 --smoke    # tiny sizes; CPU via the interpreter
    python -m benchmarks.bench_rms_norm_quant_fp8 --shard 0/2 --json a.json   # half the shapes
    python -m benchmarks.bench_rms_norm_quant_fp8 --merge a.json b.json       # one report of both

--compile-only fills Inductor's caches first, several shards at once (benchmarks/sweep.py,
benchmarks/run_gpu_sweep.sh).
"""

from __future__ import annotations

import itertools
import sys

import torch

from benchmarks import common

INTERPRETED = common.interpret_smoke_run()  # before triton is imported

from benchmarks import sweep  # noqa: E402
from benchmarks.no_math import no_math_fn  # noqa: E402
from benchmarks.sweep import BANDWIDTH_MIN_TOKENS, FP8_DTYPE, SCHEMES, pct_of_copy  # noqa: E402
from fusion_passes.lowering.common.fp8 import QuantFP8  # noqa: E402
from fusion_passes.lowering.rms_norm.reference import RMSNormForm  # noqa: E402
from fusion_passes.lowering.rms_norm_quant_fp8.reference import (  # noqa: E402
    add_rms_norm_quant_fp8_reference,
    rms_norm_quant_fp8_reference,
)
from fusion_passes.lowering.rms_norm_quant_fp8.triton import rms_norm_quant_fp8_triton  # noqa: E402
from fusion_passes.numerics import fp8_codes_apart  # noqa: E402
from fusion_passes.patterns.rms_norm import llama_rms_norm  # noqa: E402
from benchmarks.spellings import GROUP_SIZE  # noqa: E402

HIDDEN = (7168, 4096, 3072)  # DeepSeek V3, Qwen 3 8B, Llama 3.2 3B
SMOKE_HIDDEN = (256,)
OPS = ("rms_norm", "add_rms_norm")
IMPLS = ("eager", "inductor", "fusion_passes", "kernel", "same_traffic", "no_math")
DTYPE, EPS = torch.bfloat16, 1e-6
LLAMA = RMSNormForm(EPS, weight_offset=0.0, cast_before_weight=True)  # the spelling eager_fn writes


def eager_fn(op: str, scheme: str):
    """The unfused spelling: (x, [residual,] weight, scale) -> (q, scales[, r])."""
    quant = sweep.quantize(scheme)
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
        q, s, r = rms_norm_quant_fp8_triton(x, weight, LLAMA, QuantFP8(scheme, scale, GROUP_SIZE), residual)
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
    reference = add_rms_norm_quant_fp8_reference if op == "add_rms_norm" else rms_norm_quant_fp8_reference
    ref = reference(x, *rest[:-1], LLAMA, QuantFP8(scheme, rest[-1], GROUP_SIZE))
    out = kernel_fn(op, scheme)(*args)
    max_code_diff = fp8_codes_apart(out[0], ref[0])
    scale_rel = ((out[1] - ref[1]).abs() / ref[1].abs()).max().item()
    ulps = 2 if INTERPRETED else 1
    ok = max_code_diff <= 1 and scale_rel <= 2 * ulps * torch.finfo(DTYPE).eps
    if op == "add_rms_norm":
        r_err = ((out[2].double() - ref[2].double()).abs() / ref[2].double().abs().clamp_min(1e-30)).max()
        ok = ok and r_err.item() <= (ulps - 1) * torch.finfo(DTYPE).eps
    return {"correct": ok, "max_code_diff": max_code_diff, "max_scale_rel_err": scale_rel}


def min_bytes(op: str, scheme: str, tokens: int, hidden: int) -> int:
    rows = tokens * hidden
    read = rows * DTYPE.itemsize * (2 if op == "add_rms_norm" else 1) + hidden * DTYPE.itemsize
    written = rows * FP8_DTYPE.itemsize + (rows * DTYPE.itemsize if op == "add_rms_norm" else 0)
    scales = {"static": 0, "per_token": tokens, "per_group": rows // GROUP_SIZE}[scheme]
    return read + written + 4 * scales


def bench_shape(op: str, scheme: str, hidden: int, tokens: int, device: str, timed: bool = True) -> dict:
    sets = sweep.input_sets(lambda: random_inputs(op, scheme, hidden, tokens, device), device, timed)
    record = {"op": op, "scheme": scheme, "hidden": hidden, "tokens": tokens}
    record.update(check_kernel(op, scheme, sets[0]))
    fusion = fusion_name(op, scheme)
    report, fns = sweep.compiled_variants(eager_fn(op, scheme), ["add_rms_norm", "rms_norm", fusion])
    fns["kernel"] = kernel_fn(op, scheme)
    fns["same_traffic"] = torch.compile(same_traffic_fn(op), dynamic=False)
    fns["no_math"] = no_math_fn(op)
    sweep.measure(record, fns, sets, fusion, report, device, timed)
    record["bytes"] = min_bytes(op, scheme, tokens, hidden)
    return record


def table(records: list[dict], mode: str, copy_gbps: float) -> list[str]:
    """The sweep's table, with the faster of the two no-math kernels' times over fusion_passes'."""

    def no_math(t):
        ours = t["fusion_passes"]
        return common.ratio(None if ours is None else min(t["same_traffic"], t["no_math"]), ours)

    return sweep.table(records, mode, copy_gbps, "hidden", IMPLS, ("no-math / fusion_passes", no_math))


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
                    cell = common.ratio(g["inductor"], g["fusion_passes"])
                    if t >= BANDWIDTH_MIN_TOKENS:
                        cell += f" ({pct_of_copy(r, g['fusion_passes'], copy_gbps)})"
                    row.append(cell)
                lines.append(f"| {op} | {scheme} | {hidden} | " + " | ".join(row) + " |")
    return lines


def report(records: list[dict], copy_gbps: float, device_name: str) -> str:
    title = "RMSNorm + FP8 quantization benchmark (Llama form, bf16 -> float8_e4m3fn)"
    lines = sweep.report_head(title, records, copy_gbps, device_name, f"eps {EPS}; group size {GROUP_SIZE}")
    lines += ["", "## Summary: CUDA graph, stock Inductor / fusion_passes (% of copy from 4096 tokens)", ""]
    lines += summary(records, copy_gbps)
    for op in OPS:
        for scheme in SCHEMES:
            rows = [r for r in records if r["op"] == op and r["scheme"] == scheme]
            lines += sweep.report_section(fusion_name(op, scheme), rows, table, copy_gbps)
    return "\n".join(lines) + "\n"


def main() -> int:
    name = "bench_rms_norm_quant_fp8"
    parser = sweep.parser(__doc__, name, "--hidden", HIDDEN, SMOKE_HIDDEN, "hidden sizes")
    parser.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS))
    args = common.parse(parser)
    shapes = list(itertools.product(args.ops, args.schemes, args.hidden, args.tokens))
    return sweep.main(
        parser,
        args,
        shapes,
        bench_shape,
        lambda r: f"{fusion_name(r['op'], r['scheme'])} hidden={r['hidden']} tokens={r['tokens']} "
        f"correct={r['correct']} fused={r['fused']} equal={r['fusion_passes_equals_kernel']}",
        IMPLS,
        report,
        "hidden",
    )


if __name__ == "__main__":
    sys.exit(main())
