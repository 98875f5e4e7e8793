"""Registration of the collective fused ops (allreduce + norm (+ quantization)) with a short
dispatch path, and the record of which path they took at run time.

Why not ``torch.library.custom_op`` as the other fused ops: a collective op is always a dispatcher
call (never inlined by Inductor as a bare Triton launch, see allreduce_rms_norm/op.py), so its
host cost is paid on every call, and at decode sizes that cost is the step time unless a CUDA
graph hides it. custom_op wraps the kernel in a Python autograd layer, a dynamo-disable frame and
an output-aliasing check: on one H200 host, 72.6 us per call against 41.3 us for the launch it
wraps. A plain ``torch.library`` definition (schema, a CompositeExplicitAutograd reference, a CUDA
kernel, a fake kernel) dispatches straight to the kernel. The ops are inference ops: there is no
autograd formula (autograd's fallback refuses a backward through them, as custom_op would).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

_LIBRARY = torch.library.Library("fusion_passes", "FRAGMENT")

# "fusion_passes.<op>.default" -> {group name: why the last call on that group did not take the
# fast (one-shot) path}. Kept after later fast calls: it is the last fallback, for a report.
runtime_fallbacks: dict[str, dict[str, str]] = {}


def define_collective_op(
    schema: str, reference: Callable, cuda: Callable, fake: Callable
) -> torch._ops.OpOverloadPacket:
    """Define ``fusion_passes::<schema>`` with ``reference`` on every device (the collective's
    functional form: gloo included), ``cuda`` on CUDA tensors and ``fake`` for tracing; returns
    ``torch.ops.fusion_passes.<name>``."""
    name = schema.split("(", 1)[0]
    _LIBRARY.define(schema)
    _LIBRARY.impl(name, reference, "CompositeExplicitAutograd")
    _LIBRARY.impl(name, cuda, "CUDA")
    torch.library.register_fake(f"fusion_passes::{name}", fake, lib=_LIBRARY)
    return getattr(torch.ops.fusion_passes, name)


def define_collective_op_pair(
    add_schema: str, schema: str, on_reference: Callable, on_cuda: Callable, fake: Callable
) -> tuple[torch._ops.OpOverloadPacket, torch._ops.OpOverloadPacket]:
    """The with-residual op (``add_schema``: x, residual, ...) and the one without (``schema``:
    x, ...), one body each: ``on_reference`` / ``on_cuda`` take (op, x, residual or None, ...),
    op naming the caller ("fusion_passes.<name>.default") for the fallback record; ``fake`` takes
    the no-residual arguments. Two ops because an op's outputs must not depend on whether an
    input is None."""
    add_op, op = (f"fusion_passes.{sch.split('(', 1)[0]}.default" for sch in (add_schema, schema))
    with_residual = define_collective_op(
        add_schema,
        lambda x, residual, *args: on_reference(add_op, x, residual, *args),
        lambda x, residual, *args: on_cuda(add_op, x, residual, *args),
        lambda x, residual, *args: fake(x, *args),
    )
    without = define_collective_op(
        schema,
        lambda x, *args: on_reference(op, x, None, *args),
        lambda x, *args: on_cuda(op, x, None, *args),
        fake,
    )
    return with_residual, without


def record_fallback(op: str, group_name: str, reason: str) -> None:
    """Note that ``op`` ("fusion_passes.<name>.default") took its fallback on ``group_name``."""
    runtime_fallbacks.setdefault(op, {})[group_name] = reason


def fallback_reason(group_name: str) -> str | None:
    """Why the last recorded fallback on ``group_name`` happened, whichever op took it (None: no
    call on that group has fallen back since the table was last cleared)."""
    return next((groups[group_name] for groups in runtime_fallbacks.values() if group_name in groups), None)
