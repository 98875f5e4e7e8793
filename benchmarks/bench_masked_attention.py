"""Time a prefill's attention on a static cache on one GPU: transformers' repeat_kv + SDPA with the
prefill's boolean mask (eager, stock Inductor) against the masked_attention kernels, at the
attention widths of MiniMax-M2 (48 / 8 heads of 128), Qwen3-MoE (64 / 4 of 128), Qwen 3.5 (16 / 2
of 256) and DeepSeek V3.2 (128 heads, as many KV heads: no repeat; q / k of 192, v of 128), batch 1,
prompts of 1024-8192 tokens on a cache --slots-after slots longer (16; a model's prefill: 1).

The region is the attention as transformers writes it (sdpa_attention_forward with a mask):

    key, value = repeat_kv(key, g), repeat_kv(value, g)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling)

with the mask of a first prompt (query i sees cache slots 0..i; the 16 slots after the prompt are
unwritten). Implementations: eager; inductor (torch.compile); ours (torch.compile with
masked_prefill_attention, and masked_prefill_attention_mha where no repeat); ours_kernel (the launcher called directly, on the additive mask).
Each is timed as plain launches (do_bench median) and in a CUDA graph of calls on 2 input sets;
the largest difference from the fp32 reference, relative to its largest value, is recorded.
--sweep times ours_kernel at each tile shape, warp count and stage count.

    python -m benchmarks.bench_masked_attention [--tokens 1024 4096 8192] [--models minimax-m2 qwen3-moe] [--sweep]
    python -m benchmarks.bench_masked_attention --smoke   # tiny sizes; on a CPU via Triton's interpreter
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from benchmarks import common

common.interpret_smoke_run()  # before triton is imported

import fusion_passes  # noqa: E402
from benchmarks.timing import kernels_per_call, time_graph_us, time_plain_us  # noqa: E402
from fusion_passes.lowering.masked_attention.reference import masked_attention_reference  # noqa: E402
from fusion_passes.lowering.masked_attention.triton import masked_attention_triton  # noqa: E402
from fusion_passes.patterns.gqa_decode_attention import repeat_kv  # noqa: E402

# query heads, KV heads, q / k head dim, v head dim (DeepSeek V3.2's MLA: as many KV heads, v of 128)
WIDTHS = {"minimax-m2": (48, 8, 128, 128), "qwen3-moe": (64, 4, 128, 128), "qwen3.5": (16, 2, 256, 256),
          "deepseek-v3.2": (128, 128, 192, 128)}  # fmt: skip
# (on the CPU a v head dim of its own takes SDPA's math path: no SDPA op for the fusion to take)
SMOKE_WIDTHS = {"tiny": (4, 2, 16, 16), "tiny-mha": (4, 4, 24, 24)}
FUSIONS = ["masked_prefill_attention", "masked_prefill_attention_mha"]
TOKENS, SMOKE_TOKENS = (1024, 4096, 8192), (40,)
SLOTS_AFTER = 16  # unwritten cache slots after the prompt (the decode steps' room; a model's prefill: 1)
SETS = 2
SWEEP = [(bm, bn, w, st) for bm, bn in ((64, 64), (128, 64), (128, 128)) for w in (4, 8) for st in (2, 3, 4)]


def region(query, key, value, mask, scale):
    groups = query.shape[1] // key.shape[1]
    if groups > 1:  # transformers' repeat_kv returns the cache as it is for one group
        key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale)


def inputs(heads, kv_heads, dim, v_dim, tokens, device, g, slots_after):
    length = tokens + slots_after
    q = torch.randn(1, heads, tokens, dim, generator=g).to(device, torch.bfloat16)
    k = torch.randn(1, kv_heads, length, dim, generator=g).to(device, torch.bfloat16)
    v = torch.randn(1, kv_heads, length, v_dim, generator=g).to(device, torch.bfloat16)
    keep = (torch.arange(length)[None, :] <= torch.arange(tokens)[:, None])[None, None].to(device)
    return q, k, v, keep


def bench(model, widths, tokens, device, g, sweep, slots_after=SLOTS_AFTER) -> dict:
    heads, kv_heads, dim, v_dim = widths
    sets = [inputs(heads, kv_heads, dim, v_dim, tokens, device, g, slots_after)
            for _ in range(SETS if device == "cuda" else 1)]  # fmt: skip
    scale = dim**-0.5
    report = fusion_passes.Report()
    ours = torch.compile(region, fullgraph=True, backend=fusion_passes.backend(FUSIONS, report=report))
    ours(*sets[0], scale)

    def kernel(q, k, v, keep, scale, **launch):
        bias = torch.zeros(keep.shape, dtype=q.dtype, device=q.device).masked_fill(~keep, float("-inf"))
        return masked_attention_triton(q, k, v, bias, scale, **launch)

    impls = {"eager": region, "inductor": torch.compile(region, fullgraph=True), "ours": ours, "ours_kernel": kernel}
    record = {"model": model, "heads": heads, "kv_heads": kv_heads, "dim": dim, "v_dim": v_dim, "tokens": tokens,
              "cache": tokens + slots_after, "fused_sites": sum(report.matches.get(f, 0) for f in FUSIONS),
              "rel_diff": {}, "plain_us": {}, "graph_us": {}, "kernels": {}}  # fmt: skip
    q, k, v, keep = sets[0]
    bias = torch.zeros(keep.shape, device=device).masked_fill(~keep, float("-inf"))
    expected = masked_attention_reference(q, k, v, bias, scale).float()
    for name, fn in impls.items():
        calls = [lambda s=s, fn=fn: fn(*s, scale) for s in sets]
        out = calls[0]().float()
        record["rel_diff"][name] = ((out - expected).abs().max() / expected.abs().max()).item()
        record["kernels"][name] = kernels_per_call(calls[0])
        record["plain_us"][name] = time_plain_us(calls[0]) if device == "cuda" else None
        record["graph_us"][name] = time_graph_us(calls)
    if sweep and device == "cuda":
        record["sweep_graph_us"] = {}
        for bm, bn, w, st in SWEEP:
            calls = [lambda s=s, c=(bm, bn, w, st): kernel(*s, scale, block_m=c[0], block_n=c[1], num_warps=c[2],
                                                          num_stages=c[3]) for s in sets]  # fmt: skip
            try:
                record["sweep_graph_us"][f"{bm}x{bn}x{w}x{st}"] = time_graph_us(calls)
            except Exception as e:  # a tile shape that does not fit (shared memory): recorded as such
                record["sweep_graph_us"][f"{bm}x{bn}x{w}x{st}"] = None
                print(f"sweep {bm}x{bn}x{w}x{st}: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
    return record


def report_text(records, device_name) -> str:
    lines = [f"# Prefill attention on a static cache (batch 1, bf16), {device_name}", ""]
    impls = list(records[0]["graph_us"])
    for mode in ("graph_us", "plain_us"):
        lines += [f"## {mode} (us per call)", "",
                  "| model widths | prompt / cache | " + " | ".join(impls) + " | ours vs inductor | kernels "
                  + "/".join(impls) + " | rel. diff from fp32 " + "/".join(impls) + " |",
                  "|---" * (len(impls) + 5) + "|"]  # fmt: skip
        for r in records:
            t = r[mode]
            lines.append(f"| {r['model']} ({r['heads']}/{r['kv_heads']}x{r['dim']}) | {r['tokens']} / {r['cache']} | "
                         + " | ".join(common.us(t[i]) for i in impls) + " | " + common.ratio(t["inductor"], t["ours"])
                         + " | " + "/".join(str(r["kernels"][i]) for i in impls) + " | "
                         + "/".join(f"{r['rel_diff'][i]:.1e}" for i in impls) + " |")  # fmt: skip
        lines.append("")
    for r in records:
        if r.get("sweep_graph_us"):
            best = min((v, k) for k, v in r["sweep_graph_us"].items() if v)
            lines.append(f"sweep (block_m x block_n x warps x stages) {r['model']} {r['tokens']}: best {best[1]} "
                         f"{best[0]:.1f} us; " + ", ".join(f"{k} {common.us(v)}" for k, v in r["sweep_graph_us"].items()))
    return "\n".join(lines)


def main() -> int:
    parser = common.parser(__doc__, "bench_masked_attention", smoke="tiny sizes; CPU under TRITON_INTERPRET=1")
    common.add_sizes(parser, "--tokens", TOKENS, SMOKE_TOKENS, "prompt tokens")
    parser.add_argument("--models", nargs="+", default=list(WIDTHS), choices=list(WIDTHS))
    parser.add_argument("--sweep", action="store_true", help="time ours_kernel at each launch configuration")
    parser.add_argument("--slots-after", type=int, nargs="+", default=[SLOTS_AFTER], metavar="N",
                        help="unwritten cache slots after the prompt (bench_decode's prefill: 1, an odd cache length)")
    args = common.parse(parser)
    device = common.device(parser, args.smoke)
    widths = SMOKE_WIDTHS if args.smoke else {m: WIDTHS[m] for m in args.models}
    g = torch.Generator().manual_seed(0)
    records = []
    with torch.no_grad():
        for model, tokens, after in [(m, t, a) for m in widths for t in args.tokens for a in args.slots_after]:
            torch._dynamo.reset()
            records.append(bench(model, widths[model], tokens, device, g, args.sweep, after))
            r = records[-1]
            print(f"{model} {tokens}: " + ", ".join(f"{i} {common.us(r['graph_us'][i])}" for i in r["graph_us"])
                  + f"; rel diff {r['rel_diff']}", flush=True)  # fmt: skip
    common.finish(args, report_text(records, common.device_name(device)),
                  {"device": common.device_name(device), "records": records})  # fmt: skip
    # bf16 outputs: within bf16's rounding of the fp32 reference (2^-8 of the largest value, twice)
    bad = [(r["model"], r["tokens"]) for r in records if r["fused_sites"] != 1 or r["rel_diff"]["ours"] > 2**-7]
    if bad:
        print(f"FAILURE (not fused, or off the reference) at {bad}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
