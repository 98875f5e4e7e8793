"""Cached decode steps of whole models at real width: step time, kernels and GPU time per class,
what is left outside GEMM / attention / MoE, and numerics against eager over several steps.

Each point (model, batch, context) prefills a transformers StaticCache with `context` tokens
(eager), then times one decode step (`fusion_passes.models.decode.DecodeStep`) as eager, stock
Inductor and fusion_passes, each compiled with fullgraph=True and dynamic=False:

  plain     steps launched back to back as torch.compile's default mode launches them (a decode
            loop without CUDA graphs: at these sizes mostly the host's cost), wall clock per step;
            the median of --plain-rounds rounds that alternate the variants (drift on a shared
            host hits them alike), each round's value kept (plain_rounds_us)
  graph     one step captured in a CUDA graph, the replay's median
  host      one step's host side (fusion_passes.kernels.host_costs): launches, calls that block
            until the GPU is done, and fusion ops reached through the dispatcher instead of
            launched by Inductor (a warning line names the last two for fusion_passes)
  classes   kernels and GPU microseconds per class (gemm, attention, moe, other) from the CUDA
            profiler, per layer (the step's total over --layers)
  left      every "other" kernel with its GPU time and the region it sits in (the GEMM / attention /
            MoE / collective kernels around it), ranked: what no fusion takes yet
  numerics  --check-steps steps from the same prefilled cache, teacher-forced with the same tokens:
            the largest relative error (norm) of a step's output and of the cache contents after
            the steps, each variant against eager
  prefill   (--prefill N) a prefill of N tokens at batch 1 that writes the cache: plain, graph,
            classes and what is left, as a step's; numerics: the prefill's output and the cache it
            wrote into a zeroed cache, each variant against eager

Compiles take most of a run; --lock FILE lets several runs (one per model) share one GPU: each
compiles on its own and holds the lock only while it times or profiles.

    python -m benchmarks.bench_decode --models deepseek-v3.2 --batch 1 64 --context 1024 --json out.json
    python -m benchmarks.bench_decode --models deepseek-v3.2 --inductor combo_kernels=True   # both variants
    python -m benchmarks.bench_decode --models deepseek-v3.2 --also sparse=sparse_decode_attention   # + a variant
    python -m benchmarks.bench_decode --smoke     # tiny widths on a CPU: the code path, numerics, no times
"""

from __future__ import annotations

import ast

import contextlib
import fcntl
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import fusion_passes
from benchmarks import common
from benchmarks.timing import host_us, time_graph_us
from fusion_passes.kernels import KERNEL_CLASSES, class_times, host_costs, profile_kernels, what_is_left
from fusion_passes.models import build_model
from fusion_passes.models.decode import DecodeStep
from fusion_passes.numerics import tolerance

DEFAULT_MODELS = ["deepseek-v3.2", "minimax-m2", "qwen3.5-moe", "qwen3-moe"]
LEFT_ROWS = 12  # "what is left" rows kept per point in the JSON and the report (--left-rows)


@contextlib.contextmanager
def gpu_lock(path: str | None):
    """Exclusive use of the GPU while timing (a no-op without --lock)."""
    if path is None:
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Relative error (norm) on the device: numerics.compare copies both to the host in float64,
    which for a real-width cache (11 GiB at DeepSeek V3.2, batch 64) is four times that in RAM."""
    expected = expected.float()
    return ((actual.float() - expected).norm() / expected.norm().clamp_min(1e-30)).item()


@torch.no_grad()
def run_steps(step: DecodeStep, fn, steps: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``steps`` decode steps of ``fn`` from the prefilled cache: (outputs, cache tensors after)."""
    step.restore()
    outs = [fn(*step.inputs(i)).float().clone() for i in range(steps)]
    return outs, [t.clone() for t in step.cache_tensors()]


@torch.no_grad()
def run_prefill(step: DecodeStep, fn, inputs: tuple) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The prefill of ``fn`` into a zeroed cache (so that a variant that writes nothing does not pass
    on what the eager prefill left there): ([output], cache tensors after)."""
    for t in step.cache_tensors():
        if t.is_floating_point():
            t.zero_()
    out = fn(*inputs).float().clone()
    return [out], [t.clone() for t in step.cache_tensors()]


def numerics(step: DecodeStep, fn, steps: int, expected, inputs: tuple | None = None) -> dict:
    """Each variant against eager: ``steps`` decode steps, or the prefill of ``inputs`` (steps 0)."""
    outs, cache = run_prefill(step, fn, inputs) if inputs is not None else run_steps(step, fn, steps)
    exp_outs, exp_cache = expected
    return {
        "steps": steps,
        "out_rel_err": max(rel_err(a, e) for a, e in zip(outs, exp_outs, strict=True)),
        "cache_rel_err": max(rel_err(a, e) for a, e in zip(cache, exp_cache, strict=True) if e.is_floating_point()),
    }


def measure(step: DecodeStep, fn, inputs: tuple, lock: str | None, layers: int | None) -> dict:
    """CUDA-graph time of one call of ``fn`` (a GPU run), with its kernel classes and what is
    left when ``layers`` is given; the call was compiled and warmed before."""
    torch.cuda.synchronize()
    with torch.no_grad(), gpu_lock(lock):
        step.restore()
        kernels = profile_kernels(fn, *inputs) if layers else None
        host = host_costs(fn, *inputs)
        try:
            graph, graph_error = time_graph_us([lambda: fn(*inputs)]), None
        except Exception as e:  # a step that cannot be captured: say why, keep the rest
            graph, graph_error = None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    result = {"graph_us": graph, "host": host}
    if graph_error:
        result["graph_error"] = graph_error
    if kernels is not None:
        classes = class_times(kernels)
        result |= {
            "kernels": len(kernels),
            "gpu_us": sum(us for _, us in kernels),
            "classes": classes,
            "per_layer": {c: {k: v / layers for k, v in classes[c].items()} for c in KERNEL_CLASSES},
            "left": what_is_left(kernels, layers)[: Point.left_rows],
        }
    return result


PLAIN_ROUNDS = 5  # rounds of the plain-launch measurement (--plain-rounds)
PLAIN_ROUND_US = 100_000  # the steps of one variant in one round last about this long


def plain_rounds(step: DecodeStep, fns: dict, inputs: tuple, rounds: int, lock: str | None) -> dict[str, list[float]]:
    """Wall-clock microseconds per step of back-to-back steps (one synchronize at the end: the
    GPU queue never runs dry where the host is the slower), for each variant, in ``rounds``
    rounds that take the variants in turn. Plain-launch times at decode sizes swing up to 1.5x
    between runs on a shared host at equal CUDA-graph times; rounds in turn put each variant under
    the same drift, and the rounds' spread says how far a ratio can be trusted."""
    times: dict[str, list[float]] = {label: [] for label in fns}
    with torch.no_grad(), gpu_lock(lock):
        step.restore()
        iters = {label: max(3, int(PLAIN_ROUND_US / host_us(lambda f=fn: f(*inputs), iters=3, warmup=2)))
                 for label, fn in fns.items()}  # fmt: skip
        for _ in range(rounds):
            for label, fn in fns.items():
                times[label].append(host_us(lambda f=fn: f(*inputs), iters=iters[label], warmup=2))
    return times


def compile_variants(
    step: DecodeStep, opt_in: tuple[str, ...] = (), inductor: dict | None = None,
    also: dict[str, tuple[str, ...]] | None = None,
) -> tuple[dict, dict[str, fusion_passes.Report]]:
    """Stock Inductor and fusion_passes (its default fusions and the opt-in ones named), compiled
    on their first call, both with the ``inductor`` config settings (e.g. combo_kernels); and for
    each ``also`` entry LABEL: (FUSION, ...) one more fusion_passes variant, "fusion_passes+LABEL",
    with those fusions on top (timed beside the others in one process: one stock baseline for
    all). No torch._dynamo.reset(): every point's steps stay compiled until it is timed (each is
    one more entry on DecodeStep's forward; the limit is raised in main). Returns the variants
    and each fusion_passes variant's report."""
    defaults = [f.name for f in fusion_passes.registry.get_fusions("all")] + list(opt_in)
    options = dict(inductor or {})
    stock = torch.compile(step, backend="inductor", fullgraph=True, dynamic=False, options=options or None)
    variants, reports = {"eager": step, "inductor": stock}, {}
    for label, extra in {"fusion_passes": (), **{f"fusion_passes+{k}": v for k, v in (also or {}).items()}}.items():
        reports[label] = fusion_passes.Report()
        backend = fusion_passes.backend(defaults + list(extra), report=reports[label], **options)
        variants[label] = torch.compile(step, backend=backend, fullgraph=True, dynamic=False)
    return variants, reports


def also_variants(pairs: list[str]) -> dict[str, tuple[str, ...]]:
    """--also LABEL=FUSION[,FUSION...] ...: {LABEL: fusions}; every name must be a fusion."""
    known = {f.name for f in fusion_passes.registry.list_fusions()}
    variants = {}
    for pair in pairs:
        label, sep, names = pair.partition("=")
        fusions = tuple(n for n in names.split(",") if n)
        if not sep or not label or not fusions:
            raise ValueError(f"--also takes LABEL=FUSION[,FUSION...], got {pair!r}")
        unknown = [n for n in fusions if n not in known]
        if unknown:
            raise ValueError(f"--also {label}: no fusion named {unknown[0]!r}")
        variants[label] = fusions
    return variants


def inductor_settings(pairs: list[str]) -> dict:
    """--inductor KEY=VALUE ...: torch._inductor.config settings, each value a Python literal
    (True, 4, 'x') or else the string as written."""
    settings = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--inductor takes KEY=VALUE, got {pair!r}")
        try:
            settings[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            settings[key] = value
    return settings


class Point:
    """One (model, batch, context) decode point, or a prefill when ``prefill`` is set: built,
    compiled and checked by prepare(), timed by time() (separately, so that several runs can
    compile at once and take turns on the GPU)."""

    opt_in: tuple[str, ...] = ()  # opt-in fusions enabled on top of the defaults (main sets it)
    also: dict[str, tuple[str, ...]] = {}  # more fusion_passes variants, LABEL: fusions on top (main sets it)
    inductor: dict = {}  # torch._inductor.config settings for both compiled variants (main sets it)
    left_rows: int = LEFT_ROWS  # "what is left" rows kept (main sets it)
    plain_rounds: int = PLAIN_ROUNDS  # rounds of the plain-launch measurement (main sets it)

    def __init__(self, name: str, size: str, layers: int, batch: int, context: int, prefill: bool = False):
        self.name, self.size, self.layers, self.batch, self.context = name, size, layers, batch, context
        self.prefill = prefill
        key = {"tokens": context} if prefill else {"batch": batch, "context": context}
        self.result = {"model": name, "layers": layers, **key, "variants": {}}
        if self.inductor:
            self.result["inductor_options"] = dict(self.inductor)

    def prepare(self, device: str, check_steps: int) -> None:
        built = build_model(self.name, size=self.size, dtype=torch.bfloat16, layers=self.layers, device=device)
        # which kinds the layers are: a hybrid model keeps both (Qwen 3.5 with 1 layer: full attention)
        self.result["layer_types"] = list(getattr(built.config, "layer_types", None) or [])
        if self.result["layer_types"]:
            print(f"{self.name}: layers {', '.join(self.result['layer_types'])}", flush=True)
        steps = 1 if self.prefill else max(check_steps, 1)
        self.step = DecodeStep(built.module, batch=self.batch, context=self.context, steps=steps)
        check = check_steps > 0
        self.variants, reports = compile_variants(self.step, self.opt_in, self.inductor, self.also)
        if self.prefill:
            self.inputs = (self.step.prompt, torch.arange(self.context, device=self.step.prompt.device))
            prefill_inputs, check_steps = self.inputs, 0
        else:
            self.inputs, prefill_inputs = self.step.inputs(0), None
        if check:
            expected = (run_prefill(self.step, self.step, prefill_inputs) if self.prefill
                        else run_steps(self.step, self.step, check_steps))  # fmt: skip
        for label, fn in self.variants.items():
            row = self.result["variants"].setdefault(label, {})
            if check and label != "eager":
                row["numerics"] = numerics(self.step, fn, check_steps, expected, prefill_inputs)
            self.step.restore()
            with torch.no_grad():
                fn(*self.inputs)  # compiled (if it was not yet) and warm
        for label, report in reports.items():
            row = self.result["variants"][label]
            row["final"] = {k: v for k, v in report.final().items() if v}
            row["lowered_back"] = dict(report.lowered_back())
            row["errors"] = list(report.errors)
            if label in self.also_labels():
                row["opt_in"] = list(self.also[label.removeprefix("fusion_passes+")])

    def also_labels(self) -> list[str]:
        return [f"fusion_passes+{k}" for k in self.also]

    def time(self, lock: str | None) -> None:
        for label, fn in self.variants.items():
            self.result["variants"][label] |= measure(self.step, fn, self.inputs, lock, self.layers)
        for label in ("fusion_passes", *self.also_labels()):
            host = self.result["variants"][label]["host"]
            for what in ("blocking", "dispatched"):
                if host[what]:
                    print(f"bench_decode: {self.name}: {label}'s step has {what} calls: {host[what]}", file=sys.stderr)
        rounds = plain_rounds(self.step, self.variants, self.inputs, self.plain_rounds, lock)
        for label, samples in rounds.items():
            self.result["variants"][label] |= {"plain_us": statistics.median(samples), "plain_rounds_us": samples}
        del self.variants, self.step, self.inputs  # the GPU memory, for the next point


def wait_for(barrier: str | None, name: str, timeout: float) -> None:
    """--barrier DIR:N: mark this run compiled and wait until N runs are (nothing is timed while
    another run still compiles, which would take the host's cores from the launches); at most
    ``timeout`` seconds, so that a run that failed does not hold the others."""
    if barrier is None:
        return
    folder, _, count = barrier.rpartition(":")
    Path(folder).mkdir(parents=True, exist_ok=True)
    (Path(folder) / f"{name}.ready").touch()
    deadline = time.monotonic() + timeout
    while len(list(Path(folder).glob("*.ready"))) < int(count) and time.monotonic() < deadline:
        time.sleep(1)


def merge(args) -> int:
    """One result from several runs' JSON files: the first run's provenance (the GPU, versions)
    with the runs' commands, each run's kept under "runs"."""
    runs = [json.loads(Path(path).read_text()) for path in args.merge]
    points = [p for run in runs for p in run["points"]]
    prefills = [p for run in runs for p in run["prefill"]]
    provenance = dict(runs[0]["provenance"])
    provenance["command"] = " ; ".join(run["provenance"]["command"] for run in runs)
    Path(args.out).write_text(report_text(points, prefills))
    Path(args.json).write_text(json.dumps({"provenance": provenance, "runs": [run["provenance"] for run in runs],
                                           "points": points, "prefill": prefills}, indent=1) + "\n")  # fmt: skip
    return 0


def left_tables(points: list[dict], where) -> list[str]:
    """The "what is left" table of each point's fusion_passes runs (``where(point)`` names it)."""
    lines = []
    for p in points:
        for label, r in p["variants"].items():
            if not label.startswith("fusion_passes") or not r.get("left"):
                continue
            lines += ["", f"What is left, {p['model']} {where(p)} ({label}):", "",
                      "| kernel | region | launches / layer | us / layer |", "|---|---|---|---|"]  # fmt: skip
            lines += [f"| `{x['kernel'][:70]}` | {x['region']} | {x['per_layer_launches']:.1f} | {x['per_layer_us']:.1f} |"
                      for x in r["left"]]  # fmt: skip
    return lines


def _cells(r: dict, base: float | None) -> str:
    """A variant's cells: times, speedup over stock Inductor's graph time ``base``, kernels, the
    "other" kernels and us per layer, and the numerics against eager."""
    other = r.get("per_layer", {}).get("other", {})
    n = r.get("numerics") or {}
    cells = (
        common.us(r.get("plain_us"), 0), common.us(r.get("graph_us"), 0),
        common.ratio(base, r.get("graph_us")), r.get("kernels", "—"),
        common.us(other.get("kernels")), common.us(other.get("us")),
        f"{n['out_rel_err']:.1e}" if n else "—", f"{n['cache_rel_err']:.1e}" if n else "—",
    )  # fmt: skip
    return " | ".join(map(str, cells))


def report_text(points: list[dict], prefills: list[dict]) -> str:
    lines = ["| model | batch | context | variant | step, plain (us) | step, graph (us) | vs Inductor (graph) "
             "| kernels | other kernels / layer | other us / layer | out err | cache err |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for p in points:
        base = p["variants"]["inductor"].get("graph_us")
        for label, r in p["variants"].items():
            lines.append(f"| {p['model']} | {p['batch']} | {p['context']} | {label} | {_cells(r, base)} |")
    lines += left_tables(points, lambda p: f"batch {p['batch']} context {p['context']}")
    if prefills:
        lines += ["", "| model | prefill tokens | variant | plain (us) | graph (us) | vs Inductor (graph) "
                  "| kernels | other kernels / layer | other us / layer | out err | cache err |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for p in prefills:
            base = p["variants"]["inductor"].get("graph_us")
            for label, r in p["variants"].items():
                lines.append(f"| {p['model']} | {p['tokens']} | {label} | {_cells(r, base)} |")
        lines += left_tables(prefills, lambda p: f"prefill of {p['tokens']} tokens")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = common.parser(__doc__, "bench_decode", smoke="tiny widths on a CPU: numerics and the code path, no times")
    parser.add_argument("--models", nargs="+", default=DEFAULT_MODELS)
    common.add_sizes(parser, "--batch", [1, 8, 64], [2], what="batch sizes")
    common.add_sizes(parser, "--context", [1024], [8], what="prefilled tokens before the step")
    parser.add_argument("--layers", type=int, default=2,
                        help="decoder layers; hybrid models keep both kinds (Qwen3-Next / 3.5: 3 linear-attention "
                             "layers then 1 full-attention layer, the last one full below 4)")  # fmt: skip
    parser.add_argument("--check-steps", type=int, default=16,
                        help="decode steps compared against eager (0: none, and no copies of the cache "
                             "for the comparison: long contexts at large batches fit)")  # fmt: skip
    parser.add_argument("--prefill", type=int, nargs="*", default=[], metavar="N",
                        help="also time a prefill of N tokens (batch 1) that writes the cache")  # fmt: skip
    parser.add_argument("--prefill-only", action="store_true", help="no decode points: the --prefill runs alone")
    parser.add_argument("--opt-in", nargs="+", default=[], metavar="FUSION",
                        help="opt-in fusions to enable on top of the defaults")  # fmt: skip
    parser.add_argument("--also", nargs="+", default=[], metavar="LABEL=FUSION[,FUSION...]",
                        help="more fusion_passes variants timed in the same run, each with these fusions on top of "
                             "the defaults (and --opt-in): one stock baseline for all")  # fmt: skip
    parser.add_argument("--inductor", nargs="+", default=[], metavar="KEY=VALUE",
                        help="torch._inductor.config settings for both compiled variants (e.g. combo_kernels=True)")  # fmt: skip
    parser.add_argument("--left-rows", type=int, default=LEFT_ROWS, metavar="N",
                        help="kernels kept in each point's 'what is left' table, the slowest first")  # fmt: skip
    parser.add_argument("--plain-rounds", type=int, default=PLAIN_ROUNDS, metavar="N",
                        help="rounds of back-to-back plain-launch steps, the variants in turn (the median is reported)")  # fmt: skip
    parser.add_argument("--lock", help="a lock file shared by runs on one GPU (held while timing)")
    parser.add_argument("--barrier", metavar="DIR:N", help="wait until N runs sharing DIR have compiled before timing")
    parser.add_argument("--barrier-timeout", type=float, default=420, help="seconds --barrier waits at most")
    parser.add_argument("--merge", nargs="+", metavar="JSON",
                        help="merge these runs' results (one per model) into --json / --out, and exit")  # fmt: skip
    args = common.parse(parser)
    if args.merge:
        return merge(args)
    device = common.device(parser, args.smoke)
    size = "tiny" if args.smoke else "real"
    if args.smoke:
        args.check_steps = min(args.check_steps, 3)
    bound = tolerance(torch.bfloat16).rel_norm
    # Two compiled variants per point, all on DecodeStep.forward (the default limit is 8).
    torch._dynamo.config.recompile_limit = 64
    torch._dynamo.config.accumulated_recompile_limit = 1024
    Point.opt_in = tuple(args.opt_in)
    try:
        Point.also = also_variants(args.also)
        Point.inductor = inductor_settings(args.inductor)
        fusion_passes.backend([], **Point.inductor)  # checks each setting's name and type (one line)
    except (ValueError, TypeError, fusion_passes.FusionError) as e:
        parser.error(str(e))
    Point.left_rows = args.left_rows
    if args.plain_rounds < 1:
        parser.error(f"--plain-rounds must be >= 1, got {args.plain_rounds}")
    Point.plain_rounds = args.plain_rounds
    decode = [] if args.prefill_only else [
        Point(m, size, args.layers, b, c) for m in args.models for c in args.context for b in args.batch]
    prefill = [Point(m, size, args.layers, 1, n, prefill=True) for m in args.models for n in args.prefill]

    def save() -> None:  # as it goes: a run cut short keeps what it measured
        if args.json:
            common.write_json(args.json, {"points": [p.result for p in decode], "prefill": [p.result for p in prefill]})

    for point in decode + prefill:
        point.prepare(device, args.check_steps)
        save()
    wait_for(args.barrier, "-".join(args.models), args.barrier_timeout)
    if device == "cuda":
        for point in decode + prefill:
            point.time(args.lock)
            print(json.dumps({k: v for k, v in point.result.items() if k != "variants"}
                             | {lbl: {k: r.get(k) for k in ("graph_us", "plain_us", "kernels")}
                                for lbl, r in point.result["variants"].items()}), flush=True)  # fmt: skip
            save()
    failed = []  # fusion_passes beyond both the bf16 bound and twice stock Inductor's own error
    for point in decode + prefill:
        # DeepSeek V3.2's indexer top-k turns ulp differences into other selected tokens:
        # Inductor's own step is ~0.17 from eager there (tiny widths), so the bar is relative to it.
        stock = point.result["variants"]["inductor"].get("numerics")
        for label in ("fusion_passes", *point.also_labels()):
            ours = point.result["variants"][label].get("numerics")
            if ours is None:  # --check-steps 0
                continue
            for key in ("out_rel_err", "cache_rel_err"):
                if ours[key] > max(bound, 2 * stock[key]):
                    where = f"prefill {point.context}" if point.prefill else f"batch {point.batch}"
                    failed.append(f"{point.name} {where} ({label}): {key} {ours[key]:.2e} > max({bound}, 2 x "
                                  f"Inductor's {stock[key]:.2e})")  # fmt: skip
    points, prefills = [p.result for p in decode], [p.result for p in prefill]
    text = report_text(points, prefills)
    common.finish(args, text, {"points": points, "prefill": prefills})
    for line in failed:
        print(f"bench_decode: numerics: {line}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
