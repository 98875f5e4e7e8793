"""Whole models at real width on one GPU: kernels per forward and forward time,
eager vs stock Inductor vs fusion_passes, with plain launches and in a CUDA graph.

Kernels are counted with the CUDA profiler and classified (GEMM, attention, MoE / grouped GEMM,
everything else); "other per layer" is the number vLLM reports for DeepSeek V3.2 (about 33 -> 10
kernels per layer outside attention and MoE).

    python benchmarks/bench_models.py --models deepseek-v3.2 qwen3.5-moe minimax-m2 --tokens 1 4096
    python benchmarks/bench_models.py --smoke    # tiny widths on a CPU: the code path, no timings
"""

from __future__ import annotations

import argparse
import json

import torch
import triton.testing

import fusion_passes
from fusion_passes.kernels import KERNEL_CLASSES, profile_kernel_classes
from fusion_passes.models import build_model


def forward_us(fn, inputs, graph: bool) -> float | None:
    if not torch.cuda.is_available():
        return None
    fn(*inputs)
    torch.cuda.synchronize()
    if not graph:
        return triton.testing.do_bench(lambda: fn(*inputs), warmup=25, rep=200, return_mode="median") * 1e3
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn(*inputs)
    return triton.testing.do_bench(g.replay, warmup=25, rep=200, return_mode="median") * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["deepseek-v3.2", "qwen3.5-moe", "minimax-m2"])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 4096])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--json", default=None)
    parser.add_argument("--smoke", action="store_true", help="tiny widths on a CPU, no timings")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.smoke:
        parser.error("no CUDA device: only --smoke runs on a CPU")
    size = "tiny" if args.smoke else "real"
    rows = []
    for name in args.models:
        for tokens in args.tokens:
            built = build_model(
                name, size=size, dtype=torch.bfloat16, layers=args.layers, seq_len=tokens, device=device
            )
            module, inputs = built.module.eval(), built.example_inputs
            torch._dynamo.reset()
            report = fusion_passes.Report()
            variants = {  # compiled lazily, on their first call below
                "eager": module,
                "inductor": torch.compile(module, backend="inductor", fullgraph=True),
                "fusion_passes": torch.compile(
                    module, backend=fusion_passes.backend(report=report), fullgraph=True
                ),
            }
            with torch.no_grad():
                expected = module(*inputs).float()
                for label, fn in variants.items():
                    kernels = profile_kernel_classes(fn, *inputs) if device == "cuda" else None
                    err = (fn(*inputs).float() - expected).norm().item() / expected.norm().item()
                    row = {
                        "model": name,
                        "tokens": tokens,
                        "variant": label,
                        "kernels": kernels,
                        "total_kernels": kernels and sum(kernels.values()),
                        "other_per_layer": kernels and kernels["other"] / args.layers,
                        "plain_us": forward_us(fn, inputs, graph=False),
                        "graph_us": forward_us(fn, inputs, graph=True),
                        "rel_err_vs_eager": err,
                    }
                    if label == "fusion_passes":
                        row["matches"] = {k: v for k, v in report.matches.items() if v}
                        row["errors"] = list(report.errors)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    if args.json:  # as it goes: a run cut short keeps what it measured
                        with open(args.json, "w") as f:
                            json.dump(rows, f, indent=2)
    print("\n| model | tokens | variant | kernels | " + " | ".join(KERNEL_CLASSES)
          + " | other / layer | plain (us) | CUDA graph (us) |")
    print("|---|---|---|---|" + "---|" * len(KERNEL_CLASSES) + "---|---|---|")
    for r in rows:
        if r["kernels"] is None:  # smoke run: nothing measured
            continue
        classes = " | ".join(str(r["kernels"][c]) for c in KERNEL_CLASSES)
        print(f"| {r['model']} | {r['tokens']} | {r['variant']} | {r['total_kernels']} | {classes} | "
              f"{r['other_per_layer']:.1f} | {r['plain_us']:.0f} | {r['graph_us']:.0f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
