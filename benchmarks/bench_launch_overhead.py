"""Host cost of a fused op inside a compiled graph: custom-op dispatch vs direct Triton launch.

A chain of L decoder layers reduced to their norm and a GEMM at decode size
(residual = residual + x; n = RMSNorm(residual); x = (n @ down) @ up, a rank-64 projection so the
GEMMs stay small), compiled three ways: stock Inductor (its own add+norm kernel per layer),
fusion_passes with launch="dispatch" (each fused op called through the PyTorch dispatcher, which
launches the Triton kernel from Python) and launch="direct" (Inductor emits the Triton launch in its
own code). The GEMMs keep Inductor from fusing the layers' norms into one kernel (without them it
fuses all 16 row-local norms of a 1-token chain into a single kernel). All three run the same
number of kernels, so the difference per layer is host cost. Timed per call with plain launches
(host-bound at these sizes) and as a CUDA-graph replay.

    python benchmarks/bench_launch_overhead.py --layers 16 --tokens 1 4 64 --hidden 7168
"""

from __future__ import annotations

import argparse
import functools
import json

import torch
import triton.testing
from timing import host_us

import fusion_passes
from fusion_passes.patterns.rms_norm import llama_rms_norm


def chain(x, residual, down, up, *weights):
    for w in weights:
        residual = residual + x
        x = (llama_rms_norm(residual, w, 1e-6) @ down) @ up
    return x, residual


def graph_us(fn):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return triton.testing.do_bench(graph.replay, warmup=25, rep=200, return_mode="median") * 1e3


def kernels_per_call(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 64])
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rows = []
    for tokens in args.tokens:
        x = torch.randn(tokens, args.hidden, device="cuda", dtype=torch.bfloat16)
        residual = torch.randn_like(x)
        weights = [
            (1 + 0.2 * torch.randn(args.hidden, device="cuda")).to(torch.bfloat16)
            for _ in range(args.layers)
        ]
        down = torch.randn(args.hidden, 64, device="cuda", dtype=torch.bfloat16) / args.hidden**0.5
        up = torch.randn(64, args.hidden, device="cuda", dtype=torch.bfloat16) / 8
        inputs = (x, residual, down, up, *weights)
        variants = {
            "inductor": "inductor",
            "fp dispatch": fusion_passes.backend(launch="dispatch"),
            "fp direct": fusion_passes.backend(launch="direct"),
        }
        expected = chain(*inputs)
        for name, backend in variants.items():
            torch._dynamo.reset()
            compiled = torch.compile(chain, backend=backend)
            out = compiled(*inputs)
            err = max((a.float() - e.float()).abs().max().item() for a, e in zip(out, expected))
            run = functools.partial(compiled, *inputs)
            rows.append(
                {
                    "tokens": tokens,
                    "variant": name,
                    "kernels": kernels_per_call(run),
                    "plain_us": host_us(run),
                    "graph_us": graph_us(run),
                    "max_abs_err_vs_eager": err,
                }
            )
            r = rows[-1]
            print(
                f"tokens {tokens:5d} {name:12s} kernels {r['kernels']:3d} "
                f"plain {r['plain_us']:8.1f} us  graph {r['graph_us']:7.1f} us  err {err:.3g}",
                flush=True,
            )
    print("\n| tokens | variant | kernels | plain launches (us/call) | per layer | CUDA graph (us/call) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['tokens']} | {r['variant']} | {r['kernels']} | {r['plain_us']:.1f} | "
            f"{r['plain_us'] / args.layers:.2f} | {r['graph_us']:.1f} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"layers": args.layers, "hidden": args.hidden, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
