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

    python -m benchmarks.bench_launch_overhead --layers 16 --tokens 1 4 64 --hidden 7168
"""

from __future__ import annotations

import functools
import sys

import torch

import fusion_passes
from benchmarks import common
from benchmarks.timing import host_us, kernels_per_call, time_graph_us
from fusion_passes.patterns.rms_norm import llama_rms_norm


def chain(x, residual, down, up, *weights):
    for w in weights:
        residual = residual + x
        x = (llama_rms_norm(residual, w, 1e-6) @ down) @ up
    return x, residual


def main() -> int:
    parser = common.parser(__doc__, "bench_launch_overhead", md=False, json_default=False)
    parser.add_argument("--layers", type=int, default=16)
    common.add_sizes(parser, "--tokens", [1, 4, 64], what="token counts")
    parser.add_argument("--hidden", type=int, default=7168)
    args = common.parse(parser)
    common.require_cuda(parser, "the host cost of a launch is what it measures")
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
                    "graph_us": time_graph_us([run]),
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
        common.write_json(args.json, {"device": torch.cuda.get_device_name(), "layers": args.layers,
                                      "hidden": args.hidden, "rows": rows})  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
