"""Plain-torch reference of SiLU-and-mul + FP8 quantization: the single statement of its math.

Unfused: the gated MLP's activation y = silu(gate) * up (transformers' ``act_fn(gate_proj(x)) *
    up_proj(x)``; vLLM's SiluAndMul on the two halves of one gate_up projection), rounded to the
    input dtype as eager rounds it; then an amax reduction over y and a scale-and-cast pass
    writing float8_e4m3fn codes for the down projection.
Fused:   one pass; the math is the same, in this order:

    s   = to_dtype(f32(gate) / (1 + exp(-f32(gate))))      F.silu: fp32 math, rounded to the dtype
    y   = to_dtype(f32(s) * f32(up))                        the product, rounded again
    q, scales = quant_fp8_reference(y, quant)

The quantization is common/fp8.py's ``quant_fp8_reference`` (static, per_token, per_group;
FP8_MAX 448, MIN_SCALE floor, optional UE8M0 scales): one statement for every "... + FP8
quantization" op.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fusion_passes.lowering.common.fp8 import QuantFP8, quant_fp8_reference

# The dtypes the kernel loads and rounds to (its fp32 math covers them; fp64 it would not).
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_silu_mul_args(gate: torch.Tensor, up: torch.Tensor) -> None:
    """Raise ValueError (one line) for inputs the op does not define: gate and up are the two
    halves of the activation, of one shape and one dtype (no broadcasting, no type promotion:
    the model's product of two same-dtype tensors is what the op computes)."""
    if gate.shape != up.shape:
        raise ValueError(
            f"silu_mul: gate and up must have one shape, got {tuple(gate.shape)} and {tuple(up.shape)}"
        )
    if gate.dtype != up.dtype or gate.dtype not in DTYPES:
        raise ValueError(
            f"silu_mul: gate and up must share one dtype of {DTYPES}, got {gate.dtype} and {up.dtype}"
        )
    if gate.device != up.device:
        raise ValueError(f"silu_mul: gate and up are on {gate.device} and {up.device}")
    if gate.dim() < 1 or gate.shape[-1] == 0:
        raise ValueError(f"silu_mul: the inputs need a non-empty last dim, got {tuple(gate.shape)}")


def silu_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """y = silu(gate) * up in the input dtype, rounded exactly where eager rounds it."""
    check_silu_mul_args(gate, up)
    return F.silu(gate) * up


def silu_mul_quant_fp8_reference(
    gate: torch.Tensor, up: torch.Tensor, quant: QuantFP8
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference SiLU-and-mul + FP8 quantization along the last dim: returns (codes, scales)."""
    check_silu_mul_args(gate, up)
    quant.check(gate)
    return quant_fp8_reference(silu_mul_reference(gate, up), quant)
