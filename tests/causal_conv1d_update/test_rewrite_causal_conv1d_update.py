"""causal-conv1d's reference decode update (``causal_conv1d_update_ref``: cat, state copy, a
depthwise conv with a bias, SiLU) as that package writes it: one fused op, bit-equal to eager on
the CPU (the op runs its reference there), the conv state updated as eager's; a prefill's padded
conv (``causal_conv1d_fn``) and a conv over a state that is not the graph's input do not match."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fusion_passes

FUSIONS = ["causal_conv1d_update", "causal_conv1d_update_bias", "causal_conv1d_update_token", "causal_conv1d_update_token_bias"]


def causal_conv1d_update_ref(x, conv_state, weight, bias=None, activation=None):
    """causal-conv1d's reference (x [B, C] or [B, C, T]; conv_state updated in place)."""
    dtype_in = x.dtype
    unsqueeze = x.dim() == 2
    if unsqueeze:
        x = x.unsqueeze(-1)
    batch, dim, seqlen = x.shape
    width = weight.shape[1]
    state_len = conv_state.shape[-1]
    assert conv_state.shape == (batch, dim, state_len)
    assert weight.shape == (dim, width)
    x_new = torch.cat([conv_state, x], dim=-1).to(weight.dtype)
    conv_state.copy_(x_new[:, :, -state_len:])
    out = F.conv1d(x_new, weight.unsqueeze(1), bias, padding=0, groups=dim)[:, :, -seqlen:]
    if unsqueeze:
        out = out.squeeze(-1)
    return (out if activation is None else F.silu(out)).to(dtype=dtype_in)


def prefill_conv(x, weight, bias):
    """transformers' causal_conv1d_fn: the conv padded on the left, no state."""
    seq_len = x.shape[-1]
    return F.silu(F.conv1d(x, weight.unsqueeze(1), bias, padding=weight.shape[-1] - 1, groups=x.shape[1])[..., :seq_len])


def _inputs(dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 40, generator=g).to(dtype)
    state = torch.randn(3, 40, 4, generator=g).to(dtype)
    return x, state, torch.randn(40, 4, generator=g).to(dtype), torch.randn(40, generator=g).to(dtype)


def _compile(fn):
    report = fusion_passes.Report()
    torch._dynamo.reset()
    return torch.compile(fn, backend=fusion_passes.backend(FUSIONS, report=report), fullgraph=True), report


@pytest.mark.parametrize("tokens", [None, 1, 2])
def test_causal_conv1d_reference_with_bias_fuses_bit_equal(tokens):
    """x [B, C] (one token, the _token fusion) or [B, C, T]."""
    x, state, weight, bias = _inputs()
    if tokens is not None:
        x = torch.stack([x] * tokens, dim=-1) + torch.arange(tokens).to(x)
    fn = lambda x, s, w, b: causal_conv1d_update_ref(x, s, w, b, activation="silu")  # noqa: E731
    compiled, report = _compile(fn)
    eager_state = state.clone()
    expected = fn(x, eager_state, weight, bias)
    with torch.no_grad():
        out = compiled(x, state, weight, bias)
    fusion = "causal_conv1d_update_token_bias" if tokens is None else "causal_conv1d_update_bias"
    assert report.final()[fusion] == 1 and sum(report.final().values()) == 1
    before, after = report.ops_before(), report.ops_after()
    assert (before["aten.convolution.default"], after["aten.convolution.default"]) == (1, 0)
    assert after["fusion_passes.causal_conv1d_update.default"] == 1
    assert torch.equal(out, expected) and torch.equal(state, eager_state)


def test_prefill_conv_does_not_match_nor_count_as_a_near_miss():
    x, _, weight, bias = _inputs()
    x = x.unsqueeze(-1).expand(3, 40, 6).contiguous()
    compiled, report = _compile(prefill_conv)
    with torch.no_grad():
        out = compiled(x, weight, bias)
    assert report.final()["causal_conv1d_update_bias"] == 0 and report.final()["causal_conv1d_update"] == 0
    assert report.ops_after() == report.ops_before() and report.ops_after()["aten.convolution.default"] == 1
    assert not [m for m in report.near_misses if m.fusion.startswith("causal_conv1d_update")]
    torch.testing.assert_close(out, prefill_conv(x, weight, bias), rtol=0, atol=0)


def test_state_computed_in_the_graph_still_fuses_functionally():
    """A state the graph computes (not a cache input): the fused op's new state is its output,
    and the model's later reads see it."""
    x, state, weight, bias = _inputs(torch.float32)
    x = x.unsqueeze(-1)

    def fn(x, s, w, b):
        s = s * 2
        out = causal_conv1d_update_ref(x, s, w, b, activation="silu")
        return out, s

    compiled, report = _compile(fn)
    with torch.no_grad():
        out, new_state = compiled(x, state, weight, bias)
    expected, expected_state = fn(x, state, weight, bias)
    assert report.final()["causal_conv1d_update_bias"] == 1 and sum(report.final().values()) == 1
    before, after = report.ops_before(), report.ops_after()
    assert (before["aten.convolution.default"], after["aten.convolution.default"]) == (1, 0)
    assert after["fusion_passes.causal_conv1d_update.default"] == 1
    assert torch.equal(out, expected) and torch.equal(new_state, expected_state)
