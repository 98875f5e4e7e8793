"""The canonical op ``fusion_passes::chunk_gated_delta_rule``: Gated DeltaNet's prefill.

Unfused (transformers' ``torch_chunk_gated_delta_rule``, traced): the per-chunk prep (l2norms,
cumulative decays, the pairwise-decay products, two triangular solves) and then a Python loop over
the chunks that torch.compile unrolls, one set of small batched GEMMs and elementwise kernels per
64 tokens: a 4096-token prompt is 64 sequential steps of ~5 kernels per layer.
Fused:
    out, final_state = chunk_gated_delta_rule(q, k, v, g, beta, state, scale, qk_l2norm, l2norm_eps)
on CUDA flash-linear-attention's chunk kernels (the optional extra ``fla``: fla-core, whose
``chunk_gated_delta_rule`` has this op's arguments and layout), elsewhere the reference.

The math lives in ``reference``; ``fla_chunk_kernel_refusal`` says where the CUDA kernel cannot
run it (the fusion leaves those sites to Inductor).
"""

from __future__ import annotations

import functools
import warnings

import torch

from fusion_passes.lowering.chunk_gated_delta_rule.reference import (
    check_chunk_gated_delta_rule_args,
    chunk_gated_delta_rule_reference,
)
from fusion_passes.lowering.common.ops import op_from_reference

chunk_gated_delta_rule = op_from_reference(
    "chunk_gated_delta_rule", chunk_gated_delta_rule_reference, check=check_chunk_gated_delta_rule_args
)

# flash-linear-attention's l2norm adds this eps (fla.modules.l2norm.l2norm_fwd's default), as
# transformers' l2norm does.
FLA_L2NORM_EPS = 1e-6
# Its chunk kernels hold a head's key dimension in one block.
FLA_MAX_HEAD_DIM = 256


@functools.cache
def fla_chunk_kernel():
    """flash-linear-attention's chunk_gated_delta_rule, or None where fla-core is not installed."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as kernel
    except ImportError:
        return None
    return kernel


def fla_chunk_kernel_refusal(q: torch.Tensor, v: torch.Tensor, l2norm_eps: float) -> str | None:
    """Why the CUDA kernel cannot compute these arguments (None: it can)."""
    if fla_chunk_kernel() is None:
        return "no chunk kernel on CUDA: flash-linear-attention (the extra `fla`, fla-core) is not installed"
    if q.dtype == torch.float32:
        return "flash-linear-attention's chunk kernel takes bf16 / fp16 q, k, v, not fp32"
    if max(q.shape[-1], v.shape[-1]) > FLA_MAX_HEAD_DIM:
        return f"head dims {q.shape[-1]} / {v.shape[-1]} exceed the chunk kernel's {FLA_MAX_HEAD_DIM}"
    if l2norm_eps != FLA_L2NORM_EPS:
        return f"l2norm eps {l2norm_eps:g} is not flash-linear-attention's {FLA_L2NORM_EPS:g}"
    return None


# The inputs' l2norms and copies in one kernel of ours (qkv_prep_triton) instead of fla's input
# guard's transposing copies and its two l2norm launches. Measured on one H200 (Qwen 3.5's 16 key /
# 32 value heads of 128, inputs as views of the conv's [B, C, T] output, the whole op in a CUDA
# graph, 3 alternating rounds within 1%): 150 -> 95 us at 1024 tokens, 506 -> 289 at 4096,
# 1893 -> 1090 at 16384. False: fla's own path (for A/B runs).
QKV_PREP_KERNEL = True


@chunk_gated_delta_rule.register_kernel("cuda")
def _chunk_gated_delta_rule_cuda(q, k, v, g, beta, state, scale, qk_l2norm, l2norm_eps):
    check_chunk_gated_delta_rule_args(q, k, v, g, beta, state)
    if fla_chunk_kernel_refusal(q, v, l2norm_eps) is not None:
        return chunk_gated_delta_rule_reference(q, k, v, g, beta, state, scale, qk_l2norm, l2norm_eps)
    if qk_l2norm and QKV_PREP_KERNEL:
        from fusion_passes.lowering.chunk_gated_delta_rule.qkv_prep_triton import qkv_prep_triton

        (q, k, v), qk_l2norm = qkv_prep_triton(q, k, v, l2norm_eps), False
    with warnings.catch_warnings():
        # fla warns of a [B, H, T, ...] layout whenever T < H: a prompt shorter than the heads
        warnings.filterwarnings("ignore", message="Input tensor shape suggests potential format mismatch")
        out, final_state = fla_chunk_kernel()(
            q, k, v, g.float(), beta, scale=scale, initial_state=state, output_final_state=True,
            use_qk_l2norm_in_kernel=qk_l2norm,
        )  # fmt: skip
    return out.contiguous(), final_state.float().contiguous()


@chunk_gated_delta_rule.register_fake
def _chunk_gated_delta_rule_fake(q, k, v, g, beta, state, *form):
    check_chunk_gated_delta_rule_args(q, k, v, g, beta, state)
    return torch.empty(v.shape, dtype=q.dtype, device=q.device), torch.empty_like(
        state, memory_format=torch.contiguous_format
    )
