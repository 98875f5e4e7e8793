"""Launch-shape sweep of the MLA kernels (DeepSeek V3 widths, bf16, one GPU): each kernel alone,
inside a CUDA graph of GRAPH_CALLS calls, for every (rows or heads per program, warps) pair.

    kv:  mla_kv_norm_rope_triton(kv [T, 576]), ROWS rows per program x num_warps
    q:   mla_q_rope_triton(q [1, T, 128, 192]), BLOCK_H heads per program x num_warps

The defaults of mla_rope_triton.py come from this table; rerun it when they change.

    python -m tools.tune_mla_rope [--tokens 1 8 64 4096] [--out tune_mla_rope.md]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from benchmarks.timing import time_graph_us
from fusion_passes.lowering.mla_rope.triton import mla_kv_norm_rope_triton, mla_q_rope_triton

DTYPE, EPS = torch.bfloat16, 1e-6
HEADS, NOPE, ROPE, KV_LORA = 128, 128, 64, 512
GRAPH_CALLS = 20
KV_ROWS = (1, 2, 4)
Q_BLOCK_H = (2, 4, 8, 16)
WARPS = (1, 2, 4, 8)


def _inputs(tokens, g):
    angle = torch.rand(1, tokens, ROPE // 2, generator=g) * 1000
    return dict(
        q=torch.randn(1, tokens, HEADS, NOPE + ROPE, generator=g).to("cuda", DTYPE),
        kv=torch.randn(1, tokens, KV_LORA + ROPE, generator=g).to("cuda", DTYPE),
        w=(1 + 0.1 * torch.randn(KV_LORA, generator=g)).to("cuda", DTYPE),
        cos=angle.cos().to("cuda", DTYPE),
        sin=angle.sin().to("cuda", DTYPE),
    )


def sweep(tokens: int, g) -> list[tuple[str, int, int, float]]:
    sets = [_inputs(tokens, g) for _ in range(GRAPH_CALLS)]
    rows = []
    for per_program in KV_ROWS:
        for warps in WARPS:
            calls = [
                lambda x=x: mla_kv_norm_rope_triton(
                    x["kv"], x["w"], x["cos"], x["sin"], EPS, 0.0, True, True,
                    rows=per_program, num_warps=warps,
                )  # fmt: skip
                for x in sets
            ]
            rows.append(("kv", per_program, warps, time_graph_us(calls)))
    for block_h in Q_BLOCK_H:
        for warps in WARPS:
            calls = [
                lambda x=x: mla_q_rope_triton(
                    x["q"], x["cos"], x["sin"], False, True, True, block_h=block_h, num_warps=warps
                )
                for x in sets
            ]
            rows.append(("q", block_h, warps, time_graph_us(calls)))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 4096])
    parser.add_argument("--out", default="tune_mla_rope.md")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    g = torch.Generator().manual_seed(0)
    lines = [f"# MLA kernel launch shapes, bf16, {torch.cuda.get_device_name()} (CUDA graph, us per call)", ""]
    lines += ["| tokens | kernel | per program | warps | us |", "|---|---|---|---|---|"]
    for t in args.tokens:
        results = sweep(t, g)
        for kernel in ("kv", "q"):
            best = min(r[3] for r in results if r[0] == kernel)
            for name, per_program, warps, us in results:
                if name == kernel:
                    mark = " (best)" if us == best else ""
                    lines.append(f"| {t} | {name} | {per_program} | {warps} | {us:.2f}{mark} |")
        print(f"tokens={t} done", flush=True)
    text = "\n".join(lines) + "\n"
    Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
