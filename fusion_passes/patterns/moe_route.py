"""A MoE layer's top-k routing: scores, the top-k experts, their weights, renormalised.

transformers' routers (traced; the gate projection before them stays a GEMM):

    Qwen3-MoE, Qwen 3.5-MoE, Qwen3-Next (``*TopKRouter``):
        p = softmax(logits, dtype=float);  w, ids = topk(p, k);  w /= w.sum(-1);  w = w.to(logits.dtype)
        (Qwen3-MoE with norm_topk_prob=False: without the renormalisation)
    MiniMax-M2 (``MiniMaxM2TopKRouter``):
        p = sigmoid(logits.float());  ids = topk(p + bias, k, sorted=False);  w = p.gather(1, ids) / sum

Unfused: a softmax (or sigmoid + bias) kernel, torch's top-k (a radix select; sorted ids add a
bitonic sort, 4.0 us per layer at batch 1 inside a CUDA graph on one H200) and the
renormalisation: 3-4 kernels per MoE layer with stock Inductor.
Fused:   weights, ids = fusion_passes.moe_route(logits, bias, k, softmax, renormalize)
         one kernel; the weights cast to the logits' dtype where the router casts them.

Equal scores: the op orders them by expert id; torch.topk leaves their order unspecified (its
CUDA sort is not stable) and, at the k-th place, takes the lower ids first as the op does. Not
fused: DeepSeek V3's group-limited routing (a top-k of group scores first; reported as a near
miss), a top-k over another dim or of the smallest.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from fusion_passes.fusion import Fusion, Spelling
from fusion_passes.lowering.moe_route.reference import check_moe_route_args

# The sentinel top-k is traced with (a pattern argument): no other size of the examples is 5.
TOP_K_SENTINEL = 5


def qwen_router(router_logits, top_k):
    # Qwen3_5MoeTopKRouter / Qwen3NextTopKRouter / Qwen3MoeTopKRouter (norm_topk_prob) after the
    # gate projection; `router_top_value /= ...` written functionally.
    router_probs = F.softmax(router_logits, dtype=torch.float, dim=-1)
    router_top_value, router_indices = torch.topk(router_probs, top_k, dim=-1)
    router_top_value = router_top_value / router_top_value.sum(dim=-1, keepdim=True)
    return router_top_value.to(router_logits.dtype), router_indices


def _online_softmax(x):
    # Inductor's post-grad passes on CUDA turn softmax's amax / sub / exp / sum into its online
    # softmax prim before the fusions run (config.online_softmax): the CUDA graph's spelling.
    from torch._inductor.inductor_prims import prepare_softmax_online

    xmax, xsum = prepare_softmax_online(x, -1)
    return (x - xmax).exp() / xsum


def qwen_router_online_softmax(router_logits, top_k):
    # qwen_router as a CUDA graph holds it.
    router_probs = _online_softmax(router_logits.float())
    router_top_value, router_indices = torch.topk(router_probs, top_k, dim=-1)
    router_top_value = router_top_value / router_top_value.sum(dim=-1, keepdim=True)
    return router_top_value.to(router_logits.dtype), router_indices


def qwen_router_unnormalized_online_softmax(router_logits, top_k):
    router_probs = _online_softmax(router_logits.float())
    router_top_value, router_indices = torch.topk(router_probs, top_k, dim=-1)
    return router_top_value.to(router_logits.dtype), router_indices


def qwen_router_unnormalized(router_logits, top_k):
    # Qwen3MoeTopKRouter with norm_topk_prob=False.
    router_probs = F.softmax(router_logits, dtype=torch.float, dim=-1)
    router_top_value, router_indices = torch.topk(router_probs, top_k, dim=-1)
    return router_top_value.to(router_logits.dtype), router_indices


def minimax_router(router_logits, e_score_correction_bias, top_k):
    # MiniMaxM2TopKRouter after the gate projection.
    routing_weights = F.sigmoid(router_logits.float())
    scores_for_choice = routing_weights + e_score_correction_bias
    _, top_k_index = torch.topk(scores_for_choice, top_k, dim=-1, sorted=False)
    top_k_weights = routing_weights.gather(1, top_k_index)
    top_k_weights = top_k_weights / top_k_weights.sum(dim=-1, keepdim=True)
    return top_k_weights, top_k_index


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
)
