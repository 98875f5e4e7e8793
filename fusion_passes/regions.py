"""Small graphs of a rewritten region, before and after, as plain data for the reports.

    {"nodes": [{"id": "n3", "label": "aten.rsqrt.default", "kind": "op"}, ...],
     "edges": [["n1", "n3"], ...]}                  kind: "input" | "op" | "output"
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.fx
from torch._inductor.pattern_matcher import Match

from fusion_passes.report import op_name

Region = dict[str, list[Any]]


def _label(node: torch.fx.Node, dtypes: bool = True) -> str:
    val = node.meta.get("val") if dtypes else None
    dtype = f" : {str(val.dtype).removeprefix('torch.')}" if isinstance(val, torch.Tensor) else ""
    return f"{op_name(node)}{dtype}"


def match_region(match: Match, argnames: Sequence[str]) -> Region:
    """The matched subgraph: its argument nodes, the matched ops, and its outputs."""
    names = {v: k for k, v in match.kwargs.items() if isinstance(v, torch.fx.Node)}
    order = {n: i for i, n in enumerate(match.graph.nodes)}
    ops = sorted(set(match.nodes), key=order.__getitem__)
    ids: dict[torch.fx.Node, str] = {}
    nodes, edges = [], []
    for name in argnames:
        value = match.kwargs.get(name)
        if isinstance(value, torch.fx.Node):
            ids[value] = f"in_{name}"
            nodes.append({"id": ids[value], "label": name, "kind": "input"})
    for i, node in enumerate(ops):
        ids[node] = f"n{i}"
        nodes.append({"id": ids[node], "label": _label(node), "kind": "op"})
        for arg in node.all_input_nodes:
            if arg in ids:
                edges.append([ids[arg], ids[node]])
            elif arg in names:  # an argument the pattern saw twice
                edges.append([f"in_{names[arg]}", ids[node]])
    for j, out in enumerate(n for n in match.output_nodes() if n is not None):
        nodes.append({"id": f"out{j}", "label": f"output {j}", "kind": "output"})
        edges.append([ids[out], f"out{j}"])
    return {"nodes": nodes, "edges": edges}


def graph_region(gm: torch.fx.GraphModule, argnames: Sequence[str]) -> Region:
    """A traced replacement as a region (placeholders named after the pattern's arguments; no
    dtypes: it was traced on example inputs, not on the site's)."""
    ids: dict[torch.fx.Node, str] = {}
    nodes, edges = [], []
    names = iter(argnames)
    for i, node in enumerate(gm.graph.nodes):
        if node.op == "placeholder":
            name = next(names, node.name)
            if node.users:
                ids[node] = f"in_{name}"
                nodes.append({"id": ids[node], "label": name, "kind": "input"})
        elif node.op == "call_function":
            ids[node] = f"n{i}"
            nodes.append({"id": ids[node], "label": _label(node, dtypes=False), "kind": "op"})
            edges += [[ids[a], ids[node]] for a in node.all_input_nodes if a in ids]
        elif node.op == "output":
            outs = node.args[0] if isinstance(node.args[0], (tuple, list)) else [node.args[0]]
            for j, out in enumerate(outs):
                nodes.append({"id": f"out{j}", "label": f"output {j}", "kind": "output"})
                edges.append([ids[out], f"out{j}"])
    return {"nodes": nodes, "edges": edges}


def nodes_region(ops: Sequence[torch.fx.Node]) -> Region:
    """The region of ``ops`` (graph nodes, in graph order): the nodes they read from outside it as
    inputs, named after the nodes; for a rewrite that is not a pattern's match (Fusion.rewrite)."""
    ids: dict[torch.fx.Node, str] = {}
    nodes, edges = [], []
    for i, node in enumerate(ops):
        for arg in node.all_input_nodes:
            if arg not in ids and arg not in ops:
                ids[arg] = f"in_{arg.name}"
                nodes.append({"id": ids[arg], "label": arg.name, "kind": "input"})
        ids[node] = f"n{i}"
        nodes.append({"id": ids[node], "label": _label(node), "kind": "op"})
        edges += [[ids[a], ids[node]] for a in node.all_input_nodes]
    return {"nodes": nodes, "edges": edges}


def region_ops(region: Region) -> tuple[str, ...]:
    """The op names of a region, without dtypes and getitems."""
    ops = (n["label"].split(" : ")[0] for n in region["nodes"] if n["kind"] == "op")
    return tuple(op for op in ops if op != "getitem")
