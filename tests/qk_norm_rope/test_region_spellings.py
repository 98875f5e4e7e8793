"""QK-norm + RoPE as other code bases write it, reaching the one region fusion through the
canonical rms_norm / rope ops: Olmo2 (norm over all heads, fp32 cos / sin, cast back), gpt-fast's
layout (fused wqkv + split, RoPE on [B, S, H, D] before the transpose, fp32 math on a bf16 cache),
vLLM's flat tokens ([T, H * D] viewed per head for the norm, viewed back, native rotary with
half-width cos / sin gathered by position), Phi-3's sliced qkv with partial rotary. Each written
here the way its code base writes it; a q/k norm is added where the code base has none (gpt-fast,
Phi-3), as Qwen3 writes it. Outputs bit-equal to eager on CPU (the fused op runs its reference).

GLM4's GPT-J pairs after per-head norms (a q/k norm added as Qwen3 writes it) and vLLM's GPT-J
style fuse too (the kernel takes both pair layouts).

Negatives stay unfused: q and k of different RoPE styles or cos / sin, different eps (with a
reason), LayerNorm instead of RMSNorm, a norm over another dim."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fusion_passes
from _stock import assert_as_stock_inductor
from _rope_spellings import (  # each code base's RoPE
    glm4_rope,
    glm_rotate_half,
    gpt_fast_apply,
    hf_rope,
    hf_rope_partial,
    hf_rotate_half,
    vllm_native,
)
from fusion_passes.numerics import tolerance

D, HQ, HK = 12, 3, 1  # odd sizes: 3 + 1 heads of 12, 5 tokens
QK_OP = "fusion_passes.qk_norm_rope.default"


def llama_rms_norm(x, weight, eps):
    """transformers' Qwen3RMSNorm (the per-head q_norm / k_norm)."""
    input_dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(input_dtype)


def olmo2_rms_norm(x, weight, eps):
    """transformers' Olmo2RMSNorm: the weight multiplied in fp32, the cast last."""
    input_dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return (weight * h).to(input_dtype)


def olmo2(q_proj, k_proj, q_w, k_w, cos32, sin32):
    """Olmo2Attention: q_norm / k_norm over all heads before the head view, fp32 cos / sin."""
    b, s = q_proj.shape[:2]
    hidden_shape = (b, s, -1, D)
    q = olmo2_rms_norm(q_proj, q_w, 1e-6).view(hidden_shape).transpose(1, 2)
    k = olmo2_rms_norm(k_proj, k_w, 1e-6).view(hidden_shape).transpose(1, 2)
    q_embed, k_embed = hf_rope(q, k, cos32, sin32)
    return q_embed.to(q.dtype), k_embed.to(k.dtype)


def gpt_fast(qkv, q_w, k_w, freqs_cache, input_pos):
    """gpt-fast's Attention (wqkv split, RoPE before the transpose) with per-head q/k norms."""
    bsz, seqlen = qkv.shape[:2]
    q, k, v = qkv.split([HQ * D, HK * D, HK * D], dim=-1)
    q = llama_rms_norm(q.view(bsz, seqlen, HQ, D), q_w, 1e-6)
    k = llama_rms_norm(k.view(bsz, seqlen, HK, D), k_w, 1e-6)
    freqs_cis = freqs_cache[input_pos]
    q = gpt_fast_apply(q, freqs_cis)
    k = gpt_fast_apply(k, freqs_cis)
    q, k = map(lambda x: x.transpose(1, 2), (q, k))
    return q, k


def vllm_qwen3(rotary_dim, is_neox_style=True):
    """vLLM's Qwen3Attention: per-head norms of views of the flat projections, viewed back, then
    RotaryEmbedding.forward_native (which views q / k per head again)."""

    def fn(positions, q, k, q_w, k_w, cos_sin_cache):
        q_by_head = q.view(*q.shape[:-1], q.shape[-1] // D, D)
        q = llama_rms_norm(q_by_head, q_w, 1e-6).view(q.shape)
        k_by_head = k.view(*k.shape[:-1], k.shape[-1] // D, D)
        k = llama_rms_norm(k_by_head, k_w, 1e-6).view(k.shape)
        return vllm_native(positions, q, k, cos_sin_cache, rotary_dim, is_neox_style)

    return fn


def vllm_rms_norm(x, weight, eps):
    """vLLM's RMSNorm.forward_native (no residual)."""
    orig_dtype = x.dtype
    x = x.to(torch.float32)
    variance = x.pow(2).mean(dim=-1, keepdim=True)
    x = x * torch.rsqrt(variance + eps)
    x = x.to(orig_dtype)
    return x * weight


def vllm_olmo2(positions, q, k, q_w, k_w, cos_sin_cache):
    """vLLM's Olmo2Attention: q_norm / k_norm over all heads of the flat [T, H * D] projections,
    then RotaryEmbedding.forward_native (NeoX, the whole head)."""
    q = vllm_rms_norm(q, q_w, 1e-6)
    k = vllm_rms_norm(k, k_w, 1e-6)
    return vllm_native(positions, q, k, cos_sin_cache, D, True)


def phi3(qkv, q_w, k_w, cos, sin):
    """transformers Phi-3 (one qkv projection sliced, partial rotary) with Qwen3's q/k norms."""
    b, s = qkv.shape[:2]
    query_pos = HQ * D
    q = qkv[..., :query_pos].view(b, s, -1, D)
    k = qkv[..., query_pos : query_pos + HK * D].view(b, s, -1, D)
    q = llama_rms_norm(q, q_w, 1e-6).transpose(1, 2)
    k = llama_rms_norm(k, k_w, 1e-6).transpose(1, 2)
    return hf_rope_partial(q, k, cos, sin)


def glm4_with_norms(q_proj, k_proj, q_w, k_w, cos, sin):
    """GLM4's interleaved partial RoPE after per-head q/k norms (as Qwen3 writes them)."""
    b, s = q_proj.shape[:2]
    q = llama_rms_norm(q_proj.view(b, s, -1, D), q_w, 1e-6).transpose(1, 2)
    k = llama_rms_norm(k_proj.view(b, s, -1, D), k_w, 1e-6).transpose(1, 2)
    return glm4_rope(q, k, cos, sin)


# --- inputs ---


def _weights(dtype, width_q=D, width_k=D):
    return (1 + 0.3 * torch.randn(width_q)).to(dtype), (1 + 0.3 * torch.randn(width_k)).to(dtype)


def _hf_cos(dtype, b, s, rotary):
    a = 50 * torch.rand(b, s, rotary // 2)
    a = torch.cat((a, a), dim=-1)
    return a.cos().to(dtype), a.sin().to(dtype)


def _inputs(name, dtype):
    torch.manual_seed(sum(map(ord, name)))
    b, s = 2, 5
    if name == "olmo2":
        return (torch.randn(b, s, HQ * D).to(dtype), torch.randn(b, s, HK * D).to(dtype),
                *_weights(dtype, HQ * D, HK * D), *_hf_cos(torch.float32, b, s, D))  # fmt: skip
    if name == "gpt_fast":
        a = 50 * torch.rand(16, D // 2)
        cache = torch.stack([a.cos(), a.sin()], dim=-1).to(torch.bfloat16)
        qkv = torch.randn(1, s, (HQ + 2 * HK) * D).to(dtype)
        return qkv, *_weights(dtype), cache, torch.tensor([3, 7, 0, 15, 9])
    if name.startswith("vllm"):
        rotary = D if name == "vllm_olmo2" else int(name.rsplit("_", 1)[1])
        a = 50 * torch.rand(32, rotary // 2)
        cache = torch.cat([a.cos(), a.sin()], dim=-1).to(dtype)
        t = 7
        widths = (HQ * D, HK * D) if name == "vllm_olmo2" else (D, D)
        return (torch.tensor([5, 0, 31, 2, 2, 17, 9]), torch.randn(t, HQ * D).to(dtype),
                torch.randn(t, HK * D).to(dtype), *_weights(dtype, *widths), cache)  # fmt: skip
    if name == "phi3":
        return (torch.randn(b, s, (HQ + 2 * HK) * D).to(dtype), *_weights(dtype),
                *_hf_cos(dtype, b, s, D // 2))  # fmt: skip
    if name in ("glm4",):
        return (torch.randn(b, s, HQ * D).to(dtype), torch.randn(b, s, HK * D).to(dtype),
                *_weights(dtype), *_hf_cos(dtype, b, s, D // 2))  # fmt: skip
    raise KeyError(name)


FUSED = {  # name: (function, region fusion, raise fusion)
    "olmo2": (olmo2, "qk_norm_rope_whole_row", "rope"),
    "gpt_fast": (gpt_fast, "qk_norm_rope", "rope_gpt_fast"),
    # rotary_dim == head_size: Inductor drops the whole-width slice and the empty cat.
    "vllm_neox_12": (vllm_qwen3(12), "qk_norm_rope", "rope_half_cos"),
    "vllm_neox_8": (vllm_qwen3(8), "qk_norm_rope", "rope_half_cos_partial"),
    "phi3": (phi3, "qk_norm_rope", "rope_partial"),
    "glm4": (glm4_with_norms, "qk_norm_rope", "rope_partial"),
    "vllm_gptj_8": (vllm_qwen3(8, is_neox_style=False), "qk_norm_rope", "rope_half_cos_partial"),
    "vllm_olmo2": (vllm_olmo2, "qk_norm_rope_whole_row", "rope_half_cos"),
}


def zoo(args: dict):
    return {name: FUSED[name][0](*a) for name, a in args.items()}


def _run(fn, *args):
    report = fusion_passes.Report()
    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(fn, backend=fusion_passes.backend(["qk_norm_rope"], report=report))(*args)
        expected = fn(*args)
    return out, expected, report


def _matched(report):
    return {k: v for k, v in report.matches.items() if v}


@pytest.fixture(scope="module", params=[torch.bfloat16, pytest.param(torch.float32, marks=pytest.mark.slow),
                                        pytest.param(torch.float16, marks=pytest.mark.slow)], ids=str)  # fmt: skip
def compiled_zoo(request):
    args = {name: _inputs(name, request.param) for name in FUSED}
    return (request.param, *_run(zoo, args))


@pytest.mark.parametrize("name", list(FUSED))
def test_spelling_reaches_the_region(compiled_zoo, name):
    """Every spelling's q and k rope ops raised, then fused with their norms into one op (the
    counts per fusion: test_zoo_counts_and_ops), its outputs bit-equal to eager."""
    dtype, out, expected, report = compiled_zoo
    for a, e in zip(out[name], expected[name], strict=True):
        assert a.dtype == e.dtype and a.shape == e.shape
        assert torch.equal(a, e), (name, dtype, (a.double() - e.double()).abs().max())


def test_zoo_counts_and_ops(compiled_zoo):
    _, _, _, report = compiled_zoo
    want = {"rms_norm": 2 * len(FUSED)}
    for _, fusion, raised_by in FUSED.values():
        want[raised_by] = want.get(raised_by, 0) + 2
        want[fusion] = want.get(fusion, 0) + 1
    assert _matched(report) == want
    assert not report.rejected and not report.errors
    before, after = report.graphs[0].ops_before, report.graphs[0].ops_after
    assert after[QK_OP] == len(FUSED)
    for op in ("fusion_passes.rope.default", "fusion_passes.rms_norm.default", "aten.rsqrt.default",
               "aten.neg.default", "aten.sub.Tensor"):  # fmt: skip
        assert op not in after, op
    assert before["aten.rsqrt.default"] == 2 * len(FUSED) and before["aten.sub.Tensor"] > 0
    assert not report.lowered_back()


# --- negatives: each stays unfused, its rope ops lowered back, with a reason where one applies ---


def _close(out, expected, dtype):
    tol = tolerance(dtype)
    for a, e in zip(out, expected, strict=True):
        torch.testing.assert_close(a, e, rtol=tol.rtol, atol=tol.atol)


def _prelude(q_rope, k_rope, q_norm=llama_rms_norm, k_norm=llama_rms_norm, eps=(1e-6, 1e-6)):
    def fn(q_proj, k_proj, q_w, k_w, cos, sin, cos_k, sin_k):
        b, s = q_proj.shape[:2]
        q = q_norm(q_proj.view(b, s, -1, D), q_w, eps[0]).transpose(1, 2)
        k = k_norm(k_proj.view(b, s, -1, D), k_w, eps[1]).transpose(1, 2)
        cos, sin, cos_k, sin_k = (t.unsqueeze(1) for t in (cos, sin, cos_k, sin_k))
        return q_rope(q, cos, sin), k_rope(k, cos_k, sin_k)

    return fn


def _neox(x, cos, sin):
    return (x * cos) + (hf_rotate_half(x) * sin)


def _gptj(x, cos, sin):
    return (x * cos) + (glm_rotate_half(x) * sin)


def _layer_norm(x, w, eps):
    return F.layer_norm(x, (x.shape[-1],), w, None, eps)


def _norm_over_heads(x, w, eps):
    """RMSNorm of each dim over the heads (dim -2), not over the head's dims."""
    return llama_rms_norm(x.transpose(-1, -2), w, eps).transpose(-1, -2)


NEGATIVES = {  # name: (prelude, fusions expected to match, reason fragment or None)
    "q_neox_k_interleaved": (_prelude(_neox, _gptj), {"rms_norm": 2, "rope": 2}, None),
    "different_cos_sin": (_prelude(_neox, _neox), {"rms_norm": 2, "rope": 2}, None),
    "different_eps": (_prelude(_neox, _neox, eps=(1e-6, 1e-5)), {"rms_norm": 2, "rope": 2}, "eps"),
    "layer_norm": (_prelude(_neox, _neox, _layer_norm, _layer_norm), {"rope": 2}, None),
    "norm_over_heads": (_prelude(_neox, _neox, _norm_over_heads, _norm_over_heads), {"rms_norm": 2, "rope": 2}, None),
}


@pytest.mark.parametrize("name", list(NEGATIVES))
def test_negative_is_not_fused(name):
    fn, matched, reason = NEGATIVES[name]
    dtype = torch.bfloat16
    b, s = 2, 5
    q, k = torch.randn(b, s, HQ * D).to(dtype), torch.randn(b, s, HK * D).to(dtype)
    w_q, w_k = _weights(dtype, *((HQ, HK) if name == "norm_over_heads" else (D, D)))
    if name == "norm_over_heads":
        w_k = (1 + 0.3 * torch.randn(HQ)).to(dtype)  # both of q's width: k is viewed with 1 head
        k = torch.randn(b, s, HQ * D).to(dtype)
    cos, sin = _hf_cos(dtype, b, s, D)
    cos_k, sin_k = _hf_cos(dtype, b, s, D) if name == "different_cos_sin" else (cos, sin)
    out, expected, report = _run(fn, q, k, w_q, w_k, cos, sin, cos_k, sin_k)
    assert _matched(report) == matched
    assert QK_OP not in report.graphs[0].ops_after and not report.errors
    assert report.lowered_back()["fusion_passes.rope.default"] == 2
    if reason is not None:
        # (the matcher's other anchor, k's rope, finds k's own branch: rejected as such)
        assert any(reason in r.reason for r in report.rejected)
    # left unfused: stock Inductor's output (not eager's, from which its roundings can stray)
    assert_as_stock_inductor(fn, (q, k, w_q, w_k, cos, sin, cos_k, sin_k), out)


def test_layers_sharing_one_cache_pair_their_own_q_and_k():
    """gpt-fast hands one freqs_cis to every layer: each layer's q and k rope ops get one shared
    cos / sin (made one node per consecutive pair, not across layers, which would let the matcher
    pair q of one layer with k of the next: a cycle through the first layer's attention)."""

    def two_layers(qkv, q_w, k_w, freqs_cache, input_pos, w_mix):
        q1, k1 = gpt_fast(qkv, q_w, k_w, freqs_cache, input_pos)
        attn = (q1.sum(1, keepdim=True) * k1).transpose(1, 2).flatten(-2)  # [1, S, D]: layer 1's output
        qkv2 = qkv + attn.repeat(1, 1, HQ + 2 * HK) * w_mix
        q2, k2 = gpt_fast(qkv2, q_w, k_w, freqs_cache, input_pos)
        return q1, k1, q2, k2

    dtype = torch.bfloat16
    args = (*_inputs("gpt_fast", dtype), torch.tensor(0.5, dtype=dtype))
    out, expected, report = _run(two_layers, *args)
    assert _matched(report) == {"rms_norm": 4, "rope_gpt_fast": 4, "qk_norm_rope": 2}
    assert not report.rejected and not report.errors
    assert report.graphs[0].ops_after[QK_OP] == 2
    for a, e in zip(out[:2], expected[:2], strict=True):
        assert torch.equal(a, e)
    _close(out[2:], expected[2:], dtype)  # layer 2's input is Inductor's (sum, mul, add)
