"""A canonical op defined from its reference: the reference's signature is the op's schema, and
the reference is the op's implementation on every device (CUDA kernels are registered on top).

One statement of each op's arguments: ``torch.library.custom_op`` infers the schema from the
function it wraps, here the reference itself (``functools.wraps`` carries its signature and
annotations), so the op, its reference and its docs cannot drift apart.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch


def op_from_reference(
    name: str,
    reference: Callable[..., Any],
    *,
    check: Callable[..., None] | None = None,
    contiguous: bool = True,
) -> Any:
    """``fusion_passes::<name>`` computing ``reference``. ``check`` (optional) raises for inputs the
    op does not define; it is called with the op's arguments that its own parameters name.
    ``contiguous``: outputs made contiguous, as the fake kernels promise Inductor (False where the
    reference's layout is the op's, e.g. a transposed view of a new tensor)."""
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
        return tuple(t.contiguous() for t in out) if isinstance(out, tuple) else out.contiguous()

    return torch.library.custom_op(f"fusion_passes::{name}", op, mutates_args=())
