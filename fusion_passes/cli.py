"""``fusion-passes``: list the fusions, or show what they do to a model.

    fusion-passes list [NAME] [--json]
    fusion-passes diff qwen3.5 --dtype bf16            # a built-in model (tiny random weights)
    fusion-passes diff path/to/file.py:factory         # factory() -> (module, example_inputs)

Bad input is one line on stderr and exit status 2; ``--debug`` shows the traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import shutil
import sys
import textwrap
import time
import warnings
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Names of the dtypes a factory's model may keep (without --dtype) and the report can name.
DTYPE_NAMES = {**{v: k for k, v in DTYPES.items()}, torch.float64: "fp64"}
BUILT_IN_DEFAULT_DTYPE = "fp32"
FACTORY_SYNTAX = "path/to/file.py:factory, where factory() returns (module, example_inputs)"


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
    except BrokenPipeError:  # `fusion-passes list | head`: the reader has what it wanted
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
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
    from fusion_passes.models import MODEL_NAMES

    parser = argparse.ArgumentParser(prog="fusion-passes", description=__doc__.splitlines()[0])
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = parser.add_subparsers(required=True, metavar="COMMAND")

    p_list = sub.add_parser(
        "list", help="the registered fusions; list NAME for one fusion's Unfused / Fused doc",
        description="The registered fusions, in the order they are applied: name, family (the "
        'pattern module), whether fusions="all" includes it, and a one-line summary.',
    )
    p_list.set_defaults(run=_cmd_list)
    p_list.add_argument("name", nargs="?", help="one fusion: show its full Unfused / Fused doc")
    p_list.add_argument("--json", action="store_true", help="print the list (or NAME) as JSON")
    # --debug is accepted before or after the command (SUPPRESS: an absent one keeps the other's).
    p_list.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")

    p_diff = sub.add_parser(
        "diff", help="compile a model with and without the passes, compare",
        description=textwrap.fill(
            "Compile a model with stock Inductor and with the fusion passes, and report what the "
            "passes rewrote, what they left and why, and the numerical check.", 78
        ),
        epilog="\n".join([
            "built-in models (transformers configs, random weights):",
            *textwrap.wrap(", ".join(MODEL_NAMES), 76, initial_indent="  ", subsequent_indent="  "),
            "or a factory of your own:",
            *textwrap.wrap(FACTORY_SYNTAX, 76, initial_indent="  ", subsequent_indent="  "),
        ]),
        formatter_class=argparse.RawDescriptionHelpFormatter,  # both laid out above
    )
    p_diff.set_defaults(run=_cmd_diff)
    p_diff.add_argument("model", help="a built-in model name (listed below), or path/to/file.py:factory")
    p_diff.add_argument(
        "--size", choices=("tiny", "real"), default=None,
        help="built-in models: tiny widths or the model's real widths (default: tiny)",
    )
    p_diff.add_argument(
        "--dtype", choices=tuple(DTYPES), default=None,
        help="cast the model and its inputs to this dtype (default: a factory's model keeps its "
        f"own dtype; built-in models are built in {BUILT_IN_DEFAULT_DTYPE})",
    )
    p_diff.add_argument(
        "--layers", type=_positive_int, default=None, metavar="N",
        help="built-in models: number of decoder layers (default: 2)",
    )
    p_diff.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu",
        help="device to run on (default: %(default)s, i.e. cuda when available)",
    )
    p_diff.add_argument(
        "--fusions", default="all",
        help="comma-separated fusion names (see fusion-passes list), or all; all,NAME adds an "
        "opt-in fusion to the defaults (default: %(default)s)",
    )
    p_diff.add_argument("--verify", action="store_true", help="check each rewrite on random inputs")
    p_diff.add_argument(
        "--decode", action="store_true",
        help="compare one cached decode step (a transformers StaticCache prefilled with --context "
        "tokens) instead of a forward; on cuda, also what is left outside GEMM / attention / MoE",
    )
    p_diff.add_argument("--batch", type=_positive_int, default=None, metavar="N",
                        help="--decode: sequences in the step (default: 1)")  # fmt: skip
    p_diff.add_argument("--context", type=_positive_int, default=None, metavar="N",
                        help="--decode: tokens in the cache before the step (default: 32)")  # fmt: skip
    p_diff.add_argument(
        "--all-rows", action="store_true",
        help="list every fusion that ran in the fusions table (default: those with no rewrite "
        "are folded into one line)",
    )
    p_diff.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    p_diff.add_argument("--html", metavar="PATH", help="also write the report as one HTML page")
    p_diff.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")
    return parser


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _unknown(kind: str, name: str, known: Sequence[str], n: int = 1) -> CliError:
    """``unknown KIND 'name'; did you mean ...?``, or the known names (registry.unknown_name)."""
    from fusion_passes.registry import unknown_name

    return CliError(unknown_name(kind, name, known, n=n))


# --- list -------------------------------------------------------------------------------------


def _cmd_list(args: argparse.Namespace) -> int:
    """Plain lines, never cut (a terminal wraps them; a pipe gets them whole)."""
    import json

    import fusion_passes

    fusions = fusion_passes.list_fusions()
    if args.name is not None:
        by_name = {f.name: f for f in fusions}
        if args.name not in by_name:
            raise _unknown("fusion", args.name, list(by_name), n=3)
        f = by_name[args.name]
        if args.json:
            print(json.dumps(_fusion_json(f, doc=True), indent=2))
            return 0
        print(f.name)
        print(f"family:    {_family(f)}")
        print(f"in \"all\":  {_in_all(f)}")
        print(f"summary:   {f.summary}")
        print(f"spellings: {', '.join(s.name for s in f.spellings) or '(none: a graph rewrite, Fusion.rewrite)'}")
        if f.requires:
            print(f"requires:  {', '.join(f.requires)}")
        print()
        print(f.doc.strip())
        return 0
    if args.json:
        print(json.dumps([_fusion_json(f, doc=False) for f in fusions], indent=2))
        return 0
    # An opt-in reason is long and shared by a family: a numbered note under the list.
    reasons: list[str] = []
    rows = []
    for f in fusions:
        if f.opt_in and f.opt_in not in reasons:
            reasons.append(f.opt_in)
        flag = "all" if f.in_all else f"opt-in ({reasons.index(f.opt_in) + 1})"
        rows.append((f.name, _family(f), flag, f.summary))
    header = ("NAME", "FAMILY", 'IN "all"', "SUMMARY")
    w = [max(len(r[i]) for r in [header, *rows]) for i in range(3)]
    one_line = [f"{r[0]:<{w[0]}}  {r[1]:<{w[1]}}  {r[2]:<{w[2]}}  {r[3]}" for r in [header, *rows]]
    width = shutil.get_terminal_size().columns
    print("fusions, in the order they are applied (fusion-passes list NAME: its Unfused / Fused doc)")
    if sys.stdout.isatty() and max(map(len, one_line)) > width:
        # A narrow terminal: the name line, then the summary wrapped under it.
        for name, family, flag, summary in rows:
            print(f"{name}  [{family}; {flag}]")
            print(textwrap.fill(summary, width, initial_indent="    ", subsequent_indent="    "))
    else:  # one line per fusion, whole (a pipe, grep)
        print("\n".join(one_line))
    for i, reason in enumerate(reasons, 1):
        print(textwrap.fill(f"({i}) opt-in: {reason}", max(width, 40), subsequent_indent="    "))
    return 0


def _family(f: Any) -> str:
    """A built-in fusion's family: the stem of the patterns module that exports it (fusion_order);
    another's, the stem of the module that defines its spellings, or its rewrite."""
    from fusion_passes.fusion_order import FUSION_ORDER

    for module, _ in FUSION_ORDER:
        if any(exported.name == f.name for exported in module.FUSIONS):
            return module.__name__.rpartition(".")[2]
    defined = f.spellings[0].pattern if f.spellings else f.rewrite
    module = getattr(defined, "__module__", None)
    return (module or "?").rpartition(".")[2]


def _in_all(f: Any) -> str:
    return "all" if f.in_all else f"opt-in: {f.opt_in}"


def _fusion_json(f: Any, doc: bool) -> dict[str, Any]:
    data = {
        "name": f.name,
        "family": _family(f),
        "in_all": f.in_all,
        "opt_in": f.opt_in or None,
        "summary": f.summary,
        "spellings": [s.name for s in f.spellings],
        "requires": list(f.requires),
    }
    if doc:
        data["doc"] = f.doc.strip()
    return data


# --- diff -------------------------------------------------------------------------------------


def _cmd_diff(args: argparse.Namespace) -> int:
    import json

    from rich.console import Console

    import fusion_passes
    from fusion_passes.numerics import compare

    console = Console()
    outputs, timings, kernels = {}, {}, {}
    # The first status line comes before the framework's imports (Inductor's pattern matcher: ~2 s),
    # the model's (transformers: seconds) and its build.
    with _progress(console) as step, torch.no_grad():
        step("checking the options")
        # Everything a user can get wrong is checked here, before the slow part (the compiles).
        fusions = _check_fusions(args.fusions)
        for flag, path in (("--json", args.json), ("--html", args.html)):
            if path is not None:
                _check_output_path(flag, path)
        _check_device(args.device)
        for flag, value in (("--batch", args.batch), ("--context", args.context)):
            if value is not None and not args.decode:
                raise CliError(f"{flag} applies to --decode only")
        report = fusion_passes.Report()
        backend = fusion_passes.backend(fusions, report=report, verify=args.verify)
        step(_first_step(args.model))
        name, module, inputs, sites, dtype, dtype_from = _load_model(args)
        dtype_name = DTYPE_NAMES[dtype]
        module = module.to(args.device).eval()
        inputs = tuple(x.to(args.device) if isinstance(x, torch.Tensor) else x for x in inputs)
        restore = lambda: None  # noqa: E731  (a forward mutates nothing)
        if args.decode:
            step(f"prefilling a StaticCache of {name}")
            module, inputs, restore = _decode_step(module, args)
            name = f"{name}, a decode step at batch {module.batch} after {module.context} tokens"
        step(f"running {name} eagerly")
        expected = module(*inputs)
        for label, compile_backend in (("inductor", "inductor"), ("fusion_passes", backend)):
            step(f"compiling {name} with {label.replace('_', ' ')}")
            restore()  # every variant's step starts from the prefilled cache
            start = time.perf_counter()
            outputs[label], kernels[label] = _compile_and_run(module, compile_backend, inputs)
            timings[label] = time.perf_counter() - start
    checks = {
        f"{label} vs eager": _compare_outputs(out, expected, dtype, compare)
        for label, out in outputs.items()
    }
    header = f"model {name}, dtype {dtype_name} ({_DTYPE_FROM[dtype_from]}), device {args.device}"
    summary = _summary_line(report, checks)
    _print_report(console, header, summary, report, checks, timings, sites, kernels, dtype, args.all_rows)
    data = _as_json(name, args, dtype_name, dtype_from, report, checks, sites)
    data["summary"] = summary
    data["tolerance"] = {"rel_norm": _bound(dtype)}
    data["compile_seconds"] = timings
    data["kernels"] = kernels
    data["decode"] = {"batch": module.batch, "context": module.context} if args.decode else None
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


LEFT_ROWS = 15  # "what is left" rows printed (the JSON has them all)

_DTYPE_FROM = {"--dtype": "from --dtype", "model": "the model's own", "default": "the default"}


def _check_fusions(spec: str) -> str | list[str]:
    import fusion_passes

    if spec == "all":
        return "all"
    names = [n.strip() for n in spec.split(",") if n.strip()]
    if not names:
        raise CliError('--fusions is empty: give comma-separated fusion names, or all')
    try:
        fusion_passes.registry.get_fusions(names)
    except fusion_passes.FusionError as e:
        raise CliError(str(e)) from None
    return names


def _check_output_path(flag: str, path: str) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise CliError(f"{flag} {path} is a folder; give a file path")
    if not os.path.isdir(folder):
        raise CliError(f"{flag} {path}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise CliError(f"{flag} {path}: the folder {folder} is not writable")


def _check_device(device: str) -> None:
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError) as e:
        raise CliError(f"--device {device!r} is not a device ({e}); try cpu or cuda") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch is built without CUDA" if torch.version.cuda is None else "no GPU found"
            raise CliError(f"--device {device}: CUDA is not available ({why}); use --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise CliError(f"--device {device}: there are {torch.cuda.device_count()} CUDA devices")


def _is_factory(spec: str) -> bool:
    return ":" in spec and (spec.endswith(".py") or ".py:" in spec)


def _first_step(spec: str) -> str:
    from fusion_passes.models import MODEL_NAMES

    if spec in MODEL_NAMES and "transformers.modeling_utils" not in sys.modules:
        return f"importing transformers to build {spec}"
    return f"building {spec}" if spec in MODEL_NAMES else f"loading {spec}"


@contextlib.contextmanager
def _without_torchao():
    """Import transformers without torchao, which its quantizer integration imports when installed
    (a failed load of torchao's extensions and deprecation warnings on stderr, a few 100 ms): a
    built-in model has random weights and loads no quantized checkpoint. Only when neither is
    imported yet; ``import torchao`` works again afterwards (transformers' own torchao quantizer
    stays off in this process)."""
    if "torchao" in sys.modules or "transformers.modeling_utils" in sys.modules:
        yield
        return
    sys.modules["torchao"] = None  # type: ignore[assignment]  # find_spec -> None, import -> ImportError
    try:
        import transformers.modeling_utils  # noqa: F401
    finally:
        if sys.modules.get("torchao", 0) is None:
            del sys.modules["torchao"]
    yield


# Loggers whose import-time warnings are not the user's business: torchao's failed loads of its
# optional CUDA extensions (on a CPU-only install) and torch's pytree deprecation of torchao's
# enum registrations. A factory may use torchao (its FP8 models), so it cannot be kept out.
_NOISY_LOGGERS = ("torchao", "torch.utils._pytree")


@contextlib.contextmanager
def _quiet_import_noise():
    import logging

    loggers = [logging.getLogger(name) for name in _NOISY_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def _load_model(args: argparse.Namespace):
    """(display name, module, example inputs, expected sites or None, dtype, where the dtype came
    from: "--dtype", "model" or "default")."""
    spec = args.model
    if _is_factory(spec):
        return _load_factory(args, spec)
    if spec.endswith(".py") or os.path.isfile(spec):
        raise CliError(f"{spec}: name the factory too: {FACTORY_SYNTAX}")
    from fusion_passes.models import MODEL_NAMES, build_model

    if spec not in MODEL_NAMES:
        raise _unknown("model", spec, MODEL_NAMES)
    size = args.size or "tiny"
    dtype_name = args.dtype or BUILT_IN_DEFAULT_DTYPE
    dtype = DTYPES[dtype_name]
    with _without_torchao():
        built = build_model(spec, size=size, dtype=dtype, layers=args.layers)
    dtype_from = "--dtype" if args.dtype else "default"
    return f"{spec} ({size})", built.module, built.example_inputs, built.sites, dtype, dtype_from


def _load_factory(args: argparse.Namespace, spec: str):
    path, _, factory_name = spec.rpartition(":")
    if not os.path.isfile(path):
        raise CliError(f"no such file: {path}")
    for flag, value in (("--size", args.size), ("--layers", args.layers)):
        if value is not None:
            raise CliError(f"{flag} applies to built-in models only, not to a factory")
    module_spec = importlib.util.spec_from_file_location("_fusion_passes_user_model", path)
    user = importlib.util.module_from_spec(module_spec)  # type: ignore[arg-type]
    with _quiet_import_noise():
        module_spec.loader.exec_module(user)  # type: ignore[union-attr]
        factory = getattr(user, factory_name, None)
        if factory is None:
            raise CliError(f"{path} has no factory named {factory_name!r}")
        try:
            result = factory()
        except Exception as e:
            raise CliError(f"{spec} raised {type(e).__name__}: {e}") from e
    module, inputs = _check_factory_result(spec, result)
    if args.dtype is not None:
        dtype, dtype_from = DTYPES[args.dtype], "--dtype"
        module = module.to(dtype)
        inputs = tuple(
            x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x
            for x in inputs
        )
    else:
        dtype, dtype_from = _own_dtype(module, inputs), "model"
        if dtype not in DTYPE_NAMES:
            known = ", ".join(DTYPES)
            raise CliError(f"{spec} returned a {dtype} model; give --dtype ({known})")
    return spec, module, inputs, None, dtype, dtype_from


def _check_factory_result(spec: str, result: Any) -> tuple[torch.nn.Module, tuple]:
    """The factory must return (nn.Module, tuple | list of inputs); one tensor is one input."""
    expected = "expected (nn.Module, tuple of example inputs)"
    if isinstance(result, torch.nn.Module):
        raise CliError(f"{spec} returned only a {type(result).__name__}; {expected}")
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        what = (
            f"a {type(result).__name__} of {len(result)} items"
            if isinstance(result, (tuple, list)) else f"a {type(result).__name__}"
        )
        raise CliError(f"{spec} returned {what}; {expected}")
    module, inputs = result
    if not isinstance(module, torch.nn.Module):
        raise CliError(f"{spec} returned a {type(module).__name__} as the model; {expected}")
    if isinstance(inputs, torch.Tensor):
        print(
            f"fusion-passes: note: {spec} returned one tensor as its example inputs; "
            "passing it as the only argument",
            file=sys.stderr,
        )
        return module, (inputs,)
    if not isinstance(inputs, (tuple, list)):
        raise CliError(f"{spec} returned a {type(inputs).__name__} as the example inputs; {expected}")
    return module, tuple(inputs)


def _own_dtype(module: torch.nn.Module, inputs: tuple) -> torch.dtype:
    """The dtype of the model's floating-point weights (then buffers, then inputs); fp32 if none.

    A model of several dtypes is reported (and its numerics judged) by the lowest-precision one."""
    for tensors in (module.parameters(), module.buffers(), inputs):
        floats = {t.dtype for t in tensors if isinstance(t, torch.Tensor) and t.is_floating_point()}
        if floats:
            return max(floats, key=lambda d: torch.finfo(d).eps)
    return torch.float32


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
        raise CliError(
            f"the model does not compile as one graph (fullgraph=True): {first}{_user_frame(e)}"
        ) from e
    counts: dict[str, Any] = count_kernels(codes)
    if any(isinstance(x, torch.Tensor) and x.is_cuda for x in inputs):
        from fusion_passes.kernels import class_times, profile_kernels, what_is_left

        launched = profile_kernels(compiled, *inputs)
        classes = class_times(launched)
        counts["launched"] = {c: v["kernels"] for c, v in classes.items()}  # gemm/attention/moe/other
        counts["gpu_us"] = {c: round(v["us"], 2) for c, v in classes.items()}
        counts["left"] = what_is_left(launched)
    return out, counts


def _decode_step(module: torch.nn.Module, args: argparse.Namespace):
    """(DecodeStep, its inputs, its restore) for --decode: the model's StaticCache prefilled."""
    from fusion_passes.models.decode import DecodeError, DecodeStep

    try:
        step = DecodeStep(module, batch=args.batch or 1, context=args.context or 32, steps=1)
    except DecodeError as e:
        raise CliError(f"--decode: {e}") from e
    return step, step.inputs(0), step.restore


def _user_frame(e: Exception) -> str:
    """ " at file.py:LINE in fn (the code)" of the user's line where Dynamo stopped, if known."""
    stack = getattr(e, "real_stack", None) or []
    frame = stack[-1] if stack else None
    if frame is None:
        return ""
    code = f" ({frame.line.strip()})" if getattr(frame, "line", None) else ""
    return f" at {os.path.basename(frame.filename)}:{frame.lineno} in {frame.name}{code}"


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


def _summary_line(report, checks) -> str:
    """The report in one line: sites left in the compiled graph, what became of the others,
    rejections, near misses, numerics."""
    final = report.final()
    sites, fusions = sum(final.values()), sum(1 for n in final.values() if n)
    fates = Counter(s.fate.split(" by ")[0] for s in report.sites if s.fate)
    parts = [f"{sites} site{'s' * (sites != 1)} in {fusions} fusion{'s' * (fusions != 1)}"]
    if fates:
        parts[0] += " (" + ", ".join(f"{n} more {fate}" for fate, n in sorted(fates.items())) + ")"
    parts.append(f"{len(report.rejected)} rejected")
    parts.append(f"{len(report.near_misses)} near miss{'es' * (len(report.near_misses) != 1)}")
    if report.errors:
        parts.append(f"{len(report.errors)} failed")
    parts.append("numerics ok" if all(c["ok"] for c in checks.values()) else "numerics NOT ok")
    return ", ".join(parts)


def _print_report(console, header, summary, report, checks, timings, sites, kernels, dtype, all_rows) -> None:
    from rich.table import Table

    console.rule("fusion_passes diff")
    console.print(header, markup=False, highlight=False, soft_wrap=True)
    console.print(summary, markup=False, highlight=False, soft_wrap=True, style="bold")
    table = Table(title="fusions (sites: rewrites in the compiled graph)")
    for col in ("fusion", "sites", "rewritten, then", "where (module / source line)"):
        table.add_column(col)
    final = report.final()
    idle = [f for f, n in report.matches.items() if not n and not all_rows]
    for fusion, count in report.matches.items():
        if fusion in idle:
            continue
        where = "\n".join(
            f"{s.module or '(root)'}  {s.location}" for s in report.sites_of(fusion) if not s.fate
        )
        fates = ", ".join(f"{n} {fate}" for fate, n in sorted(report.fates(fusion).items()))
        then = f"{count}: {fates}" if fates else "-"
        table.add_row(fusion, str(final[fusion]), then, where or "-")
    console.print(table)
    if idle:
        console.print(
            f"ran with no site ({len(idle)}; --all-rows lists them): {', '.join(idle)}",
            markup=False, highlight=False, soft_wrap=True,
        )  # fmt: skip
    if sites is not None:
        # A gated RMSNorm (linear attention) fuses its norm; the SiLU gate stays an Inductor op.
        expected = len(sites.rms_norm) + len(sites.gated_rms_norm)
        got = report.matches.get("rms_norm", 0) + report.matches.get("add_rms_norm", 0)
        gated = f" (incl. {len(sites.gated_rms_norm)} gated)" if sites.gated_rms_norm else ""
        console.print(f"RMSNorm sites in the model: {expected}{gated}; raised: {got}")
    lowered = report.lowered_back()
    if lowered:
        shown = ", ".join(f"{op.removesuffix('.default')} x{n}" for op, n in sorted(lowered.items()))
        console.print(
            f"lowered back (raised, then left standalone by every region; Inductor fuses them "
            f"as it would the model's code): {shown}",
            markup=False, highlight=False, soft_wrap=True,
        )  # fmt: skip
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
    num = Table(title=f"numerical check (per output; ok: rel. norm error <= {_bound(dtype):g} in {DTYPE_NAMES[dtype]})")
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
    left = kernels.get("fusion_passes", {}).get("left")
    if left:
        shown = left[:LEFT_ROWS]
        table = Table(title=f"what is left with fusion_passes: kernels outside GEMM / attention / MoE, "
                            f"by GPU time ({len(shown)} of {len(left)})")  # fmt: skip
        for col in ("kernel", "between", "launches", "GPU us"):
            table.add_column(col)
        for row in shown:
            table.add_row(row["kernel"][:80], row["region"], str(row["launches"]), f"{row['us']:.1f}")
        console.print(table)
    console.print(
        "compile + first run: " + ", ".join(f"{k} {v:.1f} s" for k, v in timings.items())
        + " (in this order; the second starts with warm caches: not a comparison)",
        markup=False, highlight=False, soft_wrap=True,
    )  # fmt: skip
    for e in report.errors:
        console.print(f"[red]failed:[/red] {e}")


def _as_json(name, args, dtype_name, dtype_from, report, checks, sites) -> dict[str, Any]:
    from dataclasses import asdict

    return {
        "schema": "fusion_passes.diff/1",
        "model": name,
        "device": args.device,
        "dtype": dtype_name,
        "dtype_from": dtype_from,
        "matches": dict(report.matches),
        "sites": [asdict(s) for s in report.sites],
        "rejected": [asdict(r) for r in report.rejected],
        "near_misses": [asdict(m) for m in report.near_misses],
        "errors": report.errors,
        "ops_before": dict(report.ops_before()),
        "ops_after": dict(report.ops_after()),
        "lowered_back": dict(report.lowered_back()),
        "final": dict(report.final()),
        "expected_rms_norm_sites": (
            None if sites is None else len(sites.rms_norm) + len(sites.gated_rms_norm)
        ),
        "numerics": checks,
    }


if __name__ == "__main__":
    sys.exit(main())
