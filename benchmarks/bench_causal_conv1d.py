"""Time Gated DeltaNet's prefill conv on one GPU: eager vs stock Inductor vs ours (the
causal_conv1d fusion: one kernel), at Qwen 3.5 widths (8192 channels = q, k, v of 16 / 16 / 32
heads of 128; 4 taps, no bias), batch 1, bf16.

The region is what a Qwen 3.5 / Qwen3-Next GDN layer runs on a prompt between its qkv projection
and the split into q / k / v (transformers' causal_conv1d_fn on the transposed projection):

    x = mixed_qkv.transpose(1, 2)                                    [B, C, T], C contiguous
    out = silu(conv1d(x, weight[:, None], padding=W - 1, groups=C)[..., :T]).transpose(1, 2)

and where the prompt continues the StaticCache's conv state (``--after-state``: a chunked
prefill, a second turn; the cache's update_conv_state cats the state before the prompt and writes
back its last 4 inputs, the conv's outputs for the prompt are kept).

Each implementation is timed as plain launches (do_bench median) and in a CUDA graph; its kernels
per call are counted and its output compared with eager's. The floor: one read of x and one write
of the output at the GPU's copy bandwidth.

    python -m benchmarks.bench_causal_conv1d [--tokens 512 4096 16384] [--after-state]
    python -m benchmarks.bench_causal_conv1d --smoke   # tiny sizes on a CPU (the reference)
"""

from __future__ import annotations

import sys

import torch

from benchmarks import common

common.interpret_smoke_run()  # before triton is imported

import fusion_passes  # noqa: E402
from benchmarks.timing import kernels_per_call, time_graph_us, time_plain_us  # noqa: E402
from fusion_passes.numerics import compare  # noqa: E402

DTYPE = torch.bfloat16
CHANNELS, SMOKE_CHANNELS, TAPS = 8192, 48, 4
TOKENS, SMOKE_TOKENS = (512, 4096, 16384), (37,)
FUSIONS = ["causal_conv1d_after_state", "causal_conv1d"]


def region(mixed_qkv, weight):
    from transformers.models.qwen3_5.modeling_qwen3_5 import causal_conv1d_fn

    out = causal_conv1d_fn(mixed_qkv.transpose(1, 2), weight, None, activation="silu")
    return out.transpose(1, 2)


def region_after_state(mixed_qkv, conv_state, weight):
    from transformers.models.qwen3_5.modeling_qwen3_5 import causal_conv1d_fn

    full = torch.cat([conv_state, mixed_qkv.transpose(1, 2)], dim=-1)
    conv_state.copy_(full[..., -conv_state.shape[-1] :])
    out = causal_conv1d_fn(full, weight, None, activation="silu")[:, :, -mixed_qkv.shape[1] :]
    return out.transpose(1, 2)


def bench(tokens, channels, device, g, after_state=False) -> dict:
    mixed_qkv = torch.randn(1, tokens, channels, generator=g).to(device, DTYPE)
    weight = (torch.randn(channels, TAPS, generator=g) * 0.5).to(device, DTYPE)
    fn = region_after_state if after_state else region
    # the state is written each call: the same inputs each time (its last 4), so every call's
    # output is the same
    args = (mixed_qkv, mixed_qkv[:, -TAPS:].transpose(1, 2).contiguous(), weight) if after_state else (mixed_qkv, weight)
    report = fusion_passes.Report()
    torch._dynamo.reset()
    impls = {
        "eager": fn,
        "inductor": torch.compile(fn, backend="inductor", fullgraph=True),
        "ours": torch.compile(fn, backend=fusion_passes.backend(FUSIONS, report=report), fullgraph=True),
    }
    expected = fn(*args)
    record = {"tokens": tokens, "channels": channels, "after_state": after_state, "out_rel_err": {}, "plain_us": {}, "graph_us": {}, "kernels": {}}
    for name, fn in impls.items():
        record["out_rel_err"][name] = compare(fn(*args), expected).rel_norm
        record["kernels"][name] = kernels_per_call(lambda fn=fn: fn(*args))
        record["plain_us"][name] = time_plain_us(lambda fn=fn: fn(*args)) if device == "cuda" else None
        record["graph_us"][name] = time_graph_us([lambda fn=fn: fn(*args)])
    record["fused_sites"] = report.final().get("causal_conv1d_after_state" if after_state else "causal_conv1d", 0)
    record["floor_bytes"] = 2 * mixed_qkv.numel() * mixed_qkv.element_size()
    return record


def report_text(records, device_name) -> str:
    lines = [f"# Gated DeltaNet prefill conv (causal_conv1d), {device_name}", ""]
    impls = list(records[0]["out_rel_err"])
    for mode in ("graph_us", "plain_us"):
        where = ", after the cached state" if records[0]["after_state"] else ""
        lines += [f"## {mode} (us per call, batch 1, {records[0]['channels']} channels{where})", "",
                  "| tokens | " + " | ".join(impls) + " | ours vs inductor | kernels " + "/".join(impls) + " |",
                  "|---" * (len(impls) + 3) + "|"]  # fmt: skip
        for r in records:
            t = r[mode]
            lines.append(f"| {r['tokens']} | " + " | ".join(common.us(t[i]) for i in impls) + " | "
                         + common.ratio(t["inductor"], t["ours"]) + " | "
                         + "/".join(str(r["kernels"][i]) for i in impls) + " |")  # fmt: skip
        lines.append("")
    lines += ["## Error against eager (relative norm)", "", "| tokens | " + " | ".join(impls) + " |",
              "|---" * (len(impls) + 1) + "|"]  # fmt: skip
    for r in records:
        lines.append(f"| {r['tokens']} | " + " | ".join(f"{r['out_rel_err'][i]:.2e}" for i in impls) + " |")
    return "\n".join(lines + [""])


def main() -> int:
    parser = common.parser(__doc__, "bench_causal_conv1d", smoke="tiny sizes; the reference on a CPU")
    common.add_sizes(parser, "--tokens", TOKENS, SMOKE_TOKENS, "prompt tokens (batch 1)")
    parser.add_argument("--after-state", action="store_true", help="the prompt continues the cache's conv state")
    args = common.parse(parser)
    device = common.device(parser, args.smoke)
    channels = SMOKE_CHANNELS if args.smoke else CHANNELS
    g = torch.Generator().manual_seed(0)
    records = []
    with torch.no_grad():
        for tokens in args.tokens:
            records.append(bench(tokens, channels, device, g, args.after_state))
            r = records[-1]
            print(f"{tokens} tokens: " + ", ".join(f"{i} {common.us(r['graph_us'][i])}" for i in r["graph_us"])
                  + f"; fused {r['fused_sites']}", flush=True)  # fmt: skip
    common.finish(args, report_text(records, common.device_name(device)),
                  {"device": common.device_name(device), "records": records})  # fmt: skip
    bad = [r["tokens"] for r in records if r["fused_sites"] != 1]
    if bad:
        print(f"FAILURE (no fused site) at {bad}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
