"""A canonical op defined from its reference: the reference's signature is the op's schema, and
the reference is the op's implementation on every device (CUDA kernels are registered on top).

One statement of each op's arguments: ``torch.library.custom_op`` infers the schema from the
function it wraps, here the reference itself (``functools.wraps`` carries its signature and
annotations), so the op, its reference and its docs cannot drift apart.

Canonical ops that the raise stage produces (``lower_back=True``) are recorded in ``LOWER_BACK``:
one left standalone after the region fusions is decomposed back into its reference by the pass
manager (``fusion_passes.lower_back``), so Inductor fuses it with its neighbours as it would the
model's own spelling.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch

# OpOverload -> the plain-torch function it is decomposed into when left standalone.
LOWER_BACK: dict[Any, Callable[..., Any]] = {}


def op_from_reference(
    name: str,
    reference: Callable[..., Any],
    *,
    check: Callable[..., None] | None = None,
    contiguous: bool = True,
    lower_back: bool = False,
) -> Any:
    """``fusion_passes::<name>`` computing ``reference``. ``check`` (optional) raises for inputs the
    op does not define; it is called with the op's arguments that its own parameters name.
    ``contiguous``: outputs made contiguous, as the fake kernels promise Inductor (False where the
    reference's layout is the op's, e.g. a transposed view of a new tensor).
    ``lower_back``: a canonical op of the raise stage, decomposed back into ``reference`` where no
    region fusion consumed it (see ``LOWER_BACK``)."""
    signature = inspect.signature(reference)
    check_names = set(inspect.signature(check).parameters) if check is not None else set()

    @functools.wraps(reference)
    def op(*args, **kwargs):
        if check is not None:
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            check(**{k: v for k, v in bound.arguments.items() if k in check_names})
        out = reference(*args, **kwargs)
        if not contiguous:
            return out
        if isinstance(out, (tuple, list)):  # several outputs (a Tensor[] return is a list)
            return type(out)(t.contiguous() for t in out)
        return out.contiguous()

    custom = torch.library.custom_op(f"fusion_passes::{name}", op, mutates_args=())
    if lower_back:
        LOWER_BACK[getattr(torch.ops.fusion_passes, name).default] = reference
    return custom


def schema_values(target: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> list[Any]:
    """An op call's arguments in its schema's order, the defaults a call left out filled in (as the
    op sees them)."""
    return list(args) + [
        kwargs[a.name] if a.name in kwargs else a.default_value for a in target._schema.arguments[len(args) :]
    ]
