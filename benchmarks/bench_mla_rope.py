"""Time DeepSeek V3's MLA pre-attention region (bf16) on one GPU: eager vs stock Inductor vs ours.

    region:  q_pass, q_rot = split(q.view(1, T, H, 192).transpose(1, 2), [128, 64])
             kv_nope, k_rot = split(kv, [512, 64]); kv_nope = RMSNorm(kv_nope)
             q_rot, k_rot = interleaved RoPE(q_rot, k_rot); query = cat(q_pass, q_rot)
    ours:    torch.compile with the fusion_passes backend (the ops launched directly by Inductor's
             generated code): mla_q_rope + mla_kv_norm_rope merged into one mla_q_kv_rope launch
             below ONE_LAUNCH_MAX_TOKENS tokens, one kernel per branch from there on
    ours_two_launches: the same without the merge: one kernel per branch at every size

DeepSeek V3 widths: kv_lora_rank 512, rope 64, 128 heads, qk_nope 128 (q_lora_rank 1536 and v 128
are the GEMMs' business, outside the region). Each implementation is timed as plain launches
(do_bench median, L2 flushed) and in a CUDA graph of GRAPH_CALLS calls on distinct inputs, and its
kernels per call are counted with the profiler. The fewest bytes the region moves: read q, kv,
cos, sin (and the norm weight), write query, the normed latent and k_pe; at >= 4096 tokens that
over the time is reported in GB/s and as a percent of the device's copy bandwidth.

The ratios to stock Inductor are reported for both of ours; the two columns of ours place the
merge's token bound (patterns/mla_rope.py).

    python -m benchmarks.bench_mla_rope [--out bench_mla_rope.md] [--json bench_mla_rope.json]
    python -m benchmarks.bench_mla_rope --smoke     # tiny sizes; on a CPU via Triton's interpreter
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
from fusion_passes.lowering.mla_rope.reference import (  # noqa: E402
    mla_kv_norm_rope_reference,
    mla_q_rope_reference,
)
from fusion_passes.lowering.mla_rope.triton import (  # noqa: E402
    mla_kv_norm_rope_triton,
    mla_q_kv_rope_triton,
    mla_q_rope_triton,
)
from fusion_passes.patterns.mla_rope import ONE_LAUNCH_MAX_TOKENS  # noqa: E402

DTYPE = torch.bfloat16
EPS = 1e-6
V3 = dict(heads=128, nope=128, rope=64, kv_lora=512)
SMOKE = dict(heads=4, nope=32, rope=16, kv_lora=32)
TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 512, 1024, 4096, 16384)
SMOKE_TOKENS = (1, 5)
GRAPH_CALLS = 20
COPY_BYTES = 2 << 30
IMPLS = ("eager", "inductor", "ours", "ours_two_launches")
MERGES = ("mla_q_kv_rope", "mla_q_kv_rope_rotate_half")
OURS = {"ours": (), "ours_two_launches": MERGES}  # the fusions each of ours leaves out of "all"


def region(q, kv, w, cos, sin, dims):
    """The HF DeepseekV3Attention spelling, from the projections to query / latent / k_pe."""
    h, nope, rope, r = dims["heads"], dims["nope"], dims["rope"], dims["kv_lora"]
    b, t = q.shape[:2]
    q_pass, q_rot = torch.split(q.view(b, t, h, nope + rope).transpose(1, 2), [nope, rope], dim=-1)
    kv_nope, k_rot = torch.split(kv, [r, rope], dim=-1)
    x = kv_nope.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)
    kv_nope = w * x.to(kv.dtype)
    k_rot = k_rot.view(b, 1, t, rope)
    c, s = cos[..., : rope // 2].unsqueeze(1), sin[..., : rope // 2].unsqueeze(1)
    q1, q2 = q_rot[..., 0::2], q_rot[..., 1::2]
    k1, k2 = k_rot[..., 0::2], k_rot[..., 1::2]
    q_rot = torch.cat([q1 * c - q2 * s, q2 * c + q1 * s], dim=-1)
    k_rot = torch.cat([k1 * c - k2 * s, k2 * c + k1 * s], dim=-1)
    return torch.cat((q_pass, q_rot), dim=-1), kv_nope, k_rot


def inputs(tokens, dims, device, g):
    h, nope, rope, r = dims["heads"], dims["nope"], dims["rope"], dims["kv_lora"]
    angle = torch.rand(1, tokens, rope // 2, generator=g) * 1000
    emb = torch.cat([angle, angle], -1)
    return dict(
        q=torch.randn(1, tokens, h * (nope + rope), generator=g).to(device, DTYPE),
        kv=torch.randn(1, tokens, r + rope, generator=g).to(device, DTYPE),
        w=(1 + 0.1 * torch.randn(r, generator=g)).to(device, DTYPE),
        cos=emb.cos().to(device, DTYPE),
        sin=emb.sin().to(device, DTYPE),
    )


def check_ours(x, dims) -> list[str]:
    """The kernels against the references and the eager region: RoPE outputs bit-exact; the
    normalised latent within two bf16 ulps of both, the kernel tests' bound (two roundings, and
    the row reduced in another order: eager reads a strided slice). Returns what failed."""
    rope = dims["rope"]
    c, s = x["cos"][..., : rope // 2], x["sin"][..., : rope // 2]
    q4 = x["q"].view(*x["q"].shape[:2], dims["heads"], -1)
    query = mla_q_rope_triton(q4, c, s, False, True, True)
    normed, k_pe = mla_kv_norm_rope_triton(x["kv"], x["w"], c, s, EPS, 0.0, True, True)
    ref_normed, ref_pe = mla_kv_norm_rope_reference(x["kv"], x["w"], c, s, EPS, 0.0, True, True)
    e_query, e_normed, e_pe = region(**x, dims=dims)
    one_launch = mla_q_kv_rope_triton(q4, x["kv"], x["w"], c, s, EPS, 0.0, True, True)

    def within_ulp(a, b):
        return bool(((a.float() - b.float()).abs() <= 2 * 2**-7 * b.float().abs() + 1e-6).all())

    checks = {
        "query == reference": torch.equal(query, mla_q_rope_reference(q4, c, s, False, True, True)),
        "query == eager": torch.equal(query, e_query),
        "k_pe == reference": torch.equal(k_pe, ref_pe),
        "k_pe == eager": torch.equal(k_pe.unsqueeze(1), e_pe),
        "normed ~ reference": within_ulp(normed, ref_normed),
        "normed ~ eager": within_ulp(normed, e_normed),
        "one launch == the two kernels": all(
            torch.equal(a, b) for a, b in zip(one_launch, (query, normed, k_pe), strict=True)
        ),
    }
    return [name for name, ok in checks.items() if not ok]


def min_bytes(x) -> int:
    return 2 * sum(t.numel() * t.element_size() for t in x.values())  # each read once, written once


def make_calls(impl, input_sets, dims):
    fn = lambda **x: region(**x, dims=dims)  # noqa: E731
    if impl == "inductor":
        fn = torch.compile(fn, backend="inductor", fullgraph=True)
    elif impl in OURS:
        report = fusion_passes.Report()
        fusions = [f.name for f in fusion_passes.registry.get_fusions("all") if f.name not in OURS[impl]]
        fn = torch.compile(fn, backend=fusion_passes.backend(fusions, report=report), fullgraph=True)
        fn(**input_sets[0])
        fused = {k for k, v in report.matches.items() if v}
        merged = impl == "ours" and input_sets[0]["q"].shape[1] < ONE_LAUNCH_MAX_TOKENS
        if not {"mla_kv_norm_rope", "mla_q_rope"} <= fused or merged != ("mla_q_kv_rope" in fused):
            raise RuntimeError(f"the region did not fuse as expected: {dict(report.matches)}")
    return [lambda x=x: fn(**x) for x in input_sets]


def bench(tokens, dims, device, g) -> dict:
    sets = [inputs(tokens, dims, device, g) for _ in range(GRAPH_CALLS if device == "cuda" else 1)]
    failed = check_ours(sets[0], dims)
    record = {"tokens": tokens, "correct": not failed, "failed_checks": failed, "bytes": min_bytes(sets[0])}
    torch._dynamo.reset()
    record["plain_us"], record["graph_us"], record["kernels"] = {}, {}, {}
    for impl in IMPLS:
        calls = make_calls(impl, sets, dims)
        calls[0]()
        record["kernels"][impl] = kernels_per_call(calls[0])
        record["plain_us"][impl] = time_plain_us(calls[0])
        record["graph_us"][impl] = time_graph_us(calls)
    return record


def report(records, copy_gbps, device_name) -> str:
    ours = tuple(OURS)
    head = " | ".join(IMPLS) + " | " + " | ".join(f"{o} vs inductor" for o in ours)
    lines = [
        f"# MLA pre-attention region, bf16, {device_name}",
        "",
        f"copy bandwidth {copy_gbps:.0f} GB/s",
        "",
    ]
    for mode in ("graph_us", "plain_us"):
        lines += [
            f"## {mode} (us per call)", "",
            f"| tokens | {head} | kernels {'/'.join(IMPLS)} | GB/s (% copy) {'/'.join(ours)} |",
            "|---" * (len(IMPLS) + len(ours) + 3) + "|",
        ]  # fmt: skip
        for r in records:
            t = r[mode]
            speedups = [common.ratio(t["inductor"], t[o]) for o in ours]
            bandwidth = [
                f"{r['bytes'] / t[o] / 1e3:.0f} ({100 * r['bytes'] / t[o] / 1e3 / copy_gbps:.0f}%)"
                if t[o] and r["tokens"] >= 4096 else "—"
                for o in ours
            ]  # fmt: skip
            lines.append(
                f"| {r['tokens']} | " + " | ".join(common.us(t[i]) for i in IMPLS) + " | "
                + " | ".join(speedups) + " | " + "/".join(str(r["kernels"][i]) for i in IMPLS)
                + " | " + " / ".join(bandwidth) + " |"
            )  # fmt: skip
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    parser = common.parser(__doc__, "bench_mla_rope", smoke="tiny sizes; CPU under TRITON_INTERPRET=1")
    common.add_sizes(parser, "--tokens", TOKENS, SMOKE_TOKENS, "token counts")
    args = common.parse(parser)
    device = common.device(parser, args.smoke)
    dims = SMOKE if args.smoke else V3
    device_name = common.device_name(device)
    copy_gbps = copy_bandwidth_gbps(COPY_BYTES if device == "cuda" else 1 << 20, device)
    g = torch.Generator().manual_seed(0)
    records = []
    with torch.no_grad():
        for t in args.tokens:
            records.append(bench(t, dims, device, g))
            print(
                f"tokens={t}: " + ", ".join(f"{i} {common.us(records[-1]['plain_us'][i])}" for i in IMPLS),
                flush=True,
            )
    text = report(records, copy_gbps, device_name)
    payload = {"device": device_name, "dims": dims, "copy_gbps": copy_gbps, "records": records}
    common.finish(args, text, payload)
    bad = [r["tokens"] for r in records if not r["correct"]]
    if bad:
        print(
            f"CORRECTNESS FAILURE at tokens {bad}: "
            + "; ".join(
                f"{r['tokens']}: {', '.join(r['failed_checks'])}" for r in records if not r["correct"]
            )
        )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
