"""The pass manager: Inductor's ``post_grad_custom_post_pass`` running the enabled fusions.

It applies each fusion's pattern pass in registry order on the post-grad graph, records every
rewritten site in the Report, and keeps a failing fusion from breaking the compile: the graph is
restored to what it was before that fusion and a warning is raised (``strict=True`` re-raises).
``uuid()`` hashes the enabled fusions' sources, the canonical ops' sources and the options, so
Inductor's FX graph cache stays on and never serves a graph compiled under other fusions.
"""

from __future__ import annotations

import hashlib
import inspect
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.pattern_matcher import Match

import fusion_passes
from fusion_passes.registry import (
    Fusion,
    Spelling,
    match_handler,
    pattern_pass,
    trace_functional,
)
from fusion_passes.report import (
    GraphRecord,
    Rejection,
    Report,
    Site,
    module_path,
    op_counts,
    op_name,
    source_location,
)
from fusion_passes.verify import Unverifiable, verify_match


class FusionPassManager(CustomGraphPass):
    """Apply ``fusions`` to every post-grad graph Inductor compiles."""

    def __init__(
        self,
        fusions: Sequence[Fusion],
        report: Report | None = None,
        verify: bool = False,
        strict: bool = False,
    ) -> None:
        self.fusions = list(fusions)
        self.report = report if report is not None else Report()
        self.verify = verify
        self.strict = strict
        self._pending: list[tuple[Fusion, Spelling, Match]] = []
        self._graph_index = 0

    # -- CustomGraphPass ------------------------------------------------------------------------

    def uuid(self) -> str:
        h = hashlib.sha256()
        h.update(fusion_passes.__version__.encode())
        for module in _FRAMEWORK_MODULES():
            h.update(inspect.getsource(module).encode())
        for fusion in self.fusions:
            h.update(fusion.source_hash().encode())
        h.update(repr((self.verify, self.strict)).encode())
        return h.hexdigest()

    def __call__(self, graph: torch.fx.Graph) -> None:
        index = self._graph_index
        self._graph_index += 1
        before = op_counts(graph)
        with match_handler(self._on_match):
            for fusion in self.fusions:
                self._apply(fusion, graph, index)
        self.report.graphs.append(GraphRecord(before, op_counts(graph)))

    # -- internals ------------------------------------------------------------------------------

    def _apply(self, fusion: Fusion, graph: torch.fx.Graph, index: int) -> None:
        snapshot = _snapshot(graph)
        self._pending = []
        try:
            matcher = pattern_pass(fusion)
            count = matcher.apply(graph)  # type: ignore[arg-type]
            graph.lint()
        except Exception as e:  # a broken fusion must not break the user's compile
            _restore(graph, snapshot)
            if self.strict:
                raise
            message = f"fusion {fusion.name!r} failed and was skipped ({type(e).__name__}: {e})"
            self.report.errors.append(message)
            warnings.warn(f"fusion_passes: {message}; graph left unchanged", stacklevel=2)
            return
        assert count == len(self._pending), (count, len(self._pending))
        for f, spelling, match in self._pending:
            anchor = _anchor(match)
            self.report.sites.append(
                Site(
                    fusion=f.name,
                    spelling=spelling.name,
                    graph=index,
                    module=module_path(anchor),
                    location=source_location(anchor),
                    ops_removed=tuple(
                        op_name(n) for n in match.nodes if n.op == "call_function"
                    ),
                    ops_added=_replacement_ops(f, spelling),
                )
            )
        self.report.matches[fusion.name] += count

    def _on_match(self, fusion: Fusion, spelling: Spelling, match: Match) -> bool:
        """Last word on a candidate that matched a spelling structurally (dtypes included)."""
        values = {
            k: (v.meta.get("val") if isinstance(v, torch.fx.Node) else v)
            for k, v in match.kwargs.items()
        }
        reason = None
        for check in (fusion.check, spelling.check):
            if reason is None and check is not None:
                reason = check(values)
        if reason is None and self.verify:
            argnames = list(inspect.signature(spelling.pattern).parameters)
            try:
                reason = verify_match(match, argnames, spelling.replacement)
                if reason is not None:
                    reason = f"verify: {reason}"
            except Unverifiable as e:
                reason = f"verify: cannot check on real inputs ({e})"
        if reason is not None:
            anchor = _anchor(match)
            self.report.rejected.append(
                Rejection(
                    fusion.name,
                    spelling.name,
                    self._graph_index - 1,
                    module_path(anchor),
                    source_location(anchor),
                    reason,
                )
            )
            return False
        self._pending.append((fusion, spelling, match))
        return True


def _FRAMEWORK_MODULES() -> list[Any]:
    """Modules whose code decides what a rewritten graph computes."""
    from fusion_passes import pass_manager, registry, verify
    from fusion_passes.lowering import rms_norm, rms_norm_reference

    return [pass_manager, registry, verify, rms_norm, rms_norm_reference]


def _anchor(match: Match) -> torch.fx.Node:
    outputs = [n for n in match.output_nodes() if n is not None]
    return outputs[0] if outputs else match.nodes[-1]


_REPLACEMENT_OPS: dict[tuple[str, str], tuple[str, ...]] = {}


def _replacement_ops(fusion: Fusion, spelling: Spelling) -> tuple[str, ...]:
    """The ops a spelling's replacement adds (traced once on the fusion's example inputs)."""
    key = (fusion.name, spelling.name)
    if key not in _REPLACEMENT_OPS:
        example = next(iter(fusion.example_inputs()))
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        with unset_fake_temporarily():
            gm = trace_functional(spelling.replacement, list(example))
        _REPLACEMENT_OPS[key] = tuple(
            op_name(n)
            for n in gm.graph.nodes
            if n.op == "call_function" and op_name(n) != "getitem"
        )
    return _REPLACEMENT_OPS[key]


def _snapshot(graph: torch.fx.Graph) -> tuple[torch.fx.Graph, dict[torch.fx.Node, torch.fx.Node]]:
    """A copy of the graph, and the map from its placeholders back to the live ones."""
    copy = torch.fx.Graph()
    val_map: dict[torch.fx.Node, torch.fx.Node] = {}
    out = copy.graph_copy(graph, val_map)
    copy.output(out)
    back = {v: k for k, v in val_map.items() if k.op == "placeholder"}
    return copy, back


def _restore(
    graph: torch.fx.Graph,
    snapshot: tuple[torch.fx.Graph, dict[torch.fx.Node, torch.fx.Node]],
) -> None:
    """Put the snapshot's nodes back, keeping the live placeholders (Inductor holds them)."""
    copy, back = snapshot
    for node in reversed(list(graph.nodes)):  # users go before the nodes they use
        if node.op != "placeholder":
            graph.erase_node(node)
    env = dict(back)
    for node in copy.nodes:
        if node.op == "placeholder":
            continue
        if node.op == "output":
            graph.output(torch.fx.map_arg(node.args[0], env.__getitem__))
        else:
            env[node] = graph.node_copy(node, env.__getitem__)
    graph.lint()
