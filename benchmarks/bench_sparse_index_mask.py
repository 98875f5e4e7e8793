"""Time DeepSeek V3.2's index mask (fp32 index scores) on one GPU: transformers' top-k + scatter
(eager, stock Inductor) against the sparse_index_mask kernel, at decode batch sizes and cache
lengths beyond index_topk (2048), where the mask is live.

The region is the indexer's tail and the attention's mask as transformers writes them:

    idx  = index_scores.topk(min(index_topk, T), dim=-1).indices.to(torch.int32)
    mask = idx.new_ones((B, S, T), dtype=torch.bool).scatter(-1, idx.long(), False)

with S = 1 (one decode token) and the positions beyond the filled cache at -inf. Implementations:
eager; inductor (torch.compile); ours (torch.compile with sparse_index_mask_topk);
ours_kernel (the launcher called directly). Each is timed as plain launches (do_bench median) and
in a CUDA graph of calls on 4 distinct score sets; the masks are checked equal to eager's (the
scores are drawn without ties). --sweep times ours_kernel at each split (programs a row) and
warp count, each mask checked too.

    python -m benchmarks.bench_sparse_index_mask [--batch 1 8 64] [--context 4096 8192 16384] [--sweep]
    python -m benchmarks.bench_sparse_index_mask --smoke   # tiny sizes; on a CPU via Triton's interpreter
"""

from __future__ import annotations

import sys

import torch

from benchmarks import common

common.interpret_smoke_run()  # before triton is imported

import fusion_passes  # noqa: E402
from benchmarks.timing import kernels_per_call, time_graph_us, time_plain_us  # noqa: E402
from fusion_passes.lowering.sparse_index_mask.triton import sparse_index_mask_triton  # noqa: E402
from fusion_passes.patterns.sparse_index_mask import transformers_index_mask  # noqa: E402

BATCH, SMOKE_BATCH = (1, 8, 64), (2,)
CONTEXT, SMOKE_CONTEXT = (4096, 8192, 16384), (40,)
INDEX_TOPK, SMOKE_TOPK = 2048, 8
SETS = 4
SWEEP = [(split, w) for split in (1, 2, 4, 8, 16, 32, 64) for w in (4, 8)]


def region(index_scores, ones, k):
    return transformers_index_mask(index_scores, ones, k)


def scores_set(batch, context, device, g):
    """[B, 1, context + 16]: distinct scores over the filled positions, -inf beyond them."""
    t = context + 16
    scores = torch.randperm(batch * t, generator=g).float().view(batch, 1, t) / (batch * t)
    scores[..., context:] = float("-inf")
    return scores.to(device)


def bench(batch, context, top_k, device, g, sweep=False) -> dict:
    sets = [scores_set(batch, context, device, g) for _ in range(SETS if device == "cuda" else 1)]
    ones = torch.ones(sets[0].shape, dtype=torch.bool, device=device)
    k = min(top_k, sets[0].shape[-1])
    report = fusion_passes.Report()
    ours = torch.compile(region, backend=fusion_passes.backend(["sparse_index_mask_topk"], report=report),
                         fullgraph=True)  # fmt: skip
    ours(sets[0], ones, k)
    impls = {"eager": region, "inductor": torch.compile(region, fullgraph=True), "ours": ours,
             "ours_kernel": lambda s, o, k: sparse_index_mask_triton(s, k)}  # fmt: skip
    record = {"batch": batch, "context": context, "positions": sets[0].shape[-1], "k": k,
              "fused_sites": report.matches.get("sparse_index_mask_topk", 0), "correct": {},
              "plain_us": {}, "graph_us": {}, "kernels": {}}  # fmt: skip
    expected = region(sets[0], ones, k)
    for name, fn in impls.items():
        calls = [lambda s=s, fn=fn: fn(s, ones, k) for s in sets]
        record["correct"][name] = bool(torch.equal(calls[0](), expected))
        record["kernels"][name] = kernels_per_call(calls[0])
        record["plain_us"][name] = time_plain_us(calls[0]) if device == "cuda" else None
        record["graph_us"][name] = time_graph_us(calls)
    if sweep and device == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        record["sweep_graph_us"], record["sweep_correct"] = {}, {}
        for split, w in SWEEP:
            if batch * split > sms:  # a row's programs must all fit at once
                continue
            calls = [lambda s=s, sp=split, w=w: sparse_index_mask_triton(s, k, split=sp, num_warps=w) for s in sets]
            record["sweep_correct"][f"{split}x{w}"] = bool(torch.equal(calls[0](), expected))
            record["sweep_graph_us"][f"{split}x{w}"] = time_graph_us(calls)
    return record


def report_text(records, device_name) -> str:
    lines = [f"# DeepSeek V3.2 index mask, {device_name}", ""]
    impls = list(records[0]["graph_us"])
    for mode in ("graph_us", "plain_us"):
        lines += [f"## {mode} (us per call)", "",
                  "| batch | cached tokens | top-k | " + " | ".join(impls) + " | ours vs inductor | kernels "
                  + "/".join(impls) + " |", "|---" * (len(impls) + 5) + "|"]  # fmt: skip
        for r in records:
            t = r[mode]
            lines.append(f"| {r['batch']} | {r['context']} | {r['k']} | " + " | ".join(common.us(t[i]) for i in impls)
                         + " | " + common.ratio(t["inductor"], t["ours"]) + " | "
                         + "/".join(str(r["kernels"][i]) for i in impls) + " |")  # fmt: skip
        lines.append("")
    for r in records:
        if r.get("sweep_graph_us"):
            best = min((v, k) for k, v in r["sweep_graph_us"].items() if v)
            wrong = [k for k, ok in r["sweep_correct"].items() if not ok]
            lines.append(f"sweep (split x warps) batch {r['batch']} context {r['context']}: best {best[1]} "
                         f"{best[0]:.1f} us; " + ", ".join(f"{k} {common.us(v)}" for k, v in r["sweep_graph_us"].items())
                         + (f"; WRONG masks: {wrong}" if wrong else ""))  # fmt: skip
    return "\n".join(lines)


def main() -> int:
    parser = common.parser(__doc__, "bench_sparse_index_mask", smoke="tiny sizes; CPU under TRITON_INTERPRET=1")
    common.add_sizes(parser, "--batch", BATCH, SMOKE_BATCH, "batch sizes (one decode token each)")
    common.add_sizes(parser, "--context", CONTEXT, SMOKE_CONTEXT, "cached tokens")
    parser.add_argument("--top-k", type=int, default=None, help=f"index_topk (default {INDEX_TOPK})")
    parser.add_argument("--sweep", action="store_true", help="time ours_kernel at each split and warp count")
    args = common.parse(parser)
    device = common.device(parser, args.smoke)
    top_k = args.top_k or (SMOKE_TOPK if args.smoke else INDEX_TOPK)
    g = torch.Generator().manual_seed(0)
    records = []
    with torch.no_grad():
        for context, batch in [(c, b) for c in args.context for b in args.batch]:
            torch._dynamo.reset()
            records.append(bench(batch, context, top_k, device, g, args.sweep))
            r = records[-1]
            print(f"batch {batch} context {context}: " + ", ".join(f"{i} {common.us(r['graph_us'][i])}"
                                                                    for i in r["graph_us"])
                  + f"; correct {r['correct']}", flush=True)  # fmt: skip
    common.finish(args, report_text(records, common.device_name(device)),
                  {"device": common.device_name(device), "records": records})  # fmt: skip
    bad = [(r["batch"], r["context"]) for r in records
           if r["fused_sites"] != 1 or not all(r["correct"].values()) or not all(r.get("sweep_correct", {}).values())]
    if bad:
        print(f"FAILURE (not fused, or a wrong mask) at {bad}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
