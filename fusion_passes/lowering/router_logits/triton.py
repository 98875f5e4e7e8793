"""One Triton kernel for a MoE router's fp32 logits from bf16 / fp16 inputs (``reference``).

Unfused (stock Inductor on transformers' DeepseekV3TopkRouter): a pointwise kernel writing the gate
weight upcast to fp32 every step (read 2 bytes, write 4 per weight: 3.7 + 7.3 MB a layer at 256 x
7168), then cuBLAS's fp32 GEMM reading the copy (7.3 MB more).
Fused: each program takes BLOCK_T tokens x BLOCK_E experts and walks the hidden size BLOCK_K at a
time, upcasting the loaded bf16 / fp16 values and summing their exact fp32 products: the weight
is read once, in its own dtype (3.7 MB). At decode the experts are spread thin (2 a program at one
token: 128 programs for 256 experts) so that every SM streams a part of the weight. (Named a GEMM:
it is the router's GEMM, and the decode benchmark classes kernels by name.)
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from fusion_passes.lowering.common.skinny_gemm import weight_rows_times_input
from fusion_passes.lowering.router_logits.reference import check_router_logits_args


@triton.jit
def _router_gemm_kernel(
    x_ptr,  # *bf16/fp16 [T, H] (row stride stride_xt, H contiguous)
    w_ptr,  # *x.dtype [E, H] (row stride stride_we, H contiguous)
    out_ptr,  # *fp32 [T, E] contiguous
    T,
    E,
    H,
    stride_xt,
    stride_we,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    weight_rows_times_input(x_ptr, w_ptr, out_ptr, tl.program_id(0), t, T, E, H, stride_xt, stride_we, BLOCK_E, BLOCK_K)


def router_logits_triton(
    hidden_states: torch.Tensor, weight: torch.Tensor, *, wrap: Callable | None = None
) -> torch.Tensor:
    """fp32 [T, E] as ``router_logits_reference``."""
    check_router_logits_args(hidden_states, weight)
    x = hidden_states if hidden_states.stride(1) == 1 else hidden_states.contiguous()
    w = weight if weight.stride(1) == 1 else weight.contiguous()
    tokens, hidden = x.shape
    experts = w.shape[0]
    out = torch.empty((tokens, experts), dtype=torch.float32, device=x.device)
    if tokens == 0:
        return out
    # up to 4 tokens a program (a [4, BLOCK_E, 256] fp32 product tile: 32 registers a thread at 4
    # warps); experts a program so that the grid holds about 128 programs, 2 to 8 experts each
    block_t = min(4, triton.next_power_of_2(tokens))
    t_blocks = triton.cdiv(tokens, block_t)
    block_e = max(2, min(8, triton.next_power_of_2(max(1, experts * t_blocks // 128))))
    kernel = wrap(_router_gemm_kernel) if wrap is not None else _router_gemm_kernel
    kernel[(triton.cdiv(experts, block_e), t_blocks)](
        x, w, out, tokens, experts, hidden, x.stride(0), w.stride(0),
        BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_K=256, num_warps=4,
    )  # fmt: skip
    return out
