"""Shared by the MoE rewrite tests: transformers' MoE blocks (grouped_mm experts, each model's own
router) at tiny widths, bf16, with weights large enough that the routing differs per token."""

from __future__ import annotations

import torch
import transformers
from transformers.models.deepseek_v3 import modeling_deepseek_v3
from transformers.models.minimax_m2 import modeling_minimax_m2
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe

EXPERTS, TOP_K, HIDDEN = 16, 4, 64


def moe_block(name: str) -> torch.nn.Module:
    """qwen3.5-moe, minimax-m2 or deepseek-v3's MoE block."""
    common = dict(hidden_size=HIDDEN, num_experts_per_tok=TOP_K, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
    if name == "qwen3.5-moe":  # softmax top-k, renormalised; a gated shared expert
        config = transformers.Qwen3_5MoeTextConfig(
            moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=EXPERTS, **common
        )
        cls = modeling_qwen3_5_moe.Qwen3_5MoeSparseMoeBlock
    elif name == "minimax-m2":  # sigmoid + correction bias top-k
        config = transformers.MiniMaxM2Config(intermediate_size=32, num_local_experts=EXPERTS, **common)
        cls = modeling_minimax_m2.MiniMaxM2SparseMoeBlock
    else:  # deepseek-v3: group-limited sigmoid top-k, routed scaling, shared experts
        config = transformers.DeepseekV3Config(
            moe_intermediate_size=32, intermediate_size=64, n_routed_experts=EXPERTS, n_group=4, topk_group=2,
            n_shared_experts=1, **common,
        )
        cls = modeling_deepseek_v3.DeepseekV3MoE
    config._experts_implementation = "grouped_mm"
    torch.manual_seed(0)
    block = cls(config).to(torch.bfloat16).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.2)
    return block
