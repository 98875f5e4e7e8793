"""The Gated DeltaNet decode step as transformers writes it (Qwen3_5GatedDeltaNet at one cached
token: causal_conv1d_update, split, gating, repeat_interleave, torch_recurrent_gated_delta_rule,
the cache's state copies, the gated RMSNorm), written out here: the conv and the recurrent step
each become one fused op (match counts, ops before / after); on the CPU, where the fused ops run
their references, the conv and recurrent states are bit-equal to eager's and the outputs (through
Inductor's own gated-norm kernel) within the dtype's tolerance; and a step without the q / k
l2norm does not match, and is reported as a near miss."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fusion_passes
from fusion_passes.numerics import compare

FUSIONS = ["causal_conv1d_update", "gated_delta_step"]
HK, HV, DK, DV, W = 2, 4, 16, 8, 4


def _l2norm(x, dim=-1, eps=1e-6):
    inv_norm = torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)
    return x * inv_norm


def _recurrent(query, key, value, g, beta, initial_state, use_qk_l2norm_in_kernel=True):
    """transformers' torch_recurrent_gated_delta_rule(output_final_state=True)."""
    initial_dtype = query.dtype
    batch_size, sequence_length, _, k_head_dim = key.shape
    num_v_heads, v_head_dim = value.shape[-2:]
    decay = g
    query, key, value, beta, decay = [
        x.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format)
        for x in (query, key, value, beta, decay)
    ]
    if use_qk_l2norm_in_kernel:
        query = _l2norm(query, dim=-1, eps=1e-6)
        key = _l2norm(key, dim=-1, eps=1e-6)
    query = query / (query.shape[-1] ** 0.5)
    last_recurrent_state = initial_state.to(value)
    core_attn_out = torch.zeros_like(value)
    for i in range(sequence_length):
        q_t, k_t, v_t = query[:, :, i], key[:, :, i], value[:, :, i]
        decay_t = decay[:, :, i].exp()[..., None, None]
        last_recurrent_state = last_recurrent_state * decay_t
        beta_t = beta[:, :, i].unsqueeze(-1)
        kv_mem = (last_recurrent_state * k_t.unsqueeze(-1)).sum(dim=-2)
        delta = (v_t - kv_mem) * beta_t
        last_recurrent_state = last_recurrent_state + k_t.unsqueeze(-1) * delta.unsqueeze(-2)
        core_attn_out[:, :, i] = (last_recurrent_state * q_t.unsqueeze(-1)).sum(dim=-2)
    core_attn_out = core_attn_out.transpose(1, 2).contiguous().to(initial_dtype)
    return core_attn_out, last_recurrent_state


class GatedDeltaNetDecode(torch.nn.Module):
    """Qwen3_5GatedDeltaNet.forward on its cached single-token path, the cache's states as buffers."""

    def __init__(self, hidden=32, l2norm=True, state_dtype=torch.float32, dtype=torch.bfloat16):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.key_dim, self.value_dim = HK * DK, HV * DV
        conv_dim = 2 * self.key_dim + self.value_dim
        self.l2norm = l2norm
        self.in_proj_qkv = torch.nn.Linear(hidden, conv_dim, bias=False)
        self.in_proj_z = torch.nn.Linear(hidden, self.value_dim, bias=False)
        self.in_proj_b = torch.nn.Linear(hidden, HV, bias=False)
        self.in_proj_a = torch.nn.Linear(hidden, HV, bias=False)
        self.conv_weight = torch.nn.Parameter(torch.randn(conv_dim, 1, W, generator=g))
        self.dt_bias = torch.nn.Parameter(torch.randn(HV, generator=g))
        self.A_log = torch.nn.Parameter(torch.empty(HV).uniform_(0.01, 16, generator=g).log())
        self.norm_weight = torch.nn.Parameter(1 + 0.1 * torch.randn(DV, generator=g))
        self.to(dtype)
        self.register_buffer("conv_state", torch.randn(2, conv_dim, W, generator=g).to(dtype))
        self.register_buffer("recurrent_state", torch.randn(2, HV, DK, DV, generator=g).to(state_dtype))

    def _conv_update(self, hidden_states, conv_state, weight):
        # transformers' causal_conv1d_update, activation "silu", no bias
        _, hidden_size, seq_len = hidden_states.shape
        state_len = conv_state.shape[-1]
        hidden_states_new = torch.cat([conv_state, hidden_states], dim=-1).to(weight.dtype)
        conv_state.copy_(hidden_states_new[:, :, -state_len:])
        out = F.conv1d(hidden_states_new, weight.unsqueeze(1), None, padding=0, groups=hidden_size)
        out = F.silu(out[:, :, -seq_len:])
        return out.to(hidden_states.dtype)

    def _gated_norm(self, hidden_states, gate):
        # Qwen3_5RMSNormGated
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + 1e-6)
        hidden_states = self.norm_weight * hidden_states.to(input_dtype)
        hidden_states = hidden_states * F.silu(gate.to(torch.float32))
        return hidden_states.to(input_dtype)

    def forward(self, hidden_states):
        batch_size, seq_len, _ = hidden_states.shape
        mixed_qkv = self.in_proj_qkv(hidden_states).transpose(1, 2)
        z = self.in_proj_z(hidden_states).reshape(batch_size, seq_len, -1, DV)
        b, a = self.in_proj_b(hidden_states), self.in_proj_a(hidden_states)
        mixed_qkv = self._conv_update(mixed_qkv, self.conv_state, self.conv_weight.squeeze(1)).transpose(1, 2)
        query, key, value = torch.split(mixed_qkv, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        query = query.reshape(batch_size, seq_len, -1, DK)
        key = key.reshape(batch_size, seq_len, -1, DK)
        value = value.reshape(batch_size, seq_len, -1, DV)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        query = query.repeat_interleave(HV // HK, dim=2)
        key = key.repeat_interleave(HV // HK, dim=2)
        out, state = _recurrent(query, key, value, g, beta, self.recurrent_state, self.l2norm)
        self.recurrent_state.copy_(state)  # cache.update_recurrent_state
        out = self._gated_norm(out.reshape(-1, DV), z.reshape(-1, DV))
        return out.reshape(batch_size, seq_len, -1)


def _compile_and_run(module, steps=3):
    """(outputs and final states compiled with the fusions, the same in eager, the report)."""
    dtype = module.in_proj_z.weight.dtype
    x = [torch.randn(2, 1, 32, generator=torch.Generator().manual_seed(i)).to(dtype) for i in range(steps)]
    start = {k: v.clone() for k, v in module.named_buffers()}
    report = fusion_passes.Report()
    torch._dynamo.reset()
    compiled = torch.compile(module, backend=fusion_passes.backend(FUSIONS, report=report), fullgraph=True)
    with torch.no_grad():
        outs = [compiled(t) for t in x]
        states = {k: v.clone() for k, v in module.named_buffers()}
        for k, v in module.named_buffers():
            v.copy_(start[k])
        expected = [module(t) for t in x]
        expected_states = {k: v.clone() for k, v in module.named_buffers()}
    return (outs, states), (expected, expected_states), report


def _assert_ops(report, conv: int, step: int) -> None:
    """The graph ops the two fusions take (the conv; the step's softplus, its two l2norms' rsqrt)
    and the fused ops they leave, before and after the passes."""
    before, after = report.ops_before(), report.ops_after()
    assert (before["aten.convolution.default"], after["aten.convolution.default"]) == (1, 1 - conv)
    assert (before["aten.log1p.default"], after["aten.log1p.default"]) == (1, 1 - step)
    assert before["aten.rsqrt.default"] - after["aten.rsqrt.default"] == 2 * step
    assert (before["fusion_passes.causal_conv1d_update.default"], after["fusion_passes.causal_conv1d_update.default"]) == (0, conv)
    assert (before["fusion_passes.gated_delta_step.default"], after["fusion_passes.gated_delta_step.default"]) == (0, step)


def test_transformers_decode_step_fuses_states_bit_equal():
    (outs, states), (expected, expected_states), report = _compile_and_run(GatedDeltaNetDecode())
    assert report.final()["causal_conv1d_update"] == 1 and report.final()["gated_delta_step"] == 1
    _assert_ops(report, conv=1, step=1)  # the gated norm's rsqrt stays
    assert all(compare(a, e).ok for a, e in zip(outs, expected, strict=True))
    assert all(torch.equal(states[k], expected_states[k]) for k in states)


def test_bf16_recurrent_state_fuses_on_its_fp32_copy():
    """A cache holding the state in bf16: transformers' step upcasts it (initial_state.to(value)),
    the fused op takes that fp32 copy, and the copy back into the cache rounds as eager's does."""
    (outs, states), (expected, expected_states), report = _compile_and_run(
        GatedDeltaNetDecode(state_dtype=torch.bfloat16)
    )
    assert report.final()["gated_delta_step"] == 1 and report.final()["causal_conv1d_update"] == 1
    _assert_ops(report, conv=1, step=1)
    assert all(compare(a, e).ok for a, e in zip(outs, expected, strict=True))
    assert all(torch.equal(states[k], expected_states[k]) for k in states)


def test_step_without_qk_l2norm_does_not_match():
    (outs, _), (expected, _), report = _compile_and_run(GatedDeltaNetDecode(l2norm=False))
    assert report.final()["gated_delta_step"] == 0 and report.final()["causal_conv1d_update"] == 1
    before, after = report.ops_before(), report.ops_after()
    assert (before["aten.convolution.default"], after["aten.convolution.default"]) == (1, 0)
    assert (before["aten.log1p.default"], after["aten.log1p.default"]) == (1, 1)
    assert after["fusion_passes.gated_delta_step.default"] == 0
    assert all(compare(a, e).ok for a, e in zip(outs, expected, strict=True))
    # reported as a near miss: the step's gating (its softplus) is still in the graph
    (miss,) = [m for m in report.near_misses if m.fusion == "gated_delta_step"]
    assert miss.spelling == "transformers_gated_delta_step"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_other_dtypes_fuse_states_bit_equal(dtype):
    (outs, states), (expected, expected_states), report = _compile_and_run(GatedDeltaNetDecode(dtype=dtype))
    assert report.final()["causal_conv1d_update"] == 1 and report.final()["gated_delta_step"] == 1
    _assert_ops(report, conv=1, step=1)
    assert all(compare(a, e).ok for a, e in zip(outs, expected, strict=True))
    assert all(torch.equal(states[k], expected_states[k]) for k in states)
