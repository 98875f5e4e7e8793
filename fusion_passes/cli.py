"""``fusion-passes``: list the fusions, or show what they do to a model.

    fusion-passes list
    fusion-passes diff qwen3.5 --dtype bf16            # a built-in model (tiny random weights)
    fusion-passes diff path/to/file.py:factory         # factory() -> (module, example_inputs)

Bad input is one line on stderr and exit status 2; ``--debug`` shows the traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import importlib.util
import os
import sys
import time
import warnings
from collections.abc import Sequence
from typing import Any

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class CliError(Exception):
    """A user error: printed as one line, exit status 2."""


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if not args.debug:
        # transformers' MoE helpers call lru_cache-wrapped version checks that Dynamo warns about
        # at every compile (a dozen lines each): noise in front of the report, not about the model.
        warnings.filterwarnings("ignore", message="Dynamo detected a call to a `functools.lru_cache`")
    try:
        return args.run(args)
    except CliError as e:
        if args.debug:
            raise
        print(f"fusion-passes: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # anything else is still one line unless --debug
        if args.debug:
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        print(f"fusion-passes: error: {type(e).__name__}: {first}", file=sys.stderr)
        return 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fusion-passes", description=__doc__.splitlines()[0])
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = parser.add_subparsers(required=True, metavar="COMMAND")

    p_list = sub.add_parser("list", help="every registered fusion, with its Unfused / Fused doc")
    p_list.set_defaults(run=_cmd_list)
    # --debug is accepted before or after the command (SUPPRESS: an absent one keeps the other's).
    p_list.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")

    p_diff = sub.add_parser("diff", help="compile a model with and without the passes, compare")
    p_diff.set_defaults(run=_cmd_diff)
    p_diff.add_argument("model", help="a built-in model name, or path/to/file.py:factory")
    p_diff.add_argument("--size", choices=("tiny", "real"), default="tiny")
    p_diff.add_argument("--dtype", choices=tuple(DTYPES), default="fp32")
    p_diff.add_argument("--layers", type=int, default=None)
    p_diff.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p_diff.add_argument("--fusions", default="all", help="comma-separated fusion names, or all")
    p_diff.add_argument("--verify", action="store_true", help="check each rewrite on random inputs")
    p_diff.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    p_diff.add_argument("--html", metavar="PATH", help="also write the report as one HTML page")
    p_diff.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")
    return parser


# --- list -------------------------------------------------------------------------------------


def _cmd_list(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    import fusion_passes

    console = Console()
    table = Table(title="fusions (applied in this order)")
    table.add_column("name", style="bold")
    table.add_column("summary")
    table.add_column("spellings")
    table.add_column("in \"all\"")
    for f in fusion_passes.list_fusions():
        in_all = "yes" if f.in_all else f"opt-in: {f.opt_in}"
        table.add_row(f.name, f.summary, ", ".join(s.name for s in f.spellings), in_all)
    console.print(table)
    for f in fusion_passes.list_fusions():
        console.rule(f.name)
        console.print(f.doc, markup=False, highlight=False)
    return 0


# --- diff -------------------------------------------------------------------------------------


def _cmd_diff(args: argparse.Namespace) -> int:
    import json

    from rich.console import Console

    import fusion_passes
    from fusion_passes.numerics import compare

    fusions = "all" if args.fusions == "all" else [n for n in args.fusions.split(",") if n]
    try:
        fusion_passes.registry.get_fusions(fusions)
    except fusion_passes.FusionError as e:
        raise CliError(str(e)) from None
    console = Console()
    dtype = DTYPES[args.dtype]
    name, module, inputs, sites = _load_model(args, dtype)
    module = module.to(args.device).eval()
    inputs = tuple(x.to(args.device) if isinstance(x, torch.Tensor) else x for x in inputs)
    report = fusion_passes.Report()
    backend = fusion_passes.backend(fusions, report=report, verify=args.verify)
    with torch.no_grad():
        expected = module(*inputs)
        outputs, timings, kernels = {}, {}, {}
        with _progress(console) as step:
            for label, compile_backend in (("inductor", "inductor"), ("fusion_passes", backend)):
                step(f"compiling {name} with {label.replace('_', ' ')}")
                start = time.perf_counter()
                outputs[label], kernels[label] = _compile_and_run(module, compile_backend, inputs)
                timings[label] = time.perf_counter() - start
    checks = {
        f"{label} vs eager": _compare_outputs(out, expected, dtype, compare)
        for label, out in outputs.items()
    }
    _print_report(console, name, report, checks, timings, sites, kernels)
    data = _as_json(name, args, report, checks, sites)
    data["kernels"] = kernels
    if args.json:
        with open(args.json, "w") as f:
            json.dump(data, f, indent=2)
        console.print(f"wrote {args.json}")
    if args.html:
        from fusion_passes.html_report import render_html

        with open(args.html, "w") as f:
            f.write(render_html(data))
        console.print(f"wrote {args.html}")
    return 0 if all(c["ok"] for c in checks.values()) else 1


def _load_model(args: argparse.Namespace, dtype: torch.dtype):
    """(display name, module, example inputs, expected sites or None)."""
    spec = args.model
    if ":" in spec and (spec.endswith(".py") or ".py:" in spec):
        path, _, factory_name = spec.rpartition(":")
        if not os.path.isfile(path):
            raise CliError(f"no such file: {path}")
        module_spec = importlib.util.spec_from_file_location("_fusion_passes_user_model", path)
        user = importlib.util.module_from_spec(module_spec)  # type: ignore[arg-type]
        module_spec.loader.exec_module(user)  # type: ignore[union-attr]
        factory = getattr(user, factory_name, None)
        if factory is None:
            raise CliError(f"{path} has no factory named {factory_name!r}")
        try:
            module, inputs = factory()
        except Exception as e:
            raise CliError(f"{spec} raised {type(e).__name__}: {e}") from e
        inputs = tuple(
            x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x
            for x in inputs
        )
        return spec, module.to(dtype), inputs, None
    from fusion_passes.models import MODEL_NAMES, build_model

    if spec not in MODEL_NAMES:
        close = difflib.get_close_matches(spec, MODEL_NAMES, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else f"; known: {', '.join(MODEL_NAMES)}"
        raise CliError(f"unknown model {spec!r}{hint}")
    built = build_model(spec, size=args.size, dtype=dtype, layers=args.layers)
    return f"{spec} ({args.size}, {args.dtype})", built.module, built.example_inputs, built.sites


def _compile_and_run(module: torch.nn.Module, backend: Any, inputs: tuple) -> tuple[Any, dict]:
    """Compile (one graph, past the FX graph cache so the code is there to count) and run."""
    import torch._inductor.config as inductor_config
    from torch._inductor.utils import run_and_get_code

    from fusion_passes.kernels import count_kernels

    torch._dynamo.reset()
    compiled = torch.compile(module, backend=backend, fullgraph=True)
    try:
        with inductor_config.patch(fx_graph_cache=False):
            out, codes = run_and_get_code(compiled, *inputs)
    except (torch._dynamo.exc.Unsupported, torch._dynamo.exc.UserError) as e:  # Dynamo could not trace
        first = str(e).strip().splitlines()[0]
        raise CliError(f"the model does not compile as one graph (fullgraph=True): {first}") from e
    counts: dict[str, Any] = count_kernels(codes)
    if any(isinstance(x, torch.Tensor) and x.is_cuda for x in inputs):
        from fusion_passes.kernels import profile_kernel_classes

        counts["launched"] = profile_kernel_classes(compiled, *inputs)  # gemm/attention/moe/other
    return out, counts


@contextlib.contextmanager
def _progress(console):
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    with Progress(
        SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=console,
        transient=True,
    ) as progress:
        task = None

        def step(description: str) -> None:
            nonlocal task
            if task is not None:
                progress.update(task, completed=1, total=1)
            task = progress.add_task(description, total=None)

        yield step


def _outputs(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (tuple, list)):
        return [t for item in x for t in _outputs(item)]
    if isinstance(x, dict):
        return [t for item in x.values() for t in _outputs(item)]
    return [t for t in vars(x).values() if isinstance(t, torch.Tensor)] if hasattr(x, "__dict__") else []


def _compare_outputs(actual, expected, dtype, compare) -> dict[str, Any]:
    per_output = []
    for a, e in zip(_outputs(actual), _outputs(expected), strict=True):
        c = compare(a, e, dtype)
        per_output.append({"max_abs": c.max_abs, "rel_norm": c.rel_norm, "ok": c.rel_norm <= _bound(dtype)})
    return {"outputs": per_output, "ok": all(o["ok"] for o in per_output)}


def _bound(dtype: torch.dtype) -> float:
    from fusion_passes.numerics import tolerance

    return tolerance(dtype).rel_norm


def _print_report(console, name, report, checks, timings, sites, kernels) -> None:
    from rich.table import Table

    console.rule(f"fusion_passes diff: {name}")
    table = Table(title="fusions")
    for col in ("fusion", "sites", "where (module / source line)"):
        table.add_column(col)
    for fusion, count in report.matches.items():
        where = "\n".join(
            f"{s.module or '(root)'}  {s.location}" for s in report.sites_of(fusion)
        )
        table.add_row(fusion, str(count), where or "-")
    console.print(table)
    if sites is not None:
        # A gated RMSNorm (linear attention) fuses its norm; the SiLU gate stays an Inductor op.
        expected = len(sites.rms_norm) + len(sites.gated_rms_norm)
        got = report.matches.get("rms_norm", 0) + report.matches.get("add_rms_norm", 0)
        gated = f" (incl. {len(sites.gated_rms_norm)} gated)" if sites.gated_rms_norm else ""
        console.print(f"RMSNorm sites in the model: {expected}{gated}; fused: {got}")
    if report.rejected:
        rej = Table(title="matched a spelling but not rewritten")
        for col in ("fusion", "where", "reason"):
            rej.add_column(col)
        for r in report.rejected:
            rej.add_row(r.fusion, f"{r.module or '(root)'} {r.location}", r.reason)
        console.print(rej)
    if report.near_misses:
        near = Table(title="candidate sites left unfused: the closest spelling and where it diverged")
        for col in ("where", "closest", "ops lined up", "first divergence"):
            near.add_column(col)
        for m in report.near_misses:
            where = f"{m.module or '(root)'} {m.location}"
            near.add_row(where, f"{m.fusion}.{m.spelling}", f"{m.matched}/{m.total}", m.reason)
        console.print(near)
    before, after = report.ops_before(), report.ops_after()
    ops = Table(title="graph ops that changed (all compiled graphs)")
    for col in ("op", "before", "after"):
        ops.add_column(col)
    for op in sorted(set(before) | set(after)):
        if before.get(op, 0) != after.get(op, 0):
            ops.add_row(op, str(before.get(op, 0)), str(after.get(op, 0)))
    ops.add_row("[bold]total", str(sum(before.values())), str(sum(after.values())))
    console.print(ops)
    num = Table(title="numerical check (per output)")
    for col in ("compiled", "max abs error", "rel. norm error", "ok"):
        num.add_column(col)
    for label, check in checks.items():
        for o in check["outputs"]:
            num.add_row(label, f"{o['max_abs']:.3g}", f"{o['rel_norm']:.3g}", "yes" if o["ok"] else "NO")
    console.print(num)
    kern = Table(title="kernels in the generated code")
    for col in ("compiled", "generated (Inductor)", "fused ops (dispatcher)", "extern calls"):
        kern.add_column(col)
    for label, k in kernels.items():
        kern.add_row(label, str(k["generated"]), str(k["fused_ops"]), str(k["extern"]))
    console.print(kern)
    if all("launched" in k for k in kernels.values()):
        launched = Table(title="CUDA kernels launched per forward, by class")
        classes = list(next(iter(kernels.values()))["launched"])
        for col in ("compiled", *classes, "total"):
            launched.add_column(col)
        for label, k in kernels.items():
            row = [str(k["launched"][c]) for c in classes]
            launched.add_row(label, *row, str(sum(k["launched"].values())))
        console.print(launched)
    console.print(
        "compile time: " + ", ".join(f"{k} {v:.1f} s" for k, v in timings.items())
    )
    for e in report.errors:
        console.print(f"[red]failed:[/red] {e}")


def _as_json(name, args, report, checks, sites) -> dict[str, Any]:
    from dataclasses import asdict

    return {
        "schema": "fusion_passes.diff/1",
        "model": name,
        "device": args.device,
        "dtype": args.dtype,
        "matches": dict(report.matches),
        "sites": [asdict(s) for s in report.sites],
        "rejected": [asdict(r) for r in report.rejected],
        "near_misses": [asdict(m) for m in report.near_misses],
        "errors": report.errors,
        "ops_before": dict(report.ops_before()),
        "ops_after": dict(report.ops_after()),
        "expected_rms_norm_sites": (
            None if sites is None else len(sites.rms_norm) + len(sites.gated_rms_norm)
        ),
        "numerics": checks,
    }


if __name__ == "__main__":
    sys.exit(main())
