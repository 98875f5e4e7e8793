"""Launch a Triton kernel with less host time than ``kernel[grid](...)``, for ops that stay
dispatcher calls on every step (the collective ops: see common/collective_ops.py).

``kernel[grid](*args)`` re-derives, on every call, the specialization of every argument (Triton's
binder: dtype, 16-byte alignment of each pointer, 1 / multiple-of-16 / int32-range of each
specialized int), hashes it into a cache key and looks the compiled kernel up: measured on one
H200 host, 18.1 us per launch of the one-shot allreduce kernel (21 arguments) against 11.1 us for
the compiled kernel's own launcher. Deriving the same specialization generically in Python costs
most of that gain again (5.4 us for those 21 arguments on a CPU host), so ``FastLauncher`` takes
the key from its caller, who knows which arguments can change between calls: a caller's key must
determine Triton's specialization (equal keys, equal specializations; ``specialization_of`` gives
an int's part). The first call per key, and any call while a Triton launch hook (a profiler) is
installed, goes through ``kernel[grid]``; later calls go straight to the compiled launcher.

The direct call follows the launcher protocol of the Triton versions in ``_PROTOCOL_VERSIONS``
(checked: 3.6); under any other version every call takes ``kernel[grid]``.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
from triton import knobs

# Triton versions whose JITFunction.run calls
#   compiled.run(grid_x, grid_y, grid_z, stream, function, packed_metadata, launch_metadata,
#                enter_hook, exit_hook, *bound_args)
# with bound_args every parameter's value in signature order, constexprs included.
_PROTOCOL_VERSIONS = ("3.6",)
_DIRECT = ".".join(triton.__version__.split(".")[:2]) in _PROTOCOL_VERSIONS
_INT32 = 2**31


def specialization_of(value: int) -> tuple[bool, bool, bool]:
    """What Triton specializes a (not do_not_specialize) int argument on: == 1, a multiple of 16,
    within int32."""
    return value == 1, value % 16 == 0, -_INT32 <= value < _INT32


def specialization_key(tensors: tuple, ints: tuple, *fixed: Any) -> tuple:
    """A ``FastLauncher`` key from what can change between a caller's calls: each tensor's 16-byte
    alignment residue, each specialized int's class (``specialization_of``), then ``fixed``:
    values that decide the rest of the specialization (dtypes, flags, the workspace)."""
    return (*[t.data_ptr() % 16 for t in tensors], *[specialization_of(i) for i in ints], *fixed)


def _hooked() -> bool:
    """Whether a launch hook is installed (Triton 3.6 keeps them in a HookChain, empty by default;
    older versions a callable or None): those launches keep Triton's path, which calls them."""
    hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    return any(bool(getattr(hook, "calls", True)) for hook in hooks if hook is not None)


class FastLauncher:
    """``launcher(grid, args, num_warps, key)`` = ``kernel[(grid,)](*args, num_warps=num_warps)``,
    with ``args`` every parameter of the kernel in signature order, constexprs included, and
    ``key`` a hashable value that determines the specialization of ``args`` (see the module
    docstring: a key shared by two differently specialized argument lists would launch the first
    one's binary for the second)."""

    def __init__(self, kernel: Any):
        self.kernel = kernel
        # Under TRITON_INTERPRET the kernel is interpreted (nothing compiled): every call then
        # takes kernel[grid].
        self._direct = _DIRECT and hasattr(kernel, "params")
        self._compiled: dict[Any, Any] = {}

    def __call__(self, grid: int, args: tuple, num_warps: int, key: Any) -> None:
        device = torch.cuda.current_device() if self._direct else None
        compiled = self._compiled.get((device, num_warps, key))
        if compiled is None or _hooked():
            compiled = self.kernel[(grid,)](*args, num_warps=num_warps)
            if self._direct and not _hooked() and hasattr(compiled, "packed_metadata"):
                self._compiled[(device, num_warps, key)] = compiled
            return
        stream = torch._C._cuda_getCurrentRawStream(device)
        compiled.run(
            grid, 1, 1, stream, compiled.function, compiled.packed_metadata, None, None, None, *args
        )
