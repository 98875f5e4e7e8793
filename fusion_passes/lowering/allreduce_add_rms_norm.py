"""The canonical ops ``fusion_passes::allreduce_add_rms_norm`` and
``fusion_passes::allreduce_rms_norm``: the end of a tensor-parallel attention / MLP block.

Unfused (what a TP model compiles to):
    s = wait_tensor(all_reduce(x, "sum", group)); r = s + residual; y = rms_norm(r)
    (a collective, then Inductor's add + norm kernel reading s and residual)
Fused:
    y, r = allreduce_add_rms_norm(x, residual, weight, eps, weight_offset, cast_before_weight,
                                  group_name)
    y, s = allreduce_rms_norm(x, weight, eps, weight_offset, cast_before_weight, group_name)

Two ops, as for ``rms_norm`` / ``add_rms_norm``, rather than one with an optional residual: a
custom op's outputs must not depend on whether an input is None (the fake kernel and Inductor's
buffer planning need one fixed signature), and each op maps one-to-one onto the norm op it
extends. ``allreduce_rms_norm`` also returns the sum: where no residual is added before the norm
(the first layer after a vocabulary-parallel embedding) the sum is itself the next residual.

``group_name`` is the process-group name the functional collectives carry in the graph
(``_c10d_functional.all_reduce(x, "sum", group_name)``).

The math lives in ``allreduce_add_rms_norm_reference``: it is the implementation on every device
and backend. On CUDA the op runs the one-shot symmetric-memory kernel
(``allreduce_add_rms_norm_symm_mem``: reduce + add + norm in one launch) when
``symm_mem_eligible`` says the group and the rows allow it, else the fallback: the NCCL allreduce
then the fused add_rms_norm Triton kernel. The last reason a group fell back is kept in
``fallback_reasons`` for reports. The choice depends only on what every rank shares (the group,
x's shape, dtype and layout), so all ranks take the same path. No direct launcher is registered: a
collective must stay a dispatcher call, never be inlined as a bare Triton launch.
"""

from __future__ import annotations

import torch

from fusion_passes.lowering.allreduce_add_rms_norm_reference import (
    all_reduce_sum,
    allreduce_add_rms_norm_reference,
    allreduce_rms_norm_reference,
    check_allreduce_rms_norm_args,
)


@torch.library.custom_op("fusion_passes::allreduce_add_rms_norm", mutates_args=())
def allreduce_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    weight_offset: float,
    cast_before_weight: bool,
    group_name: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """sum(x) over the group + residual, then RMSNorm: returns (normed, new_residual)."""
    check_allreduce_rms_norm_args(x, weight, weight_offset, cast_before_weight, residual)
    out, new_residual = allreduce_add_rms_norm_reference(
        x, residual, weight, eps, weight_offset, cast_before_weight, group_name
    )
    return out.contiguous(), new_residual.contiguous()


@torch.library.custom_op("fusion_passes::allreduce_rms_norm", mutates_args=())
def allreduce_rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    weight_offset: float,
    cast_before_weight: bool,
    group_name: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """sum(x) over the group, then RMSNorm: returns (normed, reduced)."""
    check_allreduce_rms_norm_args(x, weight, weight_offset, cast_before_weight)
    out, reduced = allreduce_rms_norm_reference(
        x, weight, eps, weight_offset, cast_before_weight, group_name
    )
    return out.contiguous(), reduced.contiguous()


# group_name -> the reason the last call on that group took the NCCL fallback instead of the
# one-shot kernel (kept after later one-shot calls: it is the last fallback, for a report).
fallback_reasons: dict[str, str] = {}


def _one_shot_usable(x: torch.Tensor, group_name: str) -> bool:
    """Whether the one-shot kernel serves this call; records the reason when it does not."""
    from fusion_passes.lowering.allreduce_add_rms_norm_symm_mem import symm_mem_eligible

    reason = symm_mem_eligible(x, group_name)
    if reason is not None:
        fallback_reasons[group_name] = reason
    return reason is None


@allreduce_add_rms_norm.register_kernel("cuda")
def _allreduce_add_rms_norm_cuda(
    x, residual, weight, eps, weight_offset, cast_before_weight, group_name
):
    check_allreduce_rms_norm_args(x, weight, weight_offset, cast_before_weight, residual)
    if _one_shot_usable(x, group_name):
        from fusion_passes.lowering.allreduce_add_rms_norm_symm_mem import launch_eligible

        return launch_eligible(x, residual, weight, eps, weight_offset, cast_before_weight, group_name)
    # Fallback (NCCL + the fused norm kernel), for groups or sizes the one-shot kernel does not take.
    from fusion_passes.lowering.rms_norm_triton import rms_norm_triton

    reduced = all_reduce_sum(x, group_name)
    return rms_norm_triton(
        reduced, weight, eps, weight_offset, cast_before_weight, residual=residual
    )


@allreduce_rms_norm.register_kernel("cuda")
def _allreduce_rms_norm_cuda(x, weight, eps, weight_offset, cast_before_weight, group_name):
    check_allreduce_rms_norm_args(x, weight, weight_offset, cast_before_weight)
    if _one_shot_usable(x, group_name):
        from fusion_passes.lowering.allreduce_add_rms_norm_symm_mem import launch_eligible

        return launch_eligible(x, None, weight, eps, weight_offset, cast_before_weight, group_name)
    from fusion_passes.lowering.rms_norm_triton import rms_norm_triton

    reduced = all_reduce_sum(x, group_name).contiguous()
    return rms_norm_triton(reduced, weight, eps, weight_offset, cast_before_weight)[0], reduced


@allreduce_add_rms_norm.register_fake
def _allreduce_add_rms_norm_fake(
    x, residual, weight, eps, weight_offset, cast_before_weight, group_name
):
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    return out, torch.empty_like(x, memory_format=torch.contiguous_format)


@allreduce_rms_norm.register_fake
def _allreduce_rms_norm_fake(x, weight, eps, weight_offset, cast_before_weight, group_name):
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    return out, torch.empty_like(x, memory_format=torch.contiguous_format)
