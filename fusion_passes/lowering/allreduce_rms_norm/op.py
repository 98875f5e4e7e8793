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
(``allreduce_rms_norm/symm_mem.py``: reduce + add + norm in one launch) when
``symm_mem_eligible`` says the group and the rows allow it, else the fallback: the NCCL allreduce
then the fused add_rms_norm Triton kernel. The choice depends only on what every rank shares (the group,
x's shape, dtype and layout), so all ranks take the same path. No direct launcher is registered: a
collective must stay a dispatcher call, never be inlined as a bare Triton launch.

Both ops are plain torch.library definitions (``collective_ops.define_collective_op_pair``), not
custom_op: a dispatcher call on every step, so its host cost counts (see collective_ops). Where an
op did not take the one-shot kernel, the reason is recorded per group
(``collective_ops.runtime_fallbacks``, shown by ``Report.summary``).
"""

from __future__ import annotations

import torch

from fusion_passes.lowering.allreduce_rms_norm.reference import (
    all_reduce_sum,
    allreduce_add_rms_norm_reference,
    allreduce_rms_norm_reference,
    check_allreduce_rms_norm_args,
)
from fusion_passes.lowering.common.collective_ops import define_collective_op_pair, record_fallback
from fusion_passes.lowering.rms_norm.reference import RMSNormForm

_one_shot_module = None


def one_shot_module():
    """The one-shot kernel's module, imported at the first CUDA call (it imports Triton and
    symmetric memory, which a CPU user never needs) and kept: an import statement in the per-call
    path costs host time on every step."""
    global _one_shot_module
    if _one_shot_module is None:
        from fusion_passes.lowering.allreduce_rms_norm import symm_mem

        _one_shot_module = symm_mem
    return _one_shot_module


def one_shot_usable(x: torch.Tensor, group_name: str, op: str, chunked: bool = False) -> bool:
    """Whether the one-shot kernel serves this call of ``op`` ("fusion_passes.<name>.default");
    records the reason when it does not. ``chunked``: the caller's launch runs rows beyond the
    workspace in several launches (see symm_mem_eligible)."""
    reason = one_shot_module().symm_mem_eligible(x, group_name, chunked=chunked)
    if reason is not None:
        record_fallback(op, group_name, reason)
    return reason is None


def _on_reference(op, x, residual, weight, eps, weight_offset, cast_before_weight, group_name):
    """Either op (``op`` names it for the fallback record; residual None: the one without) on
    every device and backend, gloo included: the functional collective, then the norm."""
    norm = RMSNormForm(eps, weight_offset, cast_before_weight)
    check_allreduce_rms_norm_args(x, weight, norm, residual)
    if x.device.type != "cuda":
        record_fallback(op, group_name, f"x is on {x.device.type}: the reference path")
    if residual is None:
        out, r = allreduce_rms_norm_reference(x, weight, norm, group_name)
    else:
        out, r = allreduce_add_rms_norm_reference(x, residual, weight, norm, group_name)
    return out.contiguous(), r.contiguous()


def _on_cuda(op, x, residual, weight, eps, weight_offset, cast_before_weight, group_name):
    """Either op on CUDA: the one-shot kernel where it serves, else NCCL + the fused norm kernel
    (for groups or sizes the one-shot kernel does not take), the reason recorded."""
    norm = RMSNormForm(eps, weight_offset, cast_before_weight)
    check_allreduce_rms_norm_args(x, weight, norm, residual)
    if one_shot_usable(x, group_name, op, chunked=True):
        return one_shot_module().launch_eligible(x, residual, weight, norm, group_name)
    from fusion_passes.lowering.rms_norm.triton import rms_norm_triton

    # Contiguous: without a residual the sum is an output of the op, which promises contiguous outputs.
    reduced = all_reduce_sum(x, group_name).contiguous()
    out, new_residual = rms_norm_triton(reduced, weight, *norm, residual=residual)
    return out, reduced if new_residual is None else new_residual


def _fake(x, weight, *norm_and_group):
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    return out, torch.empty_like(x, memory_format=torch.contiguous_format)


# sum(x) over the group (+ residual), then RMSNorm: (normed, new_residual), or (normed, reduced).
allreduce_add_rms_norm, allreduce_rms_norm = define_collective_op_pair(
    "allreduce_add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps, "
    "float weight_offset, bool cast_before_weight, str group_name) -> (Tensor, Tensor)",
    "allreduce_rms_norm(Tensor x, Tensor weight, float eps, float weight_offset, "
    "bool cast_before_weight, str group_name) -> (Tensor, Tensor)",
    _on_reference,
    _on_cuda,
    _fake,
)
