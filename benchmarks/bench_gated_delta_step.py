"""Time a Gated DeltaNet layer's decode-step regions (bf16, fp32 state) on one GPU: eager vs stock
Inductor vs ours, and flash-linear-attention's fused recurrent kernel as the peer.

    recurrent: transformers' gating + torch_recurrent_gated_delta_rule at one token, then the new
               state copied into the cache (cache.update_recurrent_state): what a decode step runs
    conv:      transformers' causal_conv1d_update: cat, state shift, depthwise conv, SiLU
    recurrent_norm: the recurrent region and the layer's gated RMSNorm of its output
               (transformers' Qwen3_5RMSNormGated over each value head's V, gated by silu(z))

Qwen3-Next / Qwen 3.5 widths: 16 key heads, 32 value heads of 128, a 4-tap conv over 8192
channels. Each implementation is timed as plain launches (do_bench median) and in a CUDA graph of
calls on distinct inputs (at least 128 MiB of states together, so they do not sit in L2), and its
kernels per call are counted with the profiler. The recurrent step's floor is one read and one
write of the fp32 state at the device's copy bandwidth; ours and the peer are reported against it.

Implementations: eager; inductor (torch.compile); ours (torch.compile with the fusion_passes
backend: the fused kernel launched by Inductor, the state written in place); ours_kernel (our
launcher called directly, in place); fla (fla-core's fused_recurrent_gated_delta_rule with the
gating, beta's sigmoid and the l2norms in its kernel; it returns a new state and is timed without
copying it into a cache: the peer's best case). In recurrent_norm: ours (the default fusions: the
step's kernel, then Inductor's norm kernel), ours_norm (with the opt-in gated_delta_step_norm),
and its launcher called directly in each of its two forms, epilogue (a program per whole value
row, the norm after the step: one launch) and step_norm (the step's tiles, then a norm launch):
the evidence for GATED_DELTA_STEP_NORM's rule. --sweep times ours_kernel at every block width
and warp count (the launch rule's evidence), and its persistent form (a fixed grid of programs
per SM walking the tiles: PERSISTENT_SWEEP).

    python -m benchmarks.bench_gated_delta_step [--batch 1 32 128] [--sweep] [--regions recurrent_norm]
    python -m benchmarks.bench_gated_delta_step --smoke     # tiny sizes; on a CPU via Triton's interpreter
"""

from __future__ import annotations

import math
import sys

import torch

from benchmarks import common

common.interpret_smoke_run()  # before triton is imported

import fusion_passes  # noqa: E402
from benchmarks.timing import copy_bandwidth_gbps, kernels_per_call, time_graph_us, time_plain_us  # noqa: E402
from fusion_passes.lowering.causal_conv1d_update.reference import causal_conv1d_update_reference  # noqa: E402
from fusion_passes.lowering.gated_delta_step.norm_triton import gated_delta_step_norm_triton  # noqa: E402
from fusion_passes.lowering.gated_delta_step.reference import (  # noqa: E402
    gated_delta_step_norm_reference,
    gated_delta_step_reference,
)
from fusion_passes.lowering.gated_delta_step.triton import gated_delta_step_triton  # noqa: E402
from fusion_passes.patterns.causal_conv1d_update import transformers_causal_conv1d_update  # noqa: E402
from fusion_passes.patterns.gated_delta_step import transformers_gated_delta_step  # noqa: E402

DTYPE = torch.bfloat16
QWEN = dict(hk=16, hv=32, dk=128, dv=128, taps=4)
SMOKE = dict(hk=2, hv=4, dk=16, dv=16, taps=4)
BATCHES = (1, 8, 32, 64, 128)
SMOKE_BATCHES = (1, 3)
STATE_BYTES_IN_GRAPH = 128 << 20
SWEEP = [(bv, w) for bv in (8, 16, 32, 64, 128) for w in (1, 2, 4, 8)]
# The persistent form (gated_delta_step_triton(programs=...)): programs per SM x columns x warps x
# pipeline stages, at the block widths the table picks from 256 pairs on.
# Our implementations, reported against the state-traffic floor.
FLOOR_IMPLS = ("ours", "ours_kernel", "fla", "ours_norm", "epilogue", "step_norm")
PERSISTENT_SWEEP = [(p, bv, w, st) for p in (2, 4, 8) for bv in (32, 64) for w in (1, 4) for st in (1, 2)]


def recurrent_region(q, k, v, a, b, A_log, dt_bias, cache):
    out, state = transformers_gated_delta_step(q, k, v, a, b, A_log, dt_bias, cache)
    cache.copy_(state)
    return out


def recurrent_norm_region(q, k, v, a, b, A_log, dt_bias, cache, z, norm):
    out = recurrent_region(q, k, v, a, b, A_log, dt_bias, cache)
    return norm(out.reshape(-1, out.shape[-1]), z)


def conv_region(x, conv_state, weight):
    out, state = transformers_causal_conv1d_update(x, conv_state, weight)
    conv_state.copy_(state)
    return out


def recurrent_inputs(bsz, d, device, g) -> dict:
    def randn(*shape, dtype=DTYPE):
        return torch.randn(shape, generator=g).to(device, dtype)

    # q, k, v: per-head views of the conv's [B, 1, 2 Hk K + HV V] output, as the model has them
    qkv = randn(bsz, 1, 2 * d["hk"] * d["dk"] + d["hv"] * d["dv"])
    split = torch.split(qkv, [d["hk"] * d["dk"], d["hk"] * d["dk"], d["hv"] * d["dv"]], dim=-1)
    q, k = (t.reshape(bsz, 1, d["hk"], d["dk"]) for t in split[:2])
    v = split[2].reshape(bsz, 1, d["hv"], d["dv"])
    A_log = (torch.rand(d["hv"], generator=g) * 16 + 0.01).log().to(device, DTYPE)
    return dict(q=q, k=k, v=v, a=randn(bsz, 1, d["hv"]), b=randn(bsz, 1, d["hv"]), A_log=A_log,
                dt_bias=randn(d["hv"]), cache=0.1 * randn(bsz, d["hv"], d["dk"], d["dv"], dtype=torch.float32))  # fmt: skip


def recurrent_norm_inputs(bsz, d, device, g) -> dict:
    """The recurrent region's inputs, the gate rows z [B * HV, V] and transformers' gated norm
    module (its weight near 1, as trained ones are)."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNormGated

    norm = Qwen3_5RMSNormGated(d["dv"], eps=1e-6).to(device, DTYPE)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(d["dv"], generator=g))
    z = torch.randn(bsz * d["hv"], d["dv"], generator=g).to(device, DTYPE)
    return {**recurrent_inputs(bsz, d, device, g), "z": z, "norm": norm}


def conv_inputs(bsz, d, device, g) -> dict:
    channels = 2 * d["hk"] * d["dk"] + d["hv"] * d["dv"]
    x = torch.randn(bsz, 1, channels, generator=g).to(device, DTYPE).transpose(1, 2)
    state = torch.randn(bsz, channels, d["taps"], generator=g).to(device, DTYPE)
    return dict(x=x, conv_state=state, weight=torch.randn(channels, d["taps"], generator=g).to(device, DTYPE))


def _fla():
    try:
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
    except ImportError:
        return None
    return fused_recurrent_gated_delta_rule


def fla_recurrent(fn, q, k, v, a, b, A_log, dt_bias, cache):
    out, _ = fn(q, k, v, g=a, beta=b, scale=q.shape[-1] ** -0.5, initial_state=cache, output_final_state=True,
                use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
                use_beta_sigmoid_in_kernel=True)  # fmt: skip
    return out


def ours_kernel(q, k, v, a, b, A_log, dt_bias, cache, **launch):
    form = (q.shape[-1] ** 0.5, True, True, 1e-6)
    return gated_delta_step_triton(q, k, v, a, b, A_log, dt_bias, cache, *form, wrap=lambda kernel: kernel, **launch)[0]


def norm_kernel(q, k, v, a, b, A_log, dt_bias, cache, z, norm, epilogue):
    form = (q.shape[-1] ** 0.5, True, True, 1e-6, norm.variance_epsilon, 0.0, True)
    return gated_delta_step_norm_triton(q, k, v, a, b, A_log, dt_bias, cache, z, norm.weight, *form,
                                        wrap=lambda kernel: kernel, epilogue=epilogue)[0]  # fmt: skip


def compiled(region, backend):
    return torch.compile(region, backend=backend, fullgraph=True)


def check(region_name, impls: dict, sample: dict) -> dict:
    """Errors (max abs) of each implementation's output and new state against the reference, on
    copies of one input set; and whether each is within stock Inductor's own error (or bf16's)."""
    clone = lambda: {k: (t.clone() if k in ("cache", "conv_state") else t) for k, t in sample.items()}  # noqa: E731
    state_key = "conv_state" if region_name == "conv" else "cache"
    ref_in = clone()
    if region_name == "recurrent":
        ref, ref_state = gated_delta_step_reference(*ref_in.values(), sample["q"].shape[-1] ** 0.5, True, True, 1e-6)
    elif region_name == "recurrent_norm":
        step_args = [ref_in[n] for n in ("q", "k", "v", "a", "b", "A_log", "dt_bias", "cache")]
        norm = ref_in["norm"]
        ref, ref_state = gated_delta_step_norm_reference(
            *step_args, ref_in["z"], norm.weight, sample["q"].shape[-1] ** 0.5, True, True, 1e-6,
            norm.variance_epsilon, 0.0, True,
        )  # fmt: skip
    else:
        ref, ref_state = causal_conv1d_update_reference(ref_in["x"], ref_in["conv_state"], ref_in["weight"], None, True)
    errors = {}
    for name, fn in impls.items():
        x = clone()
        out = fn(**x)
        errors[name] = {
            "out": (out.double() - ref.double()).abs().max().item(),
            "state": (x[state_key].double() - ref_state.double()).abs().max().item() if name != "fla" else None,
        }
    return errors


REGIONS = {
    "recurrent": (recurrent_inputs, recurrent_region, "gated_delta_step"),
    "recurrent_norm": (recurrent_norm_inputs, recurrent_norm_region, "gated_delta_step_norm"),
    "conv": (conv_inputs, conv_region, "causal_conv1d_update"),
}


def bench_region(region_name, bsz, d, device, g, fla) -> dict:
    make, region, fusion = REGIONS[region_name]
    sample = make(bsz, d, device, g)
    state_key = "conv_state" if region_name == "conv" else "cache"
    state_bytes = sample[state_key].numel() * sample[state_key].element_size()
    n_sets = 1 if device != "cuda" else max(4, min(64, math.ceil(STATE_BYTES_IN_GRAPH / state_bytes)))
    sets = [sample] + [make(bsz, d, device, g) for _ in range(n_sets - 1)]
    report = fusion_passes.Report()
    impls = {
        "eager": region,
        "inductor": compiled(region, "inductor"),
        "ours": compiled(region, fusion_passes.backend(report=report)),
    }
    if region_name == "recurrent":
        impls["ours_kernel"] = ours_kernel
        if fla is not None:
            impls["fla"] = lambda **x: fla_recurrent(fla, **x)
    if region_name == "recurrent_norm":
        report = fusion_passes.Report()
        with_norm = [f.name for f in fusion_passes.registry.get_fusions("all")] + [fusion]
        impls["ours_norm"] = compiled(region, fusion_passes.backend(with_norm, report=report))
        impls["epilogue"] = lambda **x: norm_kernel(**x, epilogue=True)
        impls["step_norm"] = lambda **x: norm_kernel(**x, epilogue=False)
    errors = check(region_name, impls, sample)
    fused = report.matches.get(fusion, 0)
    record = {"region": region_name, "batch": bsz, "state_bytes": state_bytes, "fused_sites": fused,
              "errors": errors, "plain_us": {}, "graph_us": {}, "kernels": {}}  # fmt: skip
    for name, fn in impls.items():
        calls = [lambda x=x, fn=fn: fn(**x) for x in sets]
        calls[0]()
        record["kernels"][name] = kernels_per_call(calls[0])
        record["plain_us"][name] = time_plain_us(calls[0])
        record["graph_us"][name] = time_graph_us(calls)
    return record


def sweep(bsz, d, device, g) -> dict:
    sample = recurrent_inputs(bsz, d, device, g)
    n_sets = max(4, min(64, math.ceil(STATE_BYTES_IN_GRAPH / (sample["cache"].numel() * 4))))
    sets = [sample] + [recurrent_inputs(bsz, d, device, g) for _ in range(n_sets - 1)]
    times = {}
    for bv, warps in SWEEP:
        calls = [lambda x=x: ours_kernel(**x, block_v=bv, num_warps=warps) for x in sets]
        times[f"{bv}x{warps}"] = time_graph_us(calls)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    for per_sm, bv, warps, stages in PERSISTENT_SWEEP:
        launch = dict(block_v=bv, num_warps=warps, programs=per_sm * sms, stages=stages)
        calls = [lambda x=x: ours_kernel(**x, **launch) for x in sets]
        times[f"persistent {per_sm}/SM {bv}x{warps} s{stages}"] = time_graph_us(calls)
    from fusion_passes.lowering.gated_delta_step.triton import _launch

    block, warps = _launch(sample["cache"], bsz, d["hv"], d["dv"])
    return {"batch": bsz, "graph_us": times, "table": f"{block}x{warps}"}


def report_text(records, sweeps, copy_gbps, device_name) -> str:
    lines = [f"# Gated DeltaNet decode regions, bf16, {device_name}", "", f"copy bandwidth {copy_gbps:.0f} GB/s", ""]
    for region_name in REGIONS:
        rows = [r for r in records if r["region"] == region_name]
        if not rows:
            continue
        impls = list(rows[0]["graph_us"])
        floor_impls = [i for i in impls if i in FLOOR_IMPLS]
        versus = " | ours_norm vs ours" if "ours_norm" in impls else ""
        for mode in ("graph_us", "plain_us"):
            lines += [f"## {region_name}, {mode} (us per call)", "",
                      "| batch | " + " | ".join(impls) + " | ours vs inductor" + versus + " | kernels " + "/".join(impls)
                      + " | floor us | % floor " + "/".join(floor_impls) + " |",
                      "|---" * (len(impls) + 5 + bool(versus)) + "|"]  # fmt: skip
            for r in rows:
                t = r[mode]
                floor = 2 * r["state_bytes"] / copy_gbps / 1e3
                pct = [f"{100 * floor / t[i]:.0f}%" if t[i] else "—" for i in floor_impls]
                extra = " | " + common.ratio(t["ours"], t["ours_norm"]) if versus else ""
                lines.append(f"| {r['batch']} | " + " | ".join(common.us(t[i]) for i in impls) + " | "
                             + common.ratio(t["inductor"], t["ours"]) + extra + " | "
                             + "/".join(str(r["kernels"][i]) for i in impls)
                             + f" | {floor:.1f} | " + " / ".join(pct) + " |")  # fmt: skip
            lines.append("")
    for s in sweeps:
        best = min((v, k) for k, v in s["graph_us"].items() if v)
        lines.append(f"sweep batch {s['batch']}: best {best[1]} {best[0]:.1f} us, the table's {s['table']} "
                     f"{common.us(s['graph_us'][s['table']])} us; "
                     + ", ".join(f"{k} {common.us(v)}" for k, v in s["graph_us"].items()))  # fmt: skip
    return "\n".join(lines)


def main() -> int:
    parser = common.parser(__doc__, "bench_gated_delta_step", smoke="tiny sizes; CPU under TRITON_INTERPRET=1")
    common.add_sizes(parser, "--batch", BATCHES, SMOKE_BATCHES, "batch sizes (sequences)")
    parser.add_argument("--sweep", action="store_true", help="time ours_kernel at every launch configuration")
    parser.add_argument("--regions", nargs="+", default=["recurrent", "conv"])
    args = common.parse(parser)
    device = common.device(parser, args.smoke)
    d = SMOKE if args.smoke else QWEN
    device_name = common.device_name(device)
    copy_gbps = copy_bandwidth_gbps((2 << 30) if device == "cuda" else 1 << 20, device)
    fla = _fla() if device == "cuda" else None
    g = torch.Generator().manual_seed(0)
    records, sweeps = [], []
    with torch.no_grad():
        for region_name in args.regions:
            for bsz in args.batch:
                torch._dynamo.reset()
                records.append(bench_region(region_name, bsz, d, device, g, fla))
                r = records[-1]
                print(f"{region_name} batch={bsz}: " + ", ".join(f"{i} {common.us(r['graph_us'][i])}" for i in r["graph_us"])
                      + f"; errors {r['errors']}", flush=True)  # fmt: skip
        if args.sweep and device == "cuda":
            for bsz in args.batch:
                sweeps.append(sweep(bsz, d, device, g))
                print(f"sweep batch={bsz}: {sweeps[-1]['graph_us']}", flush=True)
    text = report_text(records, sweeps, copy_gbps, device_name)
    payload = {"device": device_name, "dims": d, "copy_gbps": copy_gbps, "fla": fla is not None,
               "records": records, "sweeps": sweeps}  # fmt: skip
    common.finish(args, text, payload)
    bad = [(r["region"], r["batch"]) for r in records
           if r["fused_sites"] != 1 or any(r["errors"][i]["out"] > max(1.6e-2, 2 * r["errors"]["inductor"]["out"])
                                           for i in ("ours", "ours_norm") if i in r["errors"])]  # fmt: skip
    if bad:
        print(f"FAILURE (not fused, or ours outside stock Inductor's error) at {bad}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
