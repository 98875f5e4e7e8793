"""A prefill's padded causal conv + SiLU as other code bases write it: causal-conv1d's reference
(``causal_conv1d_ref``, with and without a bias) and Mamba's ``nn.Conv1d`` module call become one
fused op, bit-equal to eager on the CPU (the op runs its reference there), and so does a prompt
continuing transformers' StaticCache conv state; convs that are not causal or not depthwise do
not match (transformers' ``causal_conv1d_fn`` is the
tiny Qwen 3.5 prefill's, in tests/gated_delta_step/test_models_gated_delta_step.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fusion_passes
from fusion_passes.numerics import compare, tolerance

FUSIONS = ["causal_conv1d_after_state", "causal_conv1d", "causal_conv1d_bias", "causal_conv1d_module",
           "causal_conv1d_module_bias"]  # fmt: skip
OP = "fusion_passes.causal_conv1d.default"
CONV = "aten.convolution.default"


def causal_conv1d_ref(x, weight, bias=None, initial_states=None, return_final_states=False, activation=None):
    """causal-conv1d's reference (x [B, C, T], weight [C, W]), as that package writes it."""
    if activation not in [None, "silu", "swish"]:
        raise NotImplementedError("activation must be None, silu, or swish")
    dtype_in = x.dtype
    x = x.to(weight.dtype)
    seqlen = x.shape[-1]
    dim, width = weight.shape
    if initial_states is None:
        out = F.conv1d(x, weight.unsqueeze(1), bias, padding=width - 1, groups=dim)
    else:
        x = torch.cat([initial_states, x], dim=-1)
        out = F.conv1d(x, weight.unsqueeze(1), bias, padding=0, groups=dim)
    out = out[..., :seqlen]
    final_states = F.pad(x, (width - 1 - x.shape[-1], 0)).to(dtype_in) if return_final_states else None
    out = (out if activation is None else F.silu(out)).to(dtype=dtype_in)
    return out if not return_final_states else (out, final_states)


class MambaMixerConv(nn.Module):
    """Mamba's in_proj -> conv1d -> SiLU (mamba_simple.py's slow path), to x_proj's input."""

    def __init__(self, d_model=16, d_inner=32, d_conv=4, conv_bias=True):
        super().__init__()
        self.in_proj = nn.Linear(d_model, d_inner * 2, bias=False)
        self.conv1d = nn.Conv1d(d_inner, d_inner, bias=conv_bias, kernel_size=d_conv, groups=d_inner, padding=d_conv - 1)
        self.act = nn.SiLU()

    def forward(self, hidden_states):
        seqlen = hidden_states.shape[1]
        xz = self.in_proj(hidden_states).transpose(1, 2)
        x, z = xz.chunk(2, dim=1)
        x = self.act(self.conv1d(x)[..., :seqlen])
        return x * F.silu(z)


def continued_prompt_conv(mixed_qkv, conv_state, weight):
    """A prompt continuing a cached conv state, as transformers' StaticCache and qwen3_5 write it:
    update_conv_state's cat and in-place copy of the last inputs, then causal_conv1d_fn over the
    cat, the prompt's outputs kept."""
    seq_len = mixed_qkv.shape[1]
    x = mixed_qkv.transpose(1, 2)
    full = torch.cat([conv_state, x], dim=-1)
    conv_state.copy_(full[..., -conv_state.shape[-1] :])
    out = causal_conv1d_ref(full, weight, None, activation="silu")[:, :, -seq_len:]
    return out.transpose(1, 2)


def _compile(fn):
    report = fusion_passes.Report()
    torch._dynamo.reset()
    return torch.compile(fn, backend=fusion_passes.backend(FUSIONS, report=report), fullgraph=True), report


def _projected(dtype, tokens=37, channels=48):
    """x as the models pass it: a projection's [B, T, C] output, transposed."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(2, tokens, channels, generator=g).to(dtype)
    return h, torch.randn(channels, 4, generator=g).to(dtype), torch.randn(channels, generator=g).to(dtype)


def _assert_fused(report, fusion):
    assert report.final()[fusion] == 1 and sum(report.final().values()) == 1
    before, after = report.ops_before(), report.ops_after()
    assert (before[CONV], after[CONV]) == (1, 0)
    assert (before[OP], after[OP]) == (0, 1)


@pytest.mark.parametrize(("dtype", "bias"), [(torch.bfloat16, False), (torch.float16, True), (torch.float32, True)])
def test_causal_conv1d_ref_fuses_bit_equal(dtype, bias):
    h, weight, b = _projected(dtype)
    b = b if bias else None

    def fn(h, weight, b):
        return causal_conv1d_ref(h.transpose(1, 2), weight, b, activation="silu").transpose(1, 2) * 2

    compiled, report = _compile(fn)
    with torch.no_grad():
        out = compiled(h, weight, b)
    _assert_fused(report, "causal_conv1d_bias" if bias else "causal_conv1d")
    assert torch.equal(out, fn(h, weight, b))


@pytest.mark.parametrize("conv_bias", [True, False])
def test_mamba_module_conv_fuses_bit_equal(conv_bias):
    torch.manual_seed(0)
    model = MambaMixerConv(conv_bias=conv_bias).to(torch.bfloat16)
    h = torch.randn(2, 21, 16, dtype=torch.bfloat16)
    compiled, report = _compile(model)
    with torch.no_grad():
        out, expected = compiled(h), model(h)
    _assert_fused(report, "causal_conv1d_module_bias" if conv_bias else "causal_conv1d_module")
    # Not bit-equal: stock Inductor keeps SiLU's output in fp32 into the gate's multiply, the op
    # rounds it to bf16 as eager does.
    assert compare(out, expected).rel_norm <= tolerance(torch.bfloat16).rel_norm


@pytest.mark.parametrize(
    ("tokens", "state_len", "fusion"),
    [
        # the conv reads the state's inputs before the prompt; the cache's new state is the last 4
        # inputs (from the state too when the prompt is shorter)
        (37, 4, "causal_conv1d_after_state"),
        (2, 4, "causal_conv1d_after_state"),
        # 2 cached inputs for a 4-tap conv: the conv also reads zeros before them, which an initial
        # state does not model; the padded conv over the cat is the plain fusion's site instead
        (37, 2, "causal_conv1d"),
    ],
)
def test_prompt_after_a_cached_state_fuses_bit_equal(tokens, state_len, fusion):
    h, weight, _ = _projected(torch.bfloat16, tokens=tokens)
    state = torch.randn(2, 48, state_len, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    compiled, report = _compile(continued_prompt_conv)
    ours_state, eager_state = state.clone(), state.clone()
    with torch.no_grad():
        out = compiled(h, ours_state, weight)
        expected = continued_prompt_conv(h, eager_state, weight)
    _assert_fused(report, fusion)
    assert torch.equal(out, expected) and torch.equal(ours_state, eager_state)
    # the cache's new state is written without the cat of state and prompt where the prompt holds
    # all of it (Inductor would write the whole cat, 4 + T columns, to slice it)
    cats = (report.ops_before()["aten.cat.default"], report.ops_after()["aten.cat.default"])
    assert cats == ((1, 0) if fusion == "causal_conv1d_after_state" and tokens >= state_len else (1, 1))


def test_fp32_input_with_bf16_weights_fuses_the_bf16_conv():
    """causal-conv1d's reference casts x to the weight's dtype first: the conv over the cast
    input is the site, the cast back to x's dtype stays outside it."""
    h, weight, _ = _projected(torch.bfloat16)
    h = h.float() * 1.001
    fn = lambda h, w: causal_conv1d_ref(h.transpose(1, 2), w, activation="silu")  # noqa: E731
    compiled, report = _compile(fn)
    with torch.no_grad():
        out = compiled(h, weight)
    _assert_fused(report, "causal_conv1d")
    assert out.dtype == torch.float32 and torch.equal(out, fn(h, weight))


def test_another_width_fuses_from_the_graphs_own_sizes():
    """3 taps: not the registered width (4); the pattern is traced from the graph's sizes."""
    h, weight, _ = _projected(torch.bfloat16)
    weight = weight[:, :3].contiguous()
    fn = lambda h, w: causal_conv1d_ref(h.transpose(1, 2), w, activation="silu")  # noqa: E731
    compiled, report = _compile(fn)
    with torch.no_grad():
        out = compiled(h, weight)
    _assert_fused(report, "causal_conv1d")
    assert torch.equal(out, fn(h, weight))


def _not_causal_keeps_the_last_outputs(x, w):
    return F.silu(F.conv1d(x, w.unsqueeze(1), None, padding=3, groups=x.shape[1])[..., -x.shape[-1] :])


def _same_padding(x, w):
    return F.silu(F.conv1d(x, w[:, :3].unsqueeze(1), None, padding=1, groups=x.shape[1]))


def _not_depthwise(x, w):
    wide = w.unsqueeze(1).expand(-1, 2, -1).contiguous() / 2
    return F.silu(F.conv1d(x, wide, None, padding=3, groups=x.shape[1] // 2)[..., : x.shape[-1]])


def _no_activation(x, w):
    return causal_conv1d_ref(x, w)


@pytest.mark.parametrize(
    ("fn", "near_miss"),
    [(_not_causal_keeps_the_last_outputs, True), (_same_padding, False), (_not_depthwise, False),
     (_no_activation, True)],  # fmt: skip
)
def test_other_convs_do_not_match(fn, near_miss):
    """Left to Inductor, unchanged; the padded depthwise ones are reported as near misses."""
    h, weight, _ = _projected(torch.bfloat16)
    x = h.transpose(1, 2)
    compiled, report = _compile(fn)
    with torch.no_grad():
        out = compiled(x, weight)
    assert sum(report.final().values()) == 0
    assert report.ops_after() == report.ops_before() and report.ops_after()[CONV] == 1
    misses = [m for m in report.near_misses if m.fusion == "causal_conv1d"]
    assert len(misses) == (1 if near_miss else 0)
    torch.testing.assert_close(out, fn(x, weight), rtol=0, atol=0)


def test_prompt_lengths_under_automatic_dynamic_shapes_fuse():
    """A second prompt length recompiles with T symbolic (torch.compile's automatic dynamic
    shapes): that graph fuses too, each length bit-equal to eager."""
    _, weight, _ = _projected(torch.bfloat16)
    fn = lambda h, w: causal_conv1d_ref(h.transpose(1, 2), w, activation="silu")  # noqa: E731
    compiled, report = _compile(fn)
    with torch.no_grad():
        for tokens in (37, 50, 9):
            h = _projected(torch.bfloat16, tokens=tokens)[0]
            assert torch.equal(compiled(h, weight), fn(h, weight))
    assert report.final()["causal_conv1d"] == 2 and sum(report.final().values()) == 2  # static, then symbolic T
    assert report.ops_after()[CONV] == 0 and report.ops_after()[OP] == 2
