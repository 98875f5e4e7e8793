"""RoPE as other code bases write it (each function: a model's attention prelude from the
projection outputs to the rotated q and k), written here from how those projects compute it, not
from the patterns' helpers. Inputs are built by ``inputs(name, dtype)``; every function returns
(q, k)."""

from __future__ import annotations

import torch

B, S, HQ, HK, D = 2, 5, 3, 1, 12  # odd sizes: 5 tokens, 3 + 1 heads of 12


def hf_rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def glm_rotate_half(x):
    """transformers GLM4's rotate_half_llm: GPT-J pairs."""
    x1 = x[..., 0::2]
    x2 = x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


# --- the rotary steps on [B, H, S, D] heads, as transformers writes them ---


def hf_rope(q, k, cos, sin):
    """transformers' apply_rotary_pos_emb (unsqueeze_dim=1), every dim rotated."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    q_embed = (q * cos) + (hf_rotate_half(q) * sin)
    k_embed = (k * cos) + (hf_rotate_half(k) * sin)
    return q_embed, k_embed


def hf_rope_partial(q, k, cos, sin, rotate_half=hf_rotate_half):
    """transformers' partial rotary (Phi-3, Qwen3-Next, GLM4): the first cos.shape[-1] dims
    rotated, the rest passed through and concatenated back."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    rotary_dim = cos.shape[-1]
    q_rot, q_pass = q[..., :rotary_dim], q[..., rotary_dim:]
    k_rot, k_pass = k[..., :rotary_dim], k[..., rotary_dim:]
    q_embed = torch.cat([(q_rot * cos) + (rotate_half(q_rot) * sin), q_pass], dim=-1)
    k_embed = torch.cat([(k_rot * cos) + (rotate_half(k_rot) * sin), k_pass], dim=-1)
    return q_embed, k_embed


def glm4_rope(q, k, cos, sin):
    """transformers GLM4: cos / sin of the rotary embedding's cat((freqs, freqs)) cut to their
    first half and repeat_interleave(2)-ed, GPT-J pairs on that many dims."""
    cos = cos[..., : cos.shape[-1] // 2].repeat_interleave(2, dim=-1)
    sin = sin[..., : sin.shape[-1] // 2].repeat_interleave(2, dim=-1)
    return hf_rope_partial(q, k, cos, sin, rotate_half=glm_rotate_half)


# --- the attention preludes, from the projections ---


def _heads(q_proj, k_proj):
    b, s = q_proj.shape[:2]
    return q_proj.view(b, s, -1, D).transpose(1, 2), k_proj.view(b, s, -1, D).transpose(1, 2)


def llama(q_proj, k_proj, cos, sin):
    """transformers Llama / Qwen3 (no q/k norm here): view, transpose, cos.unsqueeze(1)."""
    return hf_rope(*_heads(q_proj, k_proj), cos, sin)


def gemma(q_proj, k_proj, cos32, sin32):
    """transformers Gemma: the rotary embedding's fp32 cos / sin cast to the activations' dtype."""
    cos, sin = cos32.to(dtype=q_proj.dtype), sin32.to(dtype=q_proj.dtype)
    return llama(q_proj, k_proj, cos, sin)


def olmo2(q_proj, k_proj, cos32, sin32):
    """transformers Olmo2: fp32 cos / sin (q * cos promotes), each result cast back."""
    q, k = _heads(q_proj, k_proj)
    q_embed, k_embed = hf_rope(q, k, cos32, sin32)
    return q_embed.to(q.dtype), k_embed.to(k.dtype)


def phi3(qkv, cos_half, sin_half):
    """transformers Phi-3: one qkv projection sliced, partial rotary (cos spans R < D)."""
    query_pos = HQ * D
    q, k = _heads(qkv[..., :query_pos], qkv[..., query_pos : query_pos + HK * D])
    return hf_rope_partial(q, k, cos_half, sin_half)


def glm4(q_proj, k_proj, cos_half, sin_half):
    """transformers GLM4: GPT-J pairs on the first half of the head (see glm4_rope)."""
    return glm4_rope(*_heads(q_proj, k_proj), cos_half, sin_half)


def gpt_fast_apply(x, freqs_cis):
    xshaped = x.float().reshape(*x.shape[:-1], -1, 2)
    freqs_cis = freqs_cis.view(1, xshaped.size(1), 1, xshaped.size(3), 2)
    x_out2 = torch.stack(
        [
            xshaped[..., 0] * freqs_cis[..., 0] - xshaped[..., 1] * freqs_cis[..., 1],
            xshaped[..., 1] * freqs_cis[..., 0] + xshaped[..., 0] * freqs_cis[..., 1],
        ],
        -1,
    )
    x_out2 = x_out2.flatten(3)
    return x_out2.type_as(x)


def gpt_fast(qkv, freqs_cache, input_pos):
    """gpt-fast: fused wqkv + split, RoPE on [B, S, H, D] before the transpose, bf16 cache."""
    bsz, seqlen = qkv.shape[:2]
    q, k, v = qkv.split([HQ * D, HK * D, HK * D], dim=-1)
    q = q.view(bsz, seqlen, HQ, D)
    k = k.view(bsz, seqlen, HK, D)
    freqs_cis = freqs_cache[input_pos]
    q = gpt_fast_apply(q, freqs_cis)
    k = gpt_fast_apply(k, freqs_cis)
    q, k = map(lambda x: x.transpose(1, 2), (q, k))
    return q, k


def vllm_apply(x, cos, sin, is_neox_style):
    cos = cos.unsqueeze(-2).to(x.dtype)
    sin = sin.unsqueeze(-2).to(x.dtype)
    if is_neox_style:
        x1, x2 = torch.chunk(x, 2, dim=-1)
    else:
        x1 = x[..., ::2]
        x2 = x[..., 1::2]
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    if is_neox_style:
        return torch.cat((o1, o2), dim=-1)
    return torch.stack((o1, o2), dim=-1).flatten(-2)


def vllm_native(positions, query, key, cos_sin_cache, rotary_dim, is_neox_style):
    """vLLM's RotaryEmbedding.forward_native on flat [T, H * D] q / k: cos / sin gathered by
    position and chunked, the first rotary_dim dims of each head rotated, the rest passed."""
    positions = positions.flatten()
    num_tokens = positions.shape[0]
    cos_sin = cos_sin_cache.index_select(0, positions)
    cos, sin = cos_sin.chunk(2, dim=-1)
    out = []
    for x in (query, key):
        shape = x.shape
        x = x.view(num_tokens, -1, D)
        x_rot = x[..., :rotary_dim]
        x_pass = x[..., rotary_dim:]
        x_rot = vllm_apply(x_rot, cos, sin, is_neox_style)
        out.append(torch.cat((x_rot, x_pass), dim=-1).reshape(shape))
    return tuple(out)


def vllm(neox: bool, rotary_dim: int):
    """vLLM's RotaryEmbedding.forward_native on flat [T, H * D] q / k."""

    def fn(positions, query, key, cos_sin_cache):
        return vllm_native(positions, query, key, cos_sin_cache, rotary_dim, neox)

    fn.__name__ = f"vllm_{'neox' if neox else 'gptj'}_{rotary_dim}"
    return fn


def _angles(s, half, batch=B):
    return 50 * torch.rand(batch, s, half)


def inputs(name: str, dtype: torch.dtype, seed: int = 0):
    torch.manual_seed(seed)
    q_proj = torch.randn(B, S, HQ * D).to(dtype)
    k_proj = torch.randn(B, S, HK * D).to(dtype)
    if name in ("llama", "gemma", "olmo2"):
        a = _angles(S, D // 2)
        a = torch.cat((a, a), -1)
        cos, sin = a.cos(), a.sin()
        if name == "llama":
            cos, sin = cos.to(dtype), sin.to(dtype)
        return q_proj, k_proj, cos, sin
    if name in ("phi3", "glm4"):
        a = _angles(S, D // 4)  # rotary D / 2 (partial_rotary_factor 0.5)
        a = torch.cat((a, a), -1)
        cos, sin = a.cos().to(dtype), a.sin().to(dtype)
        if name == "phi3":
            return torch.randn(B, S, (HQ + 2 * HK) * D).to(dtype), cos, sin
        return q_proj, k_proj, cos, sin
    if name == "gpt_fast":
        a = 50 * torch.rand(16, D // 2)
        cache = torch.stack([a.cos(), a.sin()], dim=-1).to(torch.bfloat16)
        qkv = torch.randn(1, S, (HQ + 2 * HK) * D).to(dtype)
        return qkv, cache, torch.tensor([3, 7, 0, 15, 9])
    if name.startswith("vllm"):
        rotary = int(name.rsplit("_", 1)[1])
        a = 50 * torch.rand(32, rotary // 2)
        cache = torch.cat([a.cos(), a.sin()], dim=-1).to(dtype)
        t = 7
        return (
            torch.tensor([5, 0, 31, 2, 2, 17, 9]),
            torch.randn(t, HQ * D).to(dtype),
            torch.randn(t, HK * D).to(dtype),
            cache,
        )
    raise KeyError(name)


SPELLINGS = {
    "llama": llama,
    "gemma": gemma,
    "olmo2": olmo2,
    "phi3": phi3,
    "glm4": glm4,
    "gpt_fast": gpt_fast,
    "vllm_neox_12": vllm(True, 12),
    "vllm_neox_8": vllm(True, 8),
    "vllm_gptj_12": vllm(False, 12),
    "vllm_gptj_8": vllm(False, 8),
}
# The raise fusion each spelling's two sites (q and k) go to.
RAISED_BY = {
    "llama": "rope",
    "gemma": "rope",
    "olmo2": "rope",
    "phi3": "rope_partial",
    "glm4": "rope_partial",
    "gpt_fast": "rope_gpt_fast",
    "vllm_neox_12": "rope_half_cos",
    "vllm_neox_8": "rope_half_cos_partial",
    "vllm_gptj_12": "rope_half_cos",
    "vllm_gptj_8": "rope_half_cos_partial",
}
