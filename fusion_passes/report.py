"""What a backend did: rewritten sites, rejected candidates, failures, and ops before/after.

One ``Report`` may serve many compiles (every graph compiled with that backend adds to it).
A graph served from Inductor's FX graph cache runs no pass: its records are stored beside that
cache when the graph is first compiled (``report_cache``) and replayed into the report on a hit.
"""

from __future__ import annotations

import os
import warnings
import re
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.fx

_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')


@dataclass(frozen=True)
class Site:
    """One rewritten subgraph."""

    fusion: str
    spelling: str
    graph: int  # index of the compiled graph within this report
    module: str  # nn.Module path, e.g. "model.layers.0.input_layernorm"
    location: str  # "file.py:123 in forward" of the model line that produced the anchor op
    ops_removed: tuple[str, ...]
    ops_added: tuple[str, ...]
    scalars: dict[str, float] = field(default_factory=dict)  # matched scalar arguments (eps)
    before: dict = field(default_factory=dict)  # the matched region (regions.py format)
    after: dict = field(default_factory=dict)  # what replaced it
    # What became of the rewrite: "" (its op is in the compiled graph), "taken by <fusion>" (a
    # later fusion's region consumed it) or "lowered back" (left standalone, back to plain torch).
    fate: str = ""


@dataclass(frozen=True)
class Rejection:
    """A candidate that matched a spelling but was not rewritten, and why."""

    fusion: str
    spelling: str
    graph: int
    module: str
    location: str
    reason: str


@dataclass(frozen=True)
class NearMiss:
    """A candidate site (e.g. an rsqrt) left unfused: the closest spelling and where it diverged."""

    fusion: str
    spelling: str  # the spelling that came closest
    graph: int
    module: str
    location: str
    matched: int  # spelling ops that lined up with the graph before the divergence
    total: int  # ops in the spelling
    reason: str  # the first divergence, e.g. "weight is torch.float32, the spelling expects ..."


@dataclass(frozen=True)
class GraphRecord:
    """Op counts of one graph before and after the fusion passes (after: what Inductor compiles,
    canonical ops that no region fusion consumed already lowered back)."""

    ops_before: dict[str, int]
    ops_after: dict[str, int]
    fusions: tuple[str, ...] = ()  # the fusions applied to it
    errors: tuple[str, ...] = ()  # failures while rewriting it (also in Report.errors)
    from_cache: bool = False  # served by Inductor's FX graph cache; records replayed
    # Canonical ops left standalone and decomposed back into their references: op name -> calls.
    lowered_back: dict[str, int] = field(default_factory=dict)


@dataclass
class Report:
    """Filled by ``fusion_passes.backend(report=Report())``.

    matches: fusion name -> sites rewritten, summed over every graph compiled with the backend.
    """

    matches: Counter = field(default_factory=Counter)
    sites: list[Site] = field(default_factory=list)
    rejected: list[Rejection] = field(default_factory=list)
    near_misses: list[NearMiss] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    graphs: list[GraphRecord] = field(default_factory=list)

    def sites_of(self, fusion: str) -> list[Site]:
        return [s for s in self.sites if s.fusion == fusion]

    def ops_before(self) -> Counter:
        return sum((Counter(g.ops_before) for g in self.graphs), Counter())

    def ops_after(self) -> Counter:
        return sum((Counter(g.ops_after) for g in self.graphs), Counter())

    def final(self) -> Counter:
        """Sites per fusion whose op is in the compiled graph (neither taken by a later fusion nor
        lowered back); every fusion that ran is present, with 0 where none is left."""
        counts = Counter(dict.fromkeys(self.matches, 0))
        counts.update(s.fusion for s in self.sites if not s.fate)
        return counts

    def fates(self, fusion: str) -> Counter:
        """What became of ``fusion``'s rewrites that are not in the compiled graph, by fate."""
        return Counter(s.fate for s in self.sites if s.fusion == fusion and s.fate)

    def lowered_back(self) -> Counter:
        """Canonical ops lowered back into their references (standalone after the fusions)."""
        return sum((Counter(g.lowered_back) for g in self.graphs), Counter())

    def add_site(self, site: Site) -> None:
        self.sites.append(site)
        self.matches[site.fusion] += 1

    def graphs_since(self, start: int) -> list[dict[str, Any]]:
        """The records of graphs ``start..`` as plain data, graph-relative (for the cache)."""
        out = []
        for i, g in enumerate(self.graphs[start:], start):
            out.append(
                {
                    "ops_before": g.ops_before,
                    "ops_after": g.ops_after,
                    "lowered_back": g.lowered_back,
                    "fusions": list(g.fusions),
                    "errors": list(g.errors),
                    "sites": [asdict(s) for s in self.sites if s.graph == i],
                    "rejected": [asdict(r) for r in self.rejected if r.graph == i],
                    "near_misses": [asdict(m) for m in self.near_misses if m.graph == i],
                }
            )
        return out

    def replay(self, graphs: list[dict[str, Any]]) -> None:
        """Add records of graphs served from the cache (see ``graphs_since``)."""
        for g in graphs:
            index = len(self.graphs)
            fusions, errors = tuple(g["fusions"]), tuple(g["errors"])
            self.graphs.append(
                GraphRecord(
                    g["ops_before"], g["ops_after"], fusions, errors, True, g.get("lowered_back", {})
                )
            )
            for message in errors:  # the cached code is the unchanged graph: say so again
                self.errors.append(message)
                warnings.warn(f"fusion_passes: {message}; graph left unchanged (cached)", stacklevel=2)
            for name in fusions:
                self.matches[name] += 0  # a fusion that ran shows up, even with 0 sites
            for s in g["sites"]:
                s = {**s, "graph": index}
                s["ops_removed"], s["ops_added"] = tuple(s["ops_removed"]), tuple(s["ops_added"])
                self.add_site(Site(**s))
            for r in g["rejected"]:
                self.rejected.append(Rejection(**{**r, "graph": index}))
            for m in g["near_misses"]:
                self.near_misses.append(NearMiss(**{**m, "graph": index}))

    def runtime_fallbacks(self) -> dict[str, dict[str, str]]:
        """For the ops this report's rewrites added that can choose a path at run time (the
        collective ops): op -> {process group: why its last call there took the fallback}. Only
        calls made so far count: read it after running the compiled model."""
        from fusion_passes.lowering.common.collective_ops import runtime_fallbacks

        added = {op for site in self.sites for op in site.ops_added}
        return {op: dict(groups) for op, groups in runtime_fallbacks.items() if op in added}

    def summary(self) -> str:
        """A few plain lines: matches per fusion, rejections, failures, run-time fallbacks."""
        final = self.final()
        lines = []
        for name, n in sorted(self.matches.items()):
            fates = "".join(f", {k} {f}" for f, k in sorted(self.fates(name).items()))
            lines.append(f"{name}: {final[name]} site(s)" + (f" ({n} rewritten{fates})" if fates else ""))
        lines += [f"rejected {r.fusion} at {r.module or r.location}: {r.reason}" for r in self.rejected]
        lines += [
            f"unfused candidate at {m.module or m.location}: closest {m.spelling} "
            f"({m.matched}/{m.total} ops), {m.reason}"
            for m in self.near_misses
        ]
        lines += [f"failed: {e}" for e in self.errors]
        lines += [
            f"run time: {op} on group {group!r} took its fallback: {reason}"
            for op, groups in self.runtime_fallbacks().items()
            for group, reason in groups.items()
        ]
        return "\n".join(lines) or "no fusion matched"


def op_name(node: torch.fx.Node) -> str:
    """'aten.mul.Tensor', 'fusion_passes.rms_norm.default', 'getitem' ..."""
    target = node.target
    if isinstance(target, str):
        return target
    name = str(target)
    return getattr(target, "__name__", name) if name.startswith("<") else name


def op_counts(graph: torch.fx.Graph) -> dict[str, int]:
    return dict(Counter(op_name(n) for n in graph.nodes if n.op == "call_function"))


def module_path(node: torch.fx.Node) -> str:
    """The innermost nn.Module path that produced ``node`` ('' if unknown)."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    # Dynamo spells paths as L['self'].model.layers[0]...; keep the dotted module path.
    path = re.sub(r"^L\['(self|fn)'\]\.?", "", path)  # the compiled module itself
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    path = re.sub(r"\._modules\['([^']+)'\]", r".\1", path)
    return path.lstrip(".")


_TORCH_DIR = os.path.dirname(torch.__file__)


def source_location(node: torch.fx.Node) -> str:
    """'modeling_x.py:123 in forward': the innermost frame of the node's stack trace that is
    not inside torch itself (F.rms_norm's own lines say nothing about the model)."""
    frames = _FRAME.findall(node.meta.get("stack_trace") or "")
    user = [f for f in frames if not f[0].startswith(_TORCH_DIR)] or frames
    if not user:
        return ""
    file, line, fn = user[-1]
    return f"{os.path.basename(file)}:{line} in {fn}"
