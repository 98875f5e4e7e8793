"""The canonical op ``fusion_passes::gated_delta_step``: one Gated DeltaNet decode step.

Unfused (transformers' gating + torch_recurrent_gated_delta_rule at one token, traced): sigmoid,
softplus gating, repeat_interleave of q and k, two l2norms, the decay, delta and output
reductions over the fp32 state, the output's transpose and cast, and the new state's copy back
into the cache: 4 kernels with stock Inductor (measured on one H200; 12.1 us at batch 1, 243 us
at 128 inside a CUDA graph, where one read and one write of the state take 126 us).
Fused:
    out, new_state = gated_delta_step(q, k, v, a, b, A_log, dt_bias, state,
                                      scale, divide_scale, qk_l2norm, l2norm_eps)
one kernel reading the state once and writing it once (in place on CUDA: ``direct_launch``'s
inputs written in place; Inductor's reinplacing drops the copy into the cache).

``gated_delta_step_norm``: the same step with the layer's gated RMSNorm of its output
(``norm(out) * silu(z)``, Qwen3_5RMSNormGated) in the same launch: y, new_state.

The math lives in ``reference``.
"""

from __future__ import annotations

import torch

from fusion_passes.lowering.common.direct_launch import register_launcher
from fusion_passes.lowering.common.ops import op_from_reference
from fusion_passes.lowering.gated_delta_step.reference import (
    check_gated_delta_step_args,
    check_gated_delta_step_norm_args,
    gated_delta_step_norm_reference,
    gated_delta_step_reference,
)

gated_delta_step = op_from_reference(
    "gated_delta_step", gated_delta_step_reference, check=check_gated_delta_step_args
)


# The CUDA kernel doubles as the direct launcher; the state (argument 7) is written in place only
# when the launch is inlined (wrap given), else into a copy.
@gated_delta_step.register_kernel("cuda")
@register_launcher(torch.ops.fusion_passes.gated_delta_step.default, writes_inputs=(7,))
def _gated_delta_step_cuda(*args, wrap=None):
    from fusion_passes.lowering.gated_delta_step.triton import gated_delta_step_triton

    return gated_delta_step_triton(*args, wrap=wrap)


@gated_delta_step.register_fake
def _gated_delta_step_fake(q, k, v, a, b, A_log, dt_bias, state, *form):
    check_gated_delta_step_args(q, k, v, a, b, A_log, dt_bias, state)
    return torch.empty(v.shape, dtype=v.dtype, device=v.device), torch.empty_like(
        state, memory_format=torch.contiguous_format
    )


gated_delta_step_norm = op_from_reference(
    "gated_delta_step_norm", gated_delta_step_norm_reference, check=check_gated_delta_step_norm_args
)


# The same in-place state (argument 7); one launch, or two under the launch table's bound.
@gated_delta_step_norm.register_kernel("cuda")
@register_launcher(torch.ops.fusion_passes.gated_delta_step_norm.default, writes_inputs=(7,))
def _gated_delta_step_norm_cuda(*args, wrap=None):
    from fusion_passes.lowering.gated_delta_step.norm_triton import gated_delta_step_norm_triton

    return gated_delta_step_norm_triton(*args, wrap=wrap)


@gated_delta_step_norm.register_fake
def _gated_delta_step_norm_fake(q, k, v, a, b, A_log, dt_bias, state, z, norm_weight, scale, divide_scale,
                                qk_l2norm, l2norm_eps, norm_eps, weight_offset, cast_before_weight):  # fmt: skip
    check_gated_delta_step_norm_args(q, k, v, a, b, A_log, dt_bias, state, z, norm_weight, weight_offset,
                                     cast_before_weight)  # fmt: skip
    return torch.empty(z.shape, dtype=v.dtype, device=v.device), torch.empty_like(
        state, memory_format=torch.contiguous_format
    )
