"""Time a MoE layer's routing and dispatch prep (bf16 model) on one GPU: eager vs stock Inductor vs
ours, at decode and prefill token counts.

    sort:  transformers' grouped_mm experts before the grouped GEMMs: the sort of the flat top-k
           expert ids, histc + cumsum (the grouped GEMM's offsets) and the inverse permutation
    route: the Qwen 3.5-MoE router after its gate GEMM (softmax, sorted top-k, renormalisation,
           the cast to bf16) on bf16 logits
    route_grouped: DeepSeek V3 / V3.2's group-limited router after its fp32 gate GEMM (sigmoid +
           correction bias, each group's top-2 sum, the kept groups, top-k, gather, renormalise,
           routed scaling): 8 groups, 4 kept, scale 2.5
    route_sort: the grouped router and then the sort of its ids, as a DeepSeek V3 / V3.2 MoE layer
           runs them at decode; ours is the default fusions (the route's kernel, then the sort's),
           ours_fold adds the opt-in moe_route_sort (one launch), ours_kernel its launcher

256 experts, top-8 (Qwen 3.5-MoE, MiniMax-M2, DeepSeek V3.x) by default; the ids of each token
are distinct, as top-k returns them. Each implementation is timed as plain launches (do_bench
median) and in a CUDA graph of calls on 16 distinct id sets, and its kernels per call are counted
with the profiler. The pair count from which ours is slower than stock Inductor is the launch
table's limit (lowering/launch_tables.py: MOE_SORT_BY_EXPERT).

Implementations: eager; inductor (torch.compile); ours (torch.compile with the fusion_passes
backend: the fused kernel launched by Inductor, no launch-table limit); ours_kernel (our launcher
called directly).

    python -m benchmarks.bench_moe_sort_by_expert [--regions route route_grouped sort route_sort] [--tokens 1 64 4096] [--experts 256]
    python -m benchmarks.bench_moe_sort_by_expert --smoke   # tiny sizes; on a CPU via Triton's interpreter
"""

from __future__ import annotations

import sys
from unittest import mock

import torch

from benchmarks import common

common.interpret_smoke_run()  # before triton is imported

import fusion_passes  # noqa: E402
from benchmarks.timing import kernels_per_call, time_graph_us, time_plain_us  # noqa: E402
from fusion_passes.lowering import launch_tables  # noqa: E402
from fusion_passes.lowering.moe_route.triton import moe_route_grouped_triton, moe_route_triton  # noqa: E402
from fusion_passes.lowering.moe_route_sort.triton import moe_route_sort_triton  # noqa: E402
from fusion_passes.lowering.moe_sort_by_expert.triton import moe_sort_by_expert_triton  # noqa: E402
from fusion_passes.patterns.moe_route import deepseek_v3_router, qwen_router  # noqa: E402
from fusion_passes.patterns.moe_sort_by_expert import transformers_grouped_mm_dispatch  # noqa: E402

TOKENS = (1, 8, 64, 128, 256, 512, 1024, 4096)
SMOKE_TOKENS = (1, 5)
SETS = 16
N_GROUP, TOPK_GROUP, ROUTED_SCALING = 8, 4, 2.5  # DeepSeek V3 / V3.2


def region(top_k_index, num_experts):
    return transformers_grouped_mm_dispatch(top_k_index.reshape(-1), num_experts)


def ids_set(tokens, experts, top_k, device, g):
    return torch.rand(tokens, experts, generator=g).topk(top_k, dim=-1).indices.to(device)


def check(out, ids, experts) -> bool:
    """Sorted ids and offsets as the model's ops give them; a permutation that sorts; its inverse."""
    sorted_ids, perm, offsets, inv_perm = out
    flat = ids.reshape(-1)
    want_sorted = torch.sort(flat).values
    want_offsets = torch.cumsum(torch.bincount(flat, minlength=experts), 0).to(torch.int32)
    arange = torch.arange(flat.numel(), device=flat.device)
    return (torch.equal(sorted_ids, want_sorted) and torch.equal(offsets, want_offsets)
            and torch.equal(flat[perm], sorted_ids) and torch.equal(inv_perm[perm], arange))  # fmt: skip


def bench_sort(tokens, experts, top_k, device, g) -> dict:
    sets = [ids_set(tokens, experts, top_k, device, g) for _ in range(SETS if device == "cuda" else 1)]
    report = fusion_passes.Report()
    # ours without the launch table's limit: the point of the benchmark is where the limit lies
    no_limit = {"default": launch_tables.MoeSortRule()}
    with mock.patch.object(launch_tables, "MOE_SORT_BY_EXPERT", no_limit):
        ours = torch.compile(region, backend=fusion_passes.backend(["moe_sort_by_expert"], report=report),
                             fullgraph=True)  # fmt: skip
        ours(sets[0], experts)
    impls = {
        "eager": region,
        "inductor": torch.compile(region, fullgraph=True),
        "ours": ours,
        "ours_kernel": lambda ids, e: moe_sort_by_expert_triton(ids.reshape(-1), e),
    }
    record = {"region": "sort", "tokens": tokens, "pairs": tokens * top_k, "experts": experts, "top_k": top_k,
              "fused_sites": report.matches.get("moe_sort_by_expert", 0), "correct": {},
              "plain_us": {}, "graph_us": {}, "kernels": {}}  # fmt: skip
    for name, fn in impls.items():
        calls = [lambda ids=ids, fn=fn: fn(ids, experts) for ids in sets]
        record["correct"][name] = check(calls[0](), sets[0], experts)
        record["kernels"][name] = kernels_per_call(calls[0])
        record["plain_us"][name] = time_plain_us(calls[0])
        record["graph_us"][name] = time_graph_us(calls)
    return record


def bench_route(tokens, experts, top_k, device, g) -> dict:
    n_sets = SETS if device == "cuda" else 1
    sets = [torch.randn(tokens, experts, generator=g).to(device, torch.bfloat16) for _ in range(n_sets)]
    report = fusion_passes.Report()
    backend = fusion_passes.backend(["moe_route_softmax"], report=report)
    ours = torch.compile(qwen_router, backend=backend, fullgraph=True)
    ours(sets[0], top_k)
    impls = {
        "eager": qwen_router,
        "inductor": torch.compile(qwen_router, fullgraph=True),
        "ours": ours,
        "ours_kernel": lambda x, k: moe_route_triton(x, None, k, True, True),
    }
    record = {"region": "route", "tokens": tokens, "pairs": tokens * top_k, "experts": experts, "top_k": top_k,
              "fused_sites": report.matches.get("moe_route_softmax", 0), "correct": {},
              "plain_us": {}, "graph_us": {}, "kernels": {}}  # fmt: skip
    want_w, want_ids = qwen_router(sets[0], top_k)
    for name, fn in impls.items():
        calls = [lambda x=x, fn=fn: fn(x, top_k) for x in sets]
        w, ids = calls[0]()
        # the selected experts (equal bf16 scores may come in another order) and their weights
        record["correct"][name] = bool(torch.equal(ids.sort(-1).values, want_ids.sort(-1).values)
                                       and torch.allclose(w.float().sort(-1).values, want_w.float().sort(-1).values,
                                                          rtol=1e-2, atol=1e-3))  # fmt: skip
        record["kernels"][name] = kernels_per_call(calls[0])
        record["plain_us"][name] = time_plain_us(calls[0])
        record["graph_us"][name] = time_graph_us(calls)
    return record


def bench_route_grouped(tokens, experts, top_k, device, g) -> dict:
    n_sets = SETS if device == "cuda" else 1
    sets = [(torch.randn(tokens, experts, generator=g).to(device), (torch.rand(experts, generator=g) * 0.1).to(device))
            for _ in range(n_sets)]  # fmt: skip

    def router(logits, bias):
        return deepseek_v3_router(logits, bias, top_k, N_GROUP, TOPK_GROUP, ROUTED_SCALING)

    report = fusion_passes.Report()
    backend = fusion_passes.backend(["moe_route_grouped"], report=report)
    ours = torch.compile(router, backend=backend, fullgraph=True)
    ours(*sets[0])
    impls = {
        "eager": router,
        "inductor": torch.compile(router, fullgraph=True),
        "ours": ours,
        "ours_kernel": lambda x, b: moe_route_grouped_triton(x, b, top_k, N_GROUP, TOPK_GROUP, True, ROUTED_SCALING),
    }
    record = {"region": "route_grouped", "tokens": tokens, "pairs": tokens * top_k, "experts": experts,
              "top_k": top_k, "fused_sites": report.matches.get("moe_route_grouped", 0), "correct": {},
              "plain_us": {}, "graph_us": {}, "kernels": {}}  # fmt: skip
    want_w, want_ids = router(*sets[0])
    for name, fn in impls.items():
        calls = [lambda s=s, fn=fn: fn(*s) for s in sets]
        w, ids = calls[0]()
        # the selected experts and their fp32 weights, in either order (torch's top-k is unsorted)
        order, want_order = ids.argsort(-1), want_ids.argsort(-1)
        record["correct"][name] = bool(torch.equal(ids.gather(-1, order), want_ids.gather(-1, want_order))
                                       and torch.allclose(w.gather(-1, order), want_w.gather(-1, want_order),
                                                          rtol=1e-5, atol=1e-6))  # fmt: skip
        record["kernels"][name] = kernels_per_call(calls[0])
        record["plain_us"][name] = time_plain_us(calls[0])
        record["graph_us"][name] = time_graph_us(calls)
    return record


def bench_route_sort(tokens, experts, top_k, device, g) -> dict:
    n_sets = SETS if device == "cuda" else 1
    sets = [(torch.randn(tokens, experts, generator=g).to(device), (torch.rand(experts, generator=g) * 0.1).to(device))
            for _ in range(n_sets)]  # fmt: skip

    def route_sort(logits, bias):
        # the ids only through the dispatch, as the model reads them (ids read beside it: no fold)
        weights, ids = deepseek_v3_router(logits, bias, top_k, N_GROUP, TOPK_GROUP, ROUTED_SCALING)
        return (weights, *region(ids, experts))

    def fused_kernel(logits, bias):
        weights, _, *dispatch = moe_route_sort_triton(logits, bias, top_k, False, True, N_GROUP, TOPK_GROUP,
                                                      ROUTED_SCALING, experts)  # fmt: skip
        return (weights, *dispatch)

    reports = {name: fusion_passes.Report() for name in ("ours", "ours_fold")}
    defaults = [f.name for f in fusion_passes.registry.get_fusions("all")]
    impls = {"eager": route_sort, "inductor": torch.compile(route_sort, fullgraph=True)}
    for name, fusions in (("ours", defaults), ("ours_fold", defaults + ["moe_route_sort"])):
        impls[name] = torch.compile(route_sort, backend=fusion_passes.backend(fusions, report=reports[name]),
                                    fullgraph=True)  # fmt: skip
        impls[name](*sets[0])
    impls["ours_kernel"] = fused_kernel
    record = {"region": "route_sort", "tokens": tokens, "pairs": tokens * top_k, "experts": experts, "top_k": top_k,
              "fused_sites": reports["ours_fold"].matches.get("moe_route_sort_grouped", 0), "correct": {},
              "plain_us": {}, "graph_us": {}, "kernels": {}}  # fmt: skip
    want_w, want_ids = deepseek_v3_router(*sets[0], top_k, N_GROUP, TOPK_GROUP, ROUTED_SCALING)
    for name, fn in impls.items():
        calls = [lambda s=s, fn=fn: fn(*s) for s in sets]
        w, *dispatch = calls[0]()
        # the selected experts (each pair's id put back from the sort) and their weights in either
        # order; the dispatch a correct one of those ids
        ids = torch.empty_like(dispatch[0])
        ids[dispatch[1]] = dispatch[0]
        ids = ids.view(tokens, top_k)
        order, want_order = ids.argsort(-1), want_ids.argsort(-1)
        record["correct"][name] = bool(torch.equal(ids.gather(-1, order), want_ids.gather(-1, want_order))
                                       and torch.allclose(w.gather(-1, order), want_w.gather(-1, want_order),
                                                          rtol=1e-5, atol=1e-6)
                                       and check(dispatch, ids, experts))  # fmt: skip
        record["kernels"][name] = kernels_per_call(calls[0])
        record["plain_us"][name] = time_plain_us(calls[0])
        record["graph_us"][name] = time_graph_us(calls)
    return record


BENCHES = {"route": bench_route, "route_grouped": bench_route_grouped, "sort": bench_sort,
           "route_sort": bench_route_sort}  # fmt: skip


def report_text(records, device_name) -> str:
    lines = [f"# MoE routing and dispatch prep, {device_name}", ""]
    for region, mode in [(r, m) for r in BENCHES for m in ("graph_us", "plain_us")]:
        rows = [r for r in records if r.get("region", "sort") == region]
        if not rows:
            continue
        impls = list(rows[0]["graph_us"])
        fold = " | ours_fold vs ours" if "ours_fold" in impls else ""
        lines += [f"## {region}, {mode} (us per call)", "",
                  "| tokens x top-k (pairs) | experts | " + " | ".join(impls) + " | ours vs inductor" + fold
                  + " | kernels " + "/".join(impls) + " |",
                  "|---" * (len(impls) + 4 + bool(fold)) + "|"]  # fmt: skip
        for r in rows:
            t = r[mode]
            versus = " | " + common.ratio(t["ours"], t["ours_fold"]) if fold else ""
            lines.append(f"| {r['tokens']} x {r['top_k']} ({r['pairs']}) | {r['experts']} | "
                         + " | ".join(common.us(t[i]) for i in impls) + " | " + common.ratio(t["inductor"], t["ours"])
                         + versus + " | " + "/".join(str(r["kernels"][i]) for i in impls) + " |")  # fmt: skip
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    parser = common.parser(__doc__, "bench_moe_sort_by_expert", smoke="tiny sizes; CPU under TRITON_INTERPRET=1")
    common.add_sizes(parser, "--tokens", TOKENS, SMOKE_TOKENS, "tokens (each routed to top-k experts)")
    parser.add_argument("--experts", type=int, nargs="+", default=[256])
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--regions", nargs="+", default=list(BENCHES), choices=list(BENCHES))
    args = common.parse(parser)
    device = common.device(parser, args.smoke)
    device_name = common.device_name(device)
    g = torch.Generator().manual_seed(0)
    records = []
    with torch.no_grad():
        for region, experts, tokens in [(r, e, t) for r in args.regions for e in args.experts for t in args.tokens]:
            torch._dynamo.reset()
            records.append(BENCHES[region](tokens, experts, args.top_k, device, g))
            r = records[-1]
            print(f"{region} experts={experts} tokens={tokens}: " + ", ".join(
                f"{i} {common.us(r['graph_us'][i])}" for i in r["graph_us"]) + f"; correct {r['correct']}", flush=True)
    common.finish(args, report_text(records, device_name), {"device": device_name, "records": records})
    bad = [(r["region"], r["experts"], r["tokens"]) for r in records
           if r["fused_sites"] != 1 or not all(r["correct"].values())]  # fmt: skip
    if bad:
        print(f"FAILURE (not fused, or a wrong result) at {bad}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
