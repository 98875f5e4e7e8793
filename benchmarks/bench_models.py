"""Whole models at real width on one GPU: kernels per forward and forward time,
eager vs stock Inductor vs fusion_passes, with plain launches and in a CUDA graph.

Kernels are counted with the CUDA profiler and classified (GEMM, attention, MoE / grouped GEMM,
everything else); "other per layer" is the number vLLM reports for DeepSeek V3.2 (about 33 -> 10
kernels per layer outside attention and MoE). Times as in benchmarks/timing.py: plain is
do_bench's median, graph one forward captured in a CUDA graph, the replay's median.

    python -m benchmarks.bench_models --models deepseek-v3.2 qwen3.5-moe minimax-m2 --tokens 1 4096
    python -m benchmarks.bench_models --smoke    # tiny widths on a CPU: the code path, no timings
"""

from __future__ import annotations

import json
import sys

import torch

import fusion_passes
from benchmarks import common
from benchmarks.timing import time_graph_us, time_plain_us
from fusion_passes.kernels import KERNEL_CLASSES, profile_kernel_classes
from fusion_passes.models import build_model


def forward_us(fn, inputs, graph: bool) -> float | None:
    """Median microseconds of one forward (None without a GPU)."""
    if not torch.cuda.is_available():
        return None
    fn(*inputs)
    torch.cuda.synchronize()
    return time_graph_us([lambda: fn(*inputs)]) if graph else time_plain_us(lambda: fn(*inputs))


def main() -> int:
    parser = common.parser(__doc__, "bench_models", md=False, json_default=False,
                           smoke="tiny widths on a CPU, no timings")  # fmt: skip
    parser.add_argument("--models", nargs="+", default=["deepseek-v3.2", "qwen3.5-moe", "minimax-m2"])
    common.add_sizes(parser, "--tokens", [1, 4096], what="token counts")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--keep-standalone", action="store_true",
                        help="also time fusion_passes with lower_back=False (standalone canonical "
                             "ops kept as kernels), to measure the lower-back stage")  # fmt: skip
    args = common.parse(parser)
    device = common.device(parser, args.smoke)
    size = "tiny" if args.smoke else "real"
    rows = []
    for name in args.models:
        for tokens in args.tokens:
            built = build_model(
                name, size=size, dtype=torch.bfloat16, layers=args.layers, seq_len=tokens, device=device
            )
            module, inputs = built.module.eval(), built.example_inputs
            torch._dynamo.reset()
            reports = {"fusion_passes": fusion_passes.Report()}
            variants = {  # compiled lazily, on their first call below
                "eager": module,
                "inductor": torch.compile(module, backend="inductor", fullgraph=True),
                "fusion_passes": torch.compile(
                    module, backend=fusion_passes.backend(report=reports["fusion_passes"]), fullgraph=True
                ),
            }
            if args.keep_standalone:
                reports["fusion_passes_kept"] = fusion_passes.Report()
                variants["fusion_passes_kept"] = torch.compile(
                    module,
                    backend=fusion_passes.backend(report=reports["fusion_passes_kept"], lower_back=False),
                    fullgraph=True,
                )
            with torch.no_grad():
                expected = module(*inputs).float()
                for label, fn in variants.items():
                    kernels = profile_kernel_classes(fn, *inputs) if device == "cuda" else None
                    err = (fn(*inputs).float() - expected).norm().item() / expected.norm().item()
                    row = {
                        "model": name,
                        "layers": args.layers,
                        "tokens": tokens,
                        "variant": label,
                        "kernels": kernels,
                        "total_kernels": kernels and sum(kernels.values()),
                        "other_per_layer": kernels and kernels["other"] / args.layers,
                        "plain_us": forward_us(fn, inputs, graph=False),
                        "graph_us": forward_us(fn, inputs, graph=True),
                        "rel_err_vs_eager": err,
                    }
                    if label in reports:
                        report = reports[label]
                        row["matches"] = {k: v for k, v in report.matches.items() if v}
                        row["lowered_back"] = dict(report.lowered_back())
                        row["errors"] = list(report.errors)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    if args.json:  # as it goes: a run cut short keeps what it measured
                        common.write_json(args.json, {"layers": args.layers, "rows": rows})
    print("\n| model | tokens | variant | kernels | " + " | ".join(KERNEL_CLASSES)
          + " | other / layer | plain (us) | CUDA graph (us) |")  # fmt: skip
    print("|---|---|---|---|" + "---|" * len(KERNEL_CLASSES) + "---|---|---|")
    for r in rows:
        if r["kernels"] is None:  # smoke run: nothing measured
            continue
        classes = " | ".join(str(r["kernels"][c]) for c in KERNEL_CLASSES)
        print(f"| {r['model']} | {r['tokens']} | {r['variant']} | {r['total_kernels']} | {classes} | "
              f"{r['other_per_layer']:.1f} | {r['plain_us']:.0f} | {r['graph_us']:.0f} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
