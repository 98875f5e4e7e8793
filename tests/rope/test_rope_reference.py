"""The rope op's reference against each code base's RoPE, eagerly (no compile) on random shapes:
bit-equal in every dtype, rank, rotary width and cos / sin broadcast, with the raise rules'
arguments (half-width caches widened by copying, fp32 math where the spelling upcasts). Each
spelling is written here as its code base writes it."""

from __future__ import annotations

import torch
from _hypothesis import examples
from hypothesis import given, settings
from hypothesis import strategies as st

from _rope_spellings import glm_rotate_half, hf_rotate_half
from fusion_passes.lowering.rope.reference import rope_reference

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def transformers(x, cos, sin):  # Llama / Qwen3 / Gemma / Phi-3 partial
    r = cos.shape[-1]
    x_rot, x_pass = x[..., :r], x[..., r:]
    return torch.cat([(x_rot * cos) + (hf_rotate_half(x_rot) * sin), x_pass], dim=-1)


def olmo2(x, cos32, sin32):
    return ((x * cos32) + (hf_rotate_half(x) * sin32)).to(x.dtype)


def glm(x, cos_half, sin_half):  # cos_half: one value per pair, repeated by the model
    cos = cos_half.repeat_interleave(2, dim=-1)
    sin = sin_half.repeat_interleave(2, dim=-1)
    r = cos.shape[-1]
    x_rot, x_pass = x[..., :r], x[..., r:]
    return torch.cat([(x_rot * cos) + (glm_rotate_half(x_rot) * sin), x_pass], dim=-1)


def vllm(x, cos, sin, is_neox_style):  # cos: half width
    r = 2 * cos.shape[-1]
    x_rot, x_pass = x[..., :r], x[..., r:]
    if is_neox_style:
        x1, x2 = torch.chunk(x_rot, 2, dim=-1)
    else:
        x1, x2 = x_rot[..., ::2], x_rot[..., 1::2]
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    out = torch.cat((o1, o2), dim=-1) if is_neox_style else torch.stack((o1, o2), dim=-1).flatten(-2)
    return torch.cat((out, x_pass), dim=-1)


def gpt_fast(x, freqs_cis):  # freqs_cis [.., D/2, 2], any dtype (gpt-fast's is bf16)
    xshaped = x.float().reshape(*x.shape[:-1], -1, 2)
    x_out2 = torch.stack(
        [
            xshaped[..., 0] * freqs_cis[..., 0] - xshaped[..., 1] * freqs_cis[..., 1],
            xshaped[..., 1] * freqs_cis[..., 0] + xshaped[..., 0] * freqs_cis[..., 1],
        ],
        -1,
    )
    return x_out2.flatten(-2).type_as(x)


@st.composite
def _case(draw):
    rank = draw(st.integers(2, 4))
    shape = [draw(st.integers(1, 5)) for _ in range(rank - 1)]
    half = draw(st.integers(1, 9))
    d = 2 * half + draw(st.integers(0, 3))
    # cos broadcast: each leading dim 1 or x's, and maybe fewer dims
    lead = [n if draw(st.booleans()) else 1 for n in shape][draw(st.integers(0, rank - 1)) :]
    return dict(
        shape=(*shape, d), half=half, cos_lead=tuple(lead), dtype=draw(st.sampled_from(DTYPES)),
        seed=draw(st.integers(0, 2**31 - 1)),
    )  # fmt: skip


@settings(max_examples=examples(300), deadline=None)
@given(case=_case())
def test_reference_is_each_spelling_bit_for_bit(case):
    g = torch.Generator().manual_seed(case["seed"])
    dtype, half = case["dtype"], case["half"]
    x = (4 * torch.randn(case["shape"], generator=g)).to(dtype)
    angles = 100 * torch.rand((*case["cos_lead"], half), generator=g)
    c_half, s_half = angles.cos(), angles.sin()
    neox = (torch.cat([c_half, c_half], -1), torch.cat([s_half, s_half], -1))
    pairs = (c_half.repeat_interleave(2, -1), s_half.repeat_interleave(2, -1))
    low = [t.to(dtype) for t in (*neox, *pairs)]
    d = x.shape[-1]

    def same(a, b):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b), (a.double() - b.double()).abs().max()

    same(transformers(x, low[0], low[1]), rope_reference(x, low[0], low[1], False, False))
    same(glm(x, c_half.to(dtype), s_half.to(dtype)), rope_reference(x, low[2], low[3], True, False))
    for neox_style, (c, s) in ((True, low[:2]), (False, low[2:])):
        got = vllm(x, c_half.to(dtype), s_half.to(dtype), neox_style)
        same(got, rope_reference(x, c, s, not neox_style, False))
    if 2 * half == d:  # the whole head: Olmo2 and gpt-fast have no partial form
        same(olmo2(x, *neox), rope_reference(x, *neox, False, dtype != torch.float32))
        cache = torch.stack([c_half, s_half], -1).to(torch.bfloat16)
        bf = [t.to(torch.bfloat16) for t in pairs]
        same(gpt_fast(x, cache), rope_reference(x, *bf, True, True))
