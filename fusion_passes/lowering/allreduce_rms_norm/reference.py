"""Plain-torch reference of the tensor-parallel allreduce + (residual add +) RMSNorm: the single
statement of its math.

Under tensor parallelism each rank holds a partial sum of a row-wise projection's output; the
decoder layer sums it over the group, adds the residual and normalises:

    s = sum over the ranks of `group_name` of x            all_reduce(x, "sum") + wait_tensor
    allreduce_add_rms_norm:  r = s + residual              rounded to x.dtype, as the model does
                             y = rms_norm(r)               (normed, new_residual = r)
    allreduce_rms_norm:      y = rms_norm(s)               (normed, reduced = s)

with rms_norm in the rounding form the two flags select (see ``rms_norm_reference``). The sum is
the functional collective the compiled graph calls (``_c10d_functional.all_reduce``), so the
reference runs on every backend that has it, gloo included, and every rank gets the same bits.
"""

from __future__ import annotations

import torch

from fusion_passes.lowering.rms_norm.reference import (
    RMSNormForm,
    add_rms_norm_reference,
    check_rms_norm_args,
    rms_norm_reference,
)


def check_allreduce_rms_norm_args(
    x: torch.Tensor, weight: torch.Tensor, norm: RMSNormForm, residual: torch.Tensor | None = None
) -> None:
    """Raise ValueError (one line) for inputs the canonical op does not define (the norm's own
    rules: the sum has x's shape and dtype, so the norm's checks apply to x unchanged)."""
    check_rms_norm_args(x, weight, norm.weight_offset, norm.cast_before_weight, residual)


def all_reduce_sum(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """sum over the group of x, a new tensor (x is not written): the functional collective."""
    reduced = torch.ops._c10d_functional.all_reduce.default(x, "sum", group_name)
    return torch.ops._c10d_functional.wait_tensor.default(reduced)


def allreduce_add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, norm: RMSNormForm, group_name: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(sum(x) + residual), sum(x) + residual)."""
    return add_rms_norm_reference(all_reduce_sum(x, group_name), residual, weight, *norm)


def allreduce_rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, norm: RMSNormForm, group_name: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(sum(x)), sum(x))."""
    reduced = all_reduce_sum(x, group_name)
    return rms_norm_reference(reduced, weight, *norm), reduced
