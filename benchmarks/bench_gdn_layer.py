"""Time one whole Gated DeltaNet layer's decode step on transformers' StaticCache (Qwen 3.5-MoE
widths, bf16): eager vs stock Inductor vs fusion_passes (its defaults, and each --also variant).

The layer is transformers' own module (``Qwen3_5MoeGatedDeltaNet``: the four input projections,
the conv update, the gating, the recurrent delta rule, the gated RMSNorm, the output projection),
its cache prefilled with a few tokens so that the step takes the decode path. Each variant is
compiled as ``layer(hidden_states, cache_params=cache)`` with fullgraph=True, timed as plain
launches and in a CUDA graph of calls on distinct hidden states (one cache: at small batches its
states, 2 MiB a sequence, stay in L2 for every variant alike), and its kernels counted per call
with the profiler, by class (GEMM or not). Numerics: the layer's outputs and the cache's states
after --check-steps steps from the same prefilled cache, against eager.

    python -m benchmarks.bench_gdn_layer [--batch 1 8 64] [--also lin=shared_input_linears]
    python -m benchmarks.bench_gdn_layer --smoke     # tiny widths, on a CPU (no timing)
"""

from __future__ import annotations

import sys

import torch

from benchmarks import common

common.interpret_smoke_run()  # before triton is imported

import fusion_passes  # noqa: E402
from benchmarks.timing import time_graph_us, time_plain_us  # noqa: E402
from benchmarks.bench_decode import rel_err  # noqa: E402
from fusion_passes.kernels import classify_kernel, profile_kernel_names  # noqa: E402

BATCHES = (1, 8, 32, 64)
SMOKE_BATCHES = (1, 2)
PREFILL = 4  # tokens in the cache before the step


def build_layer(smoke: bool, device: str):
    """(config, layer): a Qwen 3.5-MoE text config of one linear-attention layer and its module."""
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeGatedDeltaNet

    from fusion_passes.models.configs import SPECS
    from fusion_passes.models.registry import _transformers_classes

    spec = SPECS["qwen3.5-moe"]
    config_cls, _ = _transformers_classes(spec)
    kwargs = (spec.tiny if smoke else spec.real)(1) | {"layer_types": ["linear_attention"], "num_hidden_layers": 1}
    config = config_cls(**kwargs)
    torch.manual_seed(0)
    layer = Qwen3_5MoeGatedDeltaNet(config, layer_idx=0)
    with torch.no_grad():  # the projections' default init is fine; the norm weight off its ones
        layer.norm.weight.add_(0.1 * torch.randn(layer.norm.weight.shape))
    return config, layer.to(device, torch.bfloat16).eval()


def prefilled_cache(config, layer, batch: int, device: str):
    """A StaticCache whose linear-attention layer holds a PREFILL-token prompt's states."""
    from transformers import StaticCache

    cache = StaticCache(config=config, max_cache_len=PREFILL + 8)
    g = torch.Generator().manual_seed(batch)
    prompt = torch.randn(batch, PREFILL, config.hidden_size, generator=g).to(device, torch.bfloat16)
    with torch.no_grad():
        layer(prompt, cache_params=cache)
    if not cache.has_previous_state(0, state_idx=0):
        raise RuntimeError("the prefill left the cache without states: the step would not take the decode path")
    return cache


def cache_states(cache) -> list[torch.Tensor]:
    layer = cache.layers[0]  # its states by index (dicts of one entry for this model)
    return [*layer.conv_states.values(), *layer.recurrent_states.values()]


def bench_point(config, layer, batch, device, also, check_steps) -> dict:
    cache = prefilled_cache(config, layer, batch, device)
    saved = [t.clone() for t in cache_states(cache)]
    g = torch.Generator().manual_seed(100 + batch)
    steps = [torch.randn(batch, 1, config.hidden_size, generator=g).to(device, torch.bfloat16) for _ in range(max(20, check_steps))]

    def restore():
        for live, s in zip(cache_states(cache), saved, strict=True):
            live.copy_(s)

    def step(x):
        return layer(x, cache_params=cache)

    variants = {"eager": (step, None), "inductor": (torch.compile(step, fullgraph=True), None)}
    for label, fusions in [("fusion_passes", "all"), *also]:
        report = fusion_passes.Report()
        variants[label] = (torch.compile(step, backend=fusion_passes.backend(fusions, report=report), fullgraph=True), report)
    record = {"batch": batch, "variants": {}}
    expected = None
    for label, (fn, report) in variants.items():
        restore()
        outs = [fn(x).clone() for x in steps[:check_steps]]
        states = [t.clone() for t in cache_states(cache)]
        row = {}
        if expected is None:
            expected = (outs, states)
        else:
            row["out_rel_err"] = max(rel_err(a, b) for a, b in zip(outs, expected[0], strict=True))
            row["state_rel_err"] = max(rel_err(a, b) for a, b in zip(states, expected[1], strict=True))
        if report is not None:
            row["final"] = {k: v for k, v in report.final().items() if v}
            row["errors"] = list(report.errors)
        if device == "cuda":
            restore()
            names = profile_kernel_names(lambda fn=fn: fn(steps[0]))
            row["kernels"] = len(names)
            row["non_gemm_kernels"] = sum(classify_kernel(n) != "gemm" for n in names)
            row["plain_us"] = time_plain_us(lambda fn=fn: fn(steps[0]))
            row["graph_us"] = time_graph_us([lambda x=x, fn=fn: fn(x) for x in steps[:20]])
        record["variants"][label] = row
        print(f"batch {batch} {label}: " + ", ".join(f"{k} {v}" for k, v in row.items() if k not in ("final",)), flush=True)
    restore()
    return record


def report_text(records, device_name) -> str:
    labels = list(records[0]["variants"])
    lines = [f"# Gated DeltaNet layer, decode step on a StaticCache, bf16, {device_name}", "",
             "| batch | variant | kernels (non-GEMM) | plain us | CUDA graph us | vs inductor (graph) | out / state err |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in records:
        base = r["variants"]["inductor"].get("graph_us")
        for label in labels:
            v = r["variants"][label]
            err = f"{v['out_rel_err']:.1e} / {v['state_rel_err']:.1e}" if "out_rel_err" in v else "—"
            lines.append(f"| {r['batch']} | {label} | {v.get('kernels', '—')} ({v.get('non_gemm_kernels', '—')}) | "
                         f"{common.us(v.get('plain_us'))} | {common.us(v.get('graph_us'))} | "
                         f"{common.ratio(base, v.get('graph_us'))} | {err} |")  # fmt: skip
    return "\n".join(lines)


def main() -> int:
    parser = common.parser(__doc__, "bench_gdn_layer", smoke="tiny widths; CPU, no timing")
    common.add_sizes(parser, "--batch", BATCHES, SMOKE_BATCHES, "batch sizes (sequences)")
    parser.add_argument("--also", nargs="+", default=[], metavar="LABEL=FUSION[,FUSION...]",
                        help="more fusion_passes variants: the defaults and these opt-ins")
    parser.add_argument("--check-steps", type=int, default=8, help="decode steps compared with eager")
    args = common.parse(parser)
    device = common.device(parser, args.smoke)
    also = []
    for item in args.also:
        label, _, names = item.partition("=")
        if not label or not names:
            parser.error(f"--also takes LABEL=FUSION[,FUSION...], got {item!r}")
        also.append((label, ["all", *names.split(",")]))
    config, layer = build_layer(args.smoke, device)
    records = []
    with torch.no_grad():
        for batch in args.batch:
            torch._dynamo.reset()
            records.append(bench_point(config, layer, batch, device, also, args.check_steps))
    text = report_text(records, common.device_name(device))
    common.finish(args, text, {"device": common.device_name(device), "records": records})
    bad = [(r["batch"], label) for r in records for label, v in r["variants"].items()
           if v.get("errors") or ("final" in v and not v["final"].get("gated_delta_step"))]  # fmt: skip
    if bad:
        print(f"FAILURE (a fusion error, or the step not fused) at {bad}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
