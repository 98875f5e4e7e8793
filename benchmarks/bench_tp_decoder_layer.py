"""Time decoder layers of a tensor-parallel model at real width (default Qwen3-32B: hidden 5120,
64 q / 8 kv heads, bf16) on 2 GPUs, three ways on the same sharded module:

  eager          the sharded module (DTensor TP: NCCL allreduce after o_proj and down_proj)
  inductor       torch.compile(backend="inductor", dynamic=False)
  fusion_passes  torch.compile(backend=fusion_passes.backend([...every default fusion,
                 allreduce_add_rms_norm, allreduce_rms_norm]), dynamic=False): each
                 allreduce -> residual add -> RMSNorm becomes one allreduce_add_rms_norm op (the
                 one-shot symmetric-memory kernel where eligible, else NCCL + the fused norm)

The model is build_model(MODEL, size, bf16, layers) (the base model, no lm_head), built once on
cuda:LOCAL_RANK with the same seeded weights on every rank (checked: a checksum per tensor), then
sharded with fusion_passes.models.tensor_parallel.parallelize over a 1-D mesh of the world. These
models have no KV cache, so one step is one forward of `tokens` token ids, the same on every rank
(a decode step: 1 token). Each variant is compiled afresh per token count (dynamo reset).

Checked at each variant's first call, before it is timed (a failure is reported, the timing goes
on, and the exit status is 1):
  - fusion_passes' output against eager's: relative norm error within the whole-model bf16 bound
    of fusion_passes.numerics (elementwise closeness and stock Inductor's error are shown too);
  - the same bits on every rank (the ranks' residual streams must not drift apart);
  - the report: 2 allreduce_add_rms_norm sites per layer (post_attention_layernorm, and the next
    layer's input_layernorm or the final model.norm), no allreduce_rms_norm, no pass failure; its
    match counts are printed, with the path the op took at run time (Report.runtime_fallbacks).
Then, per variant (every rank makes the same fixed number of calls between barriers: a collective
must be called equally often everywhere; rank 0 reports):
  kernels  CUDA kernels per step, by class (fusion_passes.kernels.profile_kernel_classes)
  plain    median of CUDA events around each of PLAIN_ITERS steps, after warm-up
           (benchmarks/distributed.py); at decode sizes it mostly measures the host
  graph    GRAPH_CALLS steps, each on its own input_ids, captured in one CUDA graph after a warm-up
           on a side stream (NCCL communicators and the one-shot workspace exist by then: the
           variant's first call, the check, made them), median replay per step
           (benchmarks/distributed.py)

    torchrun --nproc-per-node 2 -m benchmarks.bench_tp_decoder_layer [--model qwen3] [--size real]
        [--layers 1] [--tokens 1 8] [--out bench_tp_decoder_layer.md] [--json bench_tp_decoder_layer.json]
    python -m benchmarks.bench_tp_decoder_layer --smoke   # CPU, gloo, 2 spawned ranks, tiny qwen3:
                                                          # the code path and the checks, no GPU times
"""

from __future__ import annotations

import sys

import torch

from benchmarks import common
from benchmarks import distributed  # first: no multicast, the smoke run's interpreter, before triton

import torch.distributed as dist  # noqa: E402

import fusion_passes  # noqa: E402
from fusion_passes.kernels import KERNEL_CLASSES, classify_kernel, profile_kernel_names  # noqa: E402
from fusion_passes.lowering.common.collective_ops import runtime_fallbacks  # noqa: E402
from fusion_passes.models import MODEL_NAMES, build_model  # noqa: E402
from fusion_passes.models.tensor_parallel import parallelize  # noqa: E402
from fusion_passes.numerics import compare, tolerance  # noqa: E402
from fusion_passes.registry import get_fusions  # noqa: E402

DTYPE = torch.bfloat16
TOKENS = (1, 8)
SMOKE_TOKENS, SMOKE_LAYERS = (1, 4), 2  # two layers: the next layer's input_layernorm site too
ALLREDUCE_FUSIONS = ["allreduce_add_rms_norm", "allreduce_rms_norm"]  # opt-in: not in "all"
VARIANTS = ("eager", "inductor", "fusion_passes")
BASELINE = "inductor"


def fused_fusions() -> list[str]:
    """Every default fusion plus the allreduce ones (which pull in their norms)."""
    return [f.name for f in get_fusions("all")] + ALLREDUCE_FUSIONS


def expected_allreduce_sites(layers: int) -> list[str]:
    """The norms after a row-wise projection's allreduce: o_proj -> post_attention_layernorm,
    down_proj -> the next layer's input_layernorm, or the final norm after the last layer."""
    sites = []
    for i in range(layers):
        sites.append(f"model.layers.{i}.post_attention_layernorm")
        sites.append(f"model.layers.{i + 1}.input_layernorm" if i + 1 < layers else "model.norm")
    return sites


def build_sharded(args, device, mesh):
    """The model with every rank's same seeded weights, sharded in place over the mesh; None if
    the ranks' builds differ (each rank slices its shards from its own full build)."""
    built = build_model(args.model, size=args.size, dtype=DTYPE, layers=args.layers, seq_len=1, device=device)
    if not weights_agree(built.module):
        return None
    parallelize(built, mesh)
    built.module.eval()
    return built


def weights_agree(module) -> bool:
    """Every weight of the unsharded build is the same on every rank (a checksum per tensor)."""
    sums = [p.sum(dtype=torch.float64) for p in module.parameters()]
    return distributed.same_on_every_rank(torch.stack(sums))


def input_ids(vocab, tokens, seed, device) -> torch.Tensor:
    """The same token ids on every rank (TP inputs are replicated)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (1, tokens), generator=generator).to(device)


def compile_variant(variant, module, report):
    if variant == "eager":
        return module
    torch._dynamo.reset()  # a clean compile per variant and token count
    if variant == "inductor":
        return torch.compile(module, backend="inductor", dynamic=False)
    return torch.compile(module, backend=fusion_passes.backend(fused_fusions(), report=report), dynamic=False)


def op_path(report, group_name) -> str:
    """The path allreduce_add_rms_norm took at run time: the op records why it did not take the
    one-shot kernel (runtime_fallbacks is cleared before the variant's first call)."""
    reasons = report.runtime_fallbacks().get("fusion_passes.allreduce_add_rms_norm.default", {})
    return f"fallback: {reasons[group_name]}" if group_name in reasons else "one-shot"


def check_variant(variant, out, expected, report, layers, group_name) -> dict:
    """The variant's output against eager's and across ranks; for fusion_passes also the report
    and the path the op took."""
    comparison = compare(out, expected)
    record = {
        "rel_norm_vs_eager": comparison.rel_norm,
        "max_abs_vs_eager": comparison.max_abs,
        "elementwise_ok": comparison.ok,
        "identical_across_ranks": distributed.same_on_every_rank(out),
    }
    if variant != "fusion_passes":
        return record
    sites = sorted(s.module for s in report.sites_of("allreduce_add_rms_norm"))
    record.update(
        matches={k: v for k, v in sorted(report.matches.items()) if v},
        allreduce_sites=sites,
        graphs=len(report.graphs),
        errors=list(report.errors),
        path=op_path(report, group_name),
        runtime_fallbacks=report.runtime_fallbacks(),
        summary=report.summary(),
    )
    problems = []
    if comparison.rel_norm > tolerance(DTYPE).rel_norm:
        problems.append(f"rel_norm vs eager {comparison.rel_norm:.3g} > {tolerance(DTYPE).rel_norm}")
    if not record["identical_across_ranks"]:
        problems.append("outputs differ across ranks")
    expected_sites = sorted(expected_allreduce_sites(layers))
    if not any(sites):
        # Some torch versions (2.11) keep no nn.Module path on these post-grad nodes: count only.
        if len(sites) != len(expected_sites):
            problems.append(f"{len(sites)} allreduce_add_rms_norm sites, expected {len(expected_sites)}")
    elif sites != expected_sites:
        problems.append(f"allreduce_add_rms_norm sites {sites} != {expected_sites}")
    if report.matches["allreduce_rms_norm"]:
        problems.append(f"{report.matches['allreduce_rms_norm']} unexpected allreduce_rms_norm sites")
    if report.errors:
        problems.append(f"pass failures: {report.errors}")
    record["problems"] = problems
    return record


def bench_tokens(built, tokens, device, group_name) -> dict:
    """Check and time every variant at one token count."""
    module, layers = built.module, built.config.num_hidden_layers
    vocab = built.config.vocab_size
    calls_per_graph = distributed.GRAPH_CALLS if device.type == "cuda" else 1
    inputs = [input_ids(vocab, tokens, seed, device) for seed in range(calls_per_graph)]
    expected = module(inputs[0])
    record = {"tokens": tokens, "variants": {}}
    for variant in VARIANTS:
        report = fusion_passes.Report()
        fn = compile_variant(variant, module, report)
        runtime_fallbacks.clear()  # what the calls below record is this variant's
        out = fn(inputs[0])  # compiles; creates the one-shot workspace before any capture
        result = check_variant(variant, out, expected, report, layers, group_name)
        if device.type == "cuda":
            names = profile_kernel_names(fn, inputs[0])
            kernels = dict.fromkeys(KERNEL_CLASSES, 0)
            for name in names:
                kernels[classify_kernel(name)] += 1
            result["kernels"] = {**kernels, "total": len(names)}
            result["kernel_names"] = names  # in the json: which kernels a variant adds or saves
        else:
            result["kernels"] = None
        result["plain_us"] = distributed.time_plain_us(lambda fn=fn: fn(inputs[0]), device)
        try:
            result["graph_us"] = distributed.time_graph_us([lambda fn=fn, x=x: fn(x) for x in inputs], device)
        except RuntimeError as error:  # every rank fails the capture alike: report it, go on
            result["graph_us"], result["graph_error"] = None, f"{type(error).__name__}: {error}"
            dist.barrier()
        record["variants"][variant] = result
    return record


def table(records) -> list[str]:
    lines = [
        "| tokens | variant | kernels / step | vs inductor | "
        + " | ".join(KERNEL_CLASSES)
        + " | plain us | graph us | speedup plain | speedup graph |",
        "|---:|:---|---:|---:|" + "---:|" * len(KERNEL_CLASSES) + "---:|---:|---:|---:|",
    ]
    for record in records:
        base = record["variants"][BASELINE]
        for variant, r in record["variants"].items():
            k, kb = r["kernels"], base["kernels"]
            total = "-" if k is None else str(k["total"])
            delta = "-" if k is None else f"{k['total'] - kb['total']:+d}"
            classes = " | ".join("-" if k is None else str(k[c]) for c in KERNEL_CLASSES)
            lines.append(
                f"| {record['tokens']} | {variant} | {total} | {delta} | {classes} "
                f"| {common.us(r['plain_us'])} | {common.us(r['graph_us'])} "
                f"| {common.ratio(base['plain_us'], r['plain_us'])} "
                f"| {common.ratio(base['graph_us'], r['graph_us'])} |"
            )
    return lines


def failures(records) -> list[str]:
    return [f"tokens={r['tokens']}: {p}" for r in records for p in r["variants"]["fusion_passes"]["problems"]]


def report_text(records, args, device_name, world_size) -> str:
    bound = tolerance(DTYPE).rel_norm
    smoke = device_name.startswith("CPU")
    lines = [
        f"# Tensor-parallel decoder layers: {args.model} ({args.size} width), {args.layers} layer(s), bf16",
        "",
        f"Device: {device_name} x {world_size}; torch {torch.__version__}; NCCL_NVLS_ENABLE=0, "
        "TORCH_SYMM_MEM_DISABLE_MULTICAST=1. One step = one forward of `tokens` tokens (no KV cache).",
        "",
        "- Times: median microseconds per step on rank 0 (every rank makes the same calls). plain: CUDA "
        f"events around each of {distributed.PLAIN_ITERS} steps. graph: {distributed.GRAPH_CALLS} steps in "
        f"one CUDA graph, median of {distributed.GRAPH_REPLAYS} replays, per step. Speedup = stock "
        "Inductor's time / the variant's. Compare by the graph columns: plain launches at decode sizes "
        "mostly measure the host."
        + (" (This CPU smoke run: a host clock over 3 calls, no graphs, no kernel counts.)" if smoke else ""),
        "- Kernels: CUDA kernels per step by class (fusion_passes.kernels); 'vs inductor' is the "
        "difference in the total. NCCL and the one-shot kernel count as 'other'.",
        f"- fusion_passes: {', '.join(fused_fusions())}.",
        "",
        "## Checks",
        "",
        "| tokens | variant | rel. norm error vs eager | elementwise ok | bit-identical across ranks |",
        "|---:|:---|---:|:---|:---|",
    ]
    for record in records:
        for variant, r in record["variants"].items():
            if variant != "eager":
                lines.append(
                    f"| {record['tokens']} | {variant} | {r['rel_norm_vs_eager']:.2e} | {r['elementwise_ok']} "
                    f"| {r['identical_across_ranks']} |"
                )
    lines.append("")
    for record in records:
        r = record["variants"]["fusion_passes"]
        lines.append(
            f"- tokens={record['tokens']}: matches {r['matches']}; {len(r['allreduce_sites'])} "
            f"allreduce_add_rms_norm sites (expected {2 * args.layers}); {r['graphs']} graph(s); "
            f"op path: {r['path']}"
        )
    problems = failures(records)
    lines.append(
        f"- fusion_passes vs eager within the whole-model bf16 bound ({bound}), bit-identical across "
        f"ranks, expected sites: {'all pass' if not problems else 'FAILURES: ' + '; '.join(problems)}."
    )
    graph_errors = [
        f"tokens={rec['tokens']} {v}: {r['graph_error']}"
        for rec in records
        for v, r in rec["variants"].items()
        if "graph_error" in r
    ]
    lines += [f"- CUDA graph capture failed: {e}" for e in graph_errors]
    lines += ["", "## Per step", "", *table(records)]
    return "\n".join(lines) + "\n"


def run(rank, world_size, args, device) -> int:
    """Every rank checks and times every token count; rank 0 writes the report. Returns the exit
    status."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (world_size,))
    group_name = mesh.get_group().group_name
    records = []
    with torch.no_grad():
        built = build_sharded(args, device, mesh)
        if built is None:
            print(f"rank {rank}: the seeded weights differ across ranks", flush=True)
            return 1
        for tokens in args.tokens:
            records.append(bench_tokens(built, tokens, device, group_name))
            if rank == 0:
                r = records[-1]["variants"]
                fused = r["fusion_passes"]
                print(
                    f"tokens={tokens}: fusion_passes matches {fused['matches']}, op path: {fused['path']}, "
                    f"runtime_fallbacks {fused['runtime_fallbacks']}\n  plain "
                    + ", ".join(f"{v} {common.us(r[v]['plain_us'])}" for v in VARIANTS)
                    + " | graph "
                    + ", ".join(f"{v} {common.us(r[v]['graph_us'])}" for v in VARIANTS),
                    flush=True,
                )
                for line in fused["summary"].splitlines():  # rejections, near misses, failures:
                    if not line.endswith("site(s)") and not line.startswith("run time:"):  # (above)
                        print(f"  {line}", flush=True)
                for problem in fused["problems"]:
                    print(f"CORRECTNESS FAILURE tokens={tokens}: {problem}", flush=True)
    status = 1 if failures(records) else 0
    if rank == 0:
        text = report_text(records, args, distributed.device_name(device), world_size)
        distributed.finish(args, text, device, world_size, {
            "model": args.model,
            "size": args.size,
            "layers": args.layers,
            "dtype": str(DTYPE),
            "fusions": fused_fusions(),
            "records": records,
        })  # fmt: skip
    return status


def main() -> int:
    parser = distributed.parser(__doc__, "bench_tp_decoder_layer", "tiny qwen3", "no GPU times")
    parser.add_argument("--model", default="qwen3", choices=MODEL_NAMES, help="a dense model with a TP plan")
    parser.add_argument(
        "--size", choices=("tiny", "real"), help="config width (default real; tiny with --smoke)"
    )
    parser.add_argument("--layers", type=int, help=f"decoder layers (default 1; {SMOKE_LAYERS} with --smoke)")
    common.add_sizes(parser, "--tokens", TOKENS, SMOKE_TOKENS, "tokens per step")
    args = common.parse(parser)
    args.size = args.size or ("tiny" if args.smoke else "real")
    args.layers = args.layers or (SMOKE_LAYERS if args.smoke else 1)
    return distributed.launch_ranks(run, args, parser)


if __name__ == "__main__":
    sys.exit(main())
