"""Plain-torch reference of a MoE router's fp32 logits: the single statement of its math.

DeepSeek V2 / V3 / V3.2, GLM-4.5 / 4.6 (MoE), Kimi, dots1 and the other routers written after
transformers' DeepseekV3TopkRouter score in fp32 from bf16 (or fp16) hidden states and gate weight:

    logits = F.linear(hidden_states.type(torch.float32), weight.type(torch.float32))   # [T, E] fp32

Every product of two bf16 / fp16 values is exact in fp32, so the result is the fp32 sum of exact
products; summed in another order than cuBLAS's fp32 GEMM, it may differ in the last bits (which
can reorder experts whose scores tie to within them, as any other fp32 GEMM kernel may).
"""

from __future__ import annotations

import torch

INPUT_DTYPES = (torch.bfloat16, torch.float16)


def check_router_logits_args(hidden_states: torch.Tensor, weight: torch.Tensor) -> None:
    """Raise a one-line ValueError for arguments the op does not define."""
    if hidden_states.dim() != 2 or weight.dim() != 2:
        raise ValueError(
            f"router_logits: hidden states [T, H] and weight [E, H] expected, got {tuple(hidden_states.shape)} "
            f"and {tuple(weight.shape)}"
        )
    if hidden_states.shape[1] != weight.shape[1]:
        raise ValueError(f"router_logits: hidden size {hidden_states.shape[1]} against the weight's {weight.shape[1]}")
    if hidden_states.dtype not in INPUT_DTYPES or weight.dtype != hidden_states.dtype:
        raise ValueError(
            f"router_logits: bf16 or fp16 hidden states and weight of one dtype expected, got {hidden_states.dtype} "
            f"and {weight.dtype}"
        )


def router_logits_reference(hidden_states: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """fp32 [T, E] = f32(hidden_states) @ f32(weight).T"""
    return torch.nn.functional.linear(hidden_states.float(), weight.float())
