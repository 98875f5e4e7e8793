"""Time Gated DeltaNet's prefill (transformers' chunked delta rule, bf16 activations, fp32 state) on
one GPU: eager vs stock Inductor (its trace of the rule, the loop unrolled per 64-token chunk) vs
ours (the chunk_gated_delta_rule fusion: flash-linear-attention's chunk kernels inside the op),
and fla-core's chunk_gated_delta_rule called directly as the peer.

The region is what a Qwen 3.5 / Qwen3-Next GDN layer runs on a prompt through a cache, from its
repeat of q / k to the value heads (with --key-heads below the value heads; the fusion then also
takes chunk_gated_delta_rule_gva, and fla reads the key heads as they are):

    q, k = q.repeat_interleave(HV // H, dim=2), k.repeat_interleave(HV // H, dim=2)
    out, S = torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=None,
                                          output_final_state=True, use_qk_l2norm_in_kernel=True)

at Qwen 3.5 widths (32 value heads of 128; key heads 32, or 16 as the model has), batch 1. Each implementation is timed as plain
launches (do_bench median) and in a CUDA graph; its kernels per call are counted, its output and
final state compared with eager's, and the compile time of inductor and ours is recorded (ours
traces its patterns per chunk count, once per process).

    python -m benchmarks.bench_chunk_gated_delta_rule [--tokens 64 512 1024 4096] [--key-heads 16]
    python -m benchmarks.bench_chunk_gated_delta_rule --smoke   # tiny sizes on a CPU (the reference)
"""

from __future__ import annotations

import sys
import time

import torch

from benchmarks import common

common.interpret_smoke_run()  # before triton is imported

import fusion_passes  # noqa: E402
from benchmarks.timing import kernels_per_call, time_graph_us, time_plain_us  # noqa: E402
from fusion_passes.lowering.chunk_gated_delta_rule.op import fla_chunk_kernel  # noqa: E402
from fusion_passes.numerics import compare  # noqa: E402

DTYPE = torch.bfloat16
QWEN = dict(heads=32, dk=128, dv=128)
SMOKE = dict(heads=2, dk=16, dv=8)
TOKENS, SMOKE_TOKENS = (64, 512, 1024, 4096), (70,)  # one chunk (a short turn) to a long prompt


FUSIONS = ["chunk_gated_delta_rule", "chunk_gated_delta_rule_gva"]


def region(q, k, v, g, beta):
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    ratio = v.shape[2] // q.shape[2]
    if ratio > 1:  # Qwen3_5GatedDeltaNet.forward's repeats
        q, k = q.repeat_interleave(ratio, dim=2), k.repeat_interleave(ratio, dim=2)
    return torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=None, output_final_state=True,
                                        use_qk_l2norm_in_kernel=True)  # fmt: skip


def fla_region(q, k, v, g, beta):
    return fla_chunk_kernel()(q, k, v, g, beta, scale=q.shape[-1] ** -0.5, output_final_state=True,
                              use_qk_l2norm_in_kernel=True)  # fmt: skip


def inputs(tokens, heads, dk, dv, device, g, key_heads=None):
    def rand(*shape):
        return torch.randn(*shape, generator=g).to(device)

    key_heads = key_heads or heads
    q, k = rand(1, tokens, key_heads, dk).to(DTYPE), rand(1, tokens, key_heads, dk).to(DTYPE)
    v = rand(1, tokens, heads, dv).to(DTYPE)
    # softplus-gated log decays and sigmoid write strengths, as the model's gating gives them
    decay = -torch.nn.functional.softplus(rand(1, tokens, heads)) * 0.5
    beta = torch.sigmoid(rand(1, tokens, heads)).to(DTYPE)
    return q, k, v, decay, beta


def _compiled(fn, backend, args):
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=backend, fullgraph=True)
    start = time.perf_counter()
    compiled(*args)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return compiled, time.perf_counter() - start


def bench(tokens, sizes, device, g, key_heads=None) -> dict:
    args = inputs(tokens, **sizes, device=device, g=g, key_heads=key_heads)
    report = fusion_passes.Report()
    inductor, inductor_s = _compiled(region, "inductor", args)
    ours, ours_s = _compiled(region, fusion_passes.backend(FUSIONS, report=report), args)
    impls = {"eager": region, "inductor": inductor, "ours": ours}
    if device == "cuda" and fla_chunk_kernel() is not None:
        impls["fla"] = fla_region
    expected = region(*args)
    record = {"tokens": tokens, **sizes, "key_heads": key_heads or sizes["heads"],
              "fused_sites": sum(report.final().get(f, 0) for f in FUSIONS),
              "rejected": [r.reason for r in report.rejected], "compile_s": {"inductor": inductor_s, "ours": ours_s},
              "out_rel_err": {}, "state_rel_err": {}, "plain_us": {}, "graph_us": {}, "kernels": {}}  # fmt: skip
    for name, fn in impls.items():
        out, state = fn(*args)
        record["out_rel_err"][name] = compare(out, expected[0]).rel_norm
        record["state_rel_err"][name] = compare(state, expected[1]).rel_norm
        record["kernels"][name] = kernels_per_call(lambda fn=fn: fn(*args))
        record["plain_us"][name] = time_plain_us(lambda fn=fn: fn(*args)) if device == "cuda" else None
        record["graph_us"][name] = time_graph_us([lambda fn=fn: fn(*args)])
    return record


def report_text(records, device_name) -> str:
    lines = [f"# Gated DeltaNet prefill (chunked delta rule), {device_name}", ""]
    impls = list(records[0]["out_rel_err"])
    for mode in ("graph_us", "plain_us"):
        lines += [f"## {mode} (us per call, batch 1)", "",
                  "| tokens | " + " | ".join(impls) + " | ours vs inductor | kernels " + "/".join(impls)
                  + " | compile s inductor / ours |", "|---" * (len(impls) + 4) + "|"]  # fmt: skip
        for r in records:
            t = r[mode]
            lines.append(f"| {r['tokens']} | " + " | ".join(common.us(t[i]) for i in impls) + " | "
                         + common.ratio(t["inductor"], t["ours"]) + " | "
                         + "/".join(str(r["kernels"][i]) for i in impls)
                         + f" | {r['compile_s']['inductor']:.1f} / {r['compile_s']['ours']:.1f} |")  # fmt: skip
        lines.append("")
    lines += ["## Error against eager (relative norm: output / final state)", "",
              "| tokens | " + " | ".join(impls) + " |", "|---" * (len(impls) + 1) + "|"]  # fmt: skip
    for r in records:
        lines.append(f"| {r['tokens']} | " + " | ".join(
            f"{r['out_rel_err'][i]:.2e} / {r['state_rel_err'][i]:.2e}" for i in impls) + " |")  # fmt: skip
    return "\n".join(lines + [""])


def main() -> int:
    parser = common.parser(
        __doc__, "bench_chunk_gated_delta_rule", smoke="tiny sizes; the reference on a CPU"
    )
    common.add_sizes(parser, "--tokens", TOKENS, SMOKE_TOKENS, "prompt tokens (batch 1)")
    parser.add_argument("--key-heads", type=int, default=None,
                        help="key heads (default: the value heads; Qwen 3.5: 16 of 32, repeated in the region)")
    args = common.parse(parser)
    device = common.device(parser, args.smoke)
    sizes = SMOKE if args.smoke else QWEN
    g = torch.Generator().manual_seed(0)
    records = []
    with torch.no_grad():
        for tokens in args.tokens:
            key_heads = args.key_heads and (args.key_heads if not args.smoke else sizes["heads"] // 2)
            records.append(bench(tokens, sizes, device, g, key_heads))
            r = records[-1]
            print(f"{tokens} tokens: " + ", ".join(f"{i} {common.us(r['graph_us'][i])}" for i in r["graph_us"])
                  + f"; fused {r['fused_sites']} {r['rejected']}; compile {r['compile_s']}", flush=True)  # fmt: skip
    common.finish(args, report_text(records, common.device_name(device)),
                  {"device": common.device_name(device), "records": records})  # fmt: skip
    expected_sites = 1 if device != "cuda" or fla_chunk_kernel() is not None else 0
    bad = [r["tokens"] for r in records if r["fused_sites"] != expected_sites]
    if bad:
        print(f"FAILURE (fused sites other than {expected_sites}) at {bad}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
