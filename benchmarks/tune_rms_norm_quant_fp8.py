"""Launch-shape sweep of the (add +) RMSNorm + FP8 quantization kernel (Llama form, bf16, one GPU):
the kernel alone, inside a CUDA graph of GRAPH_CALLS calls, for every (rows per program, warps)
pair, per hidden size, token count and dynamic scheme, against the default launch
(rms_norm_triton.launch_config of the padded row).

    python benchmarks/tune_rms_norm_quant_fp8.py [--hidden 7168 4096 3072] [--tokens 1 4096]
        [--no-residual] [--out tune_rms_norm_quant_fp8.md]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # timing.py

from fusion_passes.lowering.rms_norm_quant_fp8_triton import rms_norm_quant_fp8_triton  # noqa: E402
from fusion_passes.lowering.rms_norm_triton import launch_config  # noqa: E402

from timing import time_graph_us  # noqa: E402

DTYPE, EPS, GROUP = torch.bfloat16, 1e-6, 128
GRAPH_CALLS = 20
ROWS = (1, 2, 4)
WARPS = (2, 4, 8, 16)
SCHEMES = ("per_token", "per_group")


def _inputs(tokens, hidden, g):
    return dict(
        x=torch.randn(tokens, hidden, generator=g).to("cuda", DTYPE),
        residual=torch.randn(tokens, hidden, generator=g).to("cuda", DTYPE),
        w=(1 + 0.1 * torch.randn(hidden, generator=g)).to("cuda", DTYPE),
    )


def _default(hidden, scheme) -> tuple[int, int]:
    groups, group = (hidden // GROUP, GROUP) if scheme == "per_group" else (1, hidden)
    _, rows, warps = launch_config(triton.next_power_of_2(groups) * triton.next_power_of_2(group))
    return rows, warps


def sweep(
    hidden: int, tokens: int, scheme: str, g, rows_options, warps_options, residual: bool = True
) -> list[tuple[int, int, float]]:
    sets = [_inputs(tokens, hidden, g) for _ in range(GRAPH_CALLS)]
    results = []
    shapes = {(rows, warps) for rows in rows_options for warps in warps_options}
    shapes = sorted(shapes | {_default(hidden, scheme)})
    for rows, warps in shapes:
        calls = [
            lambda x=x: rms_norm_quant_fp8_triton(
                x["x"],
                x["w"],
                EPS,
                0.0,
                True,
                scheme,
                None,
                GROUP,
                False,
                x["residual"] if residual else None,
                rows=rows,
                num_warps=warps,
            )  # fmt: skip
            for x in sets
        ]
        results.append((rows, warps, time_graph_us(calls)))
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, nargs="+", default=[7168, 4096, 3072])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 4096])
    parser.add_argument("--schemes", nargs="+", choices=SCHEMES, default=list(SCHEMES))
    parser.add_argument("--rows", type=int, nargs="+", default=list(ROWS), help="rows per program")
    parser.add_argument("--warps", type=int, nargs="+", default=list(WARPS))
    parser.add_argument("--no-residual", action="store_true", help="RMSNorm + quant, no residual add")
    parser.add_argument("--out", default="tune_rms_norm_quant_fp8.md")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    g = torch.Generator().manual_seed(0)
    lines = [
        f"# {'' if args.no_residual else 'add + '}RMSNorm + FP8 launch shapes, bf16, {torch.cuda.get_device_name()} "
        "(CUDA graph, us per call)",
        "",
        "| hidden | tokens | scheme | default (rows, warps) | default us | best (rows, warps) | best us | default / best |",
        "|---:|---:|---|---|---:|---|---:|---:|",
    ]
    every = [
        "",
        "## Every shape",
        "",
        "| hidden | tokens | scheme | rows | warps | us |",
        "|---:|---:|---|---:|---:|---:|",
    ]
    for hidden in args.hidden:
        for tokens in args.tokens:
            for scheme in args.schemes:
                results = sweep(hidden, tokens, scheme, g, args.rows, args.warps, not args.no_residual)
                every += [
                    f"| {hidden} | {tokens} | {scheme} | {r} | {w} | {us:.2f} |" for r, w, us in results
                ]
                default = _default(hidden, scheme)
                default_us = next(us for rows, warps, us in results if (rows, warps) == default)
                rows, warps, best_us = min(results, key=lambda r: r[2])
                lines.append(
                    f"| {hidden} | {tokens} | {scheme} | {default} | {default_us:.2f} | ({rows}, {warps}) "
                    f"| {best_us:.2f} | {default_us / best_us:.2f}x |"
                )
                print(lines[-1], flush=True)
    text = "\n".join(lines + every) + "\n"
    Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
