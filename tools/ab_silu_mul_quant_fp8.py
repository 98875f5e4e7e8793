"""The SiLU + FP8 kernel of a git revision against the working tree's, side by side on one GPU
(bf16, gate and up the halves of one gate_up tensor): the kernel alone inside a CUDA graph
(timing.time_graph_us), the revision timed twice (their spread is the noise), codes and scales
compared bit for bit. --sweep times the working tree's kernel for each silu form and warp count.

    python -m tools.ab_silu_mul_quant_fp8 --rev 47ff024 [--intermediate 18432 2048]
        [--tokens 1 64 256 4096 16384] [--schemes static per_token per_group]
    python -m tools.ab_silu_mul_quant_fp8 --sweep --schemes per_token --intermediate 2048
        --tokens 16 64 256 --warps 4 8 16 --forms div_rn bf16_mufu
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from benchmarks.timing import time_graph_us
from fusion_passes.lowering.silu_mul_quant_fp8 import triton as current
from fusion_passes.lowering.silu_mul_quant_fp8.silu import SILU_FORMS

ROOT = Path(__file__).resolve().parents[1]
LOWERING = "fusion_passes/lowering"
# The kernel module under lowering/: in a folder per family since the layout change, flat before.
KERNELS = ("silu_mul_quant_fp8/triton.py", "silu_mul_quant_fp8_triton.py")
STATIC_SCALE = 0.02
INPUT_BYTES = 16e9  # input sets per shape: as many as fit in this (2 to 20)


def _revision_files(rev: str) -> dict[str, str]:
    """fusion_passes/lowering/**.py at rev, by path under lowering/: rev is a git revision, or a
    directory holding that revision's fusion_passes (e.g. from git archive REV fusion_passes | tar
    -x -C DIR, for a machine without the repository's history)."""
    if Path(rev).is_dir():
        lowering = Path(rev) / LOWERING
        return {str(p.relative_to(lowering)): p.read_text() for p in sorted(lowering.rglob("*.py"))}
    names = _git("ls-tree", "-r", "--name-only", rev, f"{LOWERING}/").split()
    names = [n for n in names if n.endswith(".py")]
    return {str(Path(n).relative_to(LOWERING)): _git("show", f"{rev}:{n}") for n in names}


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True).stdout


def _load_revision(rev: str):
    """The kernel module as it was at rev, with the kernel helpers it imports (the norm kernel's
    quantization, the silu forms, the shared FP8 code) as they were at rev too: the revision's
    fusion_passes/lowering under the package name fusion_passes_at_rev, its __init__ files empty
    (they register the custom ops, which the working tree has registered already), imported from
    a temporary folder by its location (the module path is left as it is)."""
    files = _revision_files(rev)
    root = Path(tempfile.mkdtemp()) / "fusion_passes_at_rev"
    for name, text in {"__init__.py": "", **{f"lowering/{n}": t for n, t in files.items()}}.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        renamed = text.replace("fusion_passes.", "fusion_passes_at_rev.")
        path.write_text("" if path.name == "__init__.py" else renamed)
    for folder in [root, *(p for p in root.rglob("*") if p.is_dir())]:
        (folder / "__init__.py").touch()
    spec = importlib.util.spec_from_file_location(
        "fusion_passes_at_rev", root / "__init__.py", submodule_search_locations=[str(root)]
    )
    package = importlib.util.module_from_spec(spec)
    for name in [n for n in sys.modules if n.split(".")[0] == "fusion_passes_at_rev"]:
        del sys.modules[name]  # another revision loaded before
    sys.modules["fusion_passes_at_rev"] = package
    spec.loader.exec_module(package)
    kernel = next(k for k in KERNELS if k in files)
    return importlib.import_module("fusion_passes_at_rev.lowering." + kernel[: -len(".py")].replace("/", "."))


def _inputs(tokens: int, n: int, g: torch.Generator) -> list:
    sets = max(2, min(20, int(INPUT_BYTES // (tokens * n * 5))))
    return [
        torch.randn(tokens, 2 * n, device="cuda", generator=g).mul_(3).to(torch.bfloat16).chunk(2, -1)
        for _ in range(sets)
    ]


def _call(module, gate, up, scheme, scale, **kw):
    """The module's launcher on gate and up: its quantization as one QuantFP8 where the module
    takes one (this tree's), else as the arguments it took before (a revision from before it)."""
    if hasattr(module, "QuantFP8"):
        return module.silu_mul_quant_fp8_triton(gate, up, module.QuantFP8(scheme, scale), **kw)
    return module.silu_mul_quant_fp8_triton(gate, up, scheme, scale, **kw)


def _time(module, xs, scheme, scale, **kw) -> float:
    return time_graph_us([lambda a=a: _call(module, *a, scheme, scale, **kw) for a in xs])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rev", help="git revision to compare against, or a directory holding its fusion_passes")
    parser.add_argument("--sweep", action="store_true", help="forms x warps of the working tree")
    parser.add_argument("--intermediate", type=int, nargs="+", default=[18432, 2048])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 64, 256, 4096, 16384])
    parser.add_argument("--schemes", nargs="+", default=["static", "per_token", "per_group"])
    parser.add_argument("--warps", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--forms", nargs="+", choices=list(SILU_FORMS), default=["div_rn", "bf16_mufu"])
    args = parser.parse_args()
    if not torch.cuda.is_available() or not (args.rev or args.sweep):
        parser.error("needs a CUDA device, and --rev or --sweep")
    old = _load_revision(args.rev) if args.rev else None
    g = torch.Generator(device="cuda").manual_seed(0)
    for n in args.intermediate:
        for tokens in args.tokens:
            xs = _inputs(tokens, n, g)
            for scheme in args.schemes:
                scale = torch.tensor(STATIC_SCALE, device="cuda") if scheme == "static" else None
                if old is not None:
                    q0, s0 = _call(old, *xs[0], scheme, scale)
                    q1, s1 = _call(current, *xs[0], scheme, scale)
                    equal = torch.equal(q0.view(torch.uint8), q1.view(torch.uint8)) and torch.equal(s0, s1)
                    before, after, again = (_time(m, xs, scheme, scale) for m in (old, current, old))
                    print(f"{n:6d} {tokens:6d} {scheme:10s} {args.rev} {before:8.2f} (again {again:8.2f}) "
                          f"now {after:8.2f}  {before / after:5.2f}x  equal={equal}", flush=True)  # fmt: skip
                if args.sweep:
                    times = [
                        f"{w} warps {form} {_time(current, xs, scheme, scale, num_warps=w, form=form):.2f}"
                        for w in args.warps
                        for form in args.forms
                    ]
                    print(f"{n:6d} {tokens:6d} {scheme:10s} " + " | ".join(times), flush=True)
            del xs
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
