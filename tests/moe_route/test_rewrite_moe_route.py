"""transformers' MoE routers compiled with the moe_route fusions: Qwen 3.5-MoE's and Qwen3-MoE's
softmax top-k (renormalised, and not: norm_topk_prob=False), MiniMax-M2's sigmoid + correction
bias top-k. Each router becomes one op: ids equal to eager's and weights within fp32 rounding in
fp32 (tie-free scores), the whole MoE block within bf16's tolerance of eager in bf16; DeepSeek V3's
group-limited routing is not matched and is reported as a near miss."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.minimax_m2 import modeling_minimax_m2
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe
from transformers.models.qwen3_moe import modeling_qwen3_moe

import fusion_passes
from _moe_blocks import moe_block
from fusion_passes.numerics import compare, tolerance

ROUTES = ["moe_route_softmax", "moe_route_softmax_unnormalized", "moe_route_sigmoid_bias"]
EXPERTS, TOP_K, HIDDEN = 32, 4, 64


def _router(name: str, dtype: torch.dtype):
    common = dict(hidden_size=HIDDEN, num_experts_per_tok=TOP_K, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
    if name == "qwen3.5-moe":
        config = transformers.Qwen3_5MoeTextConfig(num_experts=EXPERTS, **common)
        router, args = modeling_qwen3_5_moe.Qwen3_5MoeTopKRouter(config), ()
    elif name == "qwen3-moe":
        config = transformers.Qwen3MoeConfig(num_experts=EXPERTS, norm_topk_prob=False, **common)
        router, args = modeling_qwen3_moe.Qwen3MoeTopKRouter(config), ()
    else:
        config = transformers.MiniMaxM2Config(num_local_experts=EXPERTS, **common)
        router = modeling_minimax_m2.MiniMaxM2TopKRouter(config)
        args = (torch.rand(EXPERTS, generator=torch.Generator().manual_seed(3)) * 0.05,)
    torch.manual_seed(0)
    with torch.no_grad():
        router.weight.normal_(0, 0.5)
    return router.to(dtype).eval(), args


def _compile(fn, fusions):
    report = fusion_passes.Report()
    torch._dynamo.reset()
    return torch.compile(fn, backend=fusion_passes.backend(fusions, report=report), fullgraph=True), report


@pytest.mark.parametrize(
    ("model", "fusion"),
    [("qwen3.5-moe", "moe_route_softmax"), ("qwen3-moe", "moe_route_softmax_unnormalized"),
     ("minimax-m2", "moe_route_sigmoid_bias")],
)  # fmt: skip
def test_router_fuses_with_eagers_ids(model, fusion):
    router, args = _router(model, torch.float32)
    x = torch.randn(9, HIDDEN, generator=torch.Generator().manual_seed(1))
    compiled, report = _compile(router, ROUTES)
    with torch.no_grad():
        _, weights, ids = compiled(x, *args)
        _, want_weights, want_ids = router(x, *args)
    assert report.final()[fusion] == 1 and sum(report.final().values()) == 1
    before, after = report.ops_before(), report.ops_after()
    assert (before["aten.topk.default"], after["aten.topk.default"]) == (1, 0)
    assert after["fusion_passes.moe_route.default"] == 1
    if model == "minimax-m2":
        # topk(sorted=False): the order of the k ids is unspecified (the op's is by score); each
        # row's experts and their weights compared in id order
        ids, order = ids.sort(dim=-1)
        weights = weights.gather(1, order)
        want_ids, want_order = want_ids.sort(dim=-1)
        want_weights = want_weights.gather(1, want_order)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("model", ["qwen3.5-moe", "minimax-m2"])
def test_bf16_moe_block_with_routing_and_dispatch_fused(model):
    block = moe_block(model)
    x = torch.randn(1, 7, HIDDEN, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(2))
    compiled, report = _compile(block, [*ROUTES, "moe_sort_by_expert"])
    with torch.no_grad():
        out = compiled(x)
        eager = block(x)
    route = "moe_route_softmax" if model == "qwen3.5-moe" else "moe_route_sigmoid_bias"
    assert report.final()[route] == 1 and report.final()["moe_sort_by_expert"] == 1
    assert sum(report.final().values()) == 2
    before, after = report.ops_before(), report.ops_after()
    for op in ("aten.topk.default", "aten.sort.default", "aten.histc.default"):
        assert (before[op], after[op]) == (1, 0), op
    assert after["fusion_passes.moe_route.default"] == after["fusion_passes.moe_sort_by_expert.default"] == 1
    assert compare(out, eager).rel_norm < tolerance(torch.bfloat16).rel_norm


def test_deepseek_group_limited_routing_is_a_near_miss():
    config = transformers.DeepseekV3Config(hidden_size=HIDDEN, n_routed_experts=EXPERTS, num_experts_per_tok=TOP_K,
                                           n_group=4, topk_group=2, num_hidden_layers=1)  # fmt: skip
    from transformers.models.deepseek_v3 import modeling_deepseek_v3

    router = modeling_deepseek_v3.DeepseekV3TopkRouter(config).eval()
    with torch.no_grad():
        router.weight.normal_(0, 0.5)
    x = torch.randn(9, HIDDEN, generator=torch.Generator().manual_seed(1))
    compiled, report = _compile(router, ROUTES)
    with torch.no_grad():
        out = compiled(x)
        want = router(x)
    assert sum(report.final().values()) == 0
    assert report.ops_after() == report.ops_before()
    assert {m.fusion for m in report.near_misses} == {"moe_route_softmax"}
    assert len(report.near_misses) == report.ops_before()["aten.topk.default"]
    for got, expected in zip(out, want):
        assert torch.equal(got, expected)


def test_cuda_graphs_online_softmax_form_fuses():
    """On CUDA, Inductor's post-grad passes rewrite the router's softmax into its online-softmax
    prim (prepare_softmax_online) before the fusions run; that form, written here as Inductor
    leaves it, is matched too (the CPU keeps the decomposed softmax)."""
    from torch._inductor.inductor_prims import prepare_softmax_online

    def router(logits):
        x = logits.float()
        xmax, xsum = prepare_softmax_online(x, -1)
        probs = (x - xmax).exp() / xsum
        top_value, top_index = torch.topk(probs, TOP_K, dim=-1)
        top_value = top_value / top_value.sum(dim=-1, keepdim=True)
        return top_value.to(logits.dtype), top_index

    logits = torch.randn(9, EXPERTS, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    compiled, report = _compile(router, ROUTES)
    with torch.no_grad():
        weights, ids = compiled(logits)
    want_weights, want_ids = router(logits)
    assert report.final()["moe_route_softmax"] == 1 and sum(report.final().values()) == 1
    before, after = report.ops_before(), report.ops_after()
    assert (before["aten.topk.default"], after["aten.topk.default"]) == (1, 0)
    assert (before["prims.prepare_softmax_online.default"], after["fusion_passes.moe_route.default"]) == (1, 1)
    assert torch.equal(ids.sort(-1).values, want_ids.sort(-1).values)
    torch.testing.assert_close(
        weights.float().sort(-1).values, want_weights.float().sort(-1).values, rtol=1e-2, atol=1e-3
    )


@pytest.mark.parametrize(
    ("router", "topk_group", "tokens"),
    [("deepseek-v3", 2, 9), ("deepseek-v3.2", 2, 9), ("glm4-moe", 2, 9), ("deepseek-v3.2", 1, 9), ("deepseek-v3", 2, 7)],
)
def test_group_limited_router_fuses_when_enabled(router, topk_group, tokens):
    """DeepSeek V3 / V3.2's router and GLM4-MoE's copy of it, with moe_route_grouped:
    one op for the sigmoid, the group top-2 sums, both top-ks, the renormalisation and the
    routed scaling; the experts and weights equal eager's (fp32 router, tie-free). Keeping one
    group, Inductor writes the group mask as a one-hot comparison: moe_route_grouped_one_group,
    enabled along with it. 7 tokens, n_group's sentinel, in the group view [7, n_group, E / n_group]:
    the group count is still read where the router puts it (fusion.py's _scalars_then_on_match)."""
    from transformers.models.deepseek_v3 import modeling_deepseek_v3
    from transformers.models.deepseek_v32 import modeling_deepseek_v32
    from transformers.models.glm4_moe import modeling_glm4_moe

    common = dict(hidden_size=HIDDEN, num_experts_per_tok=TOP_K, n_group=4, topk_group=topk_group,
                  routed_scaling_factor=2.5, norm_topk_prob=True, num_hidden_layers=1)  # fmt: skip
    if router == "deepseek-v3":
        module = modeling_deepseek_v3.DeepseekV3TopkRouter(transformers.DeepseekV3Config(n_routed_experts=EXPERTS, **common))
    elif router == "deepseek-v3.2":
        module = modeling_deepseek_v32.DeepseekV32TopkRouter(
            transformers.DeepseekV32Config(n_routed_experts=EXPERTS, **common)
        )
    else:
        module = modeling_glm4_moe.Glm4MoeTopkRouter(transformers.Glm4MoeConfig(n_routed_experts=EXPERTS, **common))
    module.eval()
    with torch.no_grad():
        module.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(6))
        module.e_score_correction_bias.uniform_(0, 0.1, generator=torch.Generator().manual_seed(7))
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(1))
    compiled, report = _compile(module, [*ROUTES, "moe_route_grouped"])
    with torch.no_grad():
        _, weights, ids = compiled(x)
        _, want_weights, want_ids = module(x)
    fusion = "moe_route_grouped" if topk_group > 1 else "moe_route_grouped_one_group"
    assert report.final()[fusion] == 1 and sum(report.final().values()) == 1
    before, after = report.ops_before(), report.ops_after()
    assert (before["aten.topk.default"], after["aten.topk.default"]) == (3, 0)
    assert after["fusion_passes.moe_route_grouped.default"] == 1 and not report.near_misses
    # topk(sorted=False): compared in expert-id order
    ids, order = ids.sort(dim=-1)
    want_ids, want_order = want_ids.sort(dim=-1)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights.gather(1, order), want_weights.gather(1, want_order), rtol=2e-6, atol=1e-7)


def test_cuda_one_group_kept_int_mask_form_fuses():
    """With torch 2.11 (a DeepSeek V3.2 decode step on one H200) Inductor's rewrite of the group
    mask's scatter leaves the one-hot mask without the cast to the scatter's dtype that torch 2.13
    adds: where(eq, scalar_tensor(1), scalar_tensor(0)) in int64, expanded, then straight to bool
    for the masked_fill. This torch casts, so the graph is built here as that step held it (traced,
    not compiled) and given to the passes; the int-mask spelling matches it, and the rewritten
    graph computes the router's experts and weights."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    from fusion_passes.fusion import trace_functional
    from fusion_passes.pass_manager import FusionPassManager
    from fusion_passes.registry import get_fusions

    scalar = torch.ops.aten.scalar_tensor.default

    def router(logits, bias):
        scores = logits.sigmoid()
        choice = scores + bias
        group_scores = choice.view(-1, 2, EXPERTS // 2).topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=1, dim=-1, sorted=False)[1]
        iota = torch.ops.prims.iota(2, start=0, step=1, dtype=torch.int64, device=logits.device, requires_grad=False)
        hit = group_idx.expand(group_idx.shape[0], 2) == iota.view(1, 2)
        one, zero = (scalar(v, dtype=torch.int64, layout=torch.strided, device=logits.device) for v in (1, 0))
        score_mask = torch.where(hit, one, zero).unsqueeze(-1).expand(-1, 2, EXPERTS // 2).reshape(-1, EXPERTS)
        choice = torch.where(~score_mask.bool(), torch.full([], float("-inf")), choice)
        ids = torch.topk(choice, k=TOP_K, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * 2.5, ids

    g = torch.Generator().manual_seed(8)
    logits, bias = torch.randn(9, EXPERTS, generator=g), torch.rand(EXPERTS, generator=g) * 0.1
    gm = trace_functional(router, [logits, bias])
    FakeTensorProp(gm, FakeTensorMode()).propagate(logits, bias)
    report = fusion_passes.Report()
    FusionPassManager(get_fusions([*ROUTES, "moe_route_grouped"]), report)(gm.graph)
    gm.recompile()
    assert report.final()["moe_route_grouped_one_group"] == 1 and sum(report.final().values()) == 1
    before, after = report.ops_before(), report.ops_after()
    assert (before["aten.topk.default"], after["aten.topk.default"]) == (3, 0)
    assert (before["aten.scalar_tensor.default"], after["fusion_passes.moe_route_grouped.default"]) == (2, 1)
    weights, ids = gm(logits, bias)
    want_weights, want_ids = router(logits, bias)
    ids, order = ids.sort(dim=-1)
    want_ids, want_order = want_ids.sort(dim=-1)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights.gather(1, order), want_weights.gather(1, want_order), rtol=2e-6, atol=1e-7)
