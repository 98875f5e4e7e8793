"""Grouped-query attention as real code bases write it before SDPA (transformers' repeat_kv,
gpt-fast's repeat_interleave, Meta's / torchtitan's repeat on [B, L, Hkv, D]), and two forms that
are not grouped heads read in place (keys tiled, a causal call): shared by the decode and prefill
attention fusions' tests."""

from __future__ import annotations

import torch.nn.functional as F


def transformers_repeat_kv(hidden_states, n_rep):
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


def transformers_sdpa(query, key, value, mask):
    """transformers' sdpa_attention_forward with a mask (no enable_gqa), module.scaling passed."""
    groups = query.shape[1] // key.shape[1]
    key, value = transformers_repeat_kv(key, groups), transformers_repeat_kv(value, groups)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=0.0, scale=0.125, is_causal=False)


def gpt_fast_sdpa(q, k, v, mask):
    """gpt-fast's Attention.forward after its KV-cache update."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0)


def meta_sdpa(xq, keys, values, mask):
    """Meta's llama reference / torchtitan repeat_kv on the cache's [B, L, Hkv, D], transposed after."""
    bs, slen, n_kv_heads, head_dim = keys.shape
    n_rep = xq.shape[1] // n_kv_heads

    def repeat_kv(x):
        return x[:, :, :, None, :].expand(bs, slen, n_kv_heads, n_rep, head_dim).reshape(bs, slen, n_kv_heads * n_rep, head_dim)

    keys, values = repeat_kv(keys).transpose(1, 2), repeat_kv(values).transpose(1, 2)
    return F.scaled_dot_product_attention(xq, keys, values, attn_mask=mask)


def tiled_sdpa(q, k, v, mask):
    """Keys tiled: query head h reads KV head h % Hkv, not h // g (another model's layout)."""
    groups = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat(1, groups, 1, 1), v.repeat(1, groups, 1, 1), attn_mask=mask)


def causal_sdpa(q, k, v, mask):
    groups = q.shape[1] // k.shape[1]
    k, v = transformers_repeat_kv(k, groups), transformers_repeat_kv(v, groups)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)
