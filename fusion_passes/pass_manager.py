"""The pass manager: Inductor's ``post_grad_custom_post_pass`` running the enabled fusions.

It applies each fusion's pattern pass in registry order on the post-grad graph, records every
rewritten site in the Report, and keeps a failing fusion from breaking the compile: the graph is
restored to what it was before that fusion and a warning is raised (``strict=True`` re-raises).
After the fusions: the fake values below the fused ops recomputed, Inductor's no-op removal run
again on them (a clone whose input a fused op already lays out as the clone would goes), and the
fused ops' Triton launches inlined.
``uuid()`` hashes the enabled fusions' sources, the canonical ops' sources and the options, so
Inductor's FX graph cache stays on and never serves a graph compiled under other fusions.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib
import inspect
import pkgutil
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx
from torch._functorch.compile_utils import fx_graph_cse
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.fx_passes.post_grad import remove_noop_ops
from torch._inductor.pattern_matcher import Match, stable_topological_sort

import fusion_passes
from fusion_passes.fake_values import refresh_fake_values
from fusion_passes.lower_back import lower_back
from fusion_passes.lowering.common.direct_launch import inline_triton_launches
from fusion_passes.lowering.common.ops import LOWER_BACK
from fusion_passes.near_miss import find_near_misses
from fusion_passes.regions import Region, graph_region, match_region, region_ops
from fusion_passes.fusion import (
    Fusion,
    NotASite,
    Spelling,
    enabled_fusions,
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


# node.meta key: the index in Report.sites of the rewrite that created a fusion_passes op node,
# so a later fusion consuming it (or the lowering back) is recorded as that site's fate.
SITE_KEY = "fusion_passes_site"

# "direct": CUDA canonical ops become Inductor-emitted Triton launches; "dispatch": they stay
# custom-op calls through the dispatcher. CPU always runs the reference through the dispatcher.
LAUNCH_MODES = ("direct", "dispatch")


class FusionPassManager(CustomGraphPass):
    """Apply ``fusions`` to every post-grad graph Inductor compiles."""

    def __init__(
        self,
        fusions: Sequence[Fusion],
        report: Report | None = None,
        verify: bool = False,
        strict: bool = False,
        launch: str = "direct",
        lower_back: bool = True,
    ) -> None:
        if launch not in LAUNCH_MODES:
            raise ValueError(f"launch must be one of {', '.join(LAUNCH_MODES)}, got {launch!r}")
        self.launch = launch
        self.lower_back = lower_back
        self.fusions = list(fusions)
        self.report = report if report is not None else Report()
        self.verify = verify
        self.strict = strict
        self._pending: list[tuple[Fusion, Spelling, Match, Region, str, str]] = []
        self._tag: tuple[int, int] | None = None  # (pass token, pending index) of the last match
        self._taken: list[tuple[int, str]] = []  # (site index, fusion) consumed by this pass

    # -- CustomGraphPass ------------------------------------------------------------------------

    @functools.cache  # noqa: B019  (one manager per backend; its fusions and sources are fixed)
    def uuid(self) -> str:
        h = hashlib.sha256()
        h.update(fusion_passes.__version__.encode())
        for name in _FRAMEWORK_MODULES:
            h.update(inspect.getsource(importlib.import_module(name)).encode())
        for fusion in self.fusions:
            h.update(fusion.source_hash().encode())
        h.update(repr((self.verify, self.strict, self.launch, self.lower_back)).encode())
        return h.hexdigest()

    def __call__(self, graph: torch.fx.Graph) -> None:
        index = len(self.report.graphs)
        first_error = len(self.report.errors)
        before = op_counts(graph)
        deduplicated = False
        with match_handler(self._on_match), enabled_fusions(f.name for f in self.fusions):
            for fusion in self.fusions:
                if fusion.cse_before and not deduplicated and _holds_any(graph, fusion.cse_when):
                    # Identical subgraphs computed twice (an activation quantized once per
                    # projection that reads it: q / k / v, gate / up) become one, so the norm
                    # feeding them has one consumer to fuse with. AOTAutograd leaves them
                    # duplicated in inference graphs.
                    deduplicated = True
                    self._guarded(
                        "common subexpression elimination",
                        lambda: eliminate_common_subexpressions(graph),
                        graph,
                    )
                if fusion.canonicalize is not None:
                    self._guarded(
                        f"canonicalization of {fusion.name!r}",
                        lambda fusion=fusion: fusion.canonicalize(graph),
                        graph,
                    )
                self._apply(fusion, graph, index)
        self._guarded(
            "near-miss analysis",
            lambda: self.report.near_misses.extend(find_near_misses(graph, self.fusions, index)),
            graph,
        )
        lowered = None
        if self.lower_back:
            # Canonical ops no region fusion consumed: back to plain torch, for Inductor to fuse
            # with their neighbours (an opaque standalone norm costs a kernel; see lower_back).
            standalone = [
                n.meta.get(SITE_KEY) for n in graph.nodes if n.op == "call_function" and n.target in LOWER_BACK
            ]
            lowered = self._guarded("lowering back", lambda: lower_back(graph), graph)
            if lowered is not None:
                self._set_fates([(i, "lowered back") for i in standalone if isinstance(i, int)])
        # The report shows the canonical ops; how they launch is the lowering's business.
        after = op_counts(graph)
        # Before the launches are inlined (traced on these values) and Inductor reads the strides.
        refreshed = self._guarded("fake value refresh", lambda: refresh_fake_values(graph), graph)
        if refreshed:
            # Inductor removed its no-op clones before these passes, on the old values: a clone of
            # a value a fused op now lays out as the clone would is one (a prefill's attention
            # output, [B, S, H, D] in memory, through transformers' transpose(1, 2).contiguous():
            # a copy of 63 us per layer at DeepSeek V3.2's 4096 tokens on one H200).
            self._guarded("no-op removal", lambda: remove_noop_ops(graph), graph)
        if self.launch == "direct":
            self._guarded("direct Triton launch", lambda: inline_triton_launches(graph), graph)
        fusions = tuple(f.name for f in self.fusions)
        errors = tuple(self.report.errors[first_error:])
        self.report.graphs.append(
            GraphRecord(before, after, fusions, errors, lowered_back=dict(lowered or {}))
        )

    # -- internals ------------------------------------------------------------------------------

    def _guarded(self, what: str, step: Any, graph: torch.fx.Graph) -> Any:
        """Run ``step``; if it raises, restore the graph and warn (``strict``: re-raise)."""
        snapshot = _snapshot(graph)
        try:
            result = step()
            # A replacement with several outputs goes before its earliest output (the matcher's
            # rule), which may precede some of its inputs (k's projection after q's RoPE; cos/sin
            # that Inductor moved down to their first use): sort before the next fusion reads it.
            stable_topological_sort(graph)
            graph.lint()
            return result
        except Exception as e:  # a broken fusion must not break the user's compile
            _restore(graph, snapshot)
            if self.strict:
                raise
            message = f"{what} failed and was skipped ({type(e).__name__}: {e})"
            self.report.errors.append(message)
            warnings.warn(f"fusion_passes: {message}; graph left unchanged", stacklevel=3)
            return None

    def _apply(self, fusion: Fusion, graph: torch.fx.Graph, index: int) -> None:
        if fusion.applies_to is not None and not fusion.applies_to(graph):
            self.report.matches[fusion.name] += 0  # it ran: the graph holds no site of it
            return
        if fusion.rewrite is not None:
            self._apply_rewrite(fusion, graph, index)
            return
        self._pending, self._taken = [], []
        token = id(self._pending)
        module = graph.owning_module

        def tag(node: torch.fx.Node) -> None:
            # The matcher applies each accepted match right after _on_match: the fused op nodes
            # created now are that match's replacement.
            if self._tag is not None and node.op == "call_function" and str(node.target).startswith("fusion_passes."):
                node.meta[SITE_KEY] = self._tag

        if module is not None:
            module._register_create_node_hook(tag)
        try:
            count = self._guarded(
                f"fusion {fusion.name!r}", lambda: pattern_pass(fusion, graph).apply(graph), graph
            )
        finally:
            self._tag = None
            if module is not None:
                module._unregister_create_node_hook(tag)
        if count is None:
            return
        # Site indices: the pending matches become sites in reverse order, from len(sites) on.
        first, last = len(self.report.sites), len(self.report.sites) + len(self._pending) - 1
        for node in graph.nodes:
            t = node.meta.get(SITE_KEY)
            if isinstance(t, tuple) and t[0] == token:
                node.meta[SITE_KEY] = last - t[1]
        self._set_fates([(i, f"taken by {name}") for i, name in self._taken if i < first])
        # The matches the pass applied, one per count; the matcher walks the graph backwards.
        for f, spelling, match, before, module_name, location in reversed(self._pending):
            after = _replacement_region(f, spelling)
            self.report.add_site(
                Site(
                    fusion=f.name,
                    spelling=spelling.name,
                    graph=index,
                    module=module_name,
                    location=location,
                    ops_removed=region_ops(before),
                    ops_added=region_ops(after),
                    scalars={
                        k: v for k, v in match.kwargs.items() if isinstance(v, (int, float))
                    },
                    before=before,
                    after=after,
                )
            )
        self.report.matches[fusion.name] += 0  # a fusion that ran shows up, even with 0 sites

    def _apply_rewrite(self, fusion: Fusion, graph: torch.fx.Graph, index: int) -> None:
        """A fusion that rewrites the graph itself (Fusion.rewrite): its sites into the report, the
        fused ops of earlier sites that it consumed marked taken by it."""
        tagged = {n: n.meta[SITE_KEY] for n in graph.nodes if isinstance(n.meta.get(SITE_KEY), int)}
        done = self._guarded(f"fusion {fusion.name!r}", lambda: fusion.rewrite(graph), graph)
        if done is None:
            return
        left = set(graph.nodes)
        self._set_fates([(i, f"taken by {fusion.name}") for n, i in tagged.items() if n not in left])
        for site in done:
            for node in site.added:
                node.meta[SITE_KEY] = len(self.report.sites)
            self.report.add_site(
                Site(fusion=fusion.name, spelling=site.spelling, graph=index, module=site.module,
                     location=site.location, ops_removed=region_ops(site.before), ops_added=region_ops(site.after),
                     before=site.before, after=site.after)  # fmt: skip
            )
        self.report.matches[fusion.name] += 0

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
        if reason is None and fusion.match_check is not None:
            reason = fusion.match_check(match)
        if isinstance(reason, NotASite):
            return False
        if reason is None and self.verify:
            try:
                reason = verify_match(match, _argnames(spelling), spelling.replacement,
                                      outputs_agree=fusion.verify_outputs, inputs_like=fusion.verify_inputs)  # fmt: skip
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
                    len(self.report.graphs),
                    module_path(anchor),
                    source_location(anchor),
                    reason,
                )
            )
            return False
        # The matched nodes are erased once the pass applies the match: record them now.
        anchor = _anchor(match)
        region = match_region(match, _argnames(spelling))
        for node in match.nodes:  # fused ops of earlier rewrites that this region consumes
            site = node.meta.get(SITE_KEY)
            if isinstance(site, int):
                self._taken.append((site, fusion.name))
        self._pending.append(
            (fusion, spelling, match, region, module_path(anchor), source_location(anchor))
        )
        self._tag = (id(self._pending), len(self._pending) - 1)
        return True

    def _set_fates(self, fates: list[tuple[int, str]]) -> None:
        for i, fate in fates:
            if 0 <= i < len(self.report.sites) and not self.report.sites[i].fate:
                self.report.sites[i] = dataclasses.replace(self.report.sites[i], fate=fate)


# Modules whose code decides what a rewritten graph computes or launches.
_FRAMEWORK_MODULES = (
    "fusion_passes.pass_manager",
    "fusion_passes.fusion",
    "fusion_passes.fusion_order",
    "fusion_passes.registry",
    "fusion_passes.verify",
    "fusion_passes.near_miss",
    "fusion_passes.lower_back",
    # The spellings several pattern modules share (a fusion's hash holds its own module only):
    # the cache writes, and the decode step's causal mask
    "fusion_passes.patterns.cache_writes",
    "fusion_passes.patterns.causal_masks",
    # Every lowering module (ops, references, kernels, launchers): they decide the compiled code.
    *(
        m.name
        for m in pkgutil.walk_packages(
            importlib.import_module("fusion_passes.lowering").__path__, "fusion_passes.lowering."
        )
        if not m.ispkg
    ),
    "fusion_passes.regions",
)


def _holds_any(graph: torch.fx.Graph, ops: tuple[str, ...]) -> bool:
    """Whether the graph calls one of ``ops`` (by name); True for no ops."""
    if not ops:
        return True
    return any(n.op == "call_function" and op_name(n) in ops for n in graph.nodes)


def _anchor(match: Match) -> torch.fx.Node:
    outputs = [n for n in match.output_nodes() if n is not None]
    return outputs[0] if outputs else match.nodes[-1]


_REPLACEMENTS: dict[tuple[str, str], Region] = {}


def _replacement_region(fusion: Fusion, spelling: Spelling) -> Region:
    """What a spelling's replacement adds (traced once, on the fusion's example inputs)."""
    key = (fusion.name, spelling.name)
    if key not in _REPLACEMENTS:
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        example = next(iter(fusion.example_inputs()))
        with unset_fake_temporarily():
            gm = trace_functional(spelling.replacement, list(example))
        _REPLACEMENTS[key] = graph_region(gm, _argnames(spelling))
    return _REPLACEMENTS[key]


def _argnames(spelling: Spelling) -> list[str]:
    return list(inspect.signature(spelling.pattern).parameters)


def eliminate_common_subexpressions(graph: torch.fx.Graph) -> int:
    """Inductor's own CSE (functorch's fx_graph_cse: pure ops only, random ops and outputs'
    storages kept apart), applied in place; returns the number of nodes removed."""
    count = len(graph.nodes)
    deduplicated = fx_graph_cse(graph)
    if len(deduplicated.nodes) == count:
        return 0
    live = [n for n in graph.nodes if n.op == "placeholder"]
    new = [n for n in deduplicated.nodes if n.op == "placeholder"]
    _restore(graph, (deduplicated, dict(zip(new, live, strict=True))))
    return count - len(graph.nodes)


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
    doomed = [node for node in graph.nodes if node.op != "placeholder"]
    for node in doomed:  # drop every use first: a failed step may have left the graph unsorted
        node.args, node.kwargs = (), {}
    for node in doomed:
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
