"""Which sites each fusion rewrites in each built-in model: a census to compare two trees.

Compiles every built-in model (tiny, bf16, on the CPU) with every registered fusion enabled, and
again with its linears swapped for FP8 ones of each scheme, and writes each rewritten site
(fusion, spelling, module, source line) and the final graph's fused-op counts as JSON. Two trees
that rewrite the same sites write the same file:

    python -m tools.site_census --out census.json [--models qwen3 ...] [--schemes per_token ...]
"""

from __future__ import annotations

import argparse
import json
import os

import torch

import fusion_passes
from fusion_passes.models import MODEL_NAMES, build_model
from fusion_passes.models.fp8_linear import swap_fp8_linears


def census(name: str, scheme: str | None) -> dict:
    """The rewritten sites of one compile of ``name`` (FP8 linears of ``scheme``, or none)."""
    built = build_model(name, size="tiny", dtype=torch.bfloat16)
    module, inputs = built.module.eval(), built.example_inputs
    if scheme is not None:
        swap_fp8_linears(module, scheme, inputs)
    report = fusion_passes.Report()
    torch._dynamo.reset()
    fusions = [f.name for f in fusion_passes.list_fusions()]
    with torch.no_grad():
        torch.compile(module, backend=fusion_passes.backend(fusions, report=report), fullgraph=True)(*inputs)
    sites = sorted(
        (s.fusion, s.spelling, s.module, os.path.basename(s.location.split(":")[0]) + ":" + s.location.split(":")[1].split()[0])
        for s in report.sites
    )
    fused_ops = {}
    for record in report.graphs:
        for op, count in record.ops_after.items():
            if op.startswith("fusion_passes."):
                fused_ops[op] = fused_ops.get(op, 0) + count
    return {"sites": [list(s) for s in sites], "fused_ops": dict(sorted(fused_ops.items())),
            "rejected": sorted(f"{r.fusion}.{r.spelling} {r.module}: {r.reason}" for r in report.rejected),
            "errors": list(report.errors)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--models", nargs="*", default=list(MODEL_NAMES))
    parser.add_argument("--schemes", nargs="*", default=["none", "static", "per_token", "per_group"])
    args = parser.parse_args()
    result = {}
    for name in args.models:
        for scheme in args.schemes:
            key = f"{name}/{scheme}"
            result[key] = census(name, None if scheme == "none" else scheme)
            print(key, len(result[key]["sites"]), "sites", flush=True)
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1, sort_keys=True)


if __name__ == "__main__":
    main()
