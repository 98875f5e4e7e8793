"""The canonical op ``fusion_passes::silu_mul_quant_fp8``.

Unfused (what FP8 serving runs between the gated MLP's up and down projections):
    y = silu(gate) * up (in the input dtype); scale = amax(|y|) / 448 (per token or per group of
    G); q = fp8_e4m3fn(clamp(y / scale, -448, 448))       (or with a given static scale)
Fused:
    q, scale = silu_mul_quant_fp8(gate, up, scheme, scale, group_size, scale_ue8m0)

gate and up may be two views of one gate_up projection (``gate_up.chunk(2, -1)``): the kernel
reads them in place. The math lives in ``silu_mul_quant_fp8_reference``; this module only
registers the op: the reference is the implementation on every device, and CUDA tensors go to
the Triton kernel of ``silu_mul_quant_fp8_triton``. The static scheme returns a copy of its
scale: a custom op's outputs may not alias its inputs.
"""

from __future__ import annotations

import torch

from fusion_passes.lowering.common.direct_launch import register_launcher
from fusion_passes.lowering.rms_norm_quant_fp8.reference import FP8_DTYPE
from fusion_passes.lowering.silu_mul_quant_fp8.reference import silu_mul_quant_fp8_reference


def own_scales(scales: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """The scales as a new contiguous tensor: the static scheme hands back the given scale."""
    return scales.clone() if scales is scale else scales.contiguous()


@torch.library.custom_op("fusion_passes::silu_mul_quant_fp8", mutates_args=())
def silu_mul_quant_fp8(
    gate: torch.Tensor,
    up: torch.Tensor,
    scheme: str,
    scale: torch.Tensor | None = None,
    group_size: int = 128,
    scale_ue8m0: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """SiLU-and-mul + FP8 quantization: returns (codes, scales); see silu_mul_quant_fp8_reference."""
    q, scales = silu_mul_quant_fp8_reference(gate, up, scheme, scale, group_size, scale_ue8m0)
    return q.contiguous(), own_scales(scales, scale)


# The CUDA kernel doubles as the direct launcher (`wrap` given when Inductor inlines the launch).
@silu_mul_quant_fp8.register_kernel("cuda")
@register_launcher(torch.ops.fusion_passes.silu_mul_quant_fp8.default)
def _silu_mul_quant_fp8_cuda(gate, up, scheme, scale=None, group_size=128, scale_ue8m0=False, *, wrap=None):
    from fusion_passes.lowering.silu_mul_quant_fp8.triton import silu_mul_quant_fp8_triton

    q, scales = silu_mul_quant_fp8_triton(gate, up, scheme, scale, group_size, scale_ue8m0, wrap=wrap)
    return q, own_scales(scales, scale)


@silu_mul_quant_fp8.register_fake
def _silu_mul_quant_fp8_fake(gate, up, scheme, scale=None, group_size=128, scale_ue8m0=False):
    q = torch.empty(gate.shape, dtype=FP8_DTYPE, device=gate.device)
    if scheme == "static":
        return q, torch.empty_like(scale, memory_format=torch.contiguous_format)
    groups = gate.shape[-1] // group_size if scheme == "per_group" else 1
    return q, gate.new_empty((*gate.shape[:-1], groups), dtype=torch.float32)
