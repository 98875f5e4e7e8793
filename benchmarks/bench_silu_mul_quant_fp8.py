"""Time SiLU-and-mul + FP8 quantization (bf16 in, float8_e4m3fn out) on one GPU, side by side, for
the three schemes.

    silu_mul+quant:  gate, up = gate_up.chunk(2, -1) (the merged gate_up projection's output;
                     --layouts separate: two tensors); y = silu(gate) * up; q, s = quant(y)
    quant: static (given scale), per_token (one scale per row), per_group (one per 128 columns)

Implementations:
- eager: the gated MLP's activation as models write it, then the quantization as serving engines
  write their native fallback: the spellings of fusion_passes.patterns.silu_mul_quant_fp8;
- inductor: torch.compile of that with stock Inductor (static shapes, one compile per shape);
- fusion_passes: torch.compile of that with the fusion_passes backend, the silu_mul_quant_fp8
  fusion enabled (our kernel launched from Inductor's code) -- checked to match once;
- kernel: our Triton kernel called from Python (its launcher's host cost included).

Times as in benchmarks/timing.py (plain: do_bench median, L2 flushed; graph: GRAPH_CALLS calls on
their own input sets in one CUDA graph, per call). Kernels per call from the CUDA profiler. The
fewest bytes: read gate and up, write the fp8 codes and the scales; at >= 4096 tokens that over
the time is given as a percent of the device's copy bandwidth. Every shape first checks the
kernel against the reference: codes at most one fp8 code apart, scales to bf16 rounding; the
codes that differ at all are counted (on a GPU the kernel's expf is torch's: 0 expected).

    python benchmarks/bench_silu_mul_quant_fp8.py [--out PATH.md] [--json PATH.json]
    python benchmarks/bench_silu_mul_quant_fp8.py --smoke    # tiny sizes; CPU via the interpreter

--shard, --compile-only and --merge split a sweep into parts (benchmarks/sweep.py).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

if "--smoke" in sys.argv and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must be set before triton is imported
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

import triton  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # timing.py

import fusion_passes  # noqa: E402
from fusion_passes.numerics import fp8_codes_apart  # noqa: E402
from fusion_passes.lowering.rms_norm_quant_fp8.reference import FP8_DTYPE  # noqa: E402
from fusion_passes.lowering.silu_mul_quant_fp8.reference import silu_mul_quant_fp8_reference  # noqa: E402
from fusion_passes.lowering.silu_mul_quant_fp8.triton import silu_mul_quant_fp8_triton  # noqa: E402
from fusion_passes.patterns.rms_norm_quant_fp8 import (  # noqa: E402
    GROUP_SIZE,
    quant_per_group,
    quant_per_token,
    quant_static,
)
from sweep import add_sweep_args, failures, merged, run_shapes, shard_of  # noqa: E402
from timing import copy_bandwidth_gbps, kernels_per_call, time_graph_us, time_plain_us  # noqa: E402

INTERMEDIATE = (18432, 12288, 2048)  # DeepSeek V3 dense MLP, Qwen 3 (32B), a MoE expert
TOKENS = (1, 4, 16, 64, 256, 1024, 4096, 16384)
SMOKE_INTERMEDIATE, SMOKE_TOKENS = (256,), (1, 64)
SCHEMES = ("static", "per_token", "per_group")
LAYOUTS = ("chunked", "separate")
IMPLS = ("eager", "inductor", "fusion_passes", "kernel")
BANDWIDTH_MIN_TOKENS = 4096
DTYPE = torch.bfloat16
GRAPH_CALLS = 20  # calls per captured graph (see bench_rms_norm.py: >= 4096 tokens come from HBM)
COPY_BYTES, SMOKE_COPY_BYTES = 2 * 10**9, 2 * 10**6


def _quant(scheme: str):
    def quant(y, scale):
        if scheme == "static":
            return quant_static(y, scale), scale
        return quant_per_token(y) if scheme == "per_token" else quant_per_group(y)

    return quant


def _halves(layout: str, inputs: tuple) -> tuple:
    """(gate, up) of one input set: the two views of gate_up, or the two tensors."""
    return inputs[0].chunk(2, -1) if layout == "chunked" else inputs[:2]


def eager_fn(layout: str, scheme: str):
    """The unfused spelling: (gate_up, scale) or (gate, up, scale) -> (q, scales)."""
    quant = _quant(scheme)
    if layout == "chunked":

        def chunked(gate_up, scale):
            gate, up = gate_up.chunk(2, -1)
            return quant(F.silu(gate) * up, scale)

        return chunked
    return lambda gate, up, scale: quant(F.silu(gate) * up, scale)


def kernel_fn(layout: str, scheme: str):
    """Our kernel called directly (on the two halves of gate_up: row-strided views, read in place)."""

    def call(*inputs):
        scale = inputs[-1] if scheme == "static" else None
        return silu_mul_quant_fp8_triton(*_halves(layout, inputs), scheme, scale, GROUP_SIZE, False)

    return call


def fusion_name(scheme: str) -> str:
    return f"silu_mul_quant_fp8_{scheme}"


def random_inputs(layout: str, scheme: str, intermediate: int, tokens: int, device: str) -> tuple:
    # A static scale a calibration would give: silu(g) * u of N(0, 1) inputs stays below ~10.
    scale = torch.tensor(10.0 / 448, device=device) if scheme == "static" else None
    if layout == "chunked":
        return torch.randn(tokens, 2 * intermediate, device=device).to(DTYPE), scale
    gate, up = (torch.randn(tokens, intermediate, device=device).to(DTYPE) for _ in range(2))
    return gate, up, scale


def check_kernel(layout: str, scheme: str, inputs: tuple) -> dict:
    """Kernel vs reference: codes at most one code apart, scales to one bf16 ulp of y (the
    kernel's exp may differ from torch's by an ulp: numpy's under the interpreter)."""
    scale = inputs[-1]
    ref = silu_mul_quant_fp8_reference(*_halves(layout, inputs), scheme, scale, GROUP_SIZE, False)
    out = kernel_fn(layout, scheme)(*inputs)
    max_code_diff = fp8_codes_apart(out[0], ref[0])
    codes_differing = (out[0].view(torch.uint8) != ref[0].view(torch.uint8)).sum().item()
    scale_rel = ((out[1] - ref[1]).abs() / ref[1].abs()).max().item()
    ok = max_code_diff <= 1 and scale_rel <= torch.finfo(DTYPE).eps
    return {
        "correct": ok,
        "max_code_diff": max_code_diff,
        "codes_differing": codes_differing,
        "max_scale_rel_err": scale_rel,
    }


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == FP8_DTYPE else t


def min_bytes(scheme: str, tokens: int, intermediate: int) -> int:
    elements = tokens * intermediate
    scales = {"static": 0, "per_token": tokens, "per_group": elements // GROUP_SIZE}[scheme]
    return 2 * elements * DTYPE.itemsize + elements * FP8_DTYPE.itemsize + 4 * scales


def bench_shape(
    layout: str, scheme: str, intermediate: int, tokens: int, device: str, timed: bool = True
) -> dict:
    sets = [
        random_inputs(layout, scheme, intermediate, tokens, device)
        for _ in range(GRAPH_CALLS if device == "cuda" and timed else 1)
    ]
    record = {"layout": layout, "scheme": scheme, "intermediate": intermediate, "tokens": tokens}
    record.update(check_kernel(layout, scheme, sets[0]))
    torch._dynamo.reset()  # static shapes: one compile per shape, clear of the recompile limit
    report = fusion_passes.Report()
    eager = eager_fn(layout, scheme)
    fns = {
        "eager": eager,
        "inductor": torch.compile(eager, dynamic=False),
        "fusion_passes": torch.compile(
            eager, dynamic=False, backend=fusion_passes.backend(fusions=[fusion_name(scheme)], report=report)
        ),
        "kernel": kernel_fn(layout, scheme),
    }
    record["plain_us"], record["graph_us"], record["kernels"] = {}, {}, {}
    for impl, fn in fns.items():
        calls = [lambda s=s, fn=fn: fn(*s) for s in sets]
        out = calls[0]()  # compiles
        if impl == "fusion_passes":
            record["fused"] = report.matches[fusion_name(scheme)]
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
    record["bytes"] = min_bytes(scheme, tokens, intermediate)
    return record


def _us(v) -> str:
    return "—" if v is None else f"{v:.1f}"


def table(records: list[dict], mode: str, copy_gbps: float) -> list[str]:
    lines = [
        "| intermediate | tokens | kernels (inductor / ours) | "
        + " | ".join(IMPLS)
        + " | inductor / fusion_passes | fusion_passes % of copy |",
        "|---:|---:|---:|" + "---:|" * (len(IMPLS) + 2),
    ]
    for r in records:
        t = r[f"{mode}_us"]
        ratio = "—" if t["fusion_passes"] is None else f"{t['inductor'] / t['fusion_passes']:.2f}x"
        bw = "—"
        if r["tokens"] >= BANDWIDTH_MIN_TOKENS and t["fusion_passes"] is not None:
            bw = f"{100 * r['bytes'] / t['fusion_passes'] / 1e3 / copy_gbps:.0f}%"
        k = r["kernels"]
        lines.append(
            f"| {r['intermediate']} | {r['tokens']} | {k['inductor']} / {k['fusion_passes']} | "
            + " | ".join(_us(t[i]) for i in IMPLS)
            + f" | {ratio} | {bw} |"
        )
    return lines


def report(records: list[dict], copy_gbps: float, device_name: str) -> str:
    failed = failures(records)
    differing = sum(r["codes_differing"] for r in records)
    lines = [
        "# SiLU-and-mul + FP8 quantization benchmark (bf16 -> float8_e4m3fn)",
        "",
        f"Device: {device_name}; torch {torch.__version__}; triton {triton.__version__}; "
        f"copy bandwidth {copy_gbps:.0f} GB/s; group size {GROUP_SIZE}.",
        "",
        "- us per call, median. plain: do_bench (L2 flushed before each call); graph: "
        f"{GRAPH_CALLS} calls in one CUDA graph, each on its own inputs, per call.",
        "- fusion_passes: torch.compile with the fusion (our kernel launched from Inductor's code); "
        "kernel: our launcher called from Python. kernels: CUDA kernels per call (profiler).",
        f"- Checks (kernel vs reference; one fused site per compile; compiled output equal to the "
        f"kernel's): {'all shapes pass' if not failed else f'{len(failed)} FAILURES'}; "
        f"codes differing from the reference's at all: {differing}.",
    ]
    for layout in LAYOUTS:
        for scheme in SCHEMES:
            rows = [r for r in records if r["layout"] == layout and r["scheme"] == scheme]
            if not rows:
                continue
            lines += ["", f"## {fusion_name(scheme)} ({layout})"]
            for mode, title in (("graph", "CUDA graph"), ("plain", "Plain launches")):
                lines += ["", f"### {title}", "", *table(rows, mode, copy_gbps)]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench_silu_mul_quant_fp8.md")
    parser.add_argument("--json", default="bench_silu_mul_quant_fp8.json")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes; CPU under TRITON_INTERPRET=1")
    parser.add_argument("--intermediate", type=int, nargs="+")
    parser.add_argument("--tokens", type=int, nargs="+")
    parser.add_argument("--schemes", nargs="+", choices=SCHEMES, default=list(SCHEMES))
    parser.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=["chunked"])
    add_sweep_args(parser)
    args = parser.parse_args()
    if args.merge:
        records, copy_gbps, device_name = merged(args.merge)
        return write_report(records, copy_gbps, device_name, args.out)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.smoke:
        parser.error("no CUDA device: only --smoke runs on a CPU")
    intermediate = args.intermediate or (SMOKE_INTERMEDIATE if args.smoke else INTERMEDIATE)
    tokens = args.tokens or (SMOKE_TOKENS if args.smoke else TOKENS)
    shapes = shard_of(
        [(lay, s, n, t) for lay in args.layouts for s in args.schemes for n in intermediate for t in tokens],
        args.shard,
    )
    device_name = torch.cuda.get_device_name() if device == "cuda" else "CPU (Triton interpreter)"
    torch.manual_seed(0)
    copy_gbps = copy_bandwidth_gbps(COPY_BYTES if device == "cuda" else SMOKE_COPY_BYTES, device)
    with torch.no_grad():
        records = run_shapes(
            shapes,
            lambda layout, scheme, n, t, timed: bench_shape(layout, scheme, n, t, device, timed),
            lambda r: f"{fusion_name(r['scheme'])} {r['layout']} intermediate={r['intermediate']} "
            f"tokens={r['tokens']} correct={r['correct']} differing={r['codes_differing']} "
            f"fused={r['fused']} equal={r['fusion_passes_equals_kernel']}",
            IMPLS,
            args.json,
            {"device": device_name, "copy_gbps": copy_gbps},
            timed=not args.compile_only,
        )
    if args.compile_only:
        return 1 if failures(records) else 0
    return write_report(records, copy_gbps, device_name, args.out)


def write_report(records: list[dict], copy_gbps: float, device_name: str, out: str) -> int:
    """The report of records (in the sweep's order: intermediate as listed, then tokens) to out and stdout."""
    records = sorted(records, key=lambda r: (-r["intermediate"], r["tokens"]))
    text = report(records, copy_gbps, device_name)
    Path(out).write_text(text)
    print(text)
    return 1 if failures(records) else 0


if __name__ == "__main__":
    sys.exit(main())
