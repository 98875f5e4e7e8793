"""Launch-shape sweep of the FP8 quantization kernels (bf16, one GPU): (add +) RMSNorm + quant
(Llama form) or SiLU-and-mul + quant, the kernel alone inside a CUDA graph of GRAPH_CALLS calls,
for every (rows per program, warps[, columns a program]) shape, per hidden (or intermediate)
size, token count and scheme, against the default launch for the token count
(rms_norm_quant_fp8.launch.launch_shape under the GPU's launch table row;
silu_mul_quant_fp8.triton.launch_layout).

    python -m tools.tune_rms_norm_quant_fp8 [--op add_rms_norm | rms_norm | silu_mul]
        [--hidden 7168 4096 3072] [--tokens 1 4096] [--out tune_rms_norm_quant_fp8.md]
        [--chunks 1 0]    # rms_norm: a row in 1 padded block, or norm_only_chunks' (0) exact chunks

The columns column is silu_mul's columns a program, or rms_norm's chunks a row (0: the default).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from benchmarks.timing import time_graph_us
from fusion_passes.lowering.common.fp8 import QuantFP8
from fusion_passes.lowering.rms_norm.reference import RMSNormForm
from fusion_passes.lowering.rms_norm_quant_fp8.launch import launch_policy, launch_shape
from fusion_passes.lowering.rms_norm_quant_fp8.triton import rms_norm_quant_fp8_triton
from fusion_passes.lowering.silu_mul_quant_fp8.silu import takes_mufu_silu
from fusion_passes.lowering.silu_mul_quant_fp8.triton import launch_layout, silu_mul_quant_fp8_triton

DTYPE, EPS, GROUP = torch.bfloat16, 1e-6, 128
STATIC_SCALE = 0.02
GRAPH_CALLS = 20
ROWS = (1, 2, 4)
WARPS = (2, 4, 8, 16)
SCHEMES = ("static", "per_token", "per_group")
OPS = ("add_rms_norm", "rms_norm", "silu_mul")


def _inputs(tokens, hidden, g):
    """Drawn on the GPU (g a CUDA generator): 20 sets of 16384 x 7168 take minutes on a CPU."""
    return dict(
        x=torch.randn(tokens, hidden, device="cuda", generator=g).to(DTYPE),
        residual=torch.randn(tokens, hidden, device="cuda", generator=g).to(DTYPE),
        w=(1 + 0.1 * torch.randn(hidden, device="cuda", generator=g)).to(DTYPE),
    )


def _default(op, hidden, tokens, scheme) -> tuple[int, int, int | None]:
    """(rows, warps, columns) of the default launch; columns: a silu_mul static / per_group
    program's (None for per_token and add_rms_norm, whose programs hold whole rows), or 0 for
    rms_norm (its chunks a row as norm_only_chunks gives them)."""
    if op == "silu_mul":
        mufu = takes_mufu_silu(DTYPE, torch.cuda.get_device_capability())
        layout = launch_layout(hidden, scheme, GROUP, tokens, mufu_silu=mufu)
        columns = None if scheme == "per_token" else layout.block_groups * layout.block_group
        return layout.rows, layout.num_warps, columns
    groups, group = (hidden // GROUP, GROUP) if scheme == "per_group" else (1, hidden)
    policy = launch_policy(torch.device("cuda"))
    _, _, rows, warps = launch_shape(groups, group, tokens, norm_only=op == "rms_norm", policy=policy)
    return rows, warps, 0 if op == "rms_norm" else None


def _call(op, x, scheme, scale, rows, warps, columns):
    """One launch of op's kernel on the inputs x (silu_mul: gate = x, up = residual); columns:
    silu_mul's columns a program, rms_norm's chunks a row (None or 0: the default)."""
    if op == "silu_mul":
        return silu_mul_quant_fp8_triton(
            x["x"], x["residual"], QuantFP8(scheme, scale, GROUP), rows=rows, num_warps=warps, columns=columns
        )
    residual = x["residual"] if op == "add_rms_norm" else None
    chunks = (columns or None) if op == "rms_norm" else None
    return rms_norm_quant_fp8_triton(
        x["x"], x["w"], RMSNormForm(EPS, 0.0, True), QuantFP8(scheme, scale, GROUP), residual,
        rows=rows, num_warps=warps, chunks=chunks,
    )  # fmt: skip


def sweep(
    op, hidden: int, tokens: int, scheme: str, g, rows_options, warps_options, columns_options
) -> list[tuple[int, int, int | None, float]]:
    sets = [_inputs(tokens, hidden, g) for _ in range(GRAPH_CALLS)]
    scale = torch.tensor(STATIC_SCALE, device="cuda") if scheme == "static" else None
    if op == "add_rms_norm" or (op == "silu_mul" and scheme == "per_token"):
        columns_options = [None]
    elif op == "rms_norm":  # chunks a row: 0 is norm_only_chunks' (the default launch's)
        columns_options = [c or 0 for c in columns_options]
    results = []
    shapes = {(r, w, c) for r in rows_options for w in warps_options for c in columns_options}
    shapes.add(_default(op, hidden, tokens, scheme))
    for rows, warps, columns in sorted(shapes, key=lambda s: (s[0], s[1], s[2] or 0)):
        calls = [lambda x=x: _call(op, x, scheme, scale, rows, warps, columns) for x in sets]
        results.append((rows, warps, columns, time_graph_us(calls)))
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, nargs="+", default=[7168, 4096, 3072])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 4096])
    parser.add_argument("--op", choices=OPS, default="add_rms_norm")
    parser.add_argument("--schemes", nargs="+", choices=SCHEMES, default=["per_token", "per_group"])
    parser.add_argument("--rows", type=int, nargs="+", default=list(ROWS), help="rows per program")
    parser.add_argument("--warps", type=int, nargs="+", default=list(WARPS))
    parser.add_argument(
        "--columns",
        "--chunks",
        type=int,
        nargs="+",
        default=[None],
        help="silu_mul static / per_group: columns a program; rms_norm: chunks a row (0: default)",
    )
    parser.add_argument("--out", default="tune_rms_norm_quant_fp8.md")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    g = torch.Generator(device="cuda").manual_seed(0)
    lines = [
        f"# {args.op} + FP8 launch shapes, bf16, {torch.cuda.get_device_name()} (CUDA graph, us per call)",
        "",
        "| hidden | tokens | scheme | default (rows, warps, columns) | default us | best (rows, warps, columns) "
        "| best us | default / best |",
        "|---:|---:|---|---|---:|---|---:|---:|",
    ]
    every = [
        "",
        "## Every shape",
        "",
        "| hidden | tokens | scheme | rows | warps | columns | us |",
        "|---:|---:|---|---:|---:|---:|---:|",
    ]
    for hidden in args.hidden:
        for tokens in args.tokens:
            for scheme in args.schemes:
                results = sweep(args.op, hidden, tokens, scheme, g, args.rows, args.warps, args.columns)
                shapes = [
                    f"| {hidden} | {tokens} | {scheme} | {r} | {w} | {'-' if c is None else c} | {us:.2f} |"
                    for r, w, c, us in results
                ]
                print("\n".join(shapes), flush=True)  # kept in the log if a time limit cuts the run
                every += shapes
                default = _default(args.op, hidden, tokens, scheme)
                default_us = next(us for *shape, us in results if tuple(shape) == default)
                *best, best_us = min(results, key=lambda r: r[-1])
                lines.append(
                    f"| {hidden} | {tokens} | {scheme} | {default} | {default_us:.2f} | {tuple(best)} "
                    f"| {best_us:.2f} | {default_us / best_us:.2f}x |"
                )
                print(lines[-1], flush=True)
    text = "\n".join(lines + every) + "\n"
    Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
