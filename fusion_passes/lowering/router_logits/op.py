"""The canonical op ``fusion_passes::router_logits``: a MoE router's fp32 logits.

Unfused (transformers' DeepseekV3TopkRouter and its copies, traced): the gate weight upcast to fp32
in a kernel of its own every step (a new [E, H] fp32 tensor: 7.3 MB a layer at DeepSeek V3's 256
x 7168), then an fp32 GEMM reading that copy; the hidden states' upcast fused into the norm before.
Fused:
    logits = router_logits(hidden_states, weight)        # fp32 [T, E]
one kernel reading the bf16 / fp16 weight once, upcasting in its loads. The math lives in
``reference``.
"""

from __future__ import annotations

import torch

from fusion_passes.lowering.common.direct_launch import register_launcher
from fusion_passes.lowering.common.ops import op_from_reference
from fusion_passes.lowering.router_logits.reference import check_router_logits_args, router_logits_reference

router_logits = op_from_reference("router_logits", router_logits_reference, check=check_router_logits_args)


@router_logits.register_kernel("cuda")
@register_launcher(torch.ops.fusion_passes.router_logits.default)
def _router_logits_cuda(hidden_states, weight, wrap=None):
    from fusion_passes.lowering.router_logits.triton import router_logits_triton

    return router_logits_triton(hidden_states, weight, wrap=wrap)


@router_logits.register_fake
def _router_logits_fake(hidden_states, weight):
    check_router_logits_args(hidden_states, weight)
    return hidden_states.new_empty((hidden_states.shape[0], weight.shape[0]), dtype=torch.float32)
