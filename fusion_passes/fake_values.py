"""The fake values below the rewrites, recomputed.

A replacement's nodes carry the fake values (shapes, strides) their trace gave them; the nodes
that read them keep the values the model's graph gave theirs. Where a fused op lays its output out
otherwise than the subgraph it replaced, the views below it record strides the buffer no longer
has: causal_conv1d_after_state's op writes [B, C, T] where the conv over the cache's cat left a
slice of [B, C, 4 + T] (strides (C * (4 + T), 4 + T, 1) recorded, (C * T, T, 1) real). Inductor
reads those recorded strides: a custom op's default stride-order constraint takes its arguments'
stride order from them, and a Triton launch that direct_launch inlines is traced on them, its
strides baked into the launch's arguments.

``refresh_fake_values`` recomputes, in graph order, the value of every node below a fused op from
its inputs' values, and goes on below a node only while its value changed.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx
from torch._guards import detect_fake_mode


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return (
            a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype
            and a.device == b.device and a.storage_offset() == b.storage_offset()
        )  # fmt: skip
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b)


def _recomputable(node: torch.fx.Node) -> bool:
    """An op whose value follows from its inputs' alone: getitem, or an aten op that writes none
    of its inputs (a mutation would write the fake inputs; Inductor's own nodes are functional
    here, but the graph's copy_ epilogue writes its placeholders)."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return True
    if not isinstance(node.target, torch._ops.OpOverload) or node.target.namespace != "aten":
        return False
    return not node.target._schema.is_mutable


def refresh_fake_values(graph: torch.fx.Graph) -> int:
    """Recompute the fake values below the fused ops (``fusion_passes::*``); returns how many
    nodes' values changed."""
    vals = [n.meta.get("val") for n in graph.nodes if n.op == "placeholder"]
    fake_mode = detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])
    if fake_mode is None:
        return 0
    changed: set[torch.fx.Node] = set()
    count = 0
    with fake_mode:
        for node in graph.nodes:
            if node.op == "call_function" and str(node.target).startswith("fusion_passes."):
                changed.add(node)  # its users read a value its trace gave it
                continue
            if not any(arg in changed for arg in node.all_input_nodes) or not _recomputable(node):
                continue
            args, kwargs = torch.fx.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
            try:
                val = node.target(*args, **kwargs)
            except Exception:  # an op the fake mode cannot run: its value stays, its users too
                continue
            if _same(val, node.meta.get("val")):
                continue
            node.meta["val"] = val
            node.meta.pop("tensor_meta", None)  # derived from the old value; Inductor reads "val"
            changed.add(node)
            count += 1
    return count


def insert_call(graph: torch.fx.Graph, target: Any, args: tuple, before: torch.fx.Node) -> torch.fx.Node:
    """A call of ``target`` on ``args`` (nodes, lists of nodes, literals) inserted before ``before``,
    its fake value computed from its arguments' under their fake mode, and ``before``'s provenance
    (stack trace, module path) for the report: the fused op of a graph rewrite (Fusion.rewrite)."""
    values = torch.fx.map_arg(args, lambda n: n.meta["val"])
    tensors = [v for v in torch.utils._pytree.tree_leaves(values) if isinstance(v, torch.Tensor)]
    with graph.inserting_before(before):
        node = graph.call_function(target, args)
    with detect_fake_mode(tensors):
        node.meta["val"] = target(*values)
    for key in ("stack_trace", "nn_module_stack"):
        if key in before.meta:
            node.meta[key] = before.meta[key]
    return node
