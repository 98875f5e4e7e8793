"""Rewrite tests of the DeepSeek V3 / V3.2 pre-attention fusions (mla_rope): every spelling, with
its match count, the ops before/after, and outputs bit-exact against eager on the reference path
(CPU); and the near misses that must not match."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    apply_rotary_pos_emb,
    apply_rotary_pos_emb_interleave,
)

import fusion_passes
from _rewrites import compile_with, defaults_without
from fusion_passes.patterns.mla_rope import ONE_LAUNCH_MAX_TOKENS
from fusion_passes.patterns.rms_norm import functional_rms_norm, llama_rms_norm

B, S, H, NOPE, ROPE, V, R = 2, 5, 3, 16, 8, 12, 24
MLA_FUSIONS = {True: "mla_kv_norm_rope", False: "mla_kv_norm_rope_rotate_half"}


def _run(fn, *args, fusions="all"):
    report = fusion_passes.Report()
    torch._dynamo.reset()
    backend = fusion_passes.backend(fusions, report=report)
    with torch.no_grad():
        out = torch.compile(fn, backend=backend, fullgraph=True)(*args)
        expected = fn(*args)
    return out, expected, report


def _matched(report):
    return {k: v for k, v in report.matches.items() if v}


def _cos_sin(dtype, width=ROPE):
    angle = torch.rand(B, S, width // 2) * 50
    emb = torch.cat([angle, angle], dim=-1)  # HF: cat(freqs, freqs)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def mla_pre_attention(q, kv, kv_b, w, cos, sin, interleave=True, norm=llama_rms_norm):
    """DeepseekV3Attention.forward from q_b_proj's output to query/key/value (kv_b_proj given as
    kv_b, a [R, H * (NOPE + V)] weight), as transformers 5 writes it."""
    q_states = q.view(B, S, -1, NOPE + ROPE).transpose(1, 2)
    q_pass, q_rot = torch.split(q_states, [NOPE, ROPE], dim=-1)
    kv_nope, k_rot = torch.split(kv, [R, ROPE], dim=-1)
    kv_nope = norm(kv_nope, w, 1e-6).view(B, 1, S, R)
    k_rot = k_rot.view(B, 1, S, ROPE)
    rope = apply_rotary_pos_emb_interleave if interleave else apply_rotary_pos_emb
    q_rot, k_rot = rope(q_rot, k_rot, cos, sin)
    query = torch.cat((q_pass, q_rot), dim=-1)
    kv_full = (kv_nope @ kv_b).view(B, S, -1, NOPE + V).transpose(1, 2)
    k_nope, value = torch.split(kv_full, [NOPE, V], dim=-1)
    k_rot = k_rot.expand(-1, k_nope.shape[1], -1, -1)
    key = kv_full.new_empty(*kv_full.shape[:-1], NOPE + ROPE)
    key[..., :NOPE].copy_(k_nope)
    key[..., NOPE:].copy_(k_rot)
    return query, key, value


def _mla_inputs(dtype):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, S, H * (NOPE + ROPE), generator=g).to(dtype)
    kv = torch.randn(B, S, R + ROPE, generator=g).to(dtype)
    kv_b = (0.2 * torch.randn(R, H * (NOPE + V), generator=g)).to(dtype)
    w = (1 + 0.1 * torch.randn(R, generator=g)).to(dtype)
    return q, kv, kv_b, w, *_cos_sin(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("interleave", [True, False], ids=["interleave", "rotate_half"])
def test_mla_q_and_kv_branches_fuse_bit_exact(interleave, dtype):
    kv = MLA_FUSIONS[interleave]  # without the merge of the two ops (in "all")
    out, expected, report = _run(
        lambda *a: mla_pre_attention(*a, interleave=interleave),
        *_mla_inputs(dtype),
        fusions=[kv, "mla_q_rope"],
    )
    assert _matched(report) == {"rms_norm": 1, MLA_FUSIONS[interleave]: 1, "mla_q_rope": 1}
    (kv_site,) = report.sites_of(MLA_FUSIONS[interleave])
    rope = "interleave" if interleave else "rotate_half"
    assert kv_site.spelling == f"rms_norm_llama_rope_{rope}"
    assert report.sites_of("mla_q_rope")[0].spelling == f"mla_q_rope_{rope}"
    before, after = report.graphs[0].ops_before, report.graphs[0].ops_after
    assert after["fusion_passes.mla_kv_norm_rope.default"] == 1
    assert after["fusion_passes.mla_q_rope.default"] == 1
    assert "fusion_passes.rms_norm.default" not in after
    # The RoPE arithmetic is gone; what stays is the key assembly (slice_scatter) of k_nope, k_pe.
    assert before["aten.sub.Tensor"] == 2 if interleave else before["aten.neg.default"] == 2
    assert not {"aten.sub.Tensor", "aten.neg.default", "aten.cat.default"} & set(after)
    for a, e in zip(out, expected, strict=True):
        assert a.shape == e.shape and torch.equal(a, e)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("interleave", [True, False], ids=["interleave", "rotate_half"])
def test_mla_q_and_kv_merge_into_one_launch(interleave, dtype):
    """The merge (in "all"): both branches' ops (sharing cos / sin) become one mla_q_kv_rope."""
    merge = "mla_q_kv_rope" if interleave else "mla_q_kv_rope_rotate_half"
    out, expected, report = _run(lambda *a: mla_pre_attention(*a, interleave=interleave), *_mla_inputs(dtype))
    assert _matched(report) == {"rms_norm": 1, MLA_FUSIONS[interleave]: 1, "mla_q_rope": 1, merge: 1}
    rope = "interleave" if interleave else "rotate_half"
    assert report.sites_of(merge)[0].spelling == f"llama_{rope}"
    before, after = report.graphs[0].ops_before, report.graphs[0].ops_after
    # Before: both branches' RoPE arithmetic (q's and k_pe's) and the norm's rsqrt, in aten.
    assert before["aten.sub.Tensor"] == 2 if interleave else before["aten.neg.default"] == 2
    assert before["aten.rsqrt.default"] == 1 and not any(op.startswith("fusion_passes.") for op in before)
    assert after["fusion_passes.mla_q_kv_rope.default"] == 1
    assert not {"fusion_passes.mla_q_rope.default", "fusion_passes.mla_kv_norm_rope.default"} & set(after)
    assert not {"aten.sub.Tensor", "aten.neg.default", "aten.cat.default", "aten.rsqrt.default"} & set(after)
    for a, e in zip(out, expected, strict=True):
        assert a.shape == e.shape and torch.equal(a, e)


def test_prefill_sizes_stay_two_launches(monkeypatch):
    """From ONE_LAUNCH_MAX_TOKENS static tokens the merge is rejected, with the reason, and the two
    ops stay; one token fewer merges. (The bound itself, not a patched one: a compile cached under
    a patched bound would answer later compiles of the same graph.)"""
    import test_rewrite_mla_rope as this

    for tokens, merged in ((ONE_LAUNCH_MAX_TOKENS, False), (ONE_LAUNCH_MAX_TOKENS - 2, True)):
        monkeypatch.setattr(this, "S", tokens // B)  # the spelling's views and the inputs read B, S
        out, expected, report = _run(mla_pre_attention, *_mla_inputs(torch.bfloat16))
        before, after = report.graphs[0].ops_before, report.graphs[0].ops_after
        assert before["aten.rsqrt.default"] == 1 and not any(op.startswith("fusion_passes.") for op in before)
        assert report.matches["mla_q_kv_rope"] == merged
        if merged:
            assert after["fusion_passes.mla_q_kv_rope.default"] == 1 and not report.rejected
        else:
            assert "fusion_passes.mla_q_kv_rope.default" not in after
            assert (
                after["fusion_passes.mla_q_rope.default"]
                == after["fusion_passes.mla_kv_norm_rope.default"]
                == 1
            )
            (rejected,) = report.rejected
            assert f"{tokens} tokens: left as two launches" in rejected.reason
        for a, e in zip(out, expected, strict=True):
            assert torch.equal(a, e)


def test_branches_with_their_own_cos_stay_two_launches():
    """q rotated by other cos / sin than k_pe (another position table): nothing to share, no merge."""
    q, kv, kv_b, w, cos, sin = _mla_inputs(torch.bfloat16)
    q_cos, q_sin = _cos_sin(torch.bfloat16)

    def two_tables(q, kv, kv_b, w, cos, sin, q_cos, q_sin):
        query, _, _ = mla_pre_attention(q, kv, kv_b, w, q_cos, q_sin)
        _, key, value = mla_pre_attention(q, kv, kv_b, w, cos, sin)
        return query, key, value

    out, expected, report = _run(
        two_tables, q, kv, kv_b, w, cos, sin, q_cos, q_sin, fusions=["mla_q_kv_rope"]
    )
    assert report.matches["mla_q_kv_rope"] == 0 and report.matches["mla_kv_norm_rope"] >= 1
    before, after = report.graphs[0].ops_before, report.graphs[0].ops_after
    assert before["aten.rsqrt.default"] >= 1 and not any(op.startswith("fusion_passes.") for op in before)
    assert "fusion_passes.mla_q_kv_rope.default" not in after
    assert (
        after["fusion_passes.mla_q_rope.default"] >= 1
        and after["fusion_passes.mla_kv_norm_rope.default"] >= 1
    )
    for a, e in zip(out, expected, strict=True):
        assert torch.equal(a, e)


def test_fp32_weight_norm_form_fuses():
    """F.rms_norm's rounding (weight applied in fp32) is the op's cast_before_weight=False form."""
    args = _mla_inputs(torch.bfloat16)
    out, expected, report = _run(lambda *a: mla_pre_attention(*a, norm=functional_rms_norm), *args)
    assert _matched(report) == {"rms_norm": 1, "mla_kv_norm_rope": 1, "mla_q_rope": 1, "mla_q_kv_rope": 1}
    assert report.sites_of("mla_kv_norm_rope")[0].spelling == "rms_norm_fp32_weight_rope_interleave"
    assert report.sites_of("mla_q_kv_rope")[0].spelling == "fp32_weight_interleave"
    for a, e in zip(out, expected, strict=True):
        assert torch.equal(a, e)


def indexer_pre_scores(q, k, weight, bias, cos, sin):
    """DeepseekV32Indexer.forward up to the scores' operands, as transformers 5 writes it."""
    d = 2 * ROPE
    q = q.view(B, S, H, d)
    q_rot, q_pass = torch.split(q, [ROPE, d - ROPE], dim=-1)
    k = F.layer_norm(k, (d,), weight, bias, 1e-6).unsqueeze(2)
    k_rot, k_pass = torch.split(k, [ROPE, d - ROPE], dim=-1)
    q_rot, k_rot = apply_rotary_pos_emb(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
    q = torch.cat([q_rot, q_pass], dim=-1)
    k = torch.cat([k_rot, k_pass], dim=-1).squeeze(2)
    return q, k


def _indexer_inputs(dtype):
    g = torch.Generator().manual_seed(1)
    d = 2 * ROPE
    q = torch.randn(B, S, H * d, generator=g).to(dtype)
    k = (2 * torch.randn(B, S, d, generator=g) + 0.5).to(dtype)
    w = (1 + 0.1 * torch.randn(d, generator=g)).to(dtype)
    b = (0.1 * torch.randn(d, generator=g)).to(dtype)
    return q, k, w, b, *_cos_sin(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_indexer_q_and_k_fuse(dtype):
    out, expected, report = _run(indexer_pre_scores, *_indexer_inputs(dtype))
    assert _matched(report) == {"mla_indexer_k_norm_rope": 1, "mla_indexer_q_rope": 1}
    after = report.graphs[0].ops_after
    assert after["fusion_passes.mla_indexer_k_norm_rope.default"] == 1
    assert after["fusion_passes.mla_q_rope.default"] == 1
    assert "aten.var_mean.correction" in report.graphs[0].ops_before
    assert not {"aten.var_mean.correction", "aten.cat.default", "aten.neg.default"} & set(after)
    q, k = out
    assert torch.equal(q, expected[0])  # RoPE alone: bit-exact
    # The key's LayerNorm: eager's native kernel and Inductor's decomposition (which the reference
    # op runs as eager F.layer_norm) may differ by an ulp; the RoPE after it rounds twice more.
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(k, expected[1], rtol=tol, atol=tol)


# --- near misses: none of these may match ---


def test_rope_without_norm_is_not_the_kv_op():
    """k_pe rotated but the latent not normalised: only the q branch fuses."""
    args = _mla_inputs(torch.bfloat16)
    out, expected, report = _run(lambda *a: mla_pre_attention(*a, norm=lambda x, w, eps: x * w), *args)
    assert _matched(report) == {"mla_q_rope": 1}
    assert "fusion_passes.mla_kv_norm_rope.default" not in report.graphs[0].ops_after
    assert torch.equal(out[0], expected[0])  # the fused q branch rounds as eager does
    # Stock Inductor's k RoPE keeps its products in fp32 (not rounded to bf16 as eager's are).
    torch.testing.assert_close(out[1], expected[1], rtol=1.6e-2, atol=1.6e-2)


def test_norm_over_another_axis_is_not_the_indexer_op():
    """The indexer key normalised over the token axis: the LayerNorm spelling must not match."""

    def fn(q, k, weight, bias, cos, sin):
        k = F.layer_norm(k.transpose(1, 2), (S,), weight[:S], bias[:S], 1e-6).transpose(1, 2)
        k = k.contiguous().unsqueeze(2)
        k_rot, k_pass = torch.split(k, [ROPE, ROPE], dim=-1)
        k_rot = apply_rotary_pos_emb(k_rot, k_rot, cos, sin, unsqueeze_dim=2)[0]
        return torch.cat([k_rot, k_pass], dim=-1).squeeze(2)

    out, expected, report = _run(fn, *_indexer_inputs(torch.bfloat16))
    assert "mla_indexer_k_norm_rope" not in _matched(report)
    assert "fusion_passes.mla_indexer_k_norm_rope.default" not in report.graphs[0].ops_after
    torch.testing.assert_close(out, expected, rtol=2e-2, atol=2e-2)


def test_mismatched_cos_sin_shapes_are_rejected():
    """sin broadcast from one position (another shape than cos): every candidate is rejected."""
    q, kv, kv_b, w, cos, sin = _mla_inputs(torch.bfloat16)
    sin = sin[:, :1].contiguous()
    out, expected, report = _run(mla_pre_attention, q, kv, kv_b, w, cos, sin)
    assert _matched(report) == {"rms_norm": 1}
    reasons = {r.fusion: r.reason for r in report.rejected}
    assert set(reasons) >= {"mla_kv_norm_rope", "mla_q_rope"}
    assert all("differ" in reason for reason in reasons.values()), reasons
    for a, e in zip(out, expected, strict=True):  # stock Inductor's RoPE: fp32 intermediates
        torch.testing.assert_close(a, e, rtol=1.6e-2, atol=1.6e-2)


def test_mla_fusions_are_in_all_after_rms_norm():
    names = [f.name for f in fusion_passes.registry.get_fusions("all")]
    mla = [n for n in names if n.startswith("mla_")]
    # The indexer key's fusion runs before the indexer q's: its unsqueezed key has q's shape.
    assert mla == [
        "mla_kv_norm_rope",
        "mla_kv_norm_rope_rotate_half",
        "mla_indexer_k_norm_rope",
        "mla_q_rope",
        "mla_indexer_q_rope",
        "mla_q_kv_rope",
        "mla_q_kv_rope_rotate_half",
        # the decode step's cache folds and the regroup (mla_indexer_qk_rope without a cache is opt-in)
        "mla_indexer_k_norm_rope_cache",
        "mla_kv_cache_write",
        "mla_indexer_qk_rope_cache",
        "mla_indexer_qk_rope_kv_cache",
        "mla_decode_regroup",
    ]
    assert names.index("rms_norm") < names.index("mla_kv_norm_rope")
    requested = [f.name for f in fusion_passes.registry.get_fusions(["mla_kv_norm_rope"])]
    assert requested == ["rms_norm", "mla_kv_norm_rope"]


# --- the indexer key written into its cache (opt-in) ---

CACHE_SLOTS = 9


def indexer_key_into_cache(k, weight, bias, cos, sin, indexer_keys, length):
    """DeepseekV32Indexer's key, then transformers' DeepseekV32 cache layer (update_indexer): the
    rows go to arange(S) + the layer's write counter, in place (the counter advanced too)."""
    d = 2 * ROPE
    k = F.layer_norm(k, (d,), weight, bias, 1e-6).unsqueeze(2)
    k_rot, k_pass = torch.split(k, [ROPE, d - ROPE], dim=-1)
    k_rot = apply_rotary_pos_emb(k_rot, k_rot, cos, sin, unsqueeze_dim=2)[1]
    key = torch.cat([k_rot, k_pass], dim=-1).squeeze(2)
    positions = torch.arange(key.shape[1], device=key.device) + length
    length.add_(key.shape[1])
    indexer_keys.index_copy_(1, positions, key)
    return indexer_keys


def indexer_key_at_slots(k, weight, bias, cos, sin, indexer_keys, slots):
    """The same key stored at a slot per token, as an engine's slot mapping (and transformers'
    fallback where index_copy_ is missing) writes it: ``cache[:, slots] = key``."""
    d = 2 * ROPE
    k = F.layer_norm(k, (d,), weight, bias, 1e-6).unsqueeze(2)
    k_rot, k_pass = torch.split(k, [ROPE, d - ROPE], dim=-1)
    k_rot = apply_rotary_pos_emb(k_rot, k_rot, cos, sin, unsqueeze_dim=2)[1]
    indexer_keys[:, slots] = torch.cat([k_rot, k_pass], dim=-1).squeeze(2)
    return indexer_keys


def _cache_inputs(dtype, slots):
    _, k, w, b, cos, sin = _indexer_inputs(dtype)
    cache = torch.randn(B, CACHE_SLOTS, 2 * ROPE, generator=torch.Generator().manual_seed(2)).to(dtype)
    return k, w, b, cos, sin, cache, slots


def _run_on_caches(fn, args, fusions):
    """fn compiled with ``fusions`` and with the defaults, each on its own copy of the cache (and
    counter): (cache with fusions, cache with the defaults, report)."""
    results = []
    for names in (fusions, "all"):
        copies = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
        _, report = compile_with(names, fn, copies)
        results.append((copies, report))
    return results[0][0], results[1][0], results[0][1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "fn,slots",
    [(indexer_key_into_cache, torch.tensor(3)), (indexer_key_at_slots, torch.tensor([8, 0, 4, 5, 1])), ("batch_one", None)],
    ids=["from_write_counter", "slot_per_token", "slot_per_token_batch_one"],
)
def test_indexer_key_is_written_into_its_cache_by_the_kernel(fn, slots, dtype):
    """Both spellings become one op writing the cache; the cache holds what the defaults (the key
    op, then Inductor's index_put) write there, bit for bit, and eager's within the LayerNorm's
    tolerance; the counter still advances."""
    batch_one = fn == "batch_one"
    if batch_one:  # the store by indexing at a batch of one (traced with the key reshaped)
        fn, slots = indexer_key_at_slots, torch.tensor([8, 0, 4, 5, 1])
        args = tuple(a[:1] if i in (0, 3, 4, 5) else a for i, a in enumerate(_cache_inputs(dtype, slots)))  # k, cos, sin, cache
    else:
        args = _cache_inputs(dtype, slots)
    fused, defaults, report = _run_on_caches(fn, args, ["all", "mla_indexer_k_norm_rope_cache"])
    assert _matched(report) == {"mla_indexer_k_norm_rope": 1, "mla_indexer_k_norm_rope_cache": 1}
    (site,) = report.sites_of("mla_indexer_k_norm_rope_cache")
    assert site.spelling.startswith("slot_per_token_batch_one") == batch_one, site.spelling
    before, after = report.ops_before(), report.ops_after()
    assert before["aten.index_put.default"] == 1 and "aten.index_put.default" not in after
    assert after["fusion_passes.mla_indexer_k_norm_rope_cache.default"] == 1
    assert "fusion_passes.mla_indexer_k_norm_rope.default" not in after
    assert torch.equal(fused[5], defaults[5]) and torch.equal(fused[6], defaults[6])
    eager = [a.clone() for a in args]
    fn(*eager)
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(fused[5], eager[5], rtol=tol, atol=tol)
    assert torch.equal(fused[6], eager[6])  # the counter (or the slots, untouched)


def test_a_key_written_into_a_cache_of_another_dtype_is_not_fused():
    """bf16 keys stored into an fp32 cache (the store casts them): the key op stays, the write
    stays Inductor's."""

    def fn(k, weight, bias, cos, sin, cache, slots):
        d = 2 * ROPE
        k = F.layer_norm(k, (d,), weight, bias, 1e-6).unsqueeze(2)
        k_rot, k_pass = torch.split(k, [ROPE, d - ROPE], dim=-1)
        k_rot = apply_rotary_pos_emb(k_rot, k_rot, cos, sin, unsqueeze_dim=2)[1]
        cache = cache.to(torch.float32)
        cache[:, slots] = torch.cat([k_rot, k_pass], dim=-1).squeeze(2).to(cache.dtype)
        return cache

    args = _cache_inputs(torch.bfloat16, torch.tensor([8, 0, 4, 5, 1]))
    out, report = compile_with(["all", "mla_indexer_k_norm_rope_cache"], fn, args)
    assert report.matches["mla_indexer_k_norm_rope_cache"] == 0 and report.matches["mla_indexer_k_norm_rope"] == 1
    assert report.ops_after()["aten.index_put.default"] == report.ops_before()["aten.index_put.default"] == 1
    torch.testing.assert_close(out, fn(*args), rtol=2e-2, atol=2e-2)  # fn writes a copy of the cache


# --- MLA's key and value written into the KV cache in one kernel (opt-in) ---

NOPE_KV, V_KV = 16, 12


def expand_kv_into_cache(kv_latent, kv_b, k_rot, k_cache, v_cache, length):
    """DeepseekV32Attention.expand_kv (kv_b_proj as the weight kv_b), then transformers'
    StaticLayer.update: both caches written at arange(S) + the layer's counter, in place."""
    b, _, s, _ = kv_latent.shape
    kv = (kv_latent @ kv_b).view(b, s, -1, NOPE_KV + V_KV).transpose(1, 2)
    k_nope, value_states = torch.split(kv, [NOPE_KV, V_KV], dim=-1)
    k_rot = k_rot.expand(-1, k_nope.shape[1], -1, -1)
    key_states = kv.new_empty(*kv.shape[:-1], NOPE_KV + ROPE)
    key_states[..., :NOPE_KV].copy_(k_nope)
    key_states[..., NOPE_KV:].copy_(k_rot)
    positions = torch.arange(s, device=kv.device) + length
    length.add_(s)
    k_cache.index_copy_(2, positions, key_states)
    v_cache.index_copy_(2, positions, value_states)
    return k_cache, v_cache


def cat_kv_at_slots(kv_latent, kv_b, k_rot, k_cache, v_cache, slots):
    """The key as a cat (vLLM's and SGLang's torch paths), the caches written at a slot per
    token by indexing (an engine's slot mapping)."""
    b, _, s, _ = kv_latent.shape
    kv = (kv_latent @ kv_b).view(b, s, -1, NOPE_KV + V_KV).transpose(1, 2)
    k_nope, value = torch.split(kv, [NOPE_KV, V_KV], dim=-1)
    k_cache[:, :, slots] = torch.cat([k_nope, k_rot.expand(-1, H, -1, -1)], dim=-1)
    v_cache[:, :, slots] = value
    return k_cache, v_cache


def _kv_write_inputs(dtype, slots):
    g = torch.Generator().manual_seed(4)
    kv_latent = torch.randn(B, 1, S, R, generator=g).to(dtype)
    kv_b = (0.2 * torch.randn(R, H * (NOPE_KV + V_KV), generator=g)).to(dtype)
    k_rot = torch.randn(B, 1, S, ROPE, generator=g).to(dtype)
    k_cache = torch.randn(B, H, CACHE_SLOTS, NOPE_KV + ROPE, generator=g).to(dtype)
    v_cache = torch.randn(B, H, CACHE_SLOTS, V_KV, generator=g).to(dtype)
    return kv_latent, kv_b, k_rot, k_cache, v_cache, slots


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "fn,slots",
    [(expand_kv_into_cache, torch.tensor(3)), (cat_kv_at_slots, torch.tensor([8, 0, 4, 5, 1])), ("batch_one", None)],
    ids=["transformers_v32", "cat_slot_per_token", "cat_slot_per_token_batch_one"],
)
def test_mla_key_and_value_go_into_the_cache_in_one_kernel(fn, slots, dtype):
    """Both spellings become one mla_kv_cache_write (both index_puts, the key's assembly gone);
    the caches equal the defaults' and eager's bit for bit (the write is a copy). A batch of one
    stored by indexing is traced with the values reshaped: its own spelling."""
    batch_one = fn == "batch_one"
    if batch_one:
        fn, slots = cat_kv_at_slots, torch.tensor([8, 0, 4, 5, 1])
        args = tuple(a[:1] if i in (0, 2, 3, 4) else a for i, a in enumerate(_kv_write_inputs(dtype, slots)))
    else:
        args = _kv_write_inputs(dtype, slots)
    fused, defaults, report = _run_on_caches(fn, args, ["all", "mla_kv_cache_write"])
    assert _matched(report) == {"mla_kv_cache_write": 1}
    before, after = report.ops_before(), report.ops_after()
    assert before["aten.index_put.default"] == 2 and "aten.index_put.default" not in after
    assert not {"aten.slice_scatter.default", "aten.cat.default"} & set(after)
    assert after["fusion_passes.mla_kv_cache_write.default"] == 1
    (site,) = report.sites_of("mla_kv_cache_write")
    assert site.spelling.endswith("batch_one") == batch_one, site.spelling
    eager = [a.clone() for a in args]
    fn(*eager)
    for i in (3, 4, 5):  # k cache, v cache, counter / slots
        assert torch.equal(fused[i], defaults[i]) and torch.equal(fused[i], eager[i])


@pytest.mark.parametrize("fn,slots", [(expand_kv_into_cache, torch.tensor(3)), (cat_kv_at_slots, torch.tensor([8, 0, 4, 5, 1]))],
                         ids=["transformers_v32", "cat_slot_per_token"])  # fmt: skip
def test_verify_checks_the_cache_write_on_slots_inside_the_cache(fn, slots):
    """verify=True runs the write on slots inside the cache, none repeated (a first slot of 0, or
    a distinct slot per token), not random integers that would write past it."""
    import fusion_passes

    args = [a.clone() if isinstance(a, torch.Tensor) else a for a in _kv_write_inputs(torch.bfloat16, slots)]
    report = fusion_passes.Report()
    torch._dynamo.reset()
    backend = fusion_passes.backend(["mla_kv_cache_write"], report=report, verify=True)
    with torch.no_grad():
        torch.compile(fn, backend=backend, fullgraph=True)(*args)
    assert report.final()["mla_kv_cache_write"] == 1 and not report.rejected and not report.errors, report.errors


def test_verify_slots_lie_in_the_cache_and_do_not_repeat():
    from fusion_passes.patterns.cache_writes import valid_slots

    make = valid_slots("k_cache", 2)
    caches = {"k_cache": torch.empty(B, H, CACHE_SLOTS, NOPE_KV + ROPE)}
    assert make(torch.tensor(5), caches).item() == 0  # a first slot: room for every token written
    for _ in range(20):
        slots = make(torch.empty(S, dtype=torch.int64), caches)
        assert slots.dtype == torch.int64 and len(set(slots.tolist())) == S and 0 <= slots.min() <= slots.max() < CACHE_SLOTS


def test_a_key_write_without_its_value_write_is_not_fused():
    """Only the key goes into a cache (the value elsewhere): no mla_kv_cache_write."""

    def fn(kv_latent, kv_b, k_rot, k_cache, v_cache, slots):
        b, _, s, _ = kv_latent.shape
        kv = (kv_latent @ kv_b).view(b, s, -1, NOPE_KV + V_KV).transpose(1, 2)
        k_nope, value = torch.split(kv, [NOPE_KV, V_KV], dim=-1)
        k_cache[:, :, slots] = torch.cat([k_nope, k_rot.expand(-1, H, -1, -1)], dim=-1)
        return k_cache, value * 2

    args = _kv_write_inputs(torch.bfloat16, torch.tensor([8, 0, 4, 5, 1]))
    fused, defaults, report = _run_on_caches(fn, args, ["all", "mla_kv_cache_write"])
    assert report.matches["mla_kv_cache_write"] == 0
    assert report.ops_after()["aten.index_put.default"] == report.ops_before()["aten.index_put.default"] == 1
    assert torch.equal(fused[3], defaults[3])


# --- the indexer's query and key in one launch (opt-in) ---


def indexer_q_and_key_into_cache(q, k, weight, bias, cos, sin, indexer_keys, length):
    """DeepseekV32Indexer's query and key up to the scores (one RoPE call for both), the key into
    transformers' indexer cache (update_indexer); returns the query and the cache."""
    query, key = indexer_pre_scores(q, k, weight, bias, cos, sin)
    positions = torch.arange(key.shape[1], device=key.device) + length
    length.add_(key.shape[1])
    indexer_keys.index_copy_(1, positions, key)
    return query, indexer_keys


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("into_cache", [False, True], ids=["keys", "into_cache"])
def test_indexer_query_and_key_merge_into_one_launch(into_cache, dtype):
    """The indexer's q RoPE op and key op (or the key's cache fold) become one mla_indexer_qk_rope;
    its outputs are the two ops' bit for bit (the defaults', or the cache fold's)."""
    q, k, w, b, cos, sin = _indexer_inputs(dtype)
    if into_cache:  # the defaults hold the merge: the two launches are the defaults without it
        fn = indexer_q_and_key_into_cache
        base = defaults_without("mla_indexer_qk_rope_cache")
        cache = torch.randn(B, CACHE_SLOTS, 2 * ROPE, generator=torch.Generator().manual_seed(2)).to(dtype)
        args = (q, k, w, b, cos, sin, cache, torch.tensor(3))
    else:
        fn, base, args = indexer_pre_scores, "all", (q, k, w, b, cos, sin)
    runs = {}
    merge = "mla_indexer_qk_rope_cache" if into_cache else "mla_indexer_qk_rope"
    for name, fusions in (("merged", ["all", merge]), ("two", base)):
        runs[name] = compile_with(fusions, fn, [a.clone() for a in args])
    out, report = runs["merged"]
    assert report.final()[merge] == 1 and not report.errors
    # the two ops the defaults (or the key's cache fold) leave, one op here
    key_op = "fusion_passes.mla_indexer_k_norm_rope" + ("_cache" if into_cache else "") + ".default"
    two = runs["two"][1].ops_after()
    assert (two["fusion_passes.mla_q_rope.default"], two[key_op]) == (1, 1)
    after = report.ops_after()
    assert after["fusion_passes.mla_indexer_qk_rope.default"] == 1
    assert not {"fusion_passes.mla_q_rope.default", key_op} & set(after)
    assert report.ops_before() == runs["two"][1].ops_before()
    for a, e in zip(out, runs["two"][0], strict=True):
        assert torch.equal(a, e)


def test_indexer_query_and_key_with_their_own_cos_stay_two_launches():
    """The query and the key rotated by two RoPE calls (each unsqueezing cos / sin itself): the
    merge needs the one cos / sin both ops read, so the two ops stay."""

    def fn(q, k, weight, bias, cos, sin, indexer_keys, length):
        query, _ = indexer_pre_scores(q, k, weight, bias, cos, sin)
        return query, indexer_key_into_cache(k, weight, bias, cos, sin, indexer_keys, length)

    q, k, w, b, cos, sin = _indexer_inputs(torch.bfloat16)
    cache = torch.randn(B, CACHE_SLOTS, 2 * ROPE, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    args = (q, k, w, b, cos, sin, cache, torch.tensor(3))
    merged, two, report = _run_on_caches(fn, args, ["all", "mla_indexer_qk_rope_cache"])
    assert report.matches["mla_indexer_qk_rope_cache"] == 0 and report.final()["mla_indexer_k_norm_rope_cache"] == 1
    after = report.ops_after()
    assert "fusion_passes.mla_indexer_qk_rope.default" not in after
    assert (after["fusion_passes.mla_q_rope.default"], after["fusion_passes.mla_indexer_k_norm_rope_cache.default"]) == (1, 1)
    assert torch.equal(merged[6], _run_on_caches(fn, args, ["all", "mla_indexer_k_norm_rope_cache"])[0][6])


def _indexer_and_kv_write(q, k, weight, bias, cos, sin, idx_cache, kv, k_pe, k_cache, v_cache, cache_position,
                          dependent=False):  # fmt: skip
    """A decode step's two cache launches as the fusions leave them: the indexer's (into its cache)
    and the KV write, each cache at its own counter (read off the step's position twice).
    ``dependent``: the value written reads the indexer's query (kept as is unless a query element
    is NaN: the same values; the two then cannot merge)."""
    query, idx_cache = torch.ops.fusion_passes.mla_indexer_qk_rope(
        q, k, weight, bias, cos, sin, idx_cache, cache_position[0], 1e-6, False
    )
    k_nope, value = kv.split([k_cache.shape[-1] - k_pe.shape[-1], v_cache.shape[-1]], dim=-1)
    if dependent:
        value = torch.where(query[0, 0, 0, 0].isnan(), value * 2, value)
    k_cache, v_cache = torch.ops.fusion_passes.mla_kv_cache_write(k_nope, k_pe, value, k_cache, v_cache, cache_position[0])
    return query, idx_cache, k_cache, v_cache


def _merge_inputs():
    g = torch.Generator().manual_seed(5)
    q, k = torch.randn(2, 1, 4, 32, generator=g), torch.randn(2, 1, 32, generator=g)
    weight, bias = torch.randn(32, generator=g), torch.randn(32, generator=g)
    cos, sin = torch.randn(2, 1, 8, generator=g), torch.randn(2, 1, 8, generator=g)
    kv = torch.randn(2, 1, 3, 40, generator=g).transpose(1, 2)  # [B, H, S, NOPE + V], strided
    k_pe = torch.randn(2, 1, 1, 8, generator=g)
    caches = torch.randn(2, 9, 32, generator=g), torch.randn(2, 3, 9, 24, generator=g), torch.randn(2, 3, 9, 24, generator=g)
    return q, k, weight, bias, cos, sin, caches[0], kv, k_pe, caches[1], caches[2], torch.tensor([6])


@pytest.mark.parametrize("dependent", [False, True])
def test_the_indexer_launch_and_the_kv_write_merge_where_independent(dependent):
    args = _merge_inputs()
    expected = _indexer_and_kv_write(*[a.clone() for a in args], dependent=dependent)

    def step(*a):
        return _indexer_and_kv_write(*a, dependent=dependent)

    out, report = compile_with(["mla_indexer_qk_rope_kv_cache"], step, [a.clone() for a in args])
    assert all(torch.equal(o, e) for o, e in zip(out, expected, strict=True))
    before, after = report.ops_before(), report.ops_after()
    if dependent:  # the KV write reads the indexer's query: no merge
        assert report.matches["mla_indexer_qk_rope_kv_cache"] == 0 and before == after
    else:
        assert report.final()["mla_indexer_qk_rope_kv_cache"] == 1
        assert (before["fusion_passes.mla_indexer_qk_rope.default"], after["fusion_passes.mla_indexer_qk_rope.default"]) == (1, 0)
        assert (before["fusion_passes.mla_kv_cache_write.default"], after["fusion_passes.mla_kv_cache_write.default"]) == (1, 0)
        assert after["fusion_passes.mla_indexer_qk_rope_kv_cache.default"] == 1


def _pre_attention_launches(x, x_weight, w_qb, kv_a, kv_weight, cos, sin, q, k, weight, bias, icos, isin, idx_cache,
                            kv, k_pe, k_cache, v_cache, cache_position, normed=True):  # fmt: skip
    """A decode step's pre-attention ops as the fusions leave them at decode: q_a_layernorm (a
    canonical rms_norm; ``normed`` False: q_b_proj reads q_a_proj's output unnormalised),
    q_b_proj, mla_q_kv_rope, then the indexer and the KV write in one launch."""
    q_a = torch.ops.fusion_passes.rms_norm(x, x_weight, 1e-6, 0.0, True) if normed else x
    mq = (q_a.reshape(-1, q_a.shape[-1]) @ w_qb).view(1, 1, 3, -1)
    query, kv_n, k_pe_roped = torch.ops.fusion_passes.mla_q_kv_rope(mq, kv_a, kv_weight, cos, sin, 1e-6)
    k_nope, value = kv.split([k_cache.shape[-1] - k_pe.shape[-1], v_cache.shape[-1]], dim=-1)
    out = torch.ops.fusion_passes.mla_indexer_qk_rope_kv_cache(
        q, k, weight, bias, icos, isin, idx_cache, cache_position[0], k_nope, k_pe, value, k_cache, v_cache,
        cache_position[0], 1e-6, False,
    )  # fmt: skip
    return query, kv_n, k_pe_roped, *out


def _regroup_inputs():
    g = torch.Generator().manual_seed(11)
    x, x_weight, w_qb = torch.randn(1, 1, 24, generator=g), torch.randn(24, generator=g), torch.randn(24, 3 * 24, generator=g)
    kv_a, kv_weight = torch.randn(1, 1, 16 + 8, generator=g), torch.randn(16, generator=g)
    cos, sin = torch.randn(1, 1, 4, generator=g), torch.randn(1, 1, 4, generator=g)  # interleaved rope of 8
    q, k = torch.randn(1, 1, 2, 32, generator=g), torch.randn(1, 1, 32, generator=g)
    weight, bias = torch.randn(32, generator=g), torch.randn(32, generator=g)
    icos, isin = torch.randn(1, 1, 8, generator=g), torch.randn(1, 1, 8, generator=g)
    kv = torch.randn(1, 1, 3, 40, generator=g).transpose(1, 2)
    k_pe = torch.randn(1, 1, 1, 8, generator=g)
    caches = torch.randn(1, 9, 32, generator=g), torch.randn(1, 3, 9, 24, generator=g), torch.randn(1, 3, 9, 24, generator=g)
    return (x, x_weight, w_qb, kv_a, kv_weight, cos, sin, q, k, weight, bias, icos, isin, caches[0], kv, k_pe,
            caches[1], caches[2], torch.tensor([6]))  # fmt: skip


@pytest.mark.parametrize("normed", [True, False])
def test_the_pre_attention_launches_regroup_where_q_b_proj_reads_the_norm(normed):
    args = _regroup_inputs()

    def step(*a):
        return _pre_attention_launches(*a, normed=normed)

    expected = step(*[a.clone() for a in args])
    out, report = compile_with(["mla_decode_regroup"], step, [a.clone() for a in args])
    for o, e in zip(out, expected, strict=True):
        torch.testing.assert_close(o, e, rtol=2e-6, atol=2e-6)  # fp32: q_a's norm in another order
    before, after = report.ops_before(), report.ops_after()
    if not normed:  # no q_a_layernorm to launch with the kv branch: left as it was
        assert report.matches["mla_decode_regroup"] == 0 and before == after
        return
    assert report.final()["mla_decode_regroup"] == 1
    assert (before["fusion_passes.mla_q_kv_rope.default"], after["fusion_passes.mla_q_kv_rope.default"]) == (1, 0)
    assert after["fusion_passes.mla_q_a_kv_norm_rope.default"] == 1 and after["fusion_passes.mla_q_indexer_kv_cache.default"] == 1
    assert after["fusion_passes.rms_norm.default"] == 0 and after["fusion_passes.mla_indexer_qk_rope_kv_cache.default"] == 0
