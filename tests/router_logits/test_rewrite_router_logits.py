"""MoE routers that score in fp32 from bf16 / fp16 inputs, as real code bases write them
(transformers' DeepseekV3TopkRouter itself, ERNIE 4.5's and HunYuan's ``.float()`` form, a matmul
against the upcast weight's transpose): rewritten to fusion_passes::router_logits, the weight's
upcast gone, the logits within fp32's tolerance of the unfused ones and the routing the same. Not
rewritten: a bf16 GEMM upcast after (Qwen3-MoE's gate), a weight already fp32, more than 64 tokens
(not a site); inputs of two dtypes are rejected with the reason."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _rewrites import compile_with, op_changes
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

FUSION = ["router_logits"]
OP = "fusion_passes.router_logits.default"


def ernie_router(hidden_states, weight):
    """ERNIE 4.5 / HunYuan: F.linear(hidden_states.float(), self.weight.float())."""
    return F.linear(hidden_states.float(), weight.float())


def matmul_router(hidden_states, weight):
    """Hand-written scoring: the upcast hidden states times the upcast weight's transpose."""
    return torch.matmul(hidden_states.to(torch.float32), weight.to(torch.float32).t())


def _inputs(tokens, experts, hidden, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, hidden, generator=g).to(dtype), (torch.randn(experts, hidden, generator=g) * 0.1).to(dtype)


def _assert_close(out, expected):
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


@pytest.mark.parametrize("spelling", [ernie_router, matmul_router])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp32_scoring_is_rewritten(spelling, dtype):
    x, w = _inputs(3, 12, 40, dtype, seed=1)
    out, report = compile_with(FUSION, spelling, (x, w))
    assert report.final()["router_logits"] == 1 and not report.rejected
    changes = op_changes(report)
    assert changes[OP] == (0, 1) and changes["aten.mm.default"] == (1, 0)
    assert changes["prims.convert_element_type.default"] == (2, 0)  # both upcasts gone
    _assert_close(out, spelling(x, w))


def test_deepseek_v3_router_module():
    """transformers' own router (2 groups of 4 experts, top-2 of 1 kept group): its logits one op,
    the experts it picks and their weights those of the uncompiled module."""
    config = DeepseekV3Config(hidden_size=32, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
                              norm_topk_prob=True, routed_scaling_factor=2.5)  # fmt: skip
    router = DeepseekV3TopkRouter(config).to(torch.bfloat16)
    with torch.no_grad():
        router.weight.copy_(torch.randn(8, 32, generator=torch.Generator().manual_seed(4)) * 0.2)
        router.e_score_correction_bias.copy_(torch.randn(8) * 0.01)
    x = torch.randn(2, 3, 32, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    out, report = compile_with(FUSION, router, (x,))
    assert report.final()["router_logits"] == 1
    changes = op_changes(report)
    assert changes[OP] == (0, 1) and changes["aten.mm.default"] == (1, 0)
    assert changes["prims.convert_element_type.default"][0] - changes["prims.convert_element_type.default"][1] == 2
    with torch.no_grad():
        logits, weights, ids = router(x)
    _assert_close(out[0], logits)
    assert torch.equal(out[2], ids)
    torch.testing.assert_close(out[1], weights, rtol=1e-5, atol=1e-6)


def test_a_bf16_gate_a_fp32_weight_and_a_prefill_are_left_alone():
    x, w = _inputs(3, 12, 40, torch.bfloat16)

    def qwen3_gate(hidden_states, weight):  # Qwen3-MoE: the bf16 GEMM, softmax in fp32 after
        return F.linear(hidden_states, weight).float()

    def fp32_weight(hidden_states, weight):  # vLLM's fp32 gate parameters: no weight upcast
        return F.linear(hidden_states.float(), weight)

    for fn, args in ((qwen3_gate, (x, w)), (fp32_weight, (x, w.float())), (ernie_router, _inputs(100, 12, 40, torch.bfloat16))):
        out, report = compile_with(FUSION, fn, args)
        assert report.final()["router_logits"] == 0 and not report.rejected, fn.__name__
        assert OP not in report.ops_after(), fn.__name__
        torch.testing.assert_close(out, fn(*args))


def test_inputs_of_two_dtypes_are_rejected():
    x, w = _inputs(3, 12, 40, torch.float16)
    out, report = compile_with(FUSION, ernie_router, (x, w.to(torch.bfloat16)))
    assert report.final()["router_logits"] == 0
    assert [r.fusion for r in report.rejected] == ["router_logits"] and "of one dtype" in report.rejected[0].reason
    torch.testing.assert_close(out, ernie_router(x, w.to(torch.bfloat16)))


@pytest.mark.slow  # two whole-model compiles
def test_deepseek_v32_decode_step():
    """A tiny DeepSeek V3.2 decode step (StaticCache, 2 layers, the second MoE) with the defaults and
    router_logits: the MoE layer's router one op, the group routing after it still fused, outputs
    and caches within bf16's tolerance of the defaults' step (the logits' last bits may differ)."""
    from _rewrites import decode_steps

    from fusion_passes.models import build_model
    from fusion_passes.models.decode import DecodeStep
    from fusion_passes.numerics import compare

    built = build_model("deepseek-v3.2", size="tiny", dtype=torch.bfloat16, layers=2)
    step = DecodeStep(built.module, batch=2, context=8, steps=2)
    moe_layers = sum(1 for m in built.module.modules() if type(m).__name__.endswith("Experts"))
    defaults, _ = decode_steps(step, "all")
    fused, report = decode_steps(step, ["all", "router_logits"])
    final = report.final()
    assert final["router_logits"] == moe_layers == 1 and not report.errors
    assert final["moe_route_grouped"] + final["moe_route_grouped_one_group"] == moe_layers
    assert report.ops_after()[OP] == moe_layers
    for ours, theirs in zip(fused, defaults, strict=True):
        if ours.is_floating_point():
            assert compare(ours, theirs).ok, compare(ours, theirs)
        else:
            assert torch.equal(ours, theirs)
