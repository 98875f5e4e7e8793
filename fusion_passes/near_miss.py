"""Near misses: candidate sites a fusion did not rewrite, the spelling that came closest, and the
first node where the graph diverged from it.

A fusion names the ops that mark a candidate site (``Fusion.candidate_ops``: ``aten.rsqrt`` for
the RMSNorm family), narrowed by ``Fusion.candidate`` where the op is common elsewhere. After the
passes, every such op still in the graph is a candidate that no
spelling matched. Each spelling is traced with the candidate's dtype and rank, then walked
against the graph from the candidate op outwards (inputs and users, breadth first), comparing
targets, literal arguments and dtypes; the first difference is the reason. The spelling that
walked furthest is reported.
"""

from __future__ import annotations

import inspect
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx

from fusion_passes.fusion import Fusion, Spelling, trace_functional
from fusion_passes.lowering.common.ops import schema_values
from fusion_passes.report import NearMiss, module_path, op_name, source_location

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def find_near_misses(graph: torch.fx.Graph, fusions: Sequence[Fusion], index: int) -> list[NearMiss]:
    by_op: dict[str, list[Fusion]] = {}
    for fusion in fusions:
        for op in fusion.candidate_ops:
            by_op.setdefault(op, []).append(fusion)
    out = []
    for node in graph.nodes:
        if node.op != "call_function" or op_name(node) not in by_op:
            continue
        val = node.meta.get("val")
        if isinstance(val, (tuple, list)) and val:  # a multi-output op (topk): its first output's rank
            val = val[0]
        if not isinstance(val, torch.Tensor):
            continue
        best: tuple[tuple[float, int], int, int, str, Fusion, Spelling] | None = None
        for fusion in by_op[op_name(node)]:
            if fusion.candidate is not None and not fusion.candidate(node):
                continue
            for spelling in fusion.spellings:
                for dtype in _DTYPES:
                    spelled = _trace(fusion, spelling, dtype, val.dim())
                    if spelled is None:
                        continue
                    walk = _Walk(spelling, fusion, spelled)
                    matched, total, reason = walk.run(node, op_name(node))
                    # An op found with other arguments (a canonical op with another form) counts
                    # half: closer than an op not found at all.
                    score = ((matched + 0.5 * walk.same_op) / total, matched)
                    if best is None or score > best[0]:
                        best = (score, matched, total, reason, fusion, spelling)
        if best is not None:
            _score, matched, total, reason, fusion, spelling = best
            out.append(
                NearMiss(
                    fusion.name,
                    spelling.name,
                    index,
                    module_path(node),
                    source_location(node),
                    matched,
                    total,
                    reason,
                )
            )
    return out


_TRACES: dict[tuple[str, str, torch.dtype, int], torch.fx.GraphModule | None] = {}


def _trace(fusion: Fusion, spelling: Spelling, dtype: torch.dtype, rank: int):
    """The spelling traced at ``dtype`` with its leading example tensors raised to ``rank``."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    key = (fusion.name, spelling.name, dtype, rank)
    if key in _TRACES:
        return _TRACES[key]
    example = next(iter(fusion.example_inputs()))
    lead_rank = max((t.dim() for t in example if isinstance(t, torch.Tensor)), default=0)
    # The activations' dtype: the first floating tensor's. Tensors of another dtype keep it (a
    # recurrent state the op wants in fp32, integer ids).
    lead_dtype = next((t.dtype for t in example if isinstance(t, torch.Tensor) and t.dtype.is_floating_point), None)

    def adapt(t: Any, raise_rank: bool = True) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        if raise_rank and t.dim() == lead_rank and rank > lead_rank:
            t = t.reshape((1,) * (rank - lead_rank) + tuple(t.shape))
        return t.to(dtype) if t.dtype == lead_dtype else t

    _TRACES[key] = None  # a spelling that does not trace at this dtype / rank is not the closest
    # Raised to the candidate's rank, else at its own: the candidate op's rank need not be the
    # inputs' (the chunked delta rule's 5-D solve of 4-D inputs).
    for raise_rank in (True, False):
        args = [adapt(t, raise_rank) for t in example]
        with unset_fake_temporarily():
            try:
                _TRACES[key] = trace_functional(spelling.pattern, args)
                break
            except Exception:
                continue
    return _TRACES[key]


def _dtype(node: torch.fx.Node) -> torch.dtype | None:
    val = node.meta.get("val")
    return val.dtype if isinstance(val, torch.Tensor) else None


class _Walk:
    """One spelling walked against the graph from a candidate op."""

    def __init__(self, spelling: Spelling, fusion: Fusion, spelled: torch.fx.GraphModule) -> None:
        self.spelled = spelled
        self.scalars = set(fusion.scalars.values())
        self.strings = set(fusion.string_args.values())  # a process-group name's sentinel
        names = list(inspect.signature(spelling.pattern).parameters)
        placeholders = [n for n in spelled.graph.nodes if n.op == "placeholder"]
        self.names = dict(zip(placeholders, names))  # make_fx may rename them arg0_1 ...
        self.ops = [n for n in spelled.graph.nodes if n.op == "call_function"]

    def run(self, start: torch.fx.Node, op: str) -> tuple[int, int, str]:
        """(spelling ops that lined up, ops in the spelling, the first divergence)."""
        anchors = [n for n in self.ops if op_name(n) == op]
        self.same_op = 0  # divergences at the spelling's own op (its arguments differ)
        if not anchors:  # (a pow(-0.5) norm spelling has no rsqrt)
            return 0, len(self.ops), f"the spelling has no {op}"
        # The spelling's op with the candidate's literal arguments first (of its casts, the one to
        # float8, not the upcast to fp32).
        anchors.sort(key=lambda s: self._compare_args(start, s) is not None)
        self.paired: dict[torch.fx.Node, torch.fx.Node] = {}
        self.bound: dict[torch.fx.Node, torch.fx.Node] = {}
        queue = deque([(start, anchors[0])])
        first = None
        # Breadth first from the candidate; a diverging pair is not expanded but the walk goes
        # on, so ``matched`` counts every op that lines up (the measure of closeness) and the
        # reason is the divergence nearest the candidate.
        while queue:
            g, s = queue.popleft()
            reason = self._step(g, s, queue)
            first = first or reason
        # getitem (an output of a multi-output op) is bookkeeping, not an op of the spelling:
        # counted, it would rank a spelling with a two-output op below a one-output one.
        def ops(nodes):
            return sum(op_name(n) != "getitem" for n in nodes)

        return (
            ops(self.paired),
            ops(self.ops),
            first or self._outside_reader() or "every op lined up and no intermediate is read "
            "elsewhere: the matcher's re-trace on the site's values (shapes, dtypes) did not match",
        )

    def _outside_reader(self) -> str | None:
        """An intermediate of the spelling that the graph also feeds to an op outside it: the
        rewrite would have to keep it, so the pattern does not match (name both, and where)."""
        matched = set(self.paired.values())
        for s, g in self.paired.items():
            if any(u.op == "output" for u in s.users):
                continue  # an output of the spelling: others may read it
            for user in g.users:
                if user not in matched:
                    where = module_path(user) or source_location(user) or "the graph"
                    return (
                        f"every op lined up, but the intermediate {op_name(g)} ({g.name}) is also read "
                        f"by {_describe(user)} ({user.name}, {where}): the rewrite would drop it"
                    )
        return None

    def _step(self, g: torch.fx.Node, s: torch.fx.Node, queue: deque) -> str | None:
        if s in self.paired:
            return None
        if s.op == "placeholder":
            name = self.names.get(s, s.name)
            if self.bound.setdefault(s, g) is not g:
                return f"{name} would be two different values"
            if _dtype(s) is not None and _dtype(g) != _dtype(s):
                return f"{name} is {_dtype(g)}, the spelling expects {_dtype(s)}"
            return None
        if g.op != "call_function" or g.target != s.target:
            return f"expected {op_name(s)}, found {_describe(g)}"
        reason = self._compare_args(g, s)
        self.same_op += reason is not None
        if reason is None and _dtype(g) != _dtype(s):
            reason = self._input_dtype_reason(g, s) or (
                f"{op_name(s)} gives {_dtype(g)}, the spelling {_dtype(s)}"
            )
        if reason is not None:
            return reason
        self.paired[s] = g
        queue.extend((ga, sa) for ga, sa in zip(g.args, s.args) if isinstance(sa, torch.fx.Node))
        used = set(self.paired.values())
        for s_user in s.users:
            if s_user.op != "call_function":
                continue
            if s_user in self.paired:  # reached from the other side already
                if self.paired[s_user] not in g.users:
                    return f"{op_name(s_user)} takes another value than {op_name(s)}"
                continue
            g_user = next((u for u in g.users if u.target == s_user.target and u not in used), None)
            if g_user is None:
                found = ", ".join(sorted({_describe(u) for u in g.users})) or "nothing"
                return f"{op_name(s)} should feed {op_name(s_user)}; here it feeds {found}"
            queue.append((g_user, s_user))
        return None

    def _input_dtype_reason(self, g: torch.fx.Node, s: torch.fx.Node) -> str | None:
        """Name the argument (e.g. the weight) whose dtype differs, when it is one."""
        for ga, sa in zip(g.args, s.args):
            if isinstance(sa, torch.fx.Node) and sa.op == "placeholder" and _dtype(ga) != _dtype(sa):
                name = self.names.get(sa, sa.name)
                return f"{name} is {_dtype(ga)}, the spelling expects {_dtype(sa)}"
        return None

    def _compare_args(self, g: torch.fx.Node, s: torch.fx.Node) -> str | None:
        g_args, s_args = _schema_args(g), _schema_args(s)
        if len(g_args) != len(s_args):
            return f"{op_name(s)} has {len(g_args)} arguments, the spelling {len(s_args)}"
        for i, (ga, sa) in enumerate(zip(g_args, s_args)):
            if isinstance(sa, torch.fx.Node):
                if not isinstance(ga, torch.fx.Node):
                    return f"{op_name(s)} argument {i} is the constant {ga!r}"
            elif isinstance(sa, (int, float)) and not isinstance(sa, bool) and sa in self.scalars:
                continue  # a scalar pattern argument (eps, top_k): any value matches
            elif isinstance(sa, str) and sa in self.strings and isinstance(ga, str):
                continue  # a string pattern argument (the group name): any name matches
            elif ga != sa:
                return f"{op_name(s)} argument {i} is {ga!r}, the spelling has {sa!r}"
        return None


def _schema_args(node: torch.fx.Node) -> list[Any]:
    """An op call's arguments with the defaults it left out filled in: a trace drops trailing
    arguments equal to their defaults (rms_norm's weight_offset=0.0), a fused op's call in the graph
    may spell them out."""
    if isinstance(node.target, torch._ops.OpOverload):
        return schema_values(node.target, node.args, node.kwargs)
    return list(node.args)


def _describe(node: torch.fx.Node) -> str:
    if node.op != "call_function":
        return f"the graph input {node.name}"
    if op_name(node) == "getitem" and isinstance(node.args[0], torch.fx.Node):
        return f"an output of {op_name(node.args[0])}"
    return op_name(node)
