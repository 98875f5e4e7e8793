"""The canonical ops ``fusion_passes::allreduce_add_rms_norm_quant_fp8`` and
``fusion_passes::allreduce_rms_norm_quant_fp8``: the end of a tensor-parallel attention / MLP block
whose next projections are FP8 linears.

Unfused (what a TP FP8 model compiles to, once the norm and quantization are canonical):
    s = wait_tensor(all_reduce(x, "sum", group))                  a collective writing s
    q, scales, r = add_rms_norm_quant_fp8(s, residual, ...)      a norm + quant kernel reading s
Fused:
    q, scales, r = allreduce_add_rms_norm_quant_fp8(x, residual, weight, eps, weight_offset,
                       cast_before_weight, scheme, scale, group_size, scale_ue8m0, group_name)
    q, scales, s = allreduce_rms_norm_quant_fp8(x, weight, eps, weight_offset,
                       cast_before_weight, scheme, scale, group_size, scale_ue8m0, group_name)

The math, in the order it rounds (every step is an existing reference, composed, not restated):
    s      = sum over the ranks of group_name of x      all_reduce_sum: the functional collective
    r      = s + residual                               in x.dtype (add form; r = s otherwise)
    y      = rms_norm(r)                                 the rounding form the two flags select
    scales = the given scale (static), or max(amax(|f32(y)|) / 448, MIN_SCALE) per row
             (per_token) or per group of group_size columns (per_group), rounded up to a power of
             two under scale_ue8m0
    q      = fp8_e4m3fn(clamp(f32(y) / scales, -448, 448))
returning (q, scales, r), or (q, scales, s) for allreduce_rms_norm_quant_fp8: where no residual
is added (the first layer after a vocabulary-parallel embedding) the sum is the next residual.

Two ops rather than one with an optional residual, for the reason allreduce_add_rms_norm.py gives
(an op's outputs must not depend on whether an input is None). The static scheme returns a copy of
its scale: an op's outputs may not alias its inputs (Inductor's buffer planning assumes so).
Both are plain torch.library definitions (``collective_ops.define_collective_op_pair``, as the
non-quantizing pair), not custom_op: a dispatcher call on every step, so its host cost counts.

On CUDA the op runs the one-shot symmetric-memory kernel
(``allreduce_add_rms_norm_quant_fp8_symm_mem``: reduce + add + norm + quantize in one launch) when
``symm_mem_eligible`` allows it, else the NCCL allreduce then the fused norm + quantization Triton
kernel. Where a call did not take the one-shot kernel the reason is recorded per op and group
(``collective_ops.runtime_fallbacks``, shown by ``Report.summary``). The choice depends
only on what every rank shares, so all ranks take the same path. No direct launcher is
registered: a collective must stay a dispatcher call, never be inlined as a bare Triton launch.
"""

from __future__ import annotations

import torch

from fusion_passes.lowering.allreduce_rms_norm.op import one_shot_usable
from fusion_passes.lowering.allreduce_rms_norm.reference import (
    all_reduce_sum,
    check_allreduce_rms_norm_args,
)
from fusion_passes.lowering.common.collective_ops import define_collective_op_pair, record_fallback
from fusion_passes.lowering.rms_norm_quant_fp8.op import fake_quant_outputs, own_scales
from fusion_passes.lowering.rms_norm_quant_fp8.reference import (
    add_rms_norm_quant_fp8_reference,
    check_quant_args,
    rms_norm_quant_fp8_reference,
)


def check_allreduce_rms_norm_quant_fp8_args(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_offset: float,
    cast_before_weight: bool,
    scheme: str,
    scale: torch.Tensor | None,
    group_size: int,
    scale_ue8m0: bool,
    residual: torch.Tensor | None = None,
) -> None:
    """Raise ValueError (one line) for inputs the ops do not define: the norm's rules and the
    quantization's, both applied to x (the sum has x's shape and dtype)."""
    check_allreduce_rms_norm_args(x, weight, weight_offset, cast_before_weight, residual)
    check_quant_args(x, scheme, scale, group_size, scale_ue8m0)


def allreduce_add_rms_norm_quant_fp8_reference(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    weight_offset: float,
    cast_before_weight: bool,
    scheme: str,
    scale: torch.Tensor | None,
    group_size: int,
    scale_ue8m0: bool,
    group_name: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes, scales, r) of add_rms_norm_quant_fp8_reference(sum(x), residual, ...)."""
    return add_rms_norm_quant_fp8_reference(
        all_reduce_sum(x, group_name), residual, weight, eps, weight_offset, cast_before_weight,
        scheme, scale, group_size, scale_ue8m0,
    )  # fmt: skip


def allreduce_rms_norm_quant_fp8_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    weight_offset: float,
    cast_before_weight: bool,
    scheme: str,
    scale: torch.Tensor | None,
    group_size: int,
    scale_ue8m0: bool,
    group_name: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes, scales, s) with (codes, scales) = rms_norm_quant_fp8_reference(s) and s = sum(x)."""
    reduced = all_reduce_sum(x, group_name)
    q, scales = rms_norm_quant_fp8_reference(
        reduced, weight, eps, weight_offset, cast_before_weight, scheme, scale, group_size, scale_ue8m0
    )
    return q, scales, reduced


_one_shot = None


def _one_shot_module():
    """The one-shot kernel's module, imported at the first CUDA call (Triton, symmetric memory: a
    CPU user never needs them) and kept: an import statement in the per-call path costs host time
    on every step (as allreduce_add_rms_norm.one_shot_module)."""
    global _one_shot
    if _one_shot is None:
        from fusion_passes.lowering.allreduce_rms_norm_quant_fp8 import symm_mem as allreduce_add_rms_norm_quant_fp8_symm_mem

        _one_shot = allreduce_add_rms_norm_quant_fp8_symm_mem
    return _one_shot


def _on_reference(
    op, x, residual, weight, eps, weight_offset, cast_before_weight, scheme, scale, group_size,
    scale_ue8m0, group_name,
):  # fmt: skip
    """Either op (``op`` names it for the fallback record; residual None: the one without) on
    every device and backend, gloo included: the functional collective, then the reference."""
    check_allreduce_rms_norm_quant_fp8_args(
        x, weight, weight_offset, cast_before_weight, scheme, scale, group_size, scale_ue8m0, residual
    )
    if x.device.type != "cuda":
        record_fallback(op, group_name, f"x is on {x.device.type}: the reference path")
    quant = (scheme, scale, group_size, scale_ue8m0, group_name)
    if residual is None:
        q, scales, r = allreduce_rms_norm_quant_fp8_reference(
            x, weight, eps, weight_offset, cast_before_weight, *quant
        )
    else:
        q, scales, r = allreduce_add_rms_norm_quant_fp8_reference(
            x, residual, weight, eps, weight_offset, cast_before_weight, *quant
        )
    return q.contiguous(), own_scales(scales, scale), r.contiguous()


def _on_cuda(
    op, x, residual, weight, eps, weight_offset, cast_before_weight, scheme, scale, group_size,
    scale_ue8m0, group_name,
):  # fmt: skip
    """Either op on CUDA: the one-shot kernel where it serves, else NCCL + the fused norm +
    quantization kernel (for groups or sizes the one-shot kernel does not take), the reason
    recorded."""
    check_allreduce_rms_norm_quant_fp8_args(
        x, weight, weight_offset, cast_before_weight, scheme, scale, group_size, scale_ue8m0, residual
    )
    if one_shot_usable(x, group_name, op):
        q, scales, r = _one_shot_module().launch_eligible(
            x, residual, weight, eps, weight_offset, cast_before_weight, scheme, scale, group_size,
            scale_ue8m0, group_name,
        )  # fmt: skip
    else:
        from fusion_passes.lowering.rms_norm_quant_fp8.triton import rms_norm_quant_fp8_triton

        # Contiguous: without a residual the sum is an output of the op, which promises
        # contiguous outputs.
        reduced = all_reduce_sum(x, group_name).contiguous()
        q, scales, r = rms_norm_quant_fp8_triton(
            reduced, weight, eps, weight_offset, cast_before_weight, scheme, scale, group_size,
            scale_ue8m0, residual,
        )  # fmt: skip
        r = reduced if r is None else r
    return q, own_scales(scales, scale), r


def _fake(
    x, weight, eps, weight_offset, cast_before_weight, scheme, scale, group_size, scale_ue8m0,
    group_name,
):  # fmt: skip
    q, scales = fake_quant_outputs(x, scheme, scale, group_size)
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
