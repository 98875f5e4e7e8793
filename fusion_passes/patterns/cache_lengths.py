"""Every cache write counter of a decode step advanced by one kernel (fusion cache_lengths).

transformers' StaticCache layers each count the tokens written into them in a 0-d int64 tensor,
advanced by every update: ``self.cumulative_length.add_(kv_length)`` (DeepSeek V3.2's indexer
cache keeps a second counter, ``indexer_cumulative_length``). Functionalized, each is an add whose
result is copied into the counter at the graph's end:

    new = aten.add.Tensor(start, S)        start: the counter itself, or the position an engine
    aten.copy_.default(counter, new)       sets it from (fusion_passes.models.decode.DecodeStep)

and Inductor writes each counter in a kernel of its own: one or two one-thread kernels per layer
(4 for 2 DeepSeek V3.2 layers in Inductor's sm_90 code; 122 a step for its 61 layers). No pattern
can state "every counter of the graph", so this fusion is a rewrite (Fusion.rewrite): the writes'
adds become one ``advance_lengths`` op placed where the writes are, after every read of the
counters' old values, and the copies read its outputs (Inductor launches it writing the counters
in place, so the copies go).
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from fusion_passes.fake_values import insert_call
from fusion_passes.fusion import Fusion, Rewritten
from fusion_passes.lowering.cache_lengths.reference import LENGTH_DTYPES
from fusion_passes.regions import nodes_region
from fusion_passes.report import module_path, source_location

_aten = torch.ops.aten


def _one_int(node) -> bool:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return isinstance(val, torch.Tensor) and val.numel() == 1 and val.dtype in LENGTH_DTYPES


def counter_writes(graph: torch.fx.Graph) -> list[tuple[torch.fx.Node, torch.fx.Node]]:
    """(copy_, add) of each write of ``start + S`` (an int literal) into a 0-d int graph input."""
    writes = []
    for copy in graph.find_nodes(op="call_function", target=_aten.copy_.default):
        counter, new = copy.args[0], copy.args[1]
        if copy.users or counter.op != "placeholder" or not _one_int(counter) or not isinstance(new, torch.fx.Node):
            continue
        if new.target is not _aten.add.Tensor or new.kwargs or len(new.users) != 1 or len(new.args) != 2:
            continue
        start, step = new.args
        if _one_int(start) and isinstance(step, int) and not isinstance(step, bool):
            writes.append((copy, new))
    return writes


def merge_counter_writes(graph: torch.fx.Graph) -> list[Rewritten]:
    """The rewrite (module docstring): one advance_lengths op for the graph's counter writes, where
    there are two or more."""
    writes = counter_writes(graph)
    if len(writes) < 2:
        return []
    first = writes[0][0]  # find_nodes keeps graph order: the first write
    anchor = writes[0][1]
    before = nodes_region([n for pair in writes for n in reversed(pair)])
    module, location = module_path(anchor), source_location(anchor)
    starts = [add.args[0] for _, add in writes]
    counters = [copy.args[0] for copy, _ in writes]
    steps = [add.args[1] for _, add in writes]
    op = insert_call(graph, torch.ops.fusion_passes.advance_lengths.default, (starts, counters, steps), first)
    with graph.inserting_before(first):
        for i, (copy, add) in enumerate(writes):
            out = graph.call_function(operator.getitem, (op, i))
            out.meta["val"] = op.meta["val"][i]
            copy.replace_input_with(add, out)
            graph.erase_node(add)
    after = nodes_region([op, *(copy for copy, _ in writes)])
    return [Rewritten("counter_plus_step", module, location, before, after, (op,))]


CACHE_LENGTHS = Fusion(
    name="cache_lengths",
    summary="every layer's cache write counter (StaticCache cumulative_length += S) -> one advance_lengths kernel",
    doc=__doc__.split("\n\n", 1)[1],
    spellings=(),
    example_inputs=lambda: (),
    rewrite=merge_counter_writes,
    builtin=True,
)

FUSIONS = (CACHE_LENGTHS,)
