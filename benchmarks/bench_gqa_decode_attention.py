"""Time a decode step's attention with grouped KV heads (bf16) on one GPU: transformers' repeat_kv
+ SDPA (eager, stock Inductor) against the gqa_decode_attention rewrite, at decode batch sizes and
cache lengths, for the attention shapes of the built-in models.

The region is transformers' SDPA path on a StaticCache at one query token: keys and values
[B, Hkv, L, D] as the cache holds them, a boolean mask of the filled positions [B, 1, 1, L], and
repeat_kv of keys and values to the query's H heads before SDPA. Implementations:

  eager      the model's code
  inductor   torch.compile, stock Inductor
  ours       torch.compile with the fusion_passes backend (gqa_decode_attention)
  torch_gqa  F.scaled_dot_product_attention(..., enable_gqa=True) eager, torch's own GQA (the
             peer transformers avoids when it passes a mask)

Each is timed as plain launches (do_bench median) and in a CUDA graph of calls on 4 distinct
caches; "floor" is one read of the keys and values at 4.3 TB/s (the device copy's bandwidth).

    python -m benchmarks.bench_gqa_decode_attention [--shapes minimax-m2 qwen3-moe] [--batch 1 64] [--context 1024 8192]
    python -m benchmarks.bench_gqa_decode_attention --smoke   # tiny sizes on a CPU
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from benchmarks import common

import fusion_passes  # noqa: E402
from benchmarks.timing import kernels_per_call, time_graph_us, time_plain_us  # noqa: E402
from fusion_passes.numerics import compare, tolerance  # noqa: E402
from fusion_passes.patterns.gqa_decode_attention import repeat_kv  # noqa: E402

# (query heads, KV heads, head dim) of the built-in models' full-attention layers
SHAPES = {"minimax-m2": (48, 8, 128), "qwen3-moe": (64, 4, 128), "qwen3.5-moe": (16, 2, 256)}
SMOKE_SHAPES = {"tiny": (4, 2, 32)}
BATCH, SMOKE_BATCH = (1, 8, 64), (2,)
CONTEXT, SMOKE_CONTEXT = (1024, 8192), (9,)
SETS = 4
COPY_BYTES_PER_US = 4.3e6  # 4.3 TB/s


def region(query, key, value, mask, scale):
    """transformers' sdpa_attention_forward with repeat_kv (a mask is passed: no enable_gqa)."""
    n_rep = query.shape[1] // key.shape[1]
    key, value = repeat_kv(key, n_rep), repeat_kv(value, n_rep)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale)


def torch_gqa(query, key, value, mask, scale):
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale, enable_gqa=True)


def inputs(batch, heads, kv_heads, head_dim, context, device, g):
    """One decode step's query, a cache of ``context`` filled positions (of context + 4), its mask."""
    length = context + 4
    q = torch.randn(batch, heads, 1, head_dim, generator=g)
    k = torch.randn(batch, kv_heads, length, head_dim, generator=g)
    v = torch.randn(batch, kv_heads, length, head_dim, generator=g)
    mask = torch.zeros(batch, 1, 1, length, dtype=torch.bool)
    mask[..., : context + 1] = True
    return [t.to(device, torch.bfloat16) if t.is_floating_point() else t.to(device) for t in (q, k, v, mask)]


def bench(shape, batch, context, device, g) -> dict:
    heads, kv_heads, head_dim = (SMOKE_SHAPES | SHAPES)[shape]
    scale = head_dim**-0.5
    sets = [inputs(batch, heads, kv_heads, head_dim, context, device, g) for _ in range(SETS if device == "cuda" else 1)]
    report = fusion_passes.Report()
    ours = torch.compile(region, backend=fusion_passes.backend(["gqa_decode_attention"], report=report), fullgraph=True)
    ours(*sets[0], scale)
    impls = {"eager": region, "inductor": torch.compile(region, fullgraph=True), "ours": ours, "torch_gqa": torch_gqa}
    kv_bytes = 2 * batch * kv_heads * (context + 4) * head_dim * 2
    record = {"shape": shape, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "batch": batch,
              "context": context, "fused_sites": report.matches.get("gqa_decode_attention", 0),
              "floor_us": kv_bytes / COPY_BYTES_PER_US, "rel_err": {}, "plain_us": {}, "graph_us": {},
              "kernels": {}}  # fmt: skip
    expected = region(*sets[0], scale).float()
    for name, fn in impls.items():
        calls = [lambda s=s, fn=fn: fn(*s, scale) for s in sets]
        record["rel_err"][name] = compare(calls[0](), expected).rel_norm
        record["kernels"][name] = kernels_per_call(calls[0])
        record["plain_us"][name] = time_plain_us(calls[0]) if device == "cuda" else None
        record["graph_us"][name] = time_graph_us(calls)
    return record


def report_text(records, device_name) -> str:
    lines = [f"# GQA attention at decode, {device_name}", ""]
    impls = list(records[0]["graph_us"])
    for mode in ("graph_us", "plain_us"):
        lines += [f"## {mode} (us per call)", "",
                  "| shape (H / Hkv x D) | batch | context | " + " | ".join(impls) + " | floor | ours vs inductor | "
                  "kernels " + "/".join(impls) + " |",
                  "|---" * (len(impls) + 6) + "|"]  # fmt: skip
        for r in records:
            t = r[mode]
            lines.append(f"| {r['shape']} ({r['heads']} / {r['kv_heads']} x {r['head_dim']}) | {r['batch']} | "
                         f"{r['context']} | " + " | ".join(common.us(t[i]) for i in impls)
                         + f" | {common.us(r['floor_us'])} | " + common.ratio(t["inductor"], t["ours"]) + " | "
                         + "/".join(str(r["kernels"][i]) for i in impls) + " |")  # fmt: skip
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    parser = common.parser(__doc__, "bench_gqa_decode_attention", smoke="tiny sizes on a CPU (numerics only)")
    common.add_sizes(parser, "--batch", BATCH, SMOKE_BATCH, "batch sizes")
    common.add_sizes(parser, "--context", CONTEXT, SMOKE_CONTEXT, "cached tokens")
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    args = common.parse(parser)
    device = common.device(parser, args.smoke)
    shapes = list(SMOKE_SHAPES) if args.smoke else args.shapes
    g = torch.Generator().manual_seed(0)
    records = []
    with torch.no_grad():
        for shape, context, batch in [(s, c, b) for s in shapes for c in args.context for b in args.batch]:
            torch._dynamo.reset()
            records.append(bench(shape, batch, context, device, g))
            r = records[-1]
            print(f"{shape} b{batch} ctx{context}: " + ", ".join(f"{i} {common.us(r['graph_us'][i])}" for i in r["graph_us"])
                  + f"; floor {common.us(r['floor_us'])}; rel_err {r['rel_err']}", flush=True)  # fmt: skip
    common.finish(args, report_text(records, common.device_name(device)), {"device": common.device_name(device),
                                                                          "records": records})  # fmt: skip
    bound = tolerance(torch.bfloat16).rel_norm
    bad = [(r["shape"], r["batch"], r["context"]) for r in records
           if r["fused_sites"] != 1 or r["rel_err"]["ours"] > bound]  # fmt: skip
    if bad:
        print(f"FAILURE (not fused, or off eager by more than bf16's tolerance) at {bad}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
