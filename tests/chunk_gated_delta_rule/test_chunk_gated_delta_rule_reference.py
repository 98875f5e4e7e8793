"""The chunked prefill op's reference: the gated delta rule token by token (its math, in fp64)
within fp32's error and bit-equal to transformers' own chunked rule in eager (the rounding it
reproduces), on random shapes (hypothesis: batch, 1-200 tokens, heads, head dims, a state or
none, every activation dtype) and on chunk boundaries; the op's registration (opcheck), and a
one-line error for bad arguments."""

from __future__ import annotations

import pytest
import torch
from _hypothesis import examples
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

import fusion_passes  # noqa: F401  (registers torch.ops.fusion_passes)
from fusion_passes.lowering.chunk_gated_delta_rule.reference import chunk_gated_delta_rule_reference


def _inputs(batch, tokens, heads, dk, dv, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, tokens, heads, dk, generator=gen).to(dtype)
    k = torch.randn(batch, tokens, heads, dk, generator=gen).to(dtype)
    v = torch.randn(batch, tokens, heads, dv, generator=gen).to(dtype)
    g = -torch.rand(batch, tokens, heads, generator=gen) * 0.5  # log decays, as softplus gives
    beta = torch.rand(batch, tokens, heads, generator=gen).to(dtype)
    state = torch.randn(batch, heads, dk, dv, generator=gen) * 0.1
    return q, k, v, g, beta, state


def _token_by_token(q, k, v, g, beta, state, scale, eps=1e-6):
    """The delta rule one token at a time, in fp64."""
    q, k, v, g, beta, s = (x.double() for x in (q, k, v, g, beta, state))
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + eps)
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + eps)
    out = torch.empty(v.shape, dtype=torch.float64)
    for t in range(q.shape[1]):
        s = s * g[:, t].exp()[..., None, None]
        kv = torch.einsum("bhk,bhkv->bhv", k[:, t], s)
        delta = (v[:, t] - kv) * beta[:, t, :, None]
        s = s + k[:, t, :, :, None] * delta[:, :, None, :]
        out[:, t] = scale * torch.einsum("bhk,bhkv->bhv", q[:, t], s)
    return out, s


@pytest.mark.parametrize("tokens", [1, 63, 64, 65, 150])
@pytest.mark.parametrize("zero_state", [True, False])
def test_reference_is_the_delta_rule(tokens, zero_state):
    q, k, v, g, beta, state = _inputs(2, tokens, 3, 16, 8, torch.float32, seed=tokens)
    if zero_state:
        state = torch.zeros_like(state)
    out, final = chunk_gated_delta_rule_reference(q, k, v, g, beta, state, 16**-0.5, True, 1e-6)
    exp_out, exp_final = _token_by_token(q, k, v, g, beta, state, 16**-0.5)
    assert out.shape == v.shape and out.dtype == torch.float32 and final.dtype == torch.float32
    torch.testing.assert_close(out.double(), exp_out, rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(final.double(), exp_final, rtol=1e-5, atol=2e-5)


@settings(max_examples=examples(40), deadline=None)
@given(
    batch=st.integers(1, 3), tokens=st.integers(1, 200), heads=st.integers(1, 4), dk=st.sampled_from([4, 8, 16, 24]),
    dv=st.sampled_from([4, 6, 16]), zero_state=st.booleans(), seed=st.integers(0, 2**16),
)  # fmt: skip
def test_reference_is_the_delta_rule_on_random_shapes(batch, tokens, heads, dk, dv, zero_state, seed):
    q, k, v, g, beta, state = _inputs(batch, tokens, heads, dk, dv, torch.float32, seed)
    if zero_state:
        state = torch.zeros_like(state)
    out, final = chunk_gated_delta_rule_reference(q, k, v, g, beta, state, dk**-0.5, True, 1e-6)
    exp_out, exp_final = _token_by_token(q, k, v, g, beta, state, dk**-0.5)
    torch.testing.assert_close(out.double(), exp_out, rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(final.double(), exp_final, rtol=1e-5, atol=2e-5)
    # and transformers' rounding, in every activation dtype
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        args = [t.to(dtype) if t is not g and t is not state else t for t in (q, k, v, g, beta, state)]
        ours = chunk_gated_delta_rule_reference(*args, dk**-0.5, True, 1e-6)
        theirs = torch_chunk_gated_delta_rule(*args[:3], g=g, beta=args[4], initial_state=state,
                                              output_final_state=True, use_qk_l2norm_in_kernel=True)  # fmt: skip
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens", [64, 100])
def test_reference_rounds_as_transformers(dtype, tokens):
    q, k, v, g, beta, state = _inputs(2, tokens, 2, 8, 6, dtype, seed=7)
    out, final = chunk_gated_delta_rule_reference(q, k, v, g, beta, state, 8**-0.5, True, 1e-6)
    exp_out, exp_final = torch_chunk_gated_delta_rule(
        q, k, v, g=g, beta=beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    assert out.dtype == dtype and torch.equal(out, exp_out) and torch.equal(final, exp_final)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_values_read_the_key_heads_as_repeat_interleave_would(dtype):
    """2 key heads, 4 value heads (Qwen 3.5 / Qwen3-Next's ratio): bit-equal to the rule on q and k
    repeated as transformers repeats them (repeat_interleave over the heads)."""
    q, k, _, _, _, _ = _inputs(2, 70, 2, 8, 6, dtype, seed=5)
    _, _, v, g, beta, state = _inputs(2, 70, 4, 8, 6, dtype, seed=6)
    g = g.float()
    out, final = chunk_gated_delta_rule_reference(q, k, v, g, beta, state, 8**-0.5, True, 1e-6)
    rep = [x.repeat_interleave(2, dim=2) for x in (q, k)]
    exp_out, exp_final = chunk_gated_delta_rule_reference(*rep, v, g, beta, state, 8**-0.5, True, 1e-6)
    assert out.shape == v.shape and torch.equal(out, exp_out) and torch.equal(final, exp_final)
    theirs = torch_chunk_gated_delta_rule(*rep, v, g=g, beta=beta, initial_state=state, output_final_state=True,
                                          use_qk_l2norm_in_kernel=True)  # fmt: skip
    assert all(torch.equal(a, b) for a, b in zip((out, final), theirs, strict=True))


def test_op_registration():
    args = _inputs(1, 70, 2, 8, 4, torch.bfloat16, seed=3)
    torch.library.opcheck(
        torch.ops.fusion_passes.chunk_gated_delta_rule.default, (*args, 8**-0.5, True, 1e-6)
    )


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: (a[0][..., :4], *a[1:]), "q, k [B, T, H, K]"),
        (lambda a: (a[0][:, :, :1], a[1][:, :, :1], a[2][:, :, :1], *a[3:]), "g (1, 70, 2)"),  # 1 value head
        (lambda a: (a[0][:, :, :1].expand(1, 70, 3, 8), a[1][:, :, :1].expand(1, 70, 3, 8), *a[2:]),
         "HV a multiple of H"),
        (lambda a: (*a[:3], a[3][:, :, :1], *a[4:]), "g (1, 70, 1)"),
        (lambda a: (*a[:5], a[5].bfloat16()), "float32"),
        (lambda a: (a[0], a[1], a[2].half(), *a[3:]), "dtypes differ"),
        (lambda a: (a[0].int(), a[1].int(), a[2].int(), *a[3:]), "supported"),
    ],
)
def test_bad_arguments_raise_one_line(change, message):
    args = change(_inputs(1, 70, 2, 8, 4, torch.bfloat16, seed=3))
    with pytest.raises(ValueError, match="chunk_gated_delta_rule: ") as err:
        torch.ops.fusion_passes.chunk_gated_delta_rule(*args, 8**-0.5, True, 1e-6)
    assert message in str(err.value) and "\n" not in str(err.value)
