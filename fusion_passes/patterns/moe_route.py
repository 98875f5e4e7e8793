"""A MoE layer's top-k routing: scores, the top-k experts, their weights, renormalised.

transformers' routers (traced; the gate projection before them stays a GEMM):

    Qwen3-MoE, Qwen 3.5-MoE, Qwen3-Next (``*TopKRouter``):
        p = softmax(logits, dtype=float);  w, ids = topk(p, k);  w /= w.sum(-1);  w = w.to(logits.dtype)
        (Qwen3-MoE with norm_topk_prob=False: without the renormalisation)
    MiniMax-M2 (``MiniMaxM2TopKRouter``):
        p = sigmoid(logits.float());  ids = topk(p + bias, k, sorted=False);  w = p.gather(1, ids) / sum
    DeepSeek V3 / V3.2 (``DeepseekV3TopkRouter``; GLM4-MoE, Kimi and others copy it):
        p = sigmoid(logits);  c = p + bias;  g = sum of each group's top-2 c;  keep topk_group groups
        ids = topk(c with the other groups at -inf, k);  w = p.gather(1, ids) / (sum + 1e-20) * scale

Unfused: a softmax (or sigmoid + bias) kernel, torch's top-k (a radix select; sorted ids add a
bitonic sort, 4.0 us per layer at batch 1 inside a CUDA graph on one H200) and the
renormalisation: 3-4 kernels per MoE layer with stock Inductor (DeepSeek's: 10, with three top-ks
and the group mask's scatter: 28.6 us at 1 token inside a CUDA graph on one H200, against the
fused kernel's 4.3; 6.6-7.8x at 1-256 tokens).
Fused:   weights, ids = fusion_passes.moe_route(logits, bias, k, softmax, renormalize)
         weights, ids = fusion_passes.moe_route_grouped(logits, bias, k, n_group, topk_group, True, scale)
         one kernel; the weights cast to the logits' dtype where the router casts them.

Equal scores: the op orders them by expert id; torch.topk leaves their order unspecified (its
CUDA sort is not stable) and, at the k-th place, takes the lower ids first as the op does. Not
fused: DeepSeek V3's routing with moe_route_grouped left out (reported as a near miss), one
group only (n_group=1: GLM-4.5; Inductor simplifies its mask further), a top-k over another dim or
of the smallest.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from fusion_passes.fusion import DEFAULT_SCALAR_SENTINEL, Fusion, Spelling
from fusion_passes.lowering.moe_route.reference import check_moe_route_args, check_moe_route_grouped_args

# The sentinel top-k is traced with (a pattern argument): no other size of the examples is 5.
TOP_K_SENTINEL = 5
# The grouped router's: 42 experts in 7 groups of 6, 3 kept, top-5, over 2 tokens; no other size of
# its examples is 7 or 3 (its literal top-2 and scatter value 1 are neither).
GROUPS_SENTINEL, KEPT_GROUPS_SENTINEL = 7, 3


def _qwen_top_k(router_logits, router_probs, top_k, renormalize):
    # Qwen3_5MoeTopKRouter / Qwen3NextTopKRouter / Qwen3MoeTopKRouter after the softmax;
    # `router_top_value /= ...` written functionally.
    router_top_value, router_indices = torch.topk(router_probs, top_k, dim=-1)
    if renormalize:
        router_top_value = router_top_value / router_top_value.sum(dim=-1, keepdim=True)
    return router_top_value.to(router_logits.dtype), router_indices


def _online_softmax(x):
    # Inductor's post-grad passes on CUDA turn softmax's amax / sub / exp / sum into its online
    # softmax prim before the fusions run (config.online_softmax): the CUDA graph's spelling.
    from torch._inductor.inductor_prims import prepare_softmax_online

    xmax, xsum = prepare_softmax_online(x, -1)
    return (x - xmax).exp() / xsum


def qwen_router(router_logits, top_k):
    # The Qwen routers after the gate projection (Qwen3-MoE with norm_topk_prob=True).
    return _qwen_top_k(router_logits, F.softmax(router_logits, dtype=torch.float, dim=-1), top_k, True)


def qwen_router_online_softmax(router_logits, top_k):
    # qwen_router as a CUDA graph holds it.
    return _qwen_top_k(router_logits, _online_softmax(router_logits.float()), top_k, True)


def qwen_router_unnormalized(router_logits, top_k):
    # Qwen3MoeTopKRouter with norm_topk_prob=False.
    return _qwen_top_k(router_logits, F.softmax(router_logits, dtype=torch.float, dim=-1), top_k, False)


def qwen_router_unnormalized_online_softmax(router_logits, top_k):
    return _qwen_top_k(router_logits, _online_softmax(router_logits.float()), top_k, False)


def minimax_router(router_logits, e_score_correction_bias, top_k):
    # MiniMaxM2TopKRouter after the gate projection.
    routing_weights = F.sigmoid(router_logits.float())
    scores_for_choice = routing_weights + e_score_correction_bias
    _, top_k_index = torch.topk(scores_for_choice, top_k, dim=-1, sorted=False)
    top_k_weights = routing_weights.gather(1, top_k_index)
    top_k_weights = top_k_weights / top_k_weights.sum(dim=-1, keepdim=True)
    return top_k_weights, top_k_index


def _deepseek_v3_group_scores(router_logits, e_score_correction_bias, n_group):
    num_experts = router_logits.shape[-1]
    scores = router_logits.sigmoid()
    scores_for_choice = scores + e_score_correction_bias
    group_scores = (
        scores_for_choice.view(-1, n_group, num_experts // n_group).topk(2, dim=-1)[0].sum(dim=-1)
    )
    return scores, scores_for_choice, group_scores


def _deepseek_v3_choose(scores, scores_for_choice, group_mask, top_k, n_group, routed_scaling_factor):
    num_experts = scores.shape[-1]
    score_mask = group_mask.unsqueeze(-1).expand(-1, n_group, num_experts // n_group).reshape(-1, num_experts)
    # masked_fill(~score_mask.bool(), -inf), in the form Inductor's constant folding leaves it
    # (its scalar_tensor(-inf) becomes full([], -inf) before the post-grad passes)
    minus_inf = torch.full([], float("-inf"), dtype=scores_for_choice.dtype, device=scores_for_choice.device)
    scores_for_choice = torch.where(~score_mask.bool(), minus_inf, scores_for_choice)
    topk_indices = torch.topk(scores_for_choice, k=top_k, dim=-1, sorted=False)[1]
    topk_weights = scores.gather(1, topk_indices)
    denominator = topk_weights.sum(dim=-1, keepdim=True) + 1e-20
    topk_weights = topk_weights / denominator
    topk_weights = topk_weights * routed_scaling_factor
    return topk_weights, topk_indices


def deepseek_v3_router(router_logits, e_score_correction_bias, top_k, n_group, topk_group, routed_scaling_factor):
    # DeepseekV3TopkRouter / DeepseekV32TopkRouter (and the routers copied from them: GLM4-MoE,
    # Kimi, dots1, ...) after the fp32 gate projection, norm_topk_prob=True; in-place ops written
    # functionally.
    scores, scores_for_choice, group_scores = _deepseek_v3_group_scores(
        router_logits, e_score_correction_bias, n_group
    )
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter(1, group_idx, 1)
    return _deepseek_v3_choose(scores, scores_for_choice, group_mask, top_k, n_group, routed_scaling_factor)


def _one_group_kept(router_logits, e_score_correction_bias, top_k, n_group, routed_scaling_factor, cast_mask):
    # The same router keeping one of several groups (topk_group=1: DeepSeek's tiny configs):
    # Inductor turns the scatter of one index per row into a one-hot comparison with an iota,
    # written here as it leaves it. (One group in all, n_group=1, simplifies further: not matched.)
    scores, scores_for_choice, group_scores = _deepseek_v3_group_scores(
        router_logits, e_score_correction_bias, n_group
    )
    group_idx = torch.topk(group_scores, k=1, dim=-1, sorted=False)[1]
    groups = torch.arange(n_group, device=group_idx.device).view(1, n_group)
    scalar = torch.ops.aten.scalar_tensor.default  # as Inductor's rewrite calls it (a layout, no pin_memory)
    one = scalar(1, dtype=torch.int64, layout=torch.strided, device=group_idx.device)
    zero = scalar(0, dtype=torch.int64, layout=torch.strided, device=group_idx.device)
    hit = group_idx.expand(group_idx.shape[0], n_group) == groups
    group_mask = torch.where(hit, one, zero)
    if cast_mask:
        group_mask = group_mask.to(scores.dtype)
    return _deepseek_v3_choose(scores, scores_for_choice, group_mask, top_k, n_group, routed_scaling_factor)


def deepseek_v3_router_one_group_kept(router_logits, e_score_correction_bias, top_k, n_group, routed_scaling_factor):
    return _one_group_kept(router_logits, e_score_correction_bias, top_k, n_group, routed_scaling_factor, True)


def deepseek_v3_router_one_group_kept_int_mask(
    router_logits, e_score_correction_bias, top_k, n_group, routed_scaling_factor
):
    # torch 2.11's rewrite of the scatter (Inductor's scatter_upon_const_tensor) leaves the one-hot
    # mask in int64, without the cast to the scatter's dtype that torch 2.13's adds: int64 straight
    # to bool for the masked_fill (the graph a decode step held on one H200 with torch 2.11).
    return _one_group_kept(router_logits, e_score_correction_bias, top_k, n_group, routed_scaling_factor, False)


def _fused_grouped(router_logits, e_score_correction_bias, top_k, n_group, topk_group, routed_scaling_factor):
    return torch.ops.fusion_passes.moe_route_grouped(
        router_logits, e_score_correction_bias, top_k, n_group, topk_group, True, routed_scaling_factor
    )


def _fused_grouped_one_kept(router_logits, e_score_correction_bias, top_k, n_group, routed_scaling_factor):
    return _fused_grouped(router_logits, e_score_correction_bias, top_k, n_group, 1, routed_scaling_factor)


def _fused_softmax(router_logits, top_k):
    weights, ids = torch.ops.fusion_passes.moe_route(router_logits, None, top_k, True, True)
    return weights.to(router_logits.dtype), ids


def _fused_softmax_unnormalized(router_logits, top_k):
    weights, ids = torch.ops.fusion_passes.moe_route(router_logits, None, top_k, True, False)
    return weights.to(router_logits.dtype), ids


def _fused_sigmoid_bias(router_logits, e_score_correction_bias, top_k):
    return torch.ops.fusion_passes.moe_route(router_logits, e_score_correction_bias, top_k, False, True)


def _check(values: dict[str, Any]) -> str | None:
    bias = values.get("e_score_correction_bias")
    try:
        check_moe_route_args(values["router_logits"], bias, values["top_k"], bias is None)
    except ValueError as e:
        return str(e).removeprefix("moe_route: ")
    return None


def _check_grouped(values: dict[str, Any]) -> str | None:
    try:
        check_moe_route_grouped_args(
            values["router_logits"], values["e_score_correction_bias"], values["top_k"], values["n_group"],
            values.get("topk_group", 1),
        )
    except ValueError as e:
        return str(e).removeprefix("moe_route_grouped: ")
    return None


def _is_router_topk(node) -> bool:
    """A top-k of scores a sigmoid or a softmax's exp computed (within a few ops): a router's,
    not an attention indexer's or a sampler's."""
    frontier, seen = [node.args[0]], 0
    while frontier and seen < 8:
        n = frontier.pop()
        seen += 1
        if not hasattr(n, "target"):
            continue
        if n.target in (torch.ops.aten.sigmoid.default, torch.ops.aten.exp.default):
            return True
        frontier.extend(a for a in n.args if hasattr(a, "target"))
    return False


def _examples_softmax():
    # 3 tokens x 40 experts; fp32 logits too (their softmax has no upcast).
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        yield torch.randn(3, 40, dtype=dtype), TOP_K_SENTINEL


def _examples_sigmoid():
    # The correction bias in the logits' dtype or kept in fp32.
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for bias_dtype in {dtype, torch.float32}:
            yield torch.randn(3, 40, dtype=dtype), torch.randn(40, dtype=bias_dtype), TOP_K_SENTINEL


def _examples_grouped():
    # fp32 logits (the router's gate GEMM runs in fp32); the bias in fp32 or bf16 (DeepSeek V3's
    # buffer follows the model's dtype, V3.2 keeps it in fp32).
    for bias_dtype in (torch.float32, torch.bfloat16):
        yield (torch.randn(2, 42), torch.rand(42).to(bias_dtype), TOP_K_SENTINEL, GROUPS_SENTINEL,
               KEPT_GROUPS_SENTINEL, DEFAULT_SCALAR_SENTINEL)  # fmt: skip


def _examples_one_group_kept():
    for args in _examples_grouped():
        yield args[:4] + args[5:]  # no topk_group: 1


def _fusion(name, summary, spellings, examples, near_misses=False) -> Fusion:
    return Fusion(
        name=name,
        summary=summary,
        doc=__doc__.split("\n\n", 1)[1],
        spellings=spellings,
        example_inputs=examples,
        scalars={"top_k": TOP_K_SENTINEL},
        check=_check,
        # One family reports the unmatched router top-ks.
        candidate_ops=("aten.topk.default",) if near_misses else (),
        candidate=_is_router_topk if near_misses else None,
        builtin=True,
    )


MOE_ROUTE_GROUPED_ONE_GROUP = Fusion(
    name="moe_route_grouped_one_group",
    summary="the same keeping one of several groups (topk_group=1: small DeepSeek configs)",
    doc=__doc__.split("\n\n", 1)[1],
    spellings=(
        Spelling("deepseek_v3_router_one_group_kept", deepseek_v3_router_one_group_kept, _fused_grouped_one_kept),
        Spelling("deepseek_v3_router_one_group_kept_int_mask", deepseek_v3_router_one_group_kept_int_mask,
                 _fused_grouped_one_kept),  # fmt: skip
    ),
    example_inputs=_examples_one_group_kept,
    scalars={"top_k": TOP_K_SENTINEL, "n_group": GROUPS_SENTINEL,
             "routed_scaling_factor": DEFAULT_SCALAR_SENTINEL},  # fmt: skip
    check=_check_grouped,
    builtin=True,
)

MOE_ROUTE_GROUPED = Fusion(
    name="moe_route_grouped",
    summary="MoE group-limited routing (DeepSeek V3 / V3.2, GLM4-MoE: sigmoid + bias, group top-2, "
    "group top-k, top-k, renormalise, scale) -> one kernel",
    doc=__doc__.split("\n\n", 1)[1],
    spellings=(Spelling("deepseek_v3_router", deepseek_v3_router, _fused_grouped),),
    example_inputs=_examples_grouped,
    scalars={"top_k": TOP_K_SENTINEL, "n_group": GROUPS_SENTINEL, "topk_group": KEPT_GROUPS_SENTINEL,
             "routed_scaling_factor": DEFAULT_SCALAR_SENTINEL},  # fmt: skip
    check=_check_grouped,
    # The one-kept-group form is the same fusion in another graph form: enabled along with it.
    requires=("moe_route_grouped_one_group",),
    builtin=True,
)

FUSIONS = (
    _fusion(
        "moe_route_softmax",
        "MoE routing: softmax + top-k + renormalise (Qwen3 / 3.5-MoE, Qwen3-Next) -> one kernel",
        (
            Spelling("qwen_router", qwen_router, _fused_softmax),
            Spelling("qwen_router_online_softmax", qwen_router_online_softmax, _fused_softmax),
        ),
        _examples_softmax,
        near_misses=True,
    ),
    _fusion(
        "moe_route_softmax_unnormalized",
        "the same without the renormalisation (Qwen3-MoE, norm_topk_prob=False)",
        (
            Spelling("qwen_router_unnormalized", qwen_router_unnormalized, _fused_softmax_unnormalized),
            Spelling(
                "qwen_router_unnormalized_online_softmax",
                qwen_router_unnormalized_online_softmax,
                _fused_softmax_unnormalized,
            ),
        ),
        _examples_softmax,
    ),
    _fusion(
        "moe_route_sigmoid_bias",
        "MoE routing: sigmoid + correction bias + top-k + gather + renormalise (MiniMax-M2) -> one kernel",
        (Spelling("minimax_router", minimax_router, _fused_sigmoid_bias),),
        _examples_sigmoid,
    ),
    MOE_ROUTE_GROUPED_ONE_GROUP,
    MOE_ROUTE_GROUPED,
)
