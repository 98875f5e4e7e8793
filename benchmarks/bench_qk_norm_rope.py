"""Time each model's pre-attention region (q/k RMSNorm + RoPE, bf16) on one GPU, three ways.

    Qwen3-235B:  per-head Llama norm, RoPE over the head      64 q / 4 kv heads, head dim 128
    Qwen 3.5:    per-head (1 + w) norm of q (chunk of q+gate), partial RoPE (configs.py's real)
    MiniMax-M2:  norm over all heads, per-head partial RoPE    48 q / 8 kv heads, dim 128, rotary 64

Implementations: eager (transformers' spelling), torch.compile of it with stock Inductor, ours
(torch.compile with fusion_passes: one qk_norm_rope kernel). Timed as plain launches and inside a
CUDA graph (see timing.py); kernels per call counted with torch.profiler. The fewest bytes: read
q, k, weights, cos, sin once, write q and k once; at >= 4096 tokens reported as GB/s and % of the
device's copy bandwidth.

    python -m benchmarks.bench_qk_norm_rope [--out bench_qk_norm_rope.md] [--json ...]
    python -m benchmarks.bench_qk_norm_rope --smoke     # tiny sizes; on a CPU via Triton's interpreter
"""

from __future__ import annotations

import sys

import torch

from benchmarks import common

common.interpret_smoke_run()  # before triton is imported

import fusion_passes  # noqa: E402
from benchmarks.timing import (  # noqa: E402
    copy_bandwidth_gbps,
    kernels_per_call,
    time_graph_us,
    time_plain_us,
)
from fusion_passes.lowering.qk_norm_rope.reference import qk_norm_rope_reference  # noqa: E402
from benchmarks.spellings import rope_full, rope_partial  # noqa: E402
from fusion_passes.patterns.rms_norm import llama_rms_norm, offset_rms_norm  # noqa: E402

DTYPE, EPS = torch.bfloat16, 1e-6
# name: (q heads, kv heads, head dim, rotary dim, per-head norm, q+gate projection, norm form)
MODELS = {
    "qwen3-235b": (64, 4, 128, 128, True, False, "llama"),
    "qwen3.5": (16, 4, 256, 64, True, True, "offset"),  # configs.py _qwen3_5_real, factor 0.25
    "minimax-m2": (48, 8, 128, 64, False, False, "llama"),
}
SMOKE_MODELS = {
    "qwen3-235b": (4, 2, 32, 32, True, False, "llama"),
    "qwen3.5": (4, 2, 32, 8, True, True, "offset"),
    "minimax-m2": (6, 2, 32, 16, False, False, "llama"),
}
TOKENS = (1, 8, 64, 512, 4096, 16384)
SMOKE_TOKENS = (1, 5)
GRAPH_CALLS = 20
IMPLS = ("eager", "inductor", "ours")


def prelude(model):
    hq, hk, d, r, per_head, gate, form = model
    norm = llama_rms_norm if form == "llama" else offset_rms_norm
    rope = rope_full if r == d else rope_partial

    def fn(q_proj, k_proj, q_weight, k_weight, cos, sin):
        b, s = q_proj.shape[:2]
        hidden_shape = (b, s, -1, d)
        q = q_proj
        if gate:
            q, _ = torch.chunk(q_proj.view(b, s, -1, 2 * d), 2, dim=-1)
        if per_head:
            q = norm(q.view(hidden_shape), q_weight, EPS).transpose(1, 2)
            k = norm(k_proj.view(hidden_shape), k_weight, EPS).transpose(1, 2)
        else:
            q = norm(q, q_weight, EPS).view(hidden_shape).transpose(1, 2)
            k = norm(k_proj, k_weight, EPS).view(hidden_shape).transpose(1, 2)
        return rope(q, k, cos, sin)

    return fn


def inputs(model, tokens, device):
    hq, hk, d, r, per_head, gate, form = model
    offset = 1.0 if form == "offset" else 0.0
    freqs = 1000 * torch.rand(1, tokens, r // 2, device=device)
    angles = torch.cat((freqs, freqs), -1)
    return (
        torch.randn(1, tokens, hq * d * (2 if gate else 1), device=device).to(DTYPE),
        torch.randn(1, tokens, hk * d, device=device).to(DTYPE),
        ((1 - offset) + 0.1 * torch.randn(d if per_head else hq * d, device=device)).to(DTYPE),
        ((1 - offset) + 0.1 * torch.randn(d if per_head else hk * d, device=device)).to(DTYPE),
        angles.cos().to(DTYPE),
        angles.sin().to(DTYPE),
    )


def min_bytes(model, tokens):
    hq, hk, d, r, per_head, _, _ = model
    elems = 2 * tokens * (hq + hk) * d + 2 * tokens * r + (2 * d if per_head else (hq + hk) * d)
    return elems * torch.finfo(DTYPE).bits // 8


def bench(name, model, tokens, device):
    fn = prelude(model)
    sets = [inputs(model, tokens, device) for _ in range(GRAPH_CALLS if device == "cuda" else 1)]
    torch._dynamo.reset()
    report = fusion_passes.Report()
    # The region's q and k are graph outputs here; in a model they go into attention, which reads
    # any strides. Inductor would copy ours ([B, S, H, D] storage) into eager's layout (contiguous
    # [B, H, S, D] after the partial-rotary cat) only because they are outputs: measured on an
    # H200, that copy was 2 of ours' 3 kernels. Both compiles may keep their own output strides.
    torch._inductor.config.keep_output_stride = False
    compiled = {
        "eager": fn,
        "inductor": torch.compile(fn, backend="inductor", dynamic=False),
        "ours": torch.compile(fn, backend=fusion_passes.backend(report=report), dynamic=False),
    }
    out = compiled["ours"](*sets[0])
    hq, hk, d, r, per_head, gate, form = model
    q, k, wq, wk, cos, sin = sets[0]
    b, s = q.shape[:2]
    q4 = q.view(b, s, -1, 2 * d)[..., :d] if gate else q.view(b, s, -1, d)
    offset, cast = (1.0, False) if form == "offset" else (0.0, True)
    ref = qk_norm_rope_reference(q4, k.view(b, s, -1, d), wq, wk, cos, sin, EPS, offset, cast,
                                 per_head)  # fmt: skip
    correct = all(torch.equal(a, e) or torch.allclose(a.float(), e.float(), rtol=2e-2, atol=2e-2)
                  for a, e in zip(out, ref))  # fmt: skip
    fused = sum(v for k_, v in report.matches.items() if k_.startswith("qk_norm_rope"))
    record = {"model": name, "tokens": tokens, "correct": correct, "fused_sites": fused,
              "plain_us": {}, "graph_us": {}, "kernels": {}, "bytes": min_bytes(model, tokens)}  # fmt: skip
    for impl, f in compiled.items():
        calls = [lambda f=f, a=a: f(*a) for a in sets]
        calls[0]()
        record["plain_us"][impl] = time_plain_us(calls[0])
        record["graph_us"][impl] = time_graph_us(calls)
        record["kernels"][impl] = kernels_per_call(calls[0])
    return record


def report_md(records, copy_gbps, device_name):
    lines = [f"# QK-norm + RoPE prelude, bf16, {device_name}", "",
             f"copy bandwidth {copy_gbps:.0f} GB/s", "",
             "| model | tokens | fused | kernels e/i/o | plain us e/i/o | graph us e/i/o "
             "| graph speedup vs inductor | ours GB/s (% copy) |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in records:
        g, p, kn = r["graph_us"], r["plain_us"], r["kernels"]
        speed = common.ratio(g["inductor"], g["ours"])
        best = g["ours"] if g["ours"] is not None else p["ours"]
        gbps = r["bytes"] / best / 1e3
        lines.append(
            f"| {r['model']} | {r['tokens']} | {r['fused_sites']} | "
            f"{'/'.join(str(kn[i]) for i in IMPLS)} | {'/'.join(common.us(p[i]) for i in IMPLS)} | "
            f"{'/'.join(common.us(g[i]) for i in IMPLS)} | {speed} | "
            f"{gbps:.0f} ({100 * gbps / copy_gbps:.0f}%) |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = common.parser(__doc__, "bench_qk_norm_rope", smoke="tiny sizes; CPU interpreter")
    common.add_sizes(parser, "--tokens", TOKENS, SMOKE_TOKENS, "token counts")
    parser.add_argument("--models", nargs="+", choices=list(MODELS))
    args = common.parse(parser)
    device = common.device(parser, args.smoke)
    models = SMOKE_MODELS if args.smoke else MODELS
    device_name = common.device_name(device)
    torch.manual_seed(0)
    copy_gbps = copy_bandwidth_gbps(2**31 if device == "cuda" else 2**20, device)
    records = []
    with torch.no_grad():
        for name, model in models.items():
            if args.models and name not in args.models:
                continue
            for t in args.tokens:
                records.append(bench(name, model, t, device))
                print(name, t, records[-1]["graph_us"], records[-1]["plain_us"], flush=True)
    text = report_md(records, copy_gbps, device_name)
    common.finish(args, text, {"device": device_name, "copy_gbps": copy_gbps, "records": records})
    return 1 if any(not r["correct"] or not r["fused_sites"] for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())
