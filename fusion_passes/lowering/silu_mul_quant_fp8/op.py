"""The canonical op ``fusion_passes::silu_mul_quant_fp8``.

Unfused (what FP8 serving runs between the gated MLP's up and down projections):
    y = silu(gate) * up (in the input dtype); scale = amax(|y|) / 448 (per token or per group of
    G); q = fp8_e4m3fn(clamp(y / scale, -448, 448))       (or with a given static scale)
Fused:
    q, scale = silu_mul_quant_fp8(gate, up, *quant)     quant: common.fp8.QuantFP8

gate and up may be two views of one gate_up projection (``gate_up.chunk(2, -1)``): the kernel
reads them in place. The math lives in ``reference``; this module only
registers the op: the reference is the implementation on every device, and CUDA tensors go to
the Triton kernel of ``triton``. The static scheme returns a copy of its
scale: a custom op's outputs may not alias its inputs.
"""

from __future__ import annotations

import torch

from fusion_passes.lowering.common.direct_launch import register_launcher
from fusion_passes.lowering.common.fp8 import FP8_MAX, MIN_SCALE, QuantFP8
from fusion_passes.lowering.silu_mul_quant_fp8.reference import silu_mul_quant_fp8_reference


@torch.library.custom_op("fusion_passes::silu_mul_quant_fp8", mutates_args=())
def silu_mul_quant_fp8(
    gate: torch.Tensor,
    up: torch.Tensor,
    scheme: str,
    scale: torch.Tensor | None = None,
    group_size: int = 128,
    scale_ue8m0: bool = False,
    floor_site: str = "scale",
    floor: float = MIN_SCALE,
    apply: str = "divide",
    pow2: str = "none",
    saturate: bool = True,
    fp8_max: float = FP8_MAX,
    scale_math: str = "fp32",
) -> tuple[torch.Tensor, torch.Tensor]:
    """SiLU-and-mul + FP8 quantization: returns (codes, scales); see silu_mul_quant_fp8_reference."""
    quant = QuantFP8(scheme, scale, group_size, scale_ue8m0, floor_site, floor, apply, pow2, saturate, fp8_max,
                     scale_math)  # fmt: skip
    q, scales = silu_mul_quant_fp8_reference(gate, up, quant)
    return q.contiguous(), quant.own(scales)


# The CUDA kernel doubles as the direct launcher (`wrap` given when Inductor inlines the launch).
@silu_mul_quant_fp8.register_kernel("cuda")
@register_launcher(torch.ops.fusion_passes.silu_mul_quant_fp8.default)
def _silu_mul_quant_fp8_cuda(gate, up, *quant, wrap=None):
    from fusion_passes.lowering.silu_mul_quant_fp8.triton import silu_mul_quant_fp8_triton

    quant = QuantFP8(*quant)
    q, scales = silu_mul_quant_fp8_triton(gate, up, quant, wrap=wrap)
    return q, quant.own(scales)


@silu_mul_quant_fp8.register_fake
def _silu_mul_quant_fp8_fake(gate, up, *quant):
    return QuantFP8(*quant).fake_outputs(gate)
