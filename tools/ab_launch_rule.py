"""A/B of one launch rule of the norm + FP8 kernel, in repeated interleaved rounds (bf16, Llama
form, one GPU): the rule on against off, each the kernel alone in a CUDA graph of
tune_rms_norm_quant_fp8.GRAPH_CALLS calls on fresh input sets, everything else the default launch
of the GPU's launch table row. Reports per shape the median gain (off / on) over the rounds and the
spread of each variant (its slowest round over its fastest): a rule is worth adopting where its
gain beats that spread (docs/notes/launch-policy.md).

    python -m tools.ab_launch_rule --rule weight_first [--ops add_rms_norm rms_norm]
        [--hidden 7168 5120 4096] [--tokens 1 512 4096 16384] [--rounds 3] [--json ab.json]

Rules: weight_first (rows depend on the weight's loads), chunks (norm-only rows in exact chunks
against one padded block).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from benchmarks.common import provenance
from benchmarks.timing import time_graph_us
from fusion_passes.lowering.common.fp8 import QuantFP8
from fusion_passes.lowering.rms_norm.reference import RMSNormForm
from fusion_passes.lowering.rms_norm_quant_fp8.launch import launch_policy, norm_only_chunks
from fusion_passes.lowering.rms_norm_quant_fp8.triton import rms_norm_quant_fp8_triton
from tools.tune_rms_norm_quant_fp8 import EPS, GRAPH_CALLS, GROUP, STATIC_SCALE, _inputs

RULES = ("weight_first", "chunks")


def _variant(rule: str, on: bool, op: str, hidden: int, tokens: int, scheme: str) -> dict:
    """The launcher keywords of the rule on or off."""
    if rule == "weight_first":
        return {"weight_first": on}
    policy = launch_policy(torch.device("cuda"))
    return {"chunks": norm_only_chunks(hidden, scheme, GROUP, tokens, policy) if on else 1}


def _calls(op, sets, scheme, scale, launch):
    residual = (lambda x: x["residual"]) if op == "add_rms_norm" else (lambda x: None)
    return [
        lambda x=x: rms_norm_quant_fp8_triton(
            x["x"], x["w"], RMSNormForm(EPS, 0.0, True), QuantFP8(scheme, scale, GROUP), residual(x),
            **launch,
        )
        for x in sets
    ]


def ab(rule, op, hidden, tokens, scheme, rounds, g) -> dict | None:
    """Per-round times of the rule off and on, interleaved; None where the rule does not apply."""
    if rule == "chunks" and (op != "rms_norm" or norm_only_chunks(
        hidden, scheme, GROUP, tokens, launch_policy(torch.device("cuda"))
    ) == 1):  # fmt: skip
        return None
    sets = [_inputs(tokens, hidden, g) for _ in range(GRAPH_CALLS)]
    scale = torch.tensor(STATIC_SCALE, device="cuda") if scheme == "static" else None
    times = {"off": [], "on": []}
    for _ in range(rounds):
        for name in ("off", "on"):
            launch = _variant(rule, name == "on", op, hidden, tokens, scheme)
            times[name].append(time_graph_us(_calls(op, sets, scheme, scale, launch)))
    off, on = statistics.median(times["off"]), statistics.median(times["on"])
    return {
        "op": op, "hidden": hidden, "tokens": tokens, "scheme": scheme,
        "off_us": times["off"], "on_us": times["on"], "gain": off / on,
        "spread_off": max(times["off"]) / min(times["off"]), "spread_on": max(times["on"]) / min(times["on"]),
    }  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rule", choices=RULES, required=True)
    parser.add_argument("--ops", nargs="+", choices=("add_rms_norm", "rms_norm"), default=["add_rms_norm", "rms_norm"])
    parser.add_argument("--hidden", type=int, nargs="+", default=[7168, 5120, 4096])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 512, 4096, 16384])
    parser.add_argument("--schemes", nargs="+", default=["static", "per_token", "per_group"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", help="write the rounds and the provenance here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("ab_launch_rule: needs a CUDA GPU", file=sys.stderr)
        return 2
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    print(f"{'op':13} {'hidden':>6} {'tokens':>6} {'scheme':9} {'off us':>8} {'on us':>8} {'gain':>6} {'spread':>6}")
    for op in args.ops:
        for hidden in args.hidden:
            for tokens in args.tokens:
                for scheme in args.schemes:
                    row = ab(args.rule, op, hidden, tokens, scheme, args.rounds, g)
                    if row is None:
                        continue
                    rows.append(row)
                    spread = max(row["spread_off"], row["spread_on"])
                    print(f"{op:13} {hidden:6} {tokens:6} {scheme:9} {statistics.median(row['off_us']):8.2f} "
                          f"{statistics.median(row['on_us']):8.2f} {row['gain']:6.3f} {spread:6.3f}", flush=True)  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"provenance": provenance(), "rule": args.rule, "rounds": args.rounds, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
