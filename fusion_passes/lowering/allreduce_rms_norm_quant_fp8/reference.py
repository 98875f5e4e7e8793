"""Plain-torch reference of allreduce + (residual add +) RMSNorm + FP8 quantization: the single
statement of its math, composed of existing references, not restated.

    s         = sum over the ranks of group_name of x      all_reduce_sum: the functional collective
    r         = s + residual                               in x.dtype (add form; r = s otherwise)
    q, scales = rms_norm_quant_fp8_reference(r, weight, norm, quant)
returning (q, scales, r), or (q, scales, s) without the residual: where no residual is added (the
first layer after a vocabulary-parallel embedding) the sum is the next residual.
"""

from __future__ import annotations

import torch

from fusion_passes.lowering.allreduce_rms_norm.reference import (
    all_reduce_sum,
    check_allreduce_rms_norm_args,
)
from fusion_passes.lowering.common.fp8 import QuantFP8
from fusion_passes.lowering.rms_norm.reference import RMSNormForm
from fusion_passes.lowering.rms_norm_quant_fp8.reference import (
    add_rms_norm_quant_fp8_reference,
    rms_norm_quant_fp8_reference,
)


def check_allreduce_rms_norm_quant_fp8_args(
    x: torch.Tensor,
    weight: torch.Tensor,
    norm: RMSNormForm,
    quant: QuantFP8,
    residual: torch.Tensor | None = None,
) -> None:
    """Raise ValueError (one line) for inputs the ops do not define: the norm's rules and the
    quantization's, both applied to x (the sum has x's shape and dtype)."""
    check_allreduce_rms_norm_args(x, weight, norm, residual)
    quant.check(x)
    if not quant.is_base_form():
        raise ValueError(
            "allreduce_rms_norm_quant_fp8: only the default quantization form (scale floored at "
            "1/(448*512) after the divide, a divide, saturated, fp32) is defined"
        )


def allreduce_add_rms_norm_quant_fp8_reference(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    norm: RMSNormForm,
    quant: QuantFP8,
    group_name: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes, scales, r) of add_rms_norm_quant_fp8_reference(sum(x), residual, ...)."""
    return add_rms_norm_quant_fp8_reference(all_reduce_sum(x, group_name), residual, weight, norm, quant)


def allreduce_rms_norm_quant_fp8_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    norm: RMSNormForm,
    quant: QuantFP8,
    group_name: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes, scales, s) with (codes, scales) = rms_norm_quant_fp8_reference(s) and s = sum(x)."""
    reduced = all_reduce_sum(x, group_name)
    return (*rms_norm_quant_fp8_reference(reduced, weight, norm, quant), reduced)
