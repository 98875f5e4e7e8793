"""Plain-torch reference of DeepSeek V3.2's index mask: the single statement of its math.

DeepSeek V3.2's indexer scores every cached position for each query token and its attention
keeps the top k (``index_topk``, 2048) of them. transformers builds the mask from a top-k and a
scatter:

    idx  = index_scores.topk(k, dim=-1).indices
    mask = ones(B, S, T, bool).scatter(-1, idx, False)        # True: the position is dropped

Only the set of the k chosen positions matters, not their order. For scores x [..., T] and k:

    key(x)   = the float's bits as a signed integer, negatives' magnitude bits flipped, so that
               keys order as the floats do; -0.0 below +0.0, NaN above +inf (the order torch's
               CUDA radix select ranks by)
    selected = the first k positions by key, descending; equal keys by the lowest position
    mask     = True outside ``selected``

torch.topk leaves the order of equal scores to the implementation. Its CUDA kernels take the
lowest positions among those equal to the k-th score, as this order does; the CPU's partial sort
does not promise it. Where no two scores tie at the k-th place, every order selects the same set.
"""

from __future__ import annotations

import torch

SCORE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_sparse_index_mask_args(index_scores: torch.Tensor, k: int) -> None:
    """Raise a one-line ValueError for arguments the op does not define."""
    if index_scores.dim() < 1 or index_scores.shape[-1] < 1:
        raise ValueError(f"sparse_index_mask: scores [..., T] with T >= 1 expected, got {tuple(index_scores.shape)}")
    if index_scores.dtype not in SCORE_DTYPES:
        raise ValueError(f"sparse_index_mask: scores are {index_scores.dtype}; fp32, bf16 or fp16 expected")
    if not 1 <= k <= index_scores.shape[-1]:
        raise ValueError(f"sparse_index_mask: k must be in [1, {index_scores.shape[-1]}], got {k}")


def order_keys(index_scores: torch.Tensor) -> torch.Tensor:
    """int32 keys that order as the scores (fp32), -0.0 below +0.0 and NaN above +inf."""
    x = index_scores.float()
    bits = x.view(torch.int32)
    keys = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return torch.where(torch.isnan(x), torch.full_like(keys, 2**31 - 1), keys)


def sparse_index_mask_reference(index_scores: torch.Tensor, k: int) -> torch.Tensor:
    """bool [..., T]: True at the positions outside the top k of each row (module docstring)."""
    order = torch.sort(order_keys(index_scores), dim=-1, descending=True, stable=True).indices
    mask = torch.ones(index_scores.shape, dtype=torch.bool, device=index_scores.device)
    return mask.scatter(-1, order[..., :k], False)


ATTENTION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_sparse_attention_mask_args(
    index_scores: torch.Tensor,
    k: int,
    attention_mask: torch.Tensor | None,
    dtype: torch.dtype,
    fill: float = float("-inf"),
    causal_first: torch.Tensor | None = None,
) -> None:
    """Raise a one-line ValueError for arguments sparse_attention_mask does not define."""
    check_sparse_index_mask_args(index_scores, k)
    if index_scores.dim() != 3:
        raise ValueError(f"sparse_attention_mask: scores [B, S, T] expected, got {tuple(index_scores.shape)}")
    b, s, t = index_scores.shape
    if (attention_mask is None) == (causal_first is None):
        raise ValueError("sparse_attention_mask: give the attention mask or the causal first position, one of them")
    if causal_first is not None and (causal_first.numel() != 1 or causal_first.dtype not in (torch.int64, torch.int32)):
        raise ValueError(
            f"sparse_attention_mask: the causal first position must be one int tensor, got "
            f"{causal_first.dtype} {tuple(causal_first.shape)}"
        )
    if attention_mask is not None and (attention_mask.dtype != torch.bool or tuple(attention_mask.shape) != (b, 1, s, t)):
        raise ValueError(
            f"sparse_attention_mask: the attention mask must be bool [{b}, 1, {s}, {t}], got "
            f"{attention_mask.dtype} {tuple(attention_mask.shape)}"
        )
    if dtype not in ATTENTION_DTYPES:
        raise ValueError(f"sparse_attention_mask: dtype {dtype}; fp32, bf16 or fp16 expected")
    if not fill < 0:
        raise ValueError(f"sparse_attention_mask: fill {fill} must be negative (the bias of a closed key)")


def causal_attention_mask(batch: int, s: int, t: int, first: torch.Tensor) -> torch.Tensor:
    """bool [B, 1, S, T]: the decode step's causal mask over a full static cache, query token i at
    position first + i seeing the positions up to it (transformers' sdpa_mask from the cache position)."""
    kv_idx = torch.arange(t, device=first.device)
    q_idx = torch.arange(s, device=first.device) + first.reshape(())
    return (kv_idx[None, :] <= q_idx[:, None]).expand(batch, 1, s, t)


def sparse_attention_mask_reference(
    index_scores: torch.Tensor,
    k: int,
    attention_mask: torch.Tensor | None,
    dtype: torch.dtype,
    fill: float,
    causal_first: torch.Tensor | None = None,
) -> torch.Tensor:
    """dtype [B, 1, S, T]: the additive mask SDPA makes of DeepSeek V3.2's boolean one, where the
    model has dropped the positions outside the top k (attention_mask & ~index_mask):

        keep = attention_mask & ~sparse_index_mask(index_scores, k)[:, None]
        mask = where(keep, 0, fill)

    ``fill``: SDPA's bias of a closed key, -inf (its math and flash paths), or -65504 where it
    calls cuDNN (a finite bias that cuDNN takes), rounded to ``dtype`` as a constant of it is.
    ``causal_first`` in place of ``attention_mask``: the causal mask of a decode step whose first
    token sits at that cache position (``causal_attention_mask``), read from the position alone.
    """
    if causal_first is not None:
        b, s, t = index_scores.shape
        attention_mask = causal_attention_mask(b, s, t, causal_first)
    keep = attention_mask & ~sparse_index_mask_reference(index_scores, k).unsqueeze(1)
    zero = torch.zeros((), dtype=dtype, device=index_scores.device)
    return torch.where(keep, zero, torch.full((), fill, dtype=dtype, device=index_scores.device))
