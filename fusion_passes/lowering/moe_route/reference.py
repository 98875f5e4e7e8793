"""Plain-torch reference of a MoE layer's top-k routing: the single statement of its math.

For one token's router logits x [E] (the gate projection's output, any float dtype):

    softmax scoring (Qwen3-MoE, Qwen 3.5-MoE, Qwen3-Next, Mixtral):
        p = softmax(f32(x));  ids = topk(p, k);                       w = p[ids]
    sigmoid scoring with a correction bias (MiniMax-M2, DeepSeek V3 without group limits):
        p = sigmoid(f32(x));  ids = topk(p + f32(bias), k);           w = p[ids]
    renormalize:  w = w / sum(w)                                       (all in fp32)

ids are ordered by descending choice score (torch.topk's sorted order); equal scores by
ascending expert id, as torch.topk selects them at the k-th place. torch.topk leaves the order of
equal values it returns unspecified (its CUDA sort is not stable): where the choice scores of two
selected experts are exactly equal the model's own order may differ from this one; the weights
are the same values.

Returns (w fp32 [T, k], ids int64 [T, k]).
"""

from __future__ import annotations

import torch

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_moe_route_args(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, softmax: bool) -> None:
    """Raise a one-line ValueError for arguments the op does not define."""
    if logits.dim() != 2:
        raise ValueError(f"moe_route: router logits [T, E] expected, got {tuple(logits.shape)}")
    if logits.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"moe_route: logits are {logits.dtype}; supported: fp32, bf16, fp16")
    experts = logits.shape[1]
    if not 1 <= top_k <= experts:
        raise ValueError(f"moe_route: top_k {top_k} must be in [1, {experts}]")
    if bias is not None:
        if softmax:
            raise ValueError("moe_route: a correction bias goes with sigmoid scoring")
        if tuple(bias.shape) != (experts,) or bias.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"moe_route: bias {tuple(bias.shape)} {bias.dtype} must be [{experts}] floating")


def moe_route_reference(
    logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, softmax: bool, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights fp32 [T, top_k], ids int64 [T, top_k]) as in the module docstring."""
    x = logits.float()
    scores = torch.softmax(x, dim=-1) if softmax else torch.sigmoid(x)
    choice = scores if bias is None else scores + bias.float()
    # Descending score, ties by ascending id: a stable sort of the negated scores.
    ids = torch.sort(-choice, dim=-1, stable=True).indices[:, :top_k]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def check_moe_route_grouped_args(
    logits: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int, topk_group: int
) -> None:
    """Raise a one-line ValueError for arguments moe_route_grouped does not define."""
    check_moe_route_args(logits, bias, top_k, softmax=False)
    experts = logits.shape[1]
    if n_group < 1 or experts % n_group or experts // n_group < 2:
        raise ValueError(f"moe_route_grouped: {experts} experts do not split into {n_group} groups of 2 or more")
    if not 1 <= topk_group <= n_group or top_k > topk_group * (experts // n_group):
        raise ValueError(
            f"moe_route_grouped: top_k {top_k} of {topk_group} kept groups of {experts // n_group} "
            f"(of {n_group}) is not defined"
        )


def moe_route_grouped_reference(
    logits: torch.Tensor,
    bias: torch.Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    renormalize: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-limited sigmoid routing (DeepSeek V3 / V3.2, GLM4-MoE, Kimi and the other models with
    transformers' DeepseekV3TopkRouter), per token:

        p      = sigmoid(f32(x));  c = p + f32(bias)                  c viewed as [n_group, E / n_group]
        g      = c[top-2 of each group] summed (the larger first)
        kept   = topk(g, topk_group)                                  the other groups' c set to -inf
        ids    = topk(c, k);  w = p[ids]
        w      = w / (sum(w) + 1e-20) if renormalize;  w = w * scale  (all in fp32)

    Ties as in moe_route_reference (the lower group or expert id first). Returns (w fp32 [T, k],
    ids int64 [T, k])."""
    scores = logits.float().sigmoid()
    choice = scores + bias.float()
    tokens, experts = choice.shape
    grouped = torch.sort(-choice.view(tokens, n_group, experts // n_group), dim=-1, stable=True).values
    group_scores = (-grouped[..., 0]) + (-grouped[..., 1])
    kept = torch.sort(-group_scores, dim=-1, stable=True).indices[:, :topk_group]
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, kept, True)
    choice = choice.masked_fill(~group_mask.repeat_interleave(experts // n_group, dim=1), float("-inf"))
    ids = torch.sort(-choice, dim=-1, stable=True).indices[:, :top_k]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scale, ids
