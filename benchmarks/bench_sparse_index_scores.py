"""Time DeepSeek V3.2's indexer scores on one GPU: transformers' two matmuls, scale and relu (eager,
stock Inductor) against the sparse_index_scores kernels, at decode batch sizes and cache lengths,
and with --prefill at a prefill's query tokens (batch 1, on a cache one slot longer: the tiled
kernel) (64 indexer heads of 128, bf16 q and key cache, fp32 weights).

The region is the indexer's scoring as transformers writes it (the causal mask after it):

    scores = relu(q.float() @ k.transpose(-1, -2).float().unsqueeze(1) * softmax_scale)
    index_scores = (weights.unsqueeze(-2) @ scores).squeeze(-2)

Implementations: eager; inductor (torch.compile); ours (torch.compile with sparse_index_scores and
sparse_index_scores_prefill); ours_kernel (the launcher called directly). Each is timed as plain launches (do_bench median) and
in a CUDA graph of calls on 4 distinct input sets; the largest relative difference from eager is
recorded (fp32 sums in another order). --sweep times ours_kernel at each positions-per-program
and warp count.

    python -m benchmarks.bench_sparse_index_scores [--batch 1 8 64] [--context 1024 8192 16384] [--sweep]
    python -m benchmarks.bench_sparse_index_scores --batch 1 --context 8192 --prefill 1024 4096   # and prefills
    python -m benchmarks.bench_sparse_index_scores --smoke   # tiny sizes; on a CPU via Triton's interpreter
"""

from __future__ import annotations

import sys

import torch

from benchmarks import common

common.interpret_smoke_run()  # before triton is imported

import fusion_passes  # noqa: E402
from benchmarks.timing import kernels_per_call, time_graph_us, time_plain_us  # noqa: E402
from fusion_passes.lowering.sparse_index_scores.triton import sparse_index_scores_triton  # noqa: E402
from fusion_passes.patterns.sparse_index_scores import transformers_index_scores  # noqa: E402

BATCH, SMOKE_BATCH = (1, 8, 64), (2,)
CONTEXT, SMOKE_CONTEXT = (1024, 8192, 16384), (40,)
HEADS, DIM, SMOKE_HEADS, SMOKE_DIM = 64, 128, 4, 16
SETS = 4
SWEEP = [(bt, w) for bt in (16, 32, 64, 128) for w in (2, 4, 8)]
FUSIONS = ["sparse_index_scores", "sparse_index_scores_prefill"]


def inputs(batch, context, heads, dim, device, g, tokens=1) -> tuple:
    q = torch.randn(batch, tokens, heads, dim, generator=g).to(device, torch.bfloat16)
    k = torch.randn(batch, context, dim, generator=g).to(device, torch.bfloat16)
    w = (torch.randn(batch, tokens, heads, generator=g) * heads**-0.5).to(device)
    return q, k, w, dim**-0.5


def rel_diff(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def bench(batch, context, heads, dim, device, g, sweep, tokens=1) -> dict:
    sets = [inputs(batch, context, heads, dim, device, g, tokens) for _ in range(SETS if device == "cuda" else 1)]
    report = fusion_passes.Report()
    ours = torch.compile(transformers_index_scores, fullgraph=True,
                         backend=fusion_passes.backend(FUSIONS, report=report))  # fmt: skip
    ours(*sets[0])
    impls = {"eager": transformers_index_scores, "inductor": torch.compile(transformers_index_scores, fullgraph=True),
             "ours": ours, "ours_kernel": sparse_index_scores_triton}  # fmt: skip
    record = {"batch": batch, "context": context, "tokens": tokens, "heads": heads, "dim": dim,
              "fused_sites": sum(report.matches.get(f, 0) for f in FUSIONS), "rel_diff": {},
              "plain_us": {}, "graph_us": {}, "kernels": {}}  # fmt: skip
    expected = transformers_index_scores(*sets[0])
    for name, fn in impls.items():
        calls = [lambda s=s, fn=fn: fn(*s) for s in sets]
        record["rel_diff"][name] = rel_diff(calls[0](), expected)
        record["kernels"][name] = kernels_per_call(calls[0])
        record["plain_us"][name] = time_plain_us(calls[0]) if device == "cuda" else None
        record["graph_us"][name] = time_graph_us(calls)
    if sweep and device == "cuda":
        record["sweep_graph_us"] = {
            f"{bt}x{w}": time_graph_us([lambda s=s, bt=bt, w=w: sparse_index_scores_triton(*s, block_t=bt, num_warps=w)
                                        for s in sets])
            for bt, w in SWEEP}  # fmt: skip
    return record


def report_text(records, device_name) -> str:
    lines = [f"# DeepSeek V3.2 indexer scores, {device_name}", ""]
    impls = list(records[0]["graph_us"])
    for mode in ("graph_us", "plain_us"):
        lines += [f"## {mode} (us per call)", "",
                  "| batch | query tokens | cached tokens | " + " | ".join(impls) + " | ours vs inductor | kernels "
                  + "/".join(impls) + " | rel. diff from eager " + "/".join(impls) + " |",
                  "|---" * (len(impls) + 6) + "|"]  # fmt: skip
        for r in records:
            t = r[mode]
            lines.append(f"| {r['batch']} | {r.get('tokens', 1)} | {r['context']} | " + " | ".join(common.us(t[i]) for i in impls)
                         + " | " + common.ratio(t["inductor"], t["ours"]) + " | "
                         + "/".join(str(r["kernels"][i]) for i in impls) + " | "
                         + "/".join(f"{r['rel_diff'][i]:.1e}" for i in impls) + " |")  # fmt: skip
        lines.append("")
    for r in records:
        if r.get("sweep_graph_us"):
            best = min((v, k) for k, v in r["sweep_graph_us"].items() if v)
            lines.append(f"sweep batch {r['batch']} context {r['context']}: best {best[1]} {best[0]:.1f} us; "
                         + ", ".join(f"{k} {common.us(v)}" for k, v in r["sweep_graph_us"].items()))  # fmt: skip
    return "\n".join(lines)


def main() -> int:
    parser = common.parser(__doc__, "bench_sparse_index_scores", smoke="tiny sizes; CPU under TRITON_INTERPRET=1")
    common.add_sizes(parser, "--batch", BATCH, SMOKE_BATCH, "batch sizes (one decode token each)")
    common.add_sizes(parser, "--context", CONTEXT, SMOKE_CONTEXT, "cached tokens")
    common.add_sizes(parser, "--prefill", (), (20,), "prefill query tokens (batch 1, a cache one slot longer)")
    parser.add_argument("--sweep", action="store_true", help="time ours_kernel at each launch configuration")
    args = common.parse(parser)
    device = common.device(parser, args.smoke)
    heads, dim = (SMOKE_HEADS, SMOKE_DIM) if args.smoke else (HEADS, DIM)
    g = torch.Generator().manual_seed(0)
    records = []
    with torch.no_grad():
        points = [(b, c, 1) for c in args.context for b in args.batch] + [(1, n + 1, n) for n in args.prefill]
        for batch, context, tokens in points:
            torch._dynamo.reset()
            records.append(bench(batch, context, heads, dim, device, g, args.sweep and tokens == 1, tokens))
            r = records[-1]
            print(f"batch {batch} tokens {tokens} context {context}: " + ", ".join(f"{i} {common.us(r['graph_us'][i])}"
                                                                    for i in r["graph_us"])
                  + f"; rel diff {r['rel_diff']}", flush=True)  # fmt: skip
    common.finish(args, report_text(records, common.device_name(device)),
                  {"device": common.device_name(device), "records": records})  # fmt: skip
    # fp32 sums in another order: 1e-5 of the largest score, far below a bf16 model's error
    bad = [(r["batch"], r["tokens"], r["context"]) for r in records if r["fused_sites"] != 1 or max(r["rel_diff"].values()) > 1e-5]
    if bad:
        print(f"FAILURE (not fused, or scores off eager's) at {bad}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
