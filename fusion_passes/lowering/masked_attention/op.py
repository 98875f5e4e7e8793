"""The canonical op ``fusion_passes::masked_attention``: grouped-query attention through a boolean
mask, each query head reading its KV head from the cache as it is.

Unfused (transformers on a StaticCache prefill, traced): repeat_kv's copies of keys and values,
g times wider, then SDPA with the mask over the whole cache (cuDNN on an H200: every key block of
every query block, the masked ones too).
Fused:
    out = masked_attention(query, key, value, mask, scale)     # [B, Hq, S, Dv]
a flash-attention kernel that skips the key blocks the mask closes (after a small kernel that
summarizes the mask's blocks); at one query token (a decode step) one program per query head that
loads only the key and value rows the mask opens (``decode``). And ``masked_attention_causal``: the
same through a prompt's causal mask from its first cache position, computed in the kernel instead
of read (no mask, no block summary):
    out = masked_attention_causal(query, key, value, first, scale)
The math lives in ``reference``.
"""

from __future__ import annotations

import torch

from fusion_passes.lowering.common.direct_launch import register_launcher
from fusion_passes.lowering.common.ops import op_from_reference
from fusion_passes.lowering.masked_attention.reference import (
    check_causal_attention_args,
    check_masked_attention_args,
    masked_attention_causal_reference,
    masked_attention_reference,
)

masked_attention = op_from_reference(
    "masked_attention", masked_attention_reference, check=check_masked_attention_args, contiguous=False
)


@masked_attention.register_kernel("cuda")
@register_launcher(torch.ops.fusion_passes.masked_attention.default)
def _masked_attention_cuda(query, key, value, mask, scale, wrap=None):
    if query.shape[2] == 1:
        from fusion_passes.lowering.masked_attention.decode import masked_decode_attention_triton

        return masked_decode_attention_triton(query, key, value, mask, scale, wrap=wrap)
    from fusion_passes.lowering.masked_attention.triton import masked_attention_triton

    return masked_attention_triton(query, key, value, mask, scale, wrap=wrap)


def _output(query: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """[B, Hq, S, Dv] laid out [B, S, Hq, Dv], as the kernels write it."""
    bsz, heads, s, _ = query.shape
    out = torch.empty((bsz, s, heads, value.shape[3]), dtype=query.dtype, device=query.device)
    return out.permute(0, 2, 1, 3)


@masked_attention.register_fake
def _masked_attention_fake(query, key, value, mask, scale):
    check_masked_attention_args(query, key, value, mask)
    return _output(query, value)


masked_attention_causal = op_from_reference(
    "masked_attention_causal", masked_attention_causal_reference, check=check_causal_attention_args, contiguous=False
)


@masked_attention_causal.register_kernel("cuda")
@register_launcher(torch.ops.fusion_passes.masked_attention_causal.default)
def _masked_attention_causal_cuda(query, key, value, first, scale, wrap=None):
    from fusion_passes.lowering.masked_attention.triton import masked_attention_triton

    return masked_attention_triton(query, key, value, None, scale, causal_first=first, wrap=wrap)


@masked_attention_causal.register_fake
def _masked_attention_causal_fake(query, key, value, first, scale):
    check_causal_attention_args(query, key, value, first)
    return _output(query, value)
