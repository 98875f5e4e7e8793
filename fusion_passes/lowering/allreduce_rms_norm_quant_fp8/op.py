"""The canonical ops ``fusion_passes::allreduce_add_rms_norm_quant_fp8`` and
``fusion_passes::allreduce_rms_norm_quant_fp8``: the end of a tensor-parallel attention / MLP block
whose next projections are FP8 linears.

Unfused (what a TP FP8 model compiles to, once the norm and quantization are canonical):
    s = wait_tensor(all_reduce(x, "sum", group))                  a collective writing s
    q, scales, r = add_rms_norm_quant_fp8(s, residual, ...)      a norm + quant kernel reading s
Fused:
    q, scales, r = allreduce_add_rms_norm_quant_fp8(x, residual, weight, *norm, *quant, group_name)
    q, scales, s = allreduce_rms_norm_quant_fp8(x, weight, *norm, *quant, group_name)
    with norm = (eps, weight_offset, cast_before_weight)             rms_norm.reference.RMSNormForm
         quant = (scheme, scale, group_size, scale_ue8m0)            common.fp8.QuantFP8

The math lives in ``reference`` (the norm + FP8 reference applied to the sum).

Two ops rather than one with an optional residual, for the reason allreduce_rms_norm/op.py gives
(an op's outputs must not depend on whether an input is None). The static scheme returns a copy of
its scale: an op's outputs may not alias its inputs (Inductor's buffer planning assumes so).
Both are plain torch.library definitions (``collective_ops.define_collective_op_pair``, as the
non-quantizing pair), not custom_op: a dispatcher call on every step, so its host cost counts.

On CUDA the op runs the one-shot symmetric-memory kernel
(``allreduce_rms_norm_quant_fp8/symm_mem.py``: reduce + add + norm + quantize in one launch) when
``symm_mem_eligible`` allows it, else the NCCL allreduce then the fused norm + quantization Triton
kernel. Where a call did not take the one-shot kernel the reason is recorded per op and group
(``collective_ops.runtime_fallbacks``, shown by ``Report.summary``). The choice depends
only on what every rank shares, so all ranks take the same path. No direct launcher is
registered: a collective must stay a dispatcher call, never be inlined as a bare Triton launch.
"""

from __future__ import annotations

import torch

from fusion_passes.lowering.allreduce_rms_norm.op import one_shot_usable
from fusion_passes.lowering.allreduce_rms_norm.reference import all_reduce_sum
from fusion_passes.lowering.allreduce_rms_norm_quant_fp8.reference import (
    allreduce_add_rms_norm_quant_fp8_reference,
    allreduce_rms_norm_quant_fp8_reference,
    check_allreduce_rms_norm_quant_fp8_args,
)
from fusion_passes.lowering.common.collective_ops import define_collective_op_pair, record_fallback
from fusion_passes.lowering.common.fp8 import QuantFP8
from fusion_passes.lowering.rms_norm.reference import RMSNormForm

_one_shot = None


def _one_shot_module():
    """The one-shot kernel's module, imported at the first CUDA call (Triton, symmetric memory: a
    CPU user never needs them) and kept: an import statement in the per-call path costs host time
    on every step (as allreduce_rms_norm.op.one_shot_module)."""
    global _one_shot
    if _one_shot is None:
        from fusion_passes.lowering.allreduce_rms_norm_quant_fp8 import symm_mem

        _one_shot = symm_mem
    return _one_shot


def _split(args: tuple) -> tuple[RMSNormForm, QuantFP8, str]:
    """(norm, quant, group_name) from an op's arguments after x, residual and weight."""
    return RMSNormForm(*args[:3]), QuantFP8(*args[3:7]), args[7]


def _on_reference(op, x, residual, weight, *args):
    """Either op (``op`` names it for the fallback record; residual None: the one without) on
    every device and backend, gloo included: the functional collective, then the reference."""
    norm, quant, group_name = _split(args)
    check_allreduce_rms_norm_quant_fp8_args(x, weight, norm, quant, residual)
    if x.device.type != "cuda":
        record_fallback(op, group_name, f"x is on {x.device.type}: the reference path")
    if residual is None:
        q, scales, r = allreduce_rms_norm_quant_fp8_reference(x, weight, norm, quant, group_name)
    else:
        q, scales, r = allreduce_add_rms_norm_quant_fp8_reference(x, residual, weight, norm, quant, group_name)
    return q.contiguous(), quant.own(scales), r.contiguous()


def _on_cuda(op, x, residual, weight, *args):
    """Either op on CUDA: the one-shot kernel where it serves, else NCCL + the fused norm +
    quantization kernel (for groups or sizes the one-shot kernel does not take), the reason
    recorded."""
    norm, quant, group_name = _split(args)
    check_allreduce_rms_norm_quant_fp8_args(x, weight, norm, quant, residual)
    if one_shot_usable(x, group_name, op):
        q, scales, r = _one_shot_module().launch_eligible(x, residual, weight, norm, quant, group_name)
    else:
        from fusion_passes.lowering.rms_norm_quant_fp8.triton import rms_norm_quant_fp8_triton

        # Contiguous: without a residual the sum is an output of the op, which promises
        # contiguous outputs.
        reduced = all_reduce_sum(x, group_name).contiguous()
        q, scales, r = rms_norm_quant_fp8_triton(reduced, weight, norm, quant, residual)
        r = reduced if r is None else r
    return q, quant.own(scales), r


def _fake(x, weight, *args):
    _, quant, _ = _split(args)
    q, scales = quant.fake_outputs(x)
    return q, scales, torch.empty_like(x, memory_format=torch.contiguous_format)


# sum(x) over the group (+ residual), RMSNorm, FP8 quantization: (codes, scales, new_residual),
# or (codes, scales, reduced).
allreduce_add_rms_norm_quant_fp8, allreduce_rms_norm_quant_fp8 = define_collective_op_pair(
    "allreduce_add_rms_norm_quant_fp8(Tensor x, Tensor residual, Tensor weight, float eps, "
    "float weight_offset, bool cast_before_weight, str scheme, Tensor? scale, int group_size, "
    "bool scale_ue8m0, str group_name) -> (Tensor, Tensor, Tensor)",
    "allreduce_rms_norm_quant_fp8(Tensor x, Tensor weight, float eps, float weight_offset, "
    "bool cast_before_weight, str scheme, Tensor? scale, int group_size, bool scale_ue8m0, "
    "str group_name) -> (Tensor, Tensor, Tensor)",
    _on_reference,
    _on_cuda,
    _fake,
)
