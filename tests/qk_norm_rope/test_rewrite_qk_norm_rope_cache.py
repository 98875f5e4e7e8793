"""Rewrite tests of QK-norm + RoPE with the decode step's KV cache writes (qk_norm_rope_cache, opt-in):
the attention prologue as transformers writes it (Qwen3's per-head norm, Qwen 3.5's (1 + w) form with
partial RoPE, MiniMax-M2's whole-row norm), then transformers' StaticLayer.update or a slot mapping's
indexed store; match counts, ops before/after, the query and both caches against eager and against
the defaults; and the near misses that must not fuse."""

from __future__ import annotations

import pytest
import torch

from _rewrites import compile_with
from fusion_passes.numerics import tolerance
from test_rewrite_qk_norm_rope import HEAD_DIM, HK, NORMS, SPELLINGS, _args, _attention_prelude

OPT_IN = ["all", "qk_norm_rope_cache", "qk_norm_rope_whole_row_cache"]
SLOTS = 9
FORMS = {"qwen3": "llama", "qwen3_5": "offset", "qwen3_next_no_gate": "fp32_weight", "minimax_m2": "llama"}


def static_layer_update(prelude):
    """The prologue, then transformers' StaticLayer.update: k and v [B, H, S, D] written into the
    caches at arange(S) + the layer's write counter, in place, the counter advanced."""

    def fn(q_proj, k_proj, v_proj, q_weight, k_weight, cos, sin, k_cache, v_cache, length):
        q, k = prelude(q_proj, k_proj, q_weight, k_weight, cos, sin)[:2]
        b, s = v_proj.shape[:2]
        v = v_proj.view(b, s, -1, HEAD_DIM).transpose(1, 2)
        positions = torch.arange(s, device=v.device) + length
        length.add_(s)
        k_cache.index_copy_(2, positions, k)
        v_cache.index_copy_(2, positions, v)
        return q, k_cache, v_cache

    return fn


def slot_mapping_store(prelude):
    """The prologue, then the caches written at a slot per token by indexing (an engine's slot
    mapping; transformers' fallback where index_copy_ is missing)."""

    def fn(q_proj, k_proj, v_proj, q_weight, k_weight, cos, sin, k_cache, v_cache, slots):
        q, k = prelude(q_proj, k_proj, q_weight, k_weight, cos, sin)[:2]
        b, s = v_proj.shape[:2]
        k_cache[:, :, slots] = k
        v_cache[:, :, slots] = v_proj.view(b, s, -1, HEAD_DIM).transpose(1, 2)
        return q, k_cache, v_cache

    return fn


def _inputs(spelling, tokens, positions, seed=0):
    _, per_head, _, rotary, gate = SPELLINGS[spelling]
    torch.manual_seed(seed)
    q, k, wq, wk, cos, sin = _args(torch.bfloat16, FORMS[spelling], per_head, rotary, gate, tokens)
    b, s = tokens
    v = torch.randn(b, s, HK * HEAD_DIM).to(torch.bfloat16)
    k_cache = torch.randn(b, HK, SLOTS, HEAD_DIM).to(torch.bfloat16)
    v_cache = torch.randn(b, HK, SLOTS, HEAD_DIM).to(torch.bfloat16)
    return [q, k, v, wq, wk, cos, sin, k_cache, v_cache, positions]


def _compiled(fn, args, fusions):
    """(outputs, the args after the call (the caches, the counter), report): fn compiled with
    fusions on copies of args."""
    copies = [a.clone() for a in args]
    out, report = compile_with(fusions, fn, copies)
    return out, copies, report


@pytest.mark.parametrize(
    "spelling,write,positions,tokens",
    [("qwen3", static_layer_update, torch.tensor(5), (2, 1)),
     ("qwen3_5", static_layer_update, torch.tensor(3), (1, 3)),
     ("minimax_m2", static_layer_update, torch.tensor(7), (2, 1)),
     ("qwen3_next_no_gate", slot_mapping_store, torch.tensor([8, 1, 4]), (2, 3)),
     ("minimax_m2", slot_mapping_store, torch.tensor([2, 6]), (2, 2))],  # fmt: skip
    ids=["qwen3-update", "qwen3_5-update", "minimax_m2-update", "qwen3_next-slots", "minimax_m2-slots"],
)
def test_prologue_and_cache_writes_become_one_op(spelling, write, positions, tokens):
    """One qk_norm_rope_cache per site (both index_puts gone, the per-head decode refusal lifted);
    the query and caches within bf16's tolerance of eager (the norm sums in its own order) and,
    where the defaults fuse the prologue too (a whole-row norm), bit-equal to theirs."""
    fusion, per_head, rope, _, gate = SPELLINGS[spelling]
    fn = write(_attention_prelude(NORMS[FORMS[spelling]], per_head, rope, gate))
    args = _inputs(spelling, tokens, positions)
    out, after_call, report = _compiled(fn, args, OPT_IN)
    cache_fusion = f"{fusion}_cache"
    assert report.matches[cache_fusion] == 1 and report.final()[cache_fusion] == 1 and not report.errors
    (site,) = report.sites_of(cache_fusion)
    form = "from_first_slot" if positions.numel() == 1 and tokens[1] > 1 or write is static_layer_update else "slot_per_token"
    assert site.spelling.startswith(FORMS[spelling]) and site.spelling.endswith(form), site.spelling
    before, after = report.ops_before(), report.ops_after()
    assert before["aten.index_put.default"] == 2 and "aten.index_put.default" not in after
    assert after["fusion_passes.qk_norm_rope_cache.default"] == 1 and "fusion_passes.qk_norm_rope.default" not in after
    eager = [a.clone() for a in args]
    expected = fn(*eager)
    tol = tolerance(torch.bfloat16)
    for a, e in zip((out[0], *after_call[7:]), (expected[0], *eager[7:]), strict=True):
        torch.testing.assert_close(a, e, rtol=tol.rtol, atol=tol.atol)
    assert torch.equal(after_call[9], eager[9])  # the counter advanced (or the slots untouched)
    if not per_head:
        default_out, default_after, _ = _compiled(fn, args, "all")
        assert torch.equal(out[0], default_out[0])
        assert all(torch.equal(a, b) for a, b in zip(after_call[7:], default_after[7:], strict=True))


def test_without_the_opt_in_a_decode_steps_per_head_prologue_stays_stock():
    """The default fusions leave a per-head decode prologue whose k goes into the cache to
    Inductor (qk_norm_rope's refusal), and write the cache with index_put."""
    fusion, per_head, rope, _, gate = SPELLINGS["qwen3"]
    fn = static_layer_update(_attention_prelude(NORMS["llama"], per_head, rope, gate))
    _, _, report = _compiled(fn, _inputs("qwen3", (2, 1), torch.tensor(5)), "all")
    assert report.matches["qk_norm_rope"] == 0 and "goes into the KV cache" in report.rejected[0].reason
    assert report.ops_after()["aten.index_put.default"] == 2


def test_values_stored_in_another_layout_are_not_fused():
    """The values stored [B, T, H, D] (no transpose: another cache layout): the prologue is fused,
    the caches are written by Inductor."""
    fusion, per_head, rope, _, gate = SPELLINGS["minimax_m2"]
    prelude = _attention_prelude(NORMS["llama"], per_head, rope, gate)

    def fn(q_proj, k_proj, v_proj, q_weight, k_weight, cos, sin, k_cache, v_cache, slots):
        q, k = prelude(q_proj, k_proj, q_weight, k_weight, cos, sin)
        b, s = v_proj.shape[:2]
        k_cache[:, :, slots] = k
        v_cache[:, slots] = v_proj.view(b, s, -1, HEAD_DIM)
        return q, k_cache, v_cache

    args = _inputs("minimax_m2", (2, 2), torch.tensor([2, 6]))
    args[8] = args[8].transpose(1, 2).contiguous()  # [B, T, H, D]
    out, after_call, report = _compiled(fn, args, OPT_IN)
    assert report.matches["qk_norm_rope_whole_row_cache"] == 0 and report.final()["qk_norm_rope_whole_row"] == 1
    assert report.ops_after()["aten.index_put.default"] == 2
    eager = [a.clone() for a in args]
    fn(*eager)
    assert torch.equal(after_call[8], eager[8])


@pytest.mark.parametrize("spelling", ["qwen3", "minimax_m2"])
def test_a_batch_of_one_stored_by_indexing_is_fused(spelling):
    """A batch of one stored at a slot per token by indexing (torch.compile drops the batch dim
    with a reshape before the store): the fusion takes it (the per-head site too), the caches
    within bf16's tolerance of eager."""
    fusion, per_head, rope, _, gate = SPELLINGS[spelling]
    fn = slot_mapping_store(_attention_prelude(NORMS["llama"], per_head, rope, gate))
    args = _inputs(spelling, (1, 2), torch.tensor([4, 1]))
    out, after_call, report = _compiled(fn, args, OPT_IN)
    (site,) = report.sites_of(f"{fusion}_cache")
    assert site.spelling.endswith("slot_per_token_batch_one") and report.final()[f"{fusion}_cache"] == 1
    assert report.ops_before()["aten.index_put.default"] == 2 and "aten.index_put.default" not in report.ops_after()
    assert report.ops_after()["fusion_passes.qk_norm_rope_cache.default"] == 1
    eager = [a.clone() for a in args]
    expected = fn(*eager)
    tol = tolerance(torch.bfloat16)
    for a, e in zip((out[0], *after_call[7:9]), (expected[0], *eager[7:9]), strict=True):
        torch.testing.assert_close(a, e, rtol=tol.rtol, atol=tol.atol)


def keys_stored_transposed(prelude):
    """The keys stored token-major (a [B, T, H, D] key cache, transposed back before the store):
    a write the cache fusion does not take."""

    def fn(q_proj, k_proj, v_proj, q_weight, k_weight, cos, sin, k_cache, v_cache, slots):
        q, k = prelude(q_proj, k_proj, q_weight, k_weight, cos, sin)[:2]
        b, s = v_proj.shape[:2]
        k_cache[:, slots] = k.transpose(1, 2)
        v_cache[:, :, slots] = v_proj.view(b, s, -1, HEAD_DIM).transpose(1, 2)
        return q, k_cache, v_cache

    return fn


def _transposed_key_cache_inputs(spelling):
    args = _inputs(spelling, (2, 1), torch.tensor([4, 1])[:1])
    args[7] = args[7].transpose(1, 2).contiguous()  # [B, T, H, D]
    return args


def test_a_per_head_site_whose_keys_are_stored_otherwise_stays_stock():
    """The per-head decode prologue whose keys go into a token-major cache: the cache fusion
    cannot take the write, so the site stays Inductor's even with it enabled (never more kernels
    than stock)."""
    fusion, per_head, rope, _, gate = SPELLINGS["qwen3"]
    fn = keys_stored_transposed(_attention_prelude(NORMS["llama"], per_head, rope, gate))
    args = _transposed_key_cache_inputs("qwen3")
    out, after_call, report = _compiled(fn, args, OPT_IN)
    assert report.matches["qk_norm_rope"] == 0 and report.matches["qk_norm_rope_cache"] == 0
    assert "goes into the KV cache" in report.rejected[0].reason
    assert report.ops_after()["aten.index_put.default"] == report.ops_before()["aten.index_put.default"] == 2
    assert "fusion_passes.qk_norm_rope.default" not in report.ops_after()
    eager = [a.clone() for a in args]
    expected = fn(*eager)
    tol = tolerance(torch.bfloat16)
    torch.testing.assert_close(out[0], expected[0], rtol=tol.rtol, atol=tol.atol)
    torch.testing.assert_close(after_call[7], eager[7], rtol=tol.rtol, atol=tol.atol)


def test_a_whole_row_sites_write_it_cannot_take_is_reported_as_a_near_miss():
    """Keys stored token-major (transposed back before the store): the prologue is fused, the
    write stays Inductor's, and the report names it with where it diverged."""
    fusion, per_head, rope, _, gate = SPELLINGS["minimax_m2"]
    fn = keys_stored_transposed(_attention_prelude(NORMS["llama"], per_head, rope, gate))
    out, after_call, report = _compiled(fn, _transposed_key_cache_inputs("minimax_m2"), OPT_IN)
    assert report.final()["qk_norm_rope_whole_row"] == 1 and report.matches["qk_norm_rope_whole_row_cache"] == 0
    assert report.ops_after()["aten.index_put.default"] == report.ops_before()["aten.index_put.default"] == 2
    misses = [m for m in report.near_misses if m.fusion == "qk_norm_rope_whole_row_cache"]
    assert len(misses) == 1 and misses[0].reason, report.near_misses
