"""Per-model specs: which transformers classes to build, tiny / real config kwargs, norm layout.

Every ``*_kwargs(layers)`` function returns the keyword arguments of the transformers config class.
"tiny" configs are for CPU tests (hidden 128, 4 heads, 4 experts top-2, vocab 256). "real" configs use
the published widths of the named source model, with few layers (default 2) and 8 experts (top-2) so a
model fits one GPU; only the depth and the expert count / top-k differ from the published model.

Norm layout (``attn_norms`` etc.) was read off the decoder-layer / attention code of transformers 5.17
(``transformers/models/<type>/modeling_<type>.py``); paths are relative to ``model.layers.<i>`` and listed
in execution order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

TINY_VOCAB = 256
TINY_EXPERTS = 4
TINY_TOP_K = 2
REAL_EXPERTS = 8
REAL_TOP_K = 2


@dataclass(frozen=True)
class ModelSpec:
    name: str  # CLI name
    model_type: str  # transformers model type (directory under transformers/models/)
    config_class: str  # attribute of the `transformers` package
    model_class: str  # base model (returns last_hidden_state)
    min_transformers: str  # first release shipping `model_type` (best knowledge; builders tested on 5.17)
    source: str  # published model that size="real" follows
    tiny: Callable[[int], dict]
    real: Callable[[int], dict]
    # RMSNorm modules of a full-attention token mixer, relative to the layer, in execution order
    attn_norms: tuple[str, ...]
    # nn.LayerNorm modules of a full-attention token mixer (a fusion must not match them)
    attn_layer_norms: tuple[str, ...] = ()
    # RMSNormGated modules of a linear-attention (gated delta net) token mixer
    linear_attn_gated_norms: tuple[str, ...] = ()
    # RMSNorm modules of a linear-attention token mixer (none in the supported models)
    linear_attn_norms: tuple[str, ...] = ()
    # True: y = norm(x) * (1 + w), weight initialised to zeros (Qwen3-Next / Qwen3.5 family)
    zero_centered_norm: bool = False


def _dense_then_moe(layers: int, published_dense: int) -> int:
    """DeepSeek's leading dense layers, clipped so that at least one MoE layer remains when layers >= 2."""
    return max(0, min(published_dense, layers - 1))


def hybrid_layer_types(layers: int, interval: int = 4) -> list[str]:
    """Qwen3-Next / Qwen3.5 layout (3 linear-attention layers then 1 full-attention layer), forced to contain
    both kinds: with fewer than ``interval`` layers the last layer is full attention (2 layers: linear, full)."""
    types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(layers)]
    if "full_attention" not in types:
        types[-1] = "full_attention"
    return types


# --------------------------------------------------------------------------------------------- DeepSeek


def _deepseek_yarn() -> dict:
    # DeepSeek-V3 / V3.2-Exp config.json: rope_theta 1e4 with YaRN (factor 40 over 4096 positions)
    return {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 40.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    }


def _deepseek_v3_tiny(layers: int) -> dict:
    return dict(
        vocab_size=TINY_VOCAB,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        n_routed_experts=TINY_EXPERTS,
        routed_scaling_factor=2.5,
        q_lora_rank=64,
        kv_lora_rank=32,
        qk_rope_head_dim=16,
        qk_nope_head_dim=32,
        v_head_dim=32,
        n_group=2,  # 2 groups of 2 experts, 1 group kept, top-2 inside it
        topk_group=1,
        num_experts_per_tok=TINY_TOP_K,
        first_k_dense_replace=_dense_then_moe(layers, 1),
        norm_topk_prob=True,
        max_position_embeddings=163840,
        rms_norm_eps=1e-6,
        rope_parameters=_deepseek_yarn(),
        rope_interleave=True,
    )


def _deepseek_v3_real(layers: int) -> dict:
    # DeepSeek-V3 (deepseek-ai/DeepSeek-V3 config.json == transformers DeepseekV3Config defaults):
    # hidden 7168, 128 heads, q_lora 1536, kv_lora 512, rope 64 / nope 128 / v 128, moe_intermediate 2048,
    # 256 routed experts (8 groups, top-4 groups, top-8) + 1 shared, 3 leading dense layers, eps 1e-6.
    return dict(
        vocab_size=129280,
        hidden_size=7168,
        intermediate_size=18432,
        moe_intermediate_size=2048,
        num_hidden_layers=layers,
        num_attention_heads=128,
        num_key_value_heads=128,
        n_shared_experts=1,
        n_routed_experts=REAL_EXPERTS,
        routed_scaling_factor=2.5,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        qk_nope_head_dim=128,
        v_head_dim=128,
        n_group=4,  # published: 8 groups of 32 experts, 4 kept; here 4 groups of 2, 2 kept
        topk_group=2,
        num_experts_per_tok=REAL_TOP_K,
        first_k_dense_replace=_dense_then_moe(layers, 3),
        norm_topk_prob=True,
        max_position_embeddings=163840,
        rms_norm_eps=1e-6,
        rope_parameters=_deepseek_yarn(),
        rope_interleave=True,
    )


def _deepseek_v32_tiny(layers: int) -> dict:
    kw = _deepseek_v3_tiny(layers)
    kw.pop("rope_interleave")  # V3.2 always uses interleaved rope in MLA (non-interleaved in the indexer)
    kw.update(index_n_heads=4, index_head_dim=32, index_topk=4)  # topk < seq_len: the sparse mask is live
    return kw


def _deepseek_v32_real(layers: int) -> dict:
    # DeepSeek-V3.2-Exp (deepseek-ai/DeepSeek-V3.2-Exp config.json == DeepseekV32Config defaults): the V3
    # widths plus the DSA indexer: 64 heads of dim 128, top-2048 tokens, nn.LayerNorm k_norm.
    kw = _deepseek_v3_real(layers)
    kw.pop("rope_interleave")
    kw.update(index_n_heads=64, index_head_dim=128, index_topk=2048)
    return kw


# ------------------------------------------------------------------------------------------------- Qwen3


def _qwen3_tiny(layers: int) -> dict:
    return dict(
        vocab_size=TINY_VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        rms_norm_eps=1e-6,
        max_position_embeddings=40960,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    )


def _qwen3_real(layers: int) -> dict:
    # Qwen3-32B (largest dense Qwen3; Qwen/Qwen3-32B config.json): hidden 5120, intermediate 25600,
    # 64 q heads, 8 kv heads, head_dim 128, rope_theta 1e6, eps 1e-6, vocab 151936.
    return dict(
        vocab_size=151936,
        hidden_size=5120,
        intermediate_size=25600,
        num_hidden_layers=layers,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=128,
        rms_norm_eps=1e-6,
        max_position_embeddings=40960,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    )


def _qwen3_moe_tiny(layers: int) -> dict:
    return dict(
        vocab_size=TINY_VOCAB,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=TINY_EXPERTS,
        num_experts_per_tok=TINY_TOP_K,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        rms_norm_eps=1e-6,
        max_position_embeddings=40960,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    )


def _qwen3_moe_real(layers: int) -> dict:
    # Qwen3-235B-A22B (Qwen/Qwen3-235B-A22B config.json): hidden 4096, 64 q heads, 4 kv heads, head_dim 128,
    # moe_intermediate 1536, 128 experts top-8 (norm_topk_prob), rope_theta 1e6, eps 1e-6, vocab 151936.
    return dict(
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        moe_intermediate_size=1536,
        num_hidden_layers=layers,
        num_attention_heads=64,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=REAL_EXPERTS,
        num_experts_per_tok=REAL_TOP_K,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        rms_norm_eps=1e-6,
        max_position_embeddings=40960,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    )


# ----------------------------------------------------------------------------- Qwen3-Next / Qwen3.5 family


def _hybrid_tiny_common(layers: int) -> dict:
    return dict(
        vocab_size=TINY_VOCAB,
        hidden_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,  # partial_rotary_factor 0.25 -> 16 rotary dims
        linear_conv_kernel_dim=4,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        layer_types=hybrid_layer_types(layers),
        rms_norm_eps=1e-6,
    )


def _qwen3_next_tiny(layers: int) -> dict:
    return dict(
        _hybrid_tiny_common(layers),
        intermediate_size=256,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        num_experts=TINY_EXPERTS,
        num_experts_per_tok=TINY_TOP_K,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    )


def _qwen3_next_real(layers: int) -> dict:
    # Qwen3-Next-80B-A3B (Qwen/Qwen3-Next-80B-A3B-Instruct config.json == Qwen3NextConfig defaults): hidden
    # 2048, 16 q heads, 2 kv heads, head_dim 256, partial_rotary_factor 0.25, rope_theta 1e7; gated delta
    # net: 16 k heads / 32 v heads of dim 128, conv 4; every 4th layer full attention; 512 experts top-10,
    # moe/shared intermediate 512; eps 1e-6, vocab 151936.
    return dict(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=5120,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=256,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        layer_types=hybrid_layer_types(layers),
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
        num_experts=REAL_EXPERTS,
        num_experts_per_tok=REAL_TOP_K,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        rms_norm_eps=1e-6,
        max_position_embeddings=262144,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    )


def _qwen3_5_rope(mrope_section: list[int]) -> dict:
    # Qwen3.5 text rope: rope_theta 1e7, partial 0.25, interleaved M-RoPE (identical positions for text)
    return {
        "rope_type": "default",
        "rope_theta": 10000000.0,
        "partial_rotary_factor": 0.25,
        "mrope_section": mrope_section,
        "mrope_interleaved": True,
    }


def _qwen3_5_tiny(layers: int) -> dict:
    return dict(
        _hybrid_tiny_common(layers),
        intermediate_size=256,
        rope_parameters=_qwen3_5_rope([3, 3, 2]),  # 16 rotary dims -> 8 frequencies
    )


def _qwen3_5_real(layers: int) -> dict:
    # Qwen3.5-9B (the dense model that transformers' Qwen3_5TextConfig defaults describe): hidden 4096,
    # intermediate 12288, 16 q heads, 4 kv heads, head_dim 256, partial_rotary_factor 0.25; gated delta
    # net 16 k heads / 32 v heads of dim 128; every 4th layer full attention; eps 1e-6, vocab 248320.
    return dict(
        vocab_size=248320,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=256,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        layer_types=hybrid_layer_types(layers),
        rms_norm_eps=1e-6,
        max_position_embeddings=262144,
        rope_parameters=_qwen3_5_rope([11, 11, 10]),
    )


def _qwen3_5_moe_tiny(layers: int) -> dict:
    return dict(
        _hybrid_tiny_common(layers),
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        num_experts=TINY_EXPERTS,
        num_experts_per_tok=TINY_TOP_K,
        rope_parameters=_qwen3_5_rope([3, 3, 2]),
    )


def _qwen3_5_moe_real(layers: int) -> dict:
    # Qwen3.5-35B-A3B (transformers Qwen3_5MoeTextConfig defaults): hidden 2048, 16 q heads, 2 kv heads,
    # head_dim 256, partial_rotary_factor 0.25; gated delta net 16 k / 32 v heads of dim 128; 256 experts
    # top-8, moe/shared intermediate 512; every 4th layer full attention; eps 1e-6, vocab 248320.
    return dict(
        vocab_size=248320,
        hidden_size=2048,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=256,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        layer_types=hybrid_layer_types(layers),
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
        num_experts=REAL_EXPERTS,
        num_experts_per_tok=REAL_TOP_K,
        rms_norm_eps=1e-6,
        max_position_embeddings=262144,
        rope_parameters=_qwen3_5_rope([11, 11, 10]),
    )


# -------------------------------------------------------------------------------------------- MiniMax-M2


def _minimax_m2_tiny(layers: int) -> dict:
    return dict(
        vocab_size=TINY_VOCAB,
        hidden_size=128,
        intermediate_size=64,  # per-expert intermediate size
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_local_experts=TINY_EXPERTS,
        num_experts_per_tok=TINY_TOP_K,
        bos_token_id=0,  # the defaults (200034 / 200020) are outside the tiny vocab
        eos_token_id=1,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 5000000.0, "partial_rotary_factor": 0.5},
    )


def _minimax_m2_real(layers: int) -> dict:
    # MiniMax-M2 (MiniMaxAI/MiniMax-M2 config.json == MiniMaxM2Config defaults): hidden 3072, 48 q heads,
    # 8 kv heads, head_dim 128, rotary_dim 64 (partial_rotary_factor 0.5), rope_theta 5e6, per-layer
    # q/k norm over all heads, 256 experts top-8 with intermediate 1536, eps 1e-6, vocab 200064.
    return dict(
        vocab_size=200064,
        hidden_size=3072,
        intermediate_size=1536,
        num_hidden_layers=layers,
        num_attention_heads=48,
        num_key_value_heads=8,
        head_dim=128,
        num_local_experts=REAL_EXPERTS,
        num_experts_per_tok=REAL_TOP_K,
        rms_norm_eps=1e-6,
        max_position_embeddings=196608,
        rope_parameters={"rope_type": "default", "rope_theta": 5000000.0, "partial_rotary_factor": 0.5},
    )


_QK_NORMS = ("self_attn.q_norm", "self_attn.k_norm")
_MLA_NORMS = ("self_attn.q_a_layernorm", "self_attn.kv_a_layernorm")

SPECS: dict[str, ModelSpec] = {
    s.name: s
    for s in (
        ModelSpec(
            name="deepseek-v3",
            model_type="deepseek_v3",
            config_class="DeepseekV3Config",
            model_class="DeepseekV3Model",
            min_transformers="5.0.0",
            source="deepseek-ai/DeepSeek-V3",
            tiny=_deepseek_v3_tiny,
            real=_deepseek_v3_real,
            attn_norms=_MLA_NORMS,
        ),
        ModelSpec(
            name="deepseek-v3.2",
            model_type="deepseek_v32",
            config_class="DeepseekV32Config",
            model_class="DeepseekV32Model",
            min_transformers="5.0.0",
            source="deepseek-ai/DeepSeek-V3.2-Exp",
            tiny=_deepseek_v32_tiny,
            real=_deepseek_v32_real,
            attn_norms=_MLA_NORMS,
            attn_layer_norms=("self_attn.indexer.k_norm",),
        ),
        ModelSpec(
            name="qwen3",
            model_type="qwen3",
            config_class="Qwen3Config",
            model_class="Qwen3Model",
            min_transformers="5.0.0",
            source="Qwen/Qwen3-32B",
            tiny=_qwen3_tiny,
            real=_qwen3_real,
            attn_norms=_QK_NORMS,
        ),
        ModelSpec(
            name="qwen3-moe",
            model_type="qwen3_moe",
            config_class="Qwen3MoeConfig",
            model_class="Qwen3MoeModel",
            min_transformers="5.0.0",
            source="Qwen/Qwen3-235B-A22B",
            tiny=_qwen3_moe_tiny,
            real=_qwen3_moe_real,
            attn_norms=_QK_NORMS,
        ),
        ModelSpec(
            name="qwen3-next",
            model_type="qwen3_next",
            config_class="Qwen3NextConfig",
            model_class="Qwen3NextModel",
            min_transformers="5.0.0",
            source="Qwen/Qwen3-Next-80B-A3B-Instruct",
            tiny=_qwen3_next_tiny,
            real=_qwen3_next_real,
            attn_norms=_QK_NORMS,
            linear_attn_gated_norms=("linear_attn.norm",),
            zero_centered_norm=True,
        ),
        ModelSpec(
            name="qwen3.5",
            model_type="qwen3_5",
            config_class="Qwen3_5TextConfig",
            model_class="Qwen3_5TextModel",
            min_transformers="5.2.0",
            source="Qwen/Qwen3.5-9B",
            tiny=_qwen3_5_tiny,
            real=_qwen3_5_real,
            attn_norms=_QK_NORMS,
            linear_attn_gated_norms=("linear_attn.norm",),
            zero_centered_norm=True,
        ),
        ModelSpec(
            name="qwen3.5-moe",
            model_type="qwen3_5_moe",
            config_class="Qwen3_5MoeTextConfig",
            model_class="Qwen3_5MoeTextModel",
            min_transformers="5.2.0",
            source="Qwen/Qwen3.5-35B-A3B",
            tiny=_qwen3_5_moe_tiny,
            real=_qwen3_5_moe_real,
            attn_norms=_QK_NORMS,
            linear_attn_gated_norms=("linear_attn.norm",),
            zero_centered_norm=True,
        ),
        ModelSpec(
            name="minimax-m2",
            model_type="minimax_m2",
            config_class="MiniMaxM2Config",
            model_class="MiniMaxM2Model",
            min_transformers="5.0.0",
            source="MiniMaxAI/MiniMax-M2",
            tiny=_minimax_m2_tiny,
            real=_minimax_m2_real,
            attn_norms=_QK_NORMS,  # q_norm / k_norm over all heads (width heads*head_dim), not per head
        ),
    )
}
