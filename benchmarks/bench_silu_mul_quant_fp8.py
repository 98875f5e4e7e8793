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

    python -m benchmarks.bench_silu_mul_quant_fp8 [--out PATH.md] [--json PATH.json]
    python -m benchmarks.bench_silu_mul_quant_fp8 --smoke    # tiny sizes; CPU via the interpreter

--shard, --compile-only and --merge split a sweep into parts (benchmarks/sweep.py).
"""

from __future__ import annotations

import itertools
import sys

import torch
import torch.nn.functional as F

from benchmarks import common

INTERPRETED = common.interpret_smoke_run()  # before triton is imported

from benchmarks import sweep  # noqa: E402
from benchmarks.sweep import FP8_DTYPE, SCHEMES  # noqa: E402
from fusion_passes.lowering.common.fp8 import QuantFP8  # noqa: E402
from fusion_passes.lowering.silu_mul_quant_fp8.reference import silu_mul_quant_fp8_reference  # noqa: E402
from fusion_passes.lowering.silu_mul_quant_fp8.triton import silu_mul_quant_fp8_triton  # noqa: E402
from fusion_passes.numerics import fp8_codes_apart  # noqa: E402
from benchmarks.spellings import GROUP_SIZE  # noqa: E402

INTERMEDIATE = (18432, 12288, 2048)  # DeepSeek V3 dense MLP, Qwen 3 (32B), a MoE expert
SMOKE_INTERMEDIATE = (256,)
LAYOUTS = ("chunked", "separate")
IMPLS = ("eager", "inductor", "fusion_passes", "kernel")
DTYPE = torch.bfloat16


def _halves(layout: str, inputs: tuple) -> tuple:
    """(gate, up) of one input set: the two views of gate_up, or the two tensors."""
    return inputs[0].chunk(2, -1) if layout == "chunked" else inputs[:2]


def eager_fn(layout: str, scheme: str):
    """The unfused spelling: (gate_up, scale) or (gate, up, scale) -> (q, scales)."""
    quant = sweep.quantize(scheme)
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
        return silu_mul_quant_fp8_triton(*_halves(layout, inputs), QuantFP8(scheme, scale, GROUP_SIZE))

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
    ref = silu_mul_quant_fp8_reference(*_halves(layout, inputs), QuantFP8(scheme, scale, GROUP_SIZE))
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


def min_bytes(scheme: str, tokens: int, intermediate: int) -> int:
    elements = tokens * intermediate
    scales = {"static": 0, "per_token": tokens, "per_group": elements // GROUP_SIZE}[scheme]
    return 2 * elements * DTYPE.itemsize + elements * FP8_DTYPE.itemsize + 4 * scales


def bench_shape(
    layout: str, scheme: str, intermediate: int, tokens: int, device: str, timed: bool = True
) -> dict:
    make = lambda: random_inputs(layout, scheme, intermediate, tokens, device)  # noqa: E731
    sets = sweep.input_sets(make, device, timed)
    record = {"layout": layout, "scheme": scheme, "intermediate": intermediate, "tokens": tokens}
    record.update(check_kernel(layout, scheme, sets[0]))
    report, fns = sweep.compiled_variants(eager_fn(layout, scheme), [fusion_name(scheme)])
    fns["kernel"] = kernel_fn(layout, scheme)
    sweep.measure(record, fns, sets, fusion_name(scheme), report, device, timed)
    record["bytes"] = min_bytes(scheme, tokens, intermediate)
    return record


def table(records: list[dict], mode: str, copy_gbps: float) -> list[str]:
    return sweep.table(records, mode, copy_gbps, "intermediate", IMPLS)


def report(records: list[dict], copy_gbps: float, device_name: str) -> str:
    differing = sum(r["codes_differing"] for r in records)
    title = "SiLU-and-mul + FP8 quantization benchmark (bf16 -> float8_e4m3fn)"
    lines = sweep.report_head(title, records, copy_gbps, device_name, f"group size {GROUP_SIZE}",
                              f"; codes differing from the reference's at all: {differing}")  # fmt: skip
    for layout in LAYOUTS:
        for scheme in SCHEMES:
            rows = [r for r in records if r["layout"] == layout and r["scheme"] == scheme]
            lines += sweep.report_section(f"{fusion_name(scheme)} ({layout})", rows, table, copy_gbps)
    return "\n".join(lines) + "\n"


def main() -> int:
    name = "bench_silu_mul_quant_fp8"
    parser = sweep.parser(__doc__, name, "--intermediate", INTERMEDIATE, SMOKE_INTERMEDIATE, "intermediates")
    parser.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=["chunked"])
    args = common.parse(parser)
    shapes = list(itertools.product(args.layouts, args.schemes, args.intermediate, args.tokens))
    return sweep.main(
        parser,
        args,
        shapes,
        bench_shape,
        lambda r: f"{fusion_name(r['scheme'])} {r['layout']} intermediate={r['intermediate']} "
        f"tokens={r['tokens']} correct={r['correct']} differing={r['codes_differing']} "
        f"fused={r['fused']} equal={r['fusion_passes_equals_kernel']}",
        IMPLS,
        report,
        "intermediate",
    )


if __name__ == "__main__":
    sys.exit(main())
