"""A layer's small bias-free linears of one input, as real code bases write them (transformers'
Qwen 3.5 Gated DeltaNet projections and MoE block, a Llama-style attention's k / v, vLLM-style
F.linear on 2-D tokens, a hand-written matmul against the weight's transpose): at decode,
rewritten into one fusion_passes::shared_input_linears per input (up to 4 weights), the GEMMs
and their transposes gone, the outputs those of the uncompiled code (on the CPU the op runs the
reference, the same GEMMs). Not rewritten: a prefill, linears with a bias, a single small linear,
fp32, a weight above SMALL_WEIGHT_BYTES (its small siblings still grouped), two inputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from _rewrites import compile_with, op_changes

from fusion_passes.patterns.shared_input_linears import MAX_TOKENS, SMALL_WEIGHT_BYTES

FUSION = ["shared_input_linears"]
OP = "fusion_passes.shared_input_linears.default"
MM = "aten.mm.default"


def _bf16(module, seed=0):
    torch.manual_seed(seed)
    for p in module.parameters():
        nn.init.normal_(p, std=0.1)
    return module.to(torch.bfloat16).eval()


def _tokens(batch, seq, hidden, seed=1):
    return torch.randn(batch, seq, hidden, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def _assert_equal(out, expected):
    for a, b in zip(out, expected, strict=True):
        assert torch.equal(a, b)


class GatedDeltaNetProjections(nn.Module):
    """transformers' Qwen3_5GatedDeltaNet.forward up to its conv: its four projections of one input."""

    def __init__(self, hidden=64, key_dim=16, value_dim=32, v_heads=4):
        super().__init__()
        self.in_proj_qkv = nn.Linear(hidden, key_dim * 2 + value_dim, bias=False)
        self.in_proj_z = nn.Linear(hidden, value_dim, bias=False)
        self.in_proj_b = nn.Linear(hidden, v_heads, bias=False)
        self.in_proj_a = nn.Linear(hidden, v_heads, bias=False)

    def forward(self, hidden_states):
        batch_size, seq_len, _ = hidden_states.shape
        mixed_qkv = self.in_proj_qkv(hidden_states)
        mixed_qkv = mixed_qkv.transpose(1, 2)
        z = self.in_proj_z(hidden_states)
        z = z.reshape(batch_size, seq_len, -1, 8)
        b = self.in_proj_b(hidden_states)
        a = self.in_proj_a(hidden_states)
        return mixed_qkv, z, b.sigmoid(), a.float()


def test_gated_deltanet_projections_one_launch():
    module = _bf16(GatedDeltaNetProjections())
    x = _tokens(2, 1, 64)
    out, report = compile_with(FUSION, module, (x,))
    assert report.final()["shared_input_linears"] == 1 and not report.errors
    changes = op_changes(report)
    assert changes[OP] == (0, 1) and changes[MM] == (4, 0)
    assert changes["aten.permute.default"][0] - changes["aten.permute.default"][1] == 4  # the weights' transposes
    with torch.no_grad():
        _assert_equal(out, module(x))


def test_qwen35_moe_block_router_and_shared_expert_one_launch():
    """transformers' Qwen3_5MoeSparseMoeBlock at decode: the router's GEMM, the shared expert's gate
    and up projections and shared_expert_gate read one input (the experts' grouped GEMMs and the
    shared expert's down projection do not)."""
    from _moe_blocks import moe_block

    block = moe_block("qwen3.5-moe")
    x = _tokens(3, 1, 64, seed=4)
    out, report = compile_with(FUSION, block, (x,))
    assert report.final()["shared_input_linears"] == 1 and not report.errors
    changes = op_changes(report)
    assert changes[OP] == (0, 1) and changes[MM][0] - changes[MM][1] == 4
    stock, _ = compile_with([], block, (x,))  # Inductor's own fusions of the block's pointwise ops
    assert torch.equal(out, stock)


class LlamaKV(nn.Module):
    """A Llama-style attention's projections: k and v small (2 KV heads), q large."""

    def __init__(self, hidden=64, heads=4, kv_heads=1, head_dim=16, q_bias=False):
        super().__init__()
        self.head_dim = head_dim
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=q_bias)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)

    def forward(self, hidden_states):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        q = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        k = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        v = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        return q, k, v


def test_attention_projections_and_a_biased_one_left_out():
    module = _bf16(LlamaKV())
    x = _tokens(2, 1, 64)
    out, report = compile_with(FUSION, module, (x,))
    assert report.final()["shared_input_linears"] == 1
    assert op_changes(report)[MM] == (3, 0) and op_changes(report)[OP] == (0, 1)
    with torch.no_grad():
        _assert_equal(out, module(x))
    # q with a bias (Qwen2's): an addmm, not a site; k and v still one launch
    module = _bf16(LlamaKV(q_bias=True))
    out, report = compile_with(FUSION, module, (x,))
    changes = op_changes(report)
    assert report.final()["shared_input_linears"] == 1 and changes[MM] == (2, 0) and "aten.addmm.default" not in changes
    assert changes[OP] == (0, 1)
    with torch.no_grad():
        _assert_equal(out, module(x))


def vllm_style(x, w_gate, w_up, w_router):
    """Two-dimensional tokens (an engine's flattened batch) through F.linear, no view."""
    return F.linear(x, w_gate), F.linear(x, w_up), F.linear(x, w_router)


def matmul_style(x, w_b, w_a):
    """Hand-written: the input times each weight's transpose."""
    return torch.matmul(x, w_b.t()), x @ w_a.T


def _weights(*rows, k=48, seed=5):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, k, generator=g) * 0.1).to(torch.bfloat16) for n in rows]


@pytest.mark.parametrize("fn,rows", [(vllm_style, (24, 24, 8)), (matmul_style, (4, 4))])
def test_other_spellings(fn, rows):
    x = torch.randn(3, 48, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    ws = _weights(*rows)
    out, report = compile_with(FUSION, fn, (x, *ws))
    assert report.final()["shared_input_linears"] == 1
    assert op_changes(report)[MM] == (len(rows), 0) and op_changes(report)[OP] == (0, 1)
    _assert_equal(out, fn(x, *ws))


def five_projections(x, *ws):
    return tuple(F.linear(x, w) for w in ws)


def test_more_than_four_siblings_take_launches_of_four():
    x = torch.randn(2, 48, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    ws = _weights(3, 5, 7, 9, 11, 13)
    out, report = compile_with(FUSION, five_projections, (x, *ws))
    assert report.final()["shared_input_linears"] == 2  # 4 + 2
    assert op_changes(report)[OP] == (0, 2)
    _assert_equal(out, five_projections(x, *ws))
    ws = ws[:5]
    out, report = compile_with(FUSION, five_projections, (x, *ws))  # 4 + 1: the last alone stays a GEMM
    assert report.final()["shared_input_linears"] == 1 and op_changes(report)[MM] == (5, 1)
    _assert_equal(out, five_projections(x, *ws))


def two_inputs(x, y, w1, w2):
    return F.linear(x, w1), F.linear(y, w2)


def test_not_sites():
    x = torch.randn(3, 48, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    w1, w2 = _weights(8, 8)
    prefill = torch.randn(MAX_TOKENS + 1, 48).to(torch.bfloat16)
    cases = [
        (vllm_style, (prefill, w1, w2, w1)),  # a prefill's GEMMs
        (vllm_style, (x.float(), w1.float(), w2.float(), w1.float())),  # fp32
        (five_projections, (x, w1)),  # one linear alone
        (two_inputs, (x, x.clone(), w1, w2)),  # two inputs
        (lambda x, w1, w2, b: (F.linear(x, w1, b), F.linear(x, w2, b)), (x, w1, w2, torch.zeros(8, dtype=torch.bfloat16))),
    ]  # fmt: skip
    for fn, args in cases:
        out, report = compile_with(FUSION, fn, args)
        assert report.final()["shared_input_linears"] == 0 and OP not in report.ops_after()
        changes = op_changes(report)  # every GEMM (mm, or addmm with the bias) as it was
        assert MM not in changes and "aten.addmm.default" not in changes, changes
        _assert_equal(out, fn(*args))


def test_a_large_weight_is_left_to_cublas_and_its_small_siblings_grouped():
    rows = SMALL_WEIGHT_BYTES // (2 * 1024) + 1  # one row over the limit at K 1024 in bf16
    x = torch.randn(1, 1024, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    big, b, a = _weights(rows, 4, 4, k=1024)
    out, report = compile_with(FUSION, vllm_style, (x, big, b, a))
    # with the large weight in, all three would be one launch and no GEMM left
    assert report.final()["shared_input_linears"] == 1 and op_changes(report)[MM] == (3, 1)
    assert op_changes(report)[OP] == (0, 1)
    _assert_equal(out, vllm_style(x, big, b, a))
    # the form without the limit (for measuring the kernel on large weights) takes all three
    out, report = compile_with(["shared_input_linears_any_size"], vllm_style, (x, big, b, a))
    assert report.final()["shared_input_linears_any_size"] == 1 and op_changes(report)[MM] == (3, 0)
    assert op_changes(report)[OP] == (0, 1)
    _assert_equal(out, vllm_style(x, big, b, a))


@pytest.mark.slow  # two whole-model compiles
def test_qwen35_moe_decode_step():
    """A tiny Qwen 3.5-MoE decode step (StaticCache, 4 layers: 3 Gated DeltaNet, 1 full attention)
    with the defaults and shared_input_linears: one launch per Gated DeltaNet layer's projections,
    per attention layer's q / k / v and per MoE block (every weight is small at tiny widths), the
    defaults' fusions still there, outputs and caches equal to the defaults' step."""
    from _rewrites import decode_steps

    from fusion_passes.models import build_model
    from fusion_passes.models.decode import DecodeStep

    built = build_model("qwen3.5-moe", size="tiny", dtype=torch.bfloat16, layers=4)
    step = DecodeStep(built.module, batch=2, context=8, steps=2)
    defaults, base = decode_steps(step, "all")
    fused, report = decode_steps(step, ["all", "shared_input_linears"])
    final = report.final()
    assert final["shared_input_linears"] == 3 + 1 + 4 and not report.errors
    for name, count in base.final().items():
        assert final[name] == count, name
    assert report.ops_after()[OP] == 8
    for ours, theirs in zip(fused, defaults, strict=True):
        assert torch.equal(ours, theirs)
