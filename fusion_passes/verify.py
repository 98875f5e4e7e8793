"""Numerical check of one rewrite, before it is applied.

The matched subgraph is cut out of the graph as it is (the original ops, with their literals),
the replacement is the spelling's fused call; both run on fresh random inputs of the recorded
shapes, dtypes and device, and every output is compared in float64 with the per-dtype tolerance.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx
from torch._inductor.pattern_matcher import Match

from fusion_passes.numerics import compare


class Unverifiable(Exception):
    """The match cannot be checked on real inputs (e.g. a size known only at run time)."""


def _concrete(size: Any) -> int:
    if isinstance(size, int):
        return size
    hint = getattr(getattr(size, "node", None), "hint", None)
    if hint is None:
        raise Unverifiable(f"size {size} has no hint")
    return int(hint)


def random_like(value: Any, generator: torch.Generator | None = None) -> Any:
    """A fresh random tensor with a (fake) tensor's shape, dtype, device and strides (a norm of a
    split's slice reads strided rows); scalars pass through."""
    if not isinstance(value, torch.Tensor):
        return value
    shape = [_concrete(s) for s in value.shape]
    stride = [_concrete(s) for s in value.stride()]
    if value.dtype.is_floating_point:
        t = torch.randn(shape, dtype=torch.float32, generator=generator).to(value.dtype)
    elif value.dtype == torch.bool:
        t = torch.randint(0, 2, shape, generator=generator).bool()
    else:  # small non-negative integers: valid positions, counts and expert ids
        t = torch.randint(0, 8, shape, generator=generator).to(value.dtype)
    if value.is_contiguous() or 0 in stride:  # broadcast (stride 0) views stay dense copies
        return t.to(value.device)
    strided = torch.empty_strided(shape, stride, dtype=value.dtype, device=value.device)
    return strided.copy_(t)


def matched_subgraph(match: Match, argnames: Sequence[str]) -> torch.fx.GraphModule:
    """The matched nodes as a GraphModule taking the match's tensor arguments by name."""
    order = {n: i for i, n in enumerate(match.graph.nodes)}
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for name in argnames:
        value = match.kwargs[name]
        if isinstance(value, torch.fx.Node):
            env[value] = graph.placeholder(name)
    for node in sorted(set(match.nodes), key=order.__getitem__):
        env[node] = graph.node_copy(node, lambda n: env[n])
    outputs = [env[n] for n in match.output_nodes() if n is not None]
    graph.output(outputs[0] if len(outputs) == 1 else tuple(outputs))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


OutputCheck = Callable[[tuple, tuple], "str | None"]


def verify_match(
    match: Match,
    argnames: Sequence[str],
    replacement: Callable[..., Any],
    seed: int | None = None,
    outputs_agree: OutputCheck | None = None,
    inputs_like: dict[str, Callable[[Any, dict[str, Any]], Any]] | None = None,
) -> str | None:
    """Run original and replacement on fresh random inputs (a new seed each call unless given);
    ``None`` if they agree, else the reason, naming the seed that reproduces it. ``outputs_agree``
    (the fusion's ``verify_outputs``): the comparison where the replacement may order equal
    elements otherwise than the original (a stable sort for an unstable one). ``inputs_like`` (the
    fusion's ``verify_inputs``): argument name -> the input to use for it, from its fake value and
    every argument's (by name), where a random one would not be what the model passes (a mask of
    ones the pattern scatters into; cache slots, which must lie in the cache and not repeat)."""
    seed = random.getrandbits(63) if seed is None else seed
    original = matched_subgraph(match, argnames)
    values = [_value(match.kwargs[name]) for name in argnames]
    with torch.no_grad(), _real_mode():  # Inductor compiles under a fake mode: leave it
        gen = torch.Generator().manual_seed(seed)
        made, by_name = inputs_like or {}, dict(zip(argnames, values))
        inputs = [made[name](v, by_name) if name in made else random_like(v, gen) for name, v in zip(argnames, values)]
        tensor_inputs = [x for x, v in zip(inputs, values) if isinstance(v, torch.Tensor)]
        expected = _as_tuple(original(*tensor_inputs))
        actual = _as_tuple(replacement(*inputs))
        reason = _compare_outputs(actual, expected, outputs_agree)
    return None if reason is None else f"{reason} (seed {seed})"


def _compare_outputs(
    actual: tuple[torch.Tensor, ...], expected: tuple[torch.Tensor, ...], outputs_agree: OutputCheck | None = None
) -> str | None:
    """The same number of outputs, each of the same dtype and shape; then their values by
    ``outputs_agree`` where given, else floating outputs within their dtype's tolerance and integer
    and boolean ones (expert ids, a mask) equal."""
    if len(expected) != len(actual):
        return f"replacement returns {len(actual)} outputs, the original {len(expected)}"
    for i, (a, e) in enumerate(zip(actual, expected)):
        if a.dtype != e.dtype or a.shape != e.shape:
            return f"output {i}: {a.dtype}{tuple(a.shape)} != original {e.dtype}{tuple(e.shape)}"
    if outputs_agree is not None:
        return outputs_agree(actual, expected)
    for i, (a, e) in enumerate(zip(actual, expected)):
        if not e.dtype.is_floating_point:
            if not torch.equal(a, e):
                return f"output {i}'s values differ from the original's at {int((a != e).sum())} of {e.numel()}"
            continue
        c = compare(a, e)
        if not c.ok:
            return f"output {i} differs from the original: max abs error {c.max_abs:.3g}"
    return None


def _value(v: Any) -> Any:
    return v.meta["val"] if isinstance(v, torch.fx.Node) else v


def _as_tuple(x: Any) -> tuple[torch.Tensor, ...]:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def _real_mode():
    """Leave Inductor's fake mode so the check computes on real tensors."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    return unset_fake_temporarily()
