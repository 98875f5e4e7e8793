"""The lower-back stage: canonical ops that no region fusion consumed become plain torch again.

The raise stage turns each spelling of a norm, a RoPE or an FP8 quantization into one canonical op
so that the region fusions see one form. A canonical op left standalone afterwards would reach
Inductor as an opaque call: Inductor could no longer fuse it with its neighbours (the cast or
quantization after a norm, the add before it), and the graph would keep one kernel more than stock
Inductor. So each one left is decomposed back into its reference (``LOWER_BACK``, filled by
``op_from_reference(lower_back=True)``), which reproduces the raised spelling bit for bit:

    Unfused: y = fusion_passes.rms_norm(x, w, eps, 0.0, True)          (one opaque call)
    Lowered: h = f32(x); y = w * (h * rsqrt(mean(h^2, -1) + eps)).to(x.dtype)   (aten, fusable)

Inductor's own matcher does the rewrite (``CallFunctionVarArgs`` + ``Match.replace_by_example``,
as its post-grad decompositions do), so the new nodes carry the fake values it needs.
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.fx
from torch._inductor.pattern_matcher import (
    CallFunctionVarArgs,
    Match,
    PatternMatcherPass,
    register_graph_pattern,
)

from fusion_passes.lowering.common.ops import LOWER_BACK, schema_values
from fusion_passes.report import op_name


def lower_back(graph: torch.fx.Graph) -> Counter:
    """Decompose every canonical op of ``LOWER_BACK`` in ``graph`` into its reference, in place;
    returns how many calls of each op (by name) were lowered."""
    lowered: Counter = Counter()
    present = {n.target for n in graph.nodes if n.op == "call_function" and n.target in LOWER_BACK}
    if not present:
        return lowered
    patterns = PatternMatcherPass(pass_name="fusion_passes_lower_back")
    for target in present:
        _register(target, patterns, lowered)
    patterns.apply(graph)
    graph.eliminate_dead_code()
    return lowered


def _register(target, patterns: PatternMatcherPass, lowered: Counter) -> None:
    reference = LOWER_BACK[target]

    @register_graph_pattern(CallFunctionVarArgs(target), pass_dict=patterns)
    def _(match: Match, *args, **kwargs) -> None:
        # Bind by the schema so defaults a call left out reach the reference as the op saw them.
        values = schema_values(target, args, kwargs)
        tensors = [i for i, v in enumerate(values) if isinstance(v, torch.fx.Node)]

        def replacement(*nodes):
            full = list(values)
            for i, node in zip(tensors, nodes, strict=True):
                full[i] = node
            return reference(*full)

        name = op_name(match.nodes[0])
        match.replace_by_example(replacement, [values[i] for i in tensors])
        lowered[name] += 1
