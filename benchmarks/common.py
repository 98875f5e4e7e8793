"""What every benchmark shares: its command line (report paths, --smoke, the size lists), the device
it runs on, number formatting, and the JSON writer that stamps each result with its provenance.

A benchmark's main reads:

    parser = common.parser(__doc__, "bench_rms_norm", smoke="tiny sizes; on a CPU under the interpreter")
    common.add_sizes(parser, "--tokens", TOKENS, SMOKE_TOKENS, "token counts")
    args = common.parse(parser)              # --tokens: the list given, or the (smoke) default
    device = common.device(parser, args.smoke)
    ...
    common.finish(args, text, {"device": ..., "records": records})   # report, JSON, stdout

Kernels run in Triton's CPU interpreter on a --smoke run without a GPU, which must be chosen before
triton is imported: a benchmark calls interpret_smoke_run() before its first import of triton (this
module imports only the standard library and torch).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
# The keys of a result's provenance (write_json adds them; tests/framework/test_benchmarks_page.py
# checks every committed result file for them).
PROVENANCE_KEYS = ("date", "gpu", "gpus", "torch", "triton", "command")


def interpret_smoke_run() -> bool:
    """A --smoke run without a GPU runs Triton kernels in the CPU interpreter; call this before
    triton is imported. Returns whether kernels run in the interpreter."""
    if "--smoke" in sys.argv and not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
    return os.environ.get("TRITON_INTERPRET") == "1"


# ---------------------------------------------------------------------------------------------
# The command line


def parser(doc: str, name: str | None = None, *, smoke: str | None = None, md: bool = True,
           json_default: bool = True) -> argparse.ArgumentParser:  # fmt: skip
    """An argument parser described by the first paragraph of ``doc``, with --out NAME.md (md),
    --json NAME.json (or no JSON unless asked: json_default=False) and --smoke (its help)."""
    result = argparse.ArgumentParser(prog=_program(), description=doc.split("\n\n")[0])
    if md:
        result.add_argument("--out", default=f"{name}.md", help="markdown report path")
    if name is not None:
        default = f"{name}.json" if json_default else None
        result.add_argument("--json", default=default, help="raw numbers, with their provenance")
    if smoke is not None:
        result.add_argument("--smoke", action="store_true", help=smoke)
    return result


def _program() -> str | None:
    """How the running module is invoked (python -m benchmarks.NAME), for its usage line."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return f"python -m {spec.name}" if spec is not None and spec.name else None


class _SizesDefault(tuple):
    """An --option's default size list, and the one a --smoke run takes instead."""

    smoke: tuple | None

    def resolve(self, smoke: bool) -> list[int]:
        return list(self.smoke if smoke and self.smoke is not None else self)


def add_sizes(parser: argparse.ArgumentParser, flag: str, default: Sequence[int],
              smoke: Sequence[int] | None = None, what: str = "sizes") -> None:  # fmt: skip
    """--FLAG N [N ...]: a list of sizes (token counts, hidden sizes), ``default`` when not given,
    ``smoke`` on a --smoke run; parse() resolves it to a list."""
    sizes = _SizesDefault(default)
    sizes.smoke = None if smoke is None else tuple(smoke)
    listed = " ".join(map(str, default))
    note = "" if smoke is None else f"; {' '.join(map(str, smoke))} with --smoke"
    help = f"{what} (default {listed}{note})"
    parser.add_argument(flag, type=int, nargs="+", default=sizes, metavar="N", help=help)


def parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> argparse.Namespace:
    """parser.parse_args, with every add_sizes list not given set to its (smoke) default."""
    args = parser.parse_args(argv)
    smoke = getattr(args, "smoke", False)
    for name, value in vars(args).items():
        if isinstance(value, _SizesDefault):
            setattr(args, name, value.resolve(smoke))
    return args


# ---------------------------------------------------------------------------------------------
# The device


def device(parser: argparse.ArgumentParser, smoke: bool) -> str:
    """"cuda", or "cpu" on a --smoke run without a GPU; without a GPU otherwise, a one-line error."""
    if torch.cuda.is_available():
        return "cuda"
    if not smoke:
        parser.error("no CUDA device: only --smoke runs on a CPU")
    return "cpu"


def require_cuda(parser: argparse.ArgumentParser, why: str = "") -> None:
    """A one-line error (exit status 2) where there is no CUDA device."""
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU" + (f": {why}" if why else ""))


def device_name(device: str) -> str:
    return torch.cuda.get_device_name() if device == "cuda" else "CPU (Triton interpreter)"


# ---------------------------------------------------------------------------------------------
# Numbers in a report


def us(value: float | None, digits: int = 1) -> str:
    """Microseconds as the reports print them; a dash where nothing was measured."""
    return "—" if value is None else f"{value:.{digits}f}"


def ratio(slow: float | None, fast: float | None) -> str:
    """slow / fast as a speedup ("1.23x"); a dash where either is missing."""
    return "—" if slow is None or fast is None or not fast else f"{slow / fast:.2f}x"


# ---------------------------------------------------------------------------------------------
# Results and their provenance


def command_line() -> str:
    """The command that is running, as one would type it again from the repository root."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    target = f"-m {spec.name}" if spec is not None and spec.name else sys.argv[0]
    launcher = "python"
    if "TORCHELASTIC_RUN_ID" in os.environ:  # started by torchrun
        launcher = f"torchrun --nproc-per-node {os.environ.get('LOCAL_WORLD_SIZE', '?')}"
    return " ".join(part for part in (launcher, target, shlex.join(sys.argv[1:])) if part)


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _git_commit() -> str | None:
    """The commit of this tree, where it is a git checkout of its own whose tracked files are
    unchanged (a copy with other files, or a tree inside another repository, names none)."""
    changed = _git("status", "--porcelain", "--untracked-files=no")
    if _git("rev-parse", "--show-toplevel") != str(REPO) or changed != "":
        return None
    return _git("rev-parse", "--short=12", "HEAD") or None


@functools.cache
def provenance() -> dict:
    """When, where and how a result was measured: the date (UTC), the GPU and how many the run
    used, torch / triton / Python versions, the command line, and the git commit where the tree is
    that commit's."""
    import triton  # imported by the benchmark already (after interpret_smoke_run)

    cuda = torch.cuda.is_available()
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name() if cuda else None,
        "gpus": int(os.environ.get("WORLD_SIZE", 1)) if cuda else 0,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "command": command_line(),
        "commit": _git_commit(),
    }


def write_json(path: str | os.PathLike, payload: dict) -> None:
    """payload as JSON at path, under a "provenance" key (see provenance())."""
    Path(path).write_text(json.dumps({"provenance": provenance(), **payload}, indent=1) + "\n")


def finish(args: argparse.Namespace, text: str, payload: dict) -> None:
    """The end of a benchmark's run: the markdown report to args.out, the numbers (with their
    provenance) to args.json, the report to stdout."""
    Path(args.out).write_text(text)
    write_json(args.json, payload)
    print(text)
