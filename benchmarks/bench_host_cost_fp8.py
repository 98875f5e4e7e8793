"""Host cost per call of the compiled norm + FP8 graphs at decode size, without CUDA graphs.

At 1-64 tokens a call's kernel takes 2-4 us on an H200 and its host work far longer, so a plain
launch measures the host: do_bench's per-call figures (bench_rms_norm_quant_fp8.py's "plain"
tables) swing by 2-10x between neighbouring shapes there. This times the host directly: the mean
wall time of many back-to-back calls with one synchronize at the end (the GPU queue never runs
dry, so the figure is the host's cost per call), for stock Inductor, fusion_passes and our
launcher called from Python, each on the same unfused spelling.

    python -m benchmarks.bench_host_cost_fp8 [--hidden 7168] [--tokens 1] [--code DIR] [--profile PATH]
        [--json PATH]

--code writes each compiled graph's generated code (Inductor's and ours) to DIR; --profile writes
cProfile's top functions of fusion_passes' calls to PATH; --json the table's numbers, with their
provenance.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import sys
from pathlib import Path

import torch

from benchmarks import common, sweep
from benchmarks.bench_rms_norm_quant_fp8 import OPS, SCHEMES, eager_fn, fusion_name, kernel_fn, random_inputs
from benchmarks.timing import host_us

ITERS = 3000


def main() -> int:
    parser = common.parser(__doc__, "bench_host_cost_fp8", md=False, json_default=False)
    parser.add_argument("--hidden", type=int, default=7168)
    common.add_sizes(parser, "--tokens", [1], what="token counts")
    parser.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS))
    parser.add_argument("--schemes", nargs="+", choices=SCHEMES, default=list(SCHEMES))
    parser.add_argument("--code", help="write the generated code of each compile to this folder")
    parser.add_argument("--profile", help="write cProfile's top functions of fusion_passes' calls here")
    args = common.parse(parser)
    common.require_cuda(parser, "the host cost of a launch is what it measures")
    from torch._inductor.utils import run_and_get_code

    # A cache hit generates no code to capture (--code); the compiles here are few.
    torch._inductor.config.fx_graph_cache = False

    profile_text, records = [], []
    print("| op | scheme | tokens | inductor | fusion_passes | kernel | fusion_passes - inductor |")
    print("|---|---|---:|---:|---:|---:|---:|")
    with torch.no_grad():
        for op in args.ops:
            for scheme in args.schemes:
                for tokens in args.tokens:
                    inputs = random_inputs(op, scheme, args.hidden, tokens, "cuda")
                    fusions = ["add_rms_norm", "rms_norm", fusion_name(op, scheme)]
                    _, compiled = sweep.compiled_variants(eager_fn(op, scheme), fusions)
                    fns = {impl: compiled[impl] for impl in ("inductor", "fusion_passes")}
                    fns["kernel"] = kernel_fn(op, scheme)
                    us = {}
                    for impl, fn in fns.items():
                        if args.code and impl != "kernel":
                            _, code = run_and_get_code(fn, *inputs)
                            name = f"{fusion_name(op, scheme)}_{tokens}_{impl}.py"
                            Path(args.code).mkdir(parents=True, exist_ok=True)
                            Path(args.code, name).write_text("\n\n".join(code))
                        us[impl] = host_us(lambda fn=fn: fn(*inputs), ITERS, 100)
                    records.append({"op": op, "scheme": scheme, "hidden": args.hidden, "tokens": tokens,
                                    "host_us": us})  # fmt: skip
                    print(
                        f"| {op} | {scheme} | {tokens} | {us['inductor']:.1f} | {us['fusion_passes']:.1f} "
                        f"| {us['kernel']:.1f} | {us['fusion_passes'] - us['inductor']:+.1f} |",
                        flush=True,
                    )
                    if args.profile:
                        profiler = cProfile.Profile()
                        profiler.enable()
                        for _ in range(ITERS):
                            fns["fusion_passes"](*inputs)
                        profiler.disable()
                        torch.cuda.synchronize()
                        text = io.StringIO()
                        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
                        title = f"## {fusion_name(op, scheme)} tokens={tokens}"
                        profile_text.append(f"{title}\n{text.getvalue()}")
    if args.profile:
        Path(args.profile).write_text("\n".join(profile_text))
    if args.json:
        device = torch.cuda.get_device_name()
        common.write_json(args.json, {"device": device, "iters": ITERS, "records": records})
    return 0


if __name__ == "__main__":
    sys.exit(main())
