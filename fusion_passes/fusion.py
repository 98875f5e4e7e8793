"""What a fusion is, and how its spellings become one traced pattern pass.

A fusion is a list of *spellings* (plain torch functions written the way model code writes the
unfused computation) each paired with a *replacement* (a call of one canonical fused op). The
spellings are traced with Inductor's pattern matcher (``register_replacement``, functionalized
``fwd_only``) the first time a fusion is used, so importing the package stays cheap.

The pattern modules (``fusion_passes.patterns``) build ``Fusion`` objects from this module; the
order they run in is ``fusion_passes.fusion_order``; ``fusion_passes.registry`` holds them (and a
user's own) by name.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import inspect
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._inductor.decomposition import select_decomp_table
from torch._inductor.pattern_matcher import (
    Match,
    PatternMatcherPass,
    fwd_only,
    fx_to_pattern,
    gen_pattern,
    is_match,
    is_mutation_op,
    register_replacement,
)
from torch._subclasses.fake_tensor import unset_fake_temporarily

# A spelling's scalar arguments (eps, offsets) are traced with these sentinel values and become
# pattern arguments, so one pattern matches every eps. 2**-17 is exact in fp32/bf16/fp16 (an eps
# that went through a float32 cast, as F.rms_norm does, keeps the sentinel intact).
DEFAULT_SCALAR_SENTINEL = 2.0**-17

# The floating dtypes a user's fusion is traced at by default (``register_fusion(dtypes=...)``):
# a bf16 or fp16 graph keeps casts (F.silu, F.rms_norm upcast) that an fp32 graph lacks.
FLOAT_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)


class FusionError(ValueError):
    """A fusion was registered or requested wrongly."""


CheckFn = Callable[[dict[str, Any]], "str | None"]


class NotASite(str):
    """A check's reason for a candidate that is no site at all, recorded nowhere: the matcher,
    retrying after a refusal, bound one branch of a two-branch pattern to the other's nodes."""


@dataclass(frozen=True)
class GraphExample:
    """An example ``Fusion.graph_examples`` read off a graph, with the names of the spellings the
    graph can hold there (None: all): a graph holds one form of code the spellings cover, and at
    real sizes each trace costs seconds (a 4096-token chunked rule: 4.5 to 7 s a spelling)."""

    args: tuple[Any, ...]
    spellings: frozenset[str] | None = None


@dataclass(frozen=True)
class Rewritten:
    """One site a ``Fusion.rewrite`` changed, recorded before its nodes were erased (the report's Site)."""

    spelling: str
    module: str  # nn.Module path of the site's anchor node
    location: str  # "file.py:123 in forward" of the anchor's model line
    before: dict  # the replaced region (regions.py format)
    after: dict  # what replaced it
    added: tuple[torch.fx.Node, ...] = ()  # the fused op nodes it put in the graph (the site's, in the report)


@dataclass(frozen=True)
class Spelling:
    """One unfused spelling, the fused call that replaces it, and an optional extra check.

    ``check(values)`` gets the matched arguments by name (fake tensors with the real shapes and
    dtypes, and scalars) and returns ``None`` to accept or a one-line reason to reject.
    """

    name: str
    pattern: Callable[..., Any]
    replacement: Callable[..., Any]
    check: CheckFn | None = None


@dataclass
class Fusion:
    """A named fusion: spellings → one canonical op, with the checks a match must pass.

    ``check`` applies to every spelling (see ``Spelling.check``); a rejected match keeps its
    reason for the report.
    """

    name: str
    summary: str
    doc: str
    spellings: tuple[Spelling, ...]
    example_inputs: Callable[[], Iterable[Sequence[Any]]]
    scalars: dict[str, float] = field(default_factory=dict)
    check: CheckFn | None = None
    # A check that needs the graph around the match (what reads the matched outputs): gets the
    # Match and returns None to accept or a one-line reason to reject; runs after ``check``.
    match_check: Callable[[Any], "str | None"] | None = None
    # Ops that mark a candidate site ("aten.rsqrt.default" for norms): one left in the graph after
    # the passes is a near miss, reported with the closest spelling and where it diverged.
    candidate_ops: tuple[str, ...] = ()
    # Narrows candidate_ops where the op alone is common elsewhere: a node of one of those ops is
    # a candidate only where this returns True (RoPE: a neg that feeds a cat, not SiLU's neg).
    candidate: Callable[[Any], bool] | None = None
    # Fusions whose canonical ops this one's patterns start from: enabled along with it.
    requires: tuple[str, ...] = ()
    # Why the fusion is left out of fusions="all" and enabled by name only ("": it is in "all").
    opt_in: str = ""
    # Deduplicate identical subgraphs before this fusion runs (see pass_manager): its pattern needs
    # one consumer where the model computes the same thing several times (an activation quantized
    # once per projection). After the fusions that need a shared input kept apart (the RoPE
    # patterns: cos.unsqueeze per layer), so they come first in application order.
    cse_before: bool = False
    # Op names one of which the graph must hold for that deduplication to run (() : always): a
    # fusion in "all" must not deduplicate the graphs it has nothing to do with.
    cse_when: tuple[str, ...] = ()
    # String arguments of the spellings that become pattern arguments (a process-group name):
    # {name: sentinel the spelling is traced with}. The matcher compares strings literally, so the
    # traced uses of the sentinel are pointed at the argument's placeholder. Such patterns are used
    # as traced, without the matcher's re-trace on each candidate's values: they must hold no
    # shapes or dtypes (start from canonical ops that carry them).
    string_args: dict[str, str] = field(default_factory=dict)
    # A graph rewrite run right before this fusion's patterns (once per graph): it must leave the
    # math unchanged, only bring spellings into the patterns' shape (e.g. move a view from after
    # a collective to before it); returns how many nodes it moved.
    canonicalize: Callable[[Any], int] | None = None
    # The dtypes each example input tuple is cast to before tracing (its tensors of a dtype in
    # FLOAT_DTYPES; others, fp8 or integer, stay as they are); None: traced as given.
    dtypes: tuple[torch.dtype, ...] | None = None
    # Example inputs read off the graph being compiled, for spellings whose traced graph depends
    # on a size (transformers' chunked delta rule unrolls its loop once per 64 tokens): each is
    # traced and registered the first time a graph holds it (keyed as ``examples()`` dedups), in
    # addition to ``example_inputs``. Cast to no dtype: the graph's dtypes are the ones to trace.
    # They carry the graph's own sizes, so their patterns compare every literal (devices aside)
    # and skip the matcher's re-trace per candidate (6 s a site for a 4096-token chunked rule).
    # A GraphExample narrows the spellings traced for it.
    graph_examples: Callable[[torch.fx.Graph], Iterable[Sequence[Any] | GraphExample]] | None = None
    # A cheap test that a graph can hold a site (an op every spelling has); False: the pass is
    # skipped there. For fusions whose patterns are large and anchored at common ops (the chunked
    # rule's, at a reshape): the matcher would try each of them at every such node of every graph.
    applies_to: Callable[[torch.fx.Graph], bool] | None = None
    # Ops whose nodes in the spellings may have users outside the match (the causal mask's expand,
    # which the attention reads too): matched whatever their users, where the matcher otherwise
    # wants a node's users in the graph to be its users in the pattern. Such spellings match as
    # traced with the literal ints ignored (the matcher's first pass) and are not re-traced on the
    # candidate's values: a match_check must then check the ints that decide the numerics.
    shared_nodes: tuple[Any, ...] = ()
    # Where no pattern can state a site (several sites merged into one op: every layer's cache
    # write counter): a rewrite of the graph, run in the fusion's turn in place of its patterns
    # (spellings and example_inputs then empty), returning the sites it changed. verify=True does
    # not re-run these sites: a rewrite only regroups canonical ops into ops whose references are
    # the same calls (their kernels tested against those of the ops they merge).
    rewrite: Callable[[torch.fx.Graph], list[Rewritten]] | None = None
    # verify=True's comparison of the original's and the replacement's outputs, where the fused op
    # may legitimately order equal elements otherwise (a stable sort standing in for the model's
    # unstable one): (actual, expected) -> None to accept or the reason. Default: floating outputs
    # within their dtype's tolerance, integer and boolean ones equal.
    verify_outputs: Callable[[tuple, tuple], "str | None"] | None = None
    # verify=True's inputs for arguments a random tensor would misstate: name -> a function of the
    # argument's fake value and every argument's (by name) returning the real tensor (a mask of
    # ones the pattern scatters into; cache slots inside the cache: cache_writes.valid_slots).
    verify_inputs: dict[str, Callable[[Any, dict[str, Any]], Any]] = field(default_factory=dict)
    builtin: bool = False
    _pass: PatternMatcherPass | None = field(default=None, repr=False)
    _traced: set = field(default_factory=set, repr=False)

    @property
    def in_all(self) -> bool:
        """Part of fusions="all" (no opt_in reason)."""
        return not self.opt_in

    def examples(self) -> list[list[Any]]:
        """The argument lists the spellings are traced with: ``example_inputs()``, each cast to
        every one of ``dtypes``, without repeats (same dtypes, shapes and scalars)."""
        out, seen = [], set()
        for example in self.example_inputs():
            for dtype in self.dtypes if self.dtypes is not None else (None,):
                args = [_cast(a, dtype) for a in example]
                key = example_key(args)
                if key not in seen:
                    seen.add(key)
                    out.append(args)
        return out

    def source_hash(self) -> str:
        """Hash of everything that decides what this fusion rewrites (for Inductor's cache key)."""
        h = hashlib.sha256(self.name.encode())
        fns = [self.example_inputs, self.check, self.canonicalize, self.graph_examples, self.rewrite] + [
            f for s in self.spellings for f in (s.pattern, s.replacement, s.check)
        ]
        for fn in fns:
            if fn is None:
                continue
            h.update(_source_of(fn).encode())
        h.update(
            repr(
                (sorted(self.scalars.items()), self.cse_before, self.cse_when, sorted(self.string_args.items()),
                 self.dtypes, [str(op) for op in self.shared_nodes])
            ).encode()
        )
        return h.hexdigest()


def example_key(args: Sequence[Any]) -> tuple:
    """What makes two example argument lists trace the same patterns: dtypes, shapes, values."""
    return tuple(
        ("tensor", a.dtype, tuple(a.shape)) if isinstance(a, torch.Tensor) else ("value", repr(a)) for a in args
    )


def _cast(value: Any, dtype: torch.dtype | None) -> Any:
    if dtype is None or not isinstance(value, torch.Tensor) or value.dtype not in FLOAT_DTYPES:
        return value
    return value.to(dtype)


def _source_of(fn: Callable[..., Any]) -> str:
    """The source of ``fn`` and of the module it lives in (a spelling may call helpers)."""
    module = sys.modules.get(getattr(fn, "__module__", ""), None)
    for obj in (module, fn):
        try:
            return inspect.getsource(obj)  # type: ignore[arg-type]
        except (OSError, TypeError):
            continue
    return getattr(fn, "__qualname__", repr(fn))


MatchHandler = Callable[[Fusion, Spelling, Match], bool]


def trace_functional(
    fn: Callable[..., Any], args: Sequence[Any], *, get_decomp_fn=select_decomp_table, **kwargs
) -> torch.fx.GraphModule:
    """``fwd_only``, put in the form of Inductor's post-grad graphs: functional (some
    decompositions mutate their temporaries: F.rms_norm adds eps with ``add_``), with views as
    reshapes (Inductor turns every ``view`` into ``reshape`` before its post-grad passes), and
    without the no-op ops Inductor removes before them (a copy into a same-shaped temporary:
    ``out[:, :, i] = x`` on a fresh tensor), nor the permutes back and forth that functionalizing
    a write into a transposed buffer leaves (``_remove_permute_pairs``)."""
    from torch._inductor.fx_passes.post_grad import remove_noop_ops, view_to_reshape
    from torch.fx.experimental.proxy_tensor import make_fx

    gm = fwd_only(fn, args, get_decomp_fn=get_decomp_fn, **kwargs)
    if any(is_mutation_op(n) for n in gm.graph.nodes if n.op == "call_function"):
        gm = make_fx(torch.func.functionalize(gm, remove="mutations"), tracing_mode="real")(*args)
        _remove_permute_pairs(gm.graph)
        gm.graph.eliminate_dead_code()
    view_to_reshape(gm)
    remove_noop_ops(gm.graph)
    gm.recompile()
    return gm


def _remove_permute_pairs(graph: torch.fx.Graph) -> None:
    """Point every use of ``permute(permute(x, p1), p2)`` with p1 then p2 the identity at x, and
    of a permute of a fresh buffer (``full``) at its identical sibling (same order).

    The functionalized trace of writes into views of a transposed buffer (transformers' chunked
    delta rule: ``out[:, :, i] = ...`` into ``zeros_like`` of a transposed solve's result) permutes
    back and forth around every write, and twice from the fresh buffer; AOTAutograd's trace of
    the same code, which the model's graph comes from, holds one permute of the buffer and no
    pair (its functionalization replays the views from one base; Inductor's
    ``pointless_permute_pair`` removes the rest)."""
    permute = torch.ops.aten.permute.default
    seen = {}
    for node in graph.nodes:
        if node.target is not permute:
            continue
        inner, order = node.args[0], tuple(node.args[1])
        if isinstance(inner, torch.fx.Node) and inner.target is permute:
            if all(inner.args[1][order[i]] == i for i in range(len(order))):
                node.replace_all_uses_with(inner.args[0])
                continue
        if not isinstance(inner, torch.fx.Node) or inner.target is not torch.ops.aten.full.default:
            continue  # the model's code may permute one tensor twice (k.transpose twice): kept
        twin = seen.setdefault((inner, order), node)
        if twin is not node:
            node.replace_all_uses_with(twin)


_match_handler: contextvars.ContextVar[MatchHandler | None] = contextvars.ContextVar(
    "fusion_passes_match_handler", default=None
)


@contextlib.contextmanager
def match_handler(handler: MatchHandler):
    """Route every match found while the block runs to ``handler`` (accept → True)."""
    token = _match_handler.set(handler)
    try:
        yield
    finally:
        _match_handler.reset(token)


_enabled: contextvars.ContextVar[frozenset[str]] = contextvars.ContextVar("fusion_passes_enabled", default=frozenset())


@contextlib.contextmanager
def enabled_fusions(names: Iterable[str]):
    """The fusions the running pass applies, for a check whose answer depends on another fusion
    being enabled (a site left to Inductor unless a later fusion takes it further)."""
    token = _enabled.set(frozenset(names))
    try:
        yield
    finally:
        _enabled.reset(token)


def is_enabled(name: str) -> bool:
    """Whether the running pass applies fusion ``name`` (see enabled_fusions)."""
    return name in _enabled.get()


def _on_match(fusion: Fusion, spelling: Spelling, match: Match) -> bool:
    handler = _match_handler.get()
    return True if handler is None else handler(fusion, spelling, match)


def _scalars_then_on_match(fusion: Fusion, spelling: Spelling, example: list) -> Callable[[Match], bool]:
    """The extra check: restore the scalar arguments (eps) the match may lack, then _on_match.

    register_replacement re-checks a candidate with the pattern re-traced on the matched values,
    scalars burned in; torch >= 2.12 copies the scalars over from the first match, torch 2.11 does
    not, so there the match has no ``eps``. The generic pattern (scalars as keyword arguments),
    matched again at the same output node, gives them back.

    The re-traced pattern also takes any literal of the graph equal to an integer scalar's sentinel
    for that scalar: DeepSeek V3's router at 7 tokens (its group view [7, n_group, E / n_group])
    bound n_group to 7, the token count, and the check refused a correct site. The generic pattern
    binds each scalar where the spelling itself put it, so with integer scalars its values are the
    ones checked (the replacement is traced with those already)."""
    names = [n for n in inspect.signature(spelling.pattern).parameters if n in fusion.scalars]
    # (patterns pre-traced with string arguments or shared nodes have no generic form to match)
    plain = not (fusion.string_args or fusion.shared_nodes)
    integers = [n for n in names if isinstance(fusion.scalars[n], int)] if plain else []
    generic: list[Any] = []

    def check(match: Match) -> bool:
        missing = [n for n in names if n not in match.kwargs]
        if missing or integers:
            if not generic:
                with unset_fake_temporarily():  # the check runs under the graph's fake mode
                    generic.append(gen_pattern(spelling.pattern, example, trace_functional, fusion.scalars))
            again = generic[0].match(match.output_nodes()[0])
            if missing and (not is_match(again) or any(n not in again.kwargs for n in missing)):
                return False
            if is_match(again):
                match.kwargs.update({n: again.kwargs[n] for n in missing + integers if n in again.kwargs})
        return _on_match(fusion, spelling, match)

    return check


def pattern_pass(fusion: Fusion, graph: torch.fx.Graph | None = None) -> PatternMatcherPass:
    """The fusion's PatternMatcherPass, traced on first use and kept; with ``graph``, also holding
    the patterns of the examples ``fusion.graph_examples`` reads off it.

    Matches go through the handler installed by ``match_handler`` (the pass manager's), so one
    traced pass serves every backend configuration.
    """
    if fusion._pass is None:
        matcher = PatternMatcherPass(pass_name=f"fusion_passes.{fusion.name}")
        for example in fusion.examples():
            _register(fusion, matcher, example)
        fusion._pass = matcher
    if graph is not None and fusion.graph_examples is not None:
        with unset_fake_temporarily():  # the pass runs under the graph's fake mode
            for example in fusion.graph_examples(graph):
                args, names = (example.args, example.spellings) if isinstance(example, GraphExample) else (example, None)
                for spelling in fusion.spellings:
                    key = (spelling.name, example_key(args))
                    if (names is None or spelling.name in names) and key not in fusion._traced:
                        fusion._traced.add(key)
                        _register(fusion, fusion._pass, list(args), exact=True, spellings=(spelling,))
    return fusion._pass


def _register(fusion: Fusion, matcher: PatternMatcherPass, example: list[Any], exact: bool = False,
              spellings: Sequence[Spelling] | None = None) -> None:  # fmt: skip
    for spelling in fusion.spellings if spellings is None else spellings:
        pretraced = {}
        if exact:
            gm = trace_functional(spelling.pattern, list(example))
            _scalar_tensors_as_full(gm.graph)
            argnames = list(inspect.signature(spelling.pattern).parameters)
            pretraced["search_fn_pattern"] = fx_to_pattern(
                gm, ignore_types=(torch.device,), argnames=argnames, scalar_workaround=fusion.scalars
            )
        elif fusion.string_args:
            pretraced["search_fn_pattern"] = _pattern_with_string_args(fusion, spelling, list(example))
        elif fusion.shared_nodes:
            pretraced["search_fn_pattern"] = _pattern_with_shared_nodes(fusion, spelling, list(example))
        register_replacement(
            spelling.pattern,
            spelling.replacement,
            list(example),
            trace_functional,
            matcher,
            extra_check=_scalars_then_on_match(fusion, spelling, list(example)),
            scalar_workaround=fusion.scalars,
            skip_duplicates=True,
            **pretraced,
            **_pattern_name(f"{fusion.name}.{spelling.name}"),
        )


def _scalar_tensors_as_full(graph: torch.fx.Graph) -> None:
    """``scalar_tensor(x)`` as ``full([], x)``: what Inductor's joint-graph constant folding leaves
    in the graphs the passes see (``tril``'s zero, a ``masked_fill`` value). Only for the exact
    patterns: the others are re-traced on each candidate by the matcher, which keeps
    ``scalar_tensor`` on both sides."""
    for node in list(graph.find_nodes(op="call_function", target=torch.ops.aten.scalar_tensor.default)):
        kwargs = {"dtype": node.kwargs.get("dtype"), "layout": torch.strided, "device": node.kwargs.get("device"),
                  "pin_memory": False}  # fmt: skip
        with graph.inserting_before(node):
            full = graph.call_function(torch.ops.aten.full.default, ([], node.args[0]), kwargs)
        full.meta = dict(node.meta)
        node.replace_all_uses_with(full)
        graph.erase_node(node)


def _pattern_with_string_args(fusion: Fusion, spelling: Spelling, example: list) -> Any:
    """The spelling's pattern with each of ``fusion.string_args`` a pattern argument: traced with
    the sentinel, whose uses are then pointed at the argument's placeholder. No literal type is
    ignored (register_replacement's default ignores floats and relies on its re-trace, which a
    pre-traced pattern skips): "sum", weight_offset and the like must match exactly."""
    argnames = list(inspect.signature(spelling.pattern).parameters)
    gm = trace_functional(spelling.pattern, example)
    for name, sentinel in fusion.string_args.items():
        # make_fx names the placeholders after the arguments (group_name_1, ...).
        placeholder = next(n for n in gm.graph.nodes if n.op == "placeholder" and n.target.startswith(name))
        uses = 0
        for node in gm.graph.nodes:
            if node.op != "call_function":
                continue
            node.args = tuple(placeholder if a == sentinel else a for a in node.args)
            uses += node.args.count(placeholder)
        if uses == 0:
            raise RuntimeError(f"{fusion.name}.{spelling.name}: no traced use of {name}={sentinel!r}")
    gm.graph.eliminate_dead_code()
    return fx_to_pattern(gm, ignore_types=(), argnames=argnames, scalar_workaround=fusion.scalars)


def _pattern_with_shared_nodes(fusion: Fusion, spelling: Spelling, example: list) -> Any:
    """The spelling's pattern as register_replacement traces it (ints, floats, lists and devices
    ignored), its nodes of ``fusion.shared_nodes`` accepting any number of users. Dtypes are
    compared: a spelling per dtype (of an additive mask, say) must not take another's site."""
    from torch._inductor.pattern_matcher import MULTIPLE, CallFunction

    argnames = list(inspect.signature(spelling.pattern).parameters)
    gm = trace_functional(spelling.pattern, example)
    pattern = fx_to_pattern(
        gm, ignore_types=(int, float, list, torch.device), argnames=argnames, scalar_workaround=fusion.scalars,
    )  # fmt: skip
    shared, seen, stack = set(fusion.shared_nodes), set(), [pattern]
    while stack:
        node = stack.pop()
        if isinstance(node, (list, tuple)):
            stack.extend(node)
            continue
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, CallFunction) and shared & set(node.fns):
            node.users = MULTIPLE
        stack.extend(getattr(node, "args", ()))
        stack.extend(getattr(node, "outputs", ()) or ())
    return pattern


def _pattern_name(name: str) -> dict[str, str]:
    """``pattern_name`` (per-pattern telemetry) exists from torch 2.12 on; 2.11 lacks it."""
    if "pattern_name" in inspect.signature(register_replacement).parameters:
        return {"pattern_name": name}
    return {}
