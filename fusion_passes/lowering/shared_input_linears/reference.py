"""Plain-torch reference of several bias-free linears that read one input: the single statement of
their math.

Models project one hidden state through several small weights, each its own GEMM (Qwen 3.5's
Gated DeltaNet ``in_proj_b`` / ``in_proj_a``; its MoE block's router, shared expert's gate and up
projections and ``shared_expert_gate``; an attention layer's ``k_proj`` / ``v_proj`` with few KV
heads):

    outputs = [F.linear(x, w) for w in weights]        # each [T, N_i], x's dtype

Every product of two bf16 / fp16 values is exact in fp32; a GEMM sums them in fp32 and rounds the
sum to the output dtype once. Another kernel sums in another order, so an output may differ from
cuBLAS's in its last bit (one rounding step of the output dtype), as cuBLAS's own kernels do
between shapes.
"""

from __future__ import annotations

import torch

INPUT_DTYPES = (torch.bfloat16, torch.float16)
MAX_WEIGHTS = 4  # weights one launch takes (the launch names each weight's pointer)


def check_shared_input_linears_args(x: torch.Tensor, weights: list[torch.Tensor]) -> None:
    """Raise a one-line ValueError for arguments the op does not define."""
    if x.dim() != 2:
        raise ValueError(f"shared_input_linears: input [T, K] expected, got {tuple(x.shape)}")
    if not 1 <= len(weights) <= MAX_WEIGHTS:
        raise ValueError(f"shared_input_linears: 1 to {MAX_WEIGHTS} weights expected, got {len(weights)}")
    if x.dtype not in INPUT_DTYPES:
        raise ValueError(f"shared_input_linears: a bf16 or fp16 input expected, got {x.dtype}")
    for w in weights:
        if w.dim() != 2 or w.shape[1] != x.shape[1]:
            raise ValueError(
                f"shared_input_linears: weights [N, {x.shape[1]}] expected for input {tuple(x.shape)}, "
                f"got {tuple(w.shape)}"
            )
        if w.dtype != x.dtype:
            raise ValueError(f"shared_input_linears: weights of the input's dtype {x.dtype} expected, got {w.dtype}")


def shared_input_linears_reference(x: torch.Tensor, weights: list[torch.Tensor]) -> list[torch.Tensor]:
    """[x @ w.T for w in weights]: F.linear(x, w) for each weight, in x's dtype."""
    return [torch.nn.functional.linear(x, w) for w in weights]
