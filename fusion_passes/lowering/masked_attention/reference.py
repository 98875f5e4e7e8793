"""Plain-torch reference of masked grouped-query attention: the single statement of its math.

A prefill on a static KV cache (transformers' StaticCache) attends every query token to the whole
cache through a mask, with fewer KV heads than query heads. SDPA's fused kernels take the mask as an
additive bias (a boolean mask becomes 0 where True, -inf where False, before the call: the form
the compiled graph holds), so the op takes that form:

    out[b, h, s] = softmax_t(scale * q[b, h, s] . k[b, h // g, t] + mask[b, 0, s, t]) @ v[b, h // g]
                                                                                   (g = Hq / Hkv)

which is ``F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)``.
A query row whose mask is -inf everywhere has no keys: zeros, as SDPA's math gives it. The output is
laid out [B, S, Hq, Dv] in memory (viewed [B, Hq, S, Dv]), as the fused kernels of SDPA leave it,
so that the model's transpose to tokens-first after it is a view. Computed in fp32, cast to the
input's dtype at the end; fused kernels (fp32 scores and sums, the probabilities rounded to the
input's dtype for the product with v, as flash attention does) are within its tolerance of this.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_masked_attention_args(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor) -> None:
    """Raise a one-line ValueError for arguments the op does not define."""
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4 or mask.dim() != 4:
        raise ValueError(
            "masked_attention: query [B, Hq, S, D], key [B, Hkv, L, D], value [B, Hkv, L, Dv] and mask "
            f"[B or 1, 1, S, L] expected, got {tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}, "
            f"{tuple(mask.shape)}"
        )
    bsz, heads, s, d = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    if key.shape[0] != bsz or key.shape[3] != d or tuple(value.shape[:3]) != (bsz, kv_heads, length):
        raise ValueError(
            f"masked_attention: key {tuple(key.shape)} / value {tuple(value.shape)} do not fit query {tuple(query.shape)}"
        )
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"masked_attention: {heads} query heads are not a multiple of {kv_heads} KV heads")
    if mask.dtype not in INPUT_DTYPES:
        raise ValueError(f"masked_attention: the mask is {mask.dtype}; an additive fp32, bf16 or fp16 mask expected")
    if mask.shape[0] not in (1, bsz) or mask.shape[1] != 1 or tuple(mask.shape[2:]) != (s, length):
        raise ValueError(f"masked_attention: mask {tuple(mask.shape)} must be [{bsz} or 1, 1, {s}, {length}]")
    if query.dtype not in INPUT_DTYPES or key.dtype != query.dtype or value.dtype != query.dtype:
        raise ValueError(
            f"masked_attention: query, key and value must share fp32, bf16 or fp16, got {query.dtype}, {key.dtype}, "
            f"{value.dtype}"
        )


def masked_attention_reference(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """[B, Hq, S, Dv] in query's dtype, laid out [B, S, Hq, Dv] (module docstring)."""
    heads, kv_heads = query.shape[1], key.shape[1]
    groups = heads // kv_heads
    # the math backend, with each KV head repeated as repeat_kv lays them out (head h reads h // g)
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    # in fp32 (SDPA's math backend would round the scores to a bf16 / fp16 input's dtype)
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        out = F.scaled_dot_product_attention(
            query.float(), key.float(), value.float(), attn_mask=mask.float(), scale=scale
        )
    return out.to(query.dtype).transpose(1, 2).contiguous().transpose(1, 2)


def check_causal_attention_args(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, first: torch.Tensor) -> None:
    """Raise a one-line ValueError for arguments masked_attention_causal does not define."""
    s, length = (query.shape[2], key.shape[2]) if query.dim() == 4 and key.dim() == 4 else (1, 1)
    mask = torch.empty((1, 1, s, length), dtype=query.dtype, device="meta")  # the causal mask's shape, never read
    check_masked_attention_args(query, key, value, mask)
    if first.numel() != 1 or first.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"masked_attention_causal: the first position must be one int tensor, got {first.dtype} "
                         f"{tuple(first.shape)}")  # fmt: skip


def causal_mask_from_first(s: int, length: int, first: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The additive [1, 1, S, L] mask of a prompt whose token i sits at cache position first + i and
    sees the positions up to it: 0 where ``t <= first + i``, -inf elsewhere."""
    device = first.device
    keep = torch.arange(length, device=device)[None, :] <= first.reshape(()) + torch.arange(s, device=device)[:, None]
    return torch.zeros((1, 1, s, length), dtype=dtype, device=device).masked_fill(~keep, float("-inf"))


def masked_attention_causal_reference(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, first: torch.Tensor, scale: float
) -> torch.Tensor:
    """``masked_attention_reference`` through the causal mask of a prompt from cache position
    ``first`` (``causal_mask_from_first``): the mask is computed, not read. With ``first >= 0``
    every query token sees position 0, so no row is without keys."""
    mask = causal_mask_from_first(query.shape[2], key.shape[2], first, query.dtype)
    return masked_attention_reference(query, key, value, mask, scale)
