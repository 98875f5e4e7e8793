"""The fusion registry: every fusion, built-in or user-registered, by name, in the order they run.

The built-in fusions and their order come from ``fusion_passes.fusion_order`` (one list, with the
reason for each place); a user's fusions (``register_fusion``) run after them, in registration
order. What a fusion is, and how it is traced, is ``fusion_passes.fusion``.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from fusion_passes.fusion import (
    DEFAULT_SCALAR_SENTINEL,
    FLOAT_DTYPES,
    CheckFn,
    Fusion,
    FusionError,
    Spelling,
)

_REGISTRY: dict[str, Fusion] = {}


def register_fusion(
    name: str,
    *,
    pattern: Callable[..., Any] | Sequence[Callable[..., Any]],
    replacement: Callable[..., Any] | Sequence[Callable[..., Any]],
    example_inputs: Callable[[], Iterable[Sequence[Any]]],
    check: CheckFn | None = None,
    scalars: Sequence[str] | dict[str, float] = (),
    summary: str | None = None,
    doc: str | None = None,
    dtypes: Sequence[torch.dtype] | None = FLOAT_DTYPES,
    replace: bool = False,
) -> Fusion:
    """Register a fusion that rewrites ``pattern`` spellings into ``replacement`` calls.

    pattern:        the unfused computation as plain torch code (one function or several
                    spellings). Its arguments are the tensors and scalars the fused call needs.
    replacement:    the fused computation with the same arguments (one for all spellings, or one
                    per spelling).
    example_inputs: returns argument tuples to trace the patterns with (one is enough; more for
                    variants whose graph differs otherwise than by dtype: shapes, ranks).
    check:          ``check(values) -> None | reason``: reject a match the fused op does not
                    compute identically (dtypes, shapes); values are the matched arguments.
    scalars:        names of float arguments that vary between call sites (eps): they are traced
                    with a sentinel and matched as pattern arguments, not literals.
    dtypes:         the dtypes the patterns are traced at: each example tuple is traced once per
                    dtype, its fp32/bf16/fp16 tensors cast to it (fp32 graphs drop the casts that
                    bf16 and fp16 graphs keep, so a pattern traced at one dtype only matches
                    graphs of that dtype). Default fp32, bf16 and fp16; None: the example
                    inputs as given (mixed dtypes that must stay mixed).
    """
    _ensure_builtins()  # built-ins first: registration order is application order
    if not replace and name in _REGISTRY:
        raise FusionError(f"a fusion named {name!r} is already registered")
    patterns = list(pattern) if isinstance(pattern, Sequence) else [pattern]
    replacements = list(replacement) if isinstance(replacement, Sequence) else [replacement]
    if len(replacements) == 1:
        replacements *= len(patterns)
    if len(replacements) != len(patterns) or not patterns:
        raise FusionError(
            f"{name}: give one replacement, or one per pattern ({len(patterns)} patterns, "
            f"{len(replacements)} replacements)"
        )
    if dtypes is not None:
        dtypes = tuple(dtypes)
        wrong = [d for d in dtypes if not isinstance(d, torch.dtype) or d not in FLOAT_DTYPES]
        if wrong or not dtypes:
            allowed = ", ".join(str(d) for d in FLOAT_DTYPES)
            raise FusionError(
                f"{name}: dtypes must be a non-empty list of {allowed} (or None), got {wrong or '[]'}"
            )
    if not isinstance(scalars, dict):
        scalars = {s: DEFAULT_SCALAR_SENTINEL * (i + 1) for i, s in enumerate(scalars)}
    doc = inspect.cleandoc(doc or patterns[0].__doc__ or "")
    fusion = Fusion(
        name=name,
        summary=summary or (doc.splitlines()[0] if doc else name),
        doc=doc,
        spellings=tuple(
            Spelling(getattr(p, "__name__", f"spelling{i}"), p, r)
            for i, (p, r) in enumerate(zip(patterns, replacements))
        ),
        example_inputs=example_inputs,
        scalars=dict(scalars),
        check=check,
        dtypes=dtypes,
        builtin=False,
    )
    _REGISTRY[name] = fusion
    return fusion


def unregister_fusion(name: str) -> None:
    """Remove a fusion (tests use this to keep the registry clean)."""
    _REGISTRY.pop(name, None)


def list_fusions() -> list[Fusion]:
    """Every registered fusion, in the order they are applied."""
    _ensure_builtins()
    return list(_REGISTRY.values())


def get_fusions(names: str | Sequence[str] = "all") -> list[Fusion]:
    """Resolve ``"all"`` or a list of names to fusions, in registry (application) order; "all"
    in a list stands for every fusion in "all" (``["all", "allreduce_rms_norm"]``: the
    defaults and an opt-in one)."""
    _ensure_builtins()
    if names == "all":
        return [f for f in _REGISTRY.values() if f.in_all]
    if isinstance(names, str):
        names = [names]
    if not isinstance(names, Sequence) or not all(isinstance(n, str) for n in names):
        shown = f"{type(names).__name__} {names!r}"[:80]
        raise TypeError(f'fusions must be "all" or a list of fusion names (str), got {shown}')
    if "all" in names:
        names = [n for n in names if n != "all"] + [f.name for f in _REGISTRY.values() if f.in_all]
    unknown = [n for n in names if n not in _REGISTRY]
    if unknown:
        raise FusionError(_unknown_fusion(unknown[0]))
    wanted: set[str] = set()
    pending = list(names)
    while pending:  # requirements of requirements too (mla_q_kv_rope -> mla_kv_norm_rope -> rms_norm)
        name = pending.pop()
        if name not in wanted:
            wanted.add(name)
            pending.extend(_REGISTRY[name].requires)
    return [f for f in _REGISTRY.values() if f.name in wanted]


def unknown_name(
    kind: str, name: str, known: Sequence[str], n: int = 3, listing: str | None = "known"
) -> str:
    """One line: ``unknown KIND 'name'; did you mean ...?`` with up to n close names (difflib),
    else every known name after ``listing`` (None: none listed)."""
    close = difflib.get_close_matches(name, list(known), n=n, cutoff=0.6)
    if close:
        return f"unknown {kind} {name!r}; did you mean {' or '.join(repr(c) for c in close)}?"
    if listing is None:
        return f"unknown {kind} {name!r}"
    return f"unknown {kind} {name!r}; {listing}: {', '.join(known) or 'none'}"


def _unknown_fusion(name: str) -> str:
    return unknown_name("fusion", name, list(_REGISTRY), listing="registered")


_BUILTINS_LOADED = False


def _ensure_builtins() -> None:
    """Register the built-in fusions, in ``fusion_order``'s order, before any user fusion.

    Imported on first use, not at package import: the pattern modules pull in every canonical op's
    spellings, which a user who only imports ``fusion_passes`` for its ops does not need."""
    global _BUILTINS_LOADED
    if not _BUILTINS_LOADED:
        _BUILTINS_LOADED = True
        from fusion_passes.fusion_order import builtin_fusions

        for fusion in builtin_fusions():
            _REGISTRY[fusion.name] = fusion
