"""Launch-shape sweep of the qk_norm_rope kernel at each model's real head configuration (bf16,
one GPU, the kernel alone inside a CUDA graph of GRAPH_CALLS calls): row body (three column tiles
per head, or whole-head and rotary tiles) x head rows per program (or per step) x warps.

The defaults of qk_norm_rope_triton.launch_config come from this table; rerun it when they change.

    python -m tools.tune_qk_norm_rope [--tokens 1 64 4096] [--out tune_qk_norm_rope.md]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton

from benchmarks.bench_qk_norm_rope import EPS, MODELS, inputs
from benchmarks.timing import time_graph_us
from fusion_passes.lowering.qk_norm_rope.triton import SPLIT_MAX_STEPS, qk_norm_rope_triton

GRAPH_CALLS = 20
# Head rows per program (per-head norm) or per step over a token's heads (whole-row norm: the
# whole-head tile's steps, or the split tiles' at most SPLIT_MAX_STEPS steps held at once).
ROWS = (2, 4, 8, 16)
WARPS = (2, 4, 8, 16)


def _kernel_args(model, x):
    """bench_qk_norm_rope's inputs as the kernel takes them: [B, S, H, D] views."""
    hq, hk, d, r, per_head, gate, form = model
    q, k, wq, wk, cos, sin = x
    b, s = q.shape[:2]
    q4 = q.view(b, s, hq, 2 * d)[..., :d] if gate else q.view(b, s, hq, d)
    offset, cast = (1.0, False) if form == "offset" else (0.0, True)
    return (q4, k.view(b, s, hk, d), wq, wk, cos, sin, EPS, offset, cast, per_head)


def sweep(model, tokens, bodies=("split", "tile"), rows_list=ROWS, warps_list=WARPS):
    sets = [_kernel_args(model, inputs(model, tokens, "cuda")) for _ in range(GRAPH_CALLS)]
    per_head = model[4]
    results = [("default", None, None, time_graph_us([lambda a=a: qk_norm_rope_triton(*a) for a in sets]))]
    for tile in (body == "tile" for body in bodies):
        for rows in rows_list:
            if not (per_head or tile) and triton.cdiv(max(model[0], model[1]), rows) > SPLIT_MAX_STEPS:
                continue  # the split tiles' whole-row norm takes at most SPLIT_MAX_STEPS steps
            for warps in warps_list:
                calls = [
                    lambda a=a: qk_norm_rope_triton(*a, whole_head_tile=tile, rows=rows, num_warps=warps)
                    for a in sets
                ]
                results.append(("tile" if tile else "split", rows, warps, time_graph_us(calls)))
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 64, 4096])
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--out", default="tune_qk_norm_rope.md")
    parser.add_argument("--bodies", nargs="+", choices=("split", "tile"), default=["split", "tile"])
    parser.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    parser.add_argument("--warps", type=int, nargs="+", default=list(WARPS))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    torch.manual_seed(0)
    lines = [
        f"# qk_norm_rope launch shapes, bf16, {torch.cuda.get_device_name()} (CUDA graph, us per call)",
        "",
    ]
    lines += ["| model | tokens | body | rows | warps | us |", "|---|---|---|---|---|---|"]
    for name in args.models:
        for t in args.tokens:
            results = sweep(MODELS[name], t, args.bodies, args.rows, args.warps)
            best = min(r[3] for r in results)
            for body, rows, warps, us in results:
                mark = " (best)" if us == best else ""
                lines.append(f"| {name} | {t} | {body} | {rows or '-'} | {warps or '-'} | {us:.2f}{mark} |")
                print(lines[-1], flush=True)  # a run cut short keeps what it measured
    Path(args.out).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
