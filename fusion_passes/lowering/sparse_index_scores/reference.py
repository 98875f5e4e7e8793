"""Plain-torch reference of DeepSeek V3.2's indexer scores: the single statement of their math.

The indexer (transformers' DeepseekV32Indexer) scores every cached position t for each query
token s with H heads of dimension D, in fp32:

    dots[b, s, h, t]    = sum_d f32(q[b, s, h, d]) * f32(k[b, t, d])            (q: [B, S, H, D]; k: [B, T, D])
    index_scores[b,s,t] = sum_h weights[b, s, h] * relu(dots[b, s, h, t] * scale)

``weights`` [B, S, H] are the per-head weights the model computes, times ``weights_scale`` in fp32
(transformers: weights_proj's bf16 output, upcast, times H^-1/2; an op given fp32 weights already
scaled takes 1.0), and ``scale`` the softmax scale (D^-1/2). ``keep`` [B, S, T] (optional, bool):
the attention mask the model applies to the scores before its top-k (masked_fill(~keep, -inf)).

transformers writes it as two matmuls (the keys transposed and upcast first):

    scores = relu(q.float() @ k.transpose(-1, -2).float().unsqueeze(1) * scale)      # [B, S, H, T]
    index_scores = (weights.unsqueeze(-2) @ scores).squeeze(-2)                     # [B, S, T]

q and k of bf16 or fp16 are exact in fp32, and so are their products: sums in another order
differ from these in fp32 rounding only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_sparse_index_scores_args(
    q: torch.Tensor,
    k: torch.Tensor,
    weights: torch.Tensor,
    keep: torch.Tensor | None = None,
    causal_first: torch.Tensor | None = None,
) -> None:
    """Raise a one-line ValueError for arguments the op does not define."""
    if q.dim() != 4 or k.dim() != 3 or weights.dim() != 3:
        raise ValueError(
            f"sparse_index_scores: q [B, S, H, D], k [B, T, D] and weights [B, S, H] expected, got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(weights.shape)}"
        )
    bsz, s, h, d = q.shape
    if k.shape[0] != bsz or k.shape[2] != d or k.shape[1] < 1:
        raise ValueError(f"sparse_index_scores: k {tuple(k.shape)} must be [{bsz}, T >= 1, {d}] for q {tuple(q.shape)}")
    if tuple(weights.shape) != (bsz, s, h):
        raise ValueError(f"sparse_index_scores: weights {tuple(weights.shape)} must be [{bsz}, {s}, {h}]")
    if q.dtype not in INPUT_DTYPES or k.dtype not in INPUT_DTYPES:
        raise ValueError(f"sparse_index_scores: q {q.dtype} and k {k.dtype} must be fp32, bf16 or fp16")
    if weights.dtype not in INPUT_DTYPES:
        raise ValueError(f"sparse_index_scores: weights are {weights.dtype}; fp32, bf16 or fp16 expected")
    if keep is not None and (keep.dtype != torch.bool or tuple(keep.shape) != (bsz, s, k.shape[1])):
        raise ValueError(
            f"sparse_index_scores: keep must be a bool [{bsz}, {s}, {k.shape[1]}] mask, got {keep.dtype} {tuple(keep.shape)}"
        )
    if causal_first is not None and (causal_first.numel() != 1 or causal_first.dtype not in (torch.int64, torch.int32)):
        raise ValueError(f"sparse_index_scores: causal_first must be one int64 / int32 position, got "
                         f"{tuple(causal_first.shape)} {causal_first.dtype}")  # fmt: skip


def sparse_index_scores_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    weights: torch.Tensor,
    scale: float,
    weights_scale: float = 1.0,
    keep: torch.Tensor | None = None,
    causal_first: torch.Tensor | None = None,
) -> torch.Tensor:
    """fp32 [B, S, T]: the index scores of every cached position, -inf where ``keep`` is False
    and, given ``causal_first``, past each query token's position (module docstring)."""
    scores = F.relu(torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * scale)
    # fp32 weights times 1.0 are themselves: the op without a weights scale computes as before
    index_scores = torch.matmul((weights.float() * weights_scale).unsqueeze(-2), scores).squeeze(-2)
    if keep is not None:
        index_scores = index_scores.masked_fill(~keep, float("-inf"))
    if causal_first is not None:
        s, t = index_scores.shape[1:]
        device = index_scores.device
        last = causal_first.reshape(()).to(torch.int64) + torch.arange(s, device=device)  # each token's position
        index_scores = index_scores.masked_fill(torch.arange(t, device=device) > last[:, None], float("-inf"))
    return index_scores
