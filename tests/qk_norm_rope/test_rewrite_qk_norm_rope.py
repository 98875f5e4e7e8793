"""Rewrite tests of QK-norm + RoPE: every spelling (per-head / whole-row norm, full / partial RoPE,
each norm form) with exact match counts and ops before/after, outputs bit-exact against eager on
the reference path (CPU); near misses that must not fuse. The RoPE is written here as transformers
writes it; tests/qk_norm_rope/test_region_spellings.py has the other code bases' spellings."""

from __future__ import annotations

import pytest
import torch

import fusion_passes
from _stock import assert_as_stock_inductor
from _params import by_str, grid
from _rope_spellings import hf_rope as rope_full  # transformers' apply_rotary_pos_emb
from _rope_spellings import hf_rope_partial as rope_partial  # and its partial form (Qwen3-Next)
from fusion_passes.patterns.qk_norm_rope import FAMILY
from fusion_passes.patterns.rope import FAMILY as ROPE_FAMILY
from fusion_passes.patterns.rms_norm import functional_rms_norm, llama_rms_norm, offset_rms_norm
from fusion_passes.numerics import tolerance
from fusion_passes.registry import get_fusions

NORMS = {"llama": llama_rms_norm, "fp32_weight": functional_rms_norm, "offset": offset_rms_norm}
HEAD_DIM, HQ, HK = 16, 4, 2
ROPE_OPS = {"aten.neg.default", "aten.cat.default"}


def _run(fn, *args, fusions="all"):
    report = fusion_passes.Report()
    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(fn, backend=fusion_passes.backend(fusions, report=report))(*args)
        expected = fn(*args)
    return out, expected, report


def _assert_close(out, expected):
    """Within the dtype's tolerance of eager: the fused kernel sums the squares in its own order."""
    for a, e in zip(out, expected, strict=True):
        tol = tolerance(e.dtype)
        torch.testing.assert_close(a, e, rtol=tol.rtol, atol=tol.atol)


def _matched(report):
    return {k: v for k, v in report.matches.items() if v}


def _attention_prelude(norm, per_head: bool, rope, gate: bool = False, eps=(1e-6, 1e-6)):
    """The pre-attention path as transformers writes it: Qwen3 (per head), Qwen 3.5 (q chunked
    from the q+gate projection, gate returned), MiniMax-M2 (norm over all heads)."""

    def fn(q_proj, k_proj, q_weight, k_weight, cos, sin):
        b, s = q_proj.shape[:2]
        hidden_shape = (b, s, -1, HEAD_DIM)
        extra = ()
        if gate:
            q, g = torch.chunk(q_proj.view(b, s, -1, HEAD_DIM * 2), 2, dim=-1)
            extra = (g.reshape(b, s, -1),)
        else:
            q = q_proj
        if per_head:
            q = norm(q.view(hidden_shape), q_weight, eps[0]).transpose(1, 2)
            k = norm(k_proj.view(hidden_shape), k_weight, eps[1]).transpose(1, 2)
        else:
            q = norm(q, q_weight, eps[0]).view(hidden_shape).transpose(1, 2)
            k = norm(k_proj, k_weight, eps[1]).view(hidden_shape).transpose(1, 2)
        return (*rope(q, k, cos, sin), *extra)

    return fn


def _args(dtype, form, per_head, rotary, gate=False, tokens=(2, 3), cos_batch=1):
    b, s = tokens
    offset = 0.0 if form != "offset" else 1.0
    q = torch.randn(b, s, HQ * HEAD_DIM * (2 if gate else 1)).to(dtype)
    k = torch.randn(b, s, HK * HEAD_DIM).to(dtype)
    wq = ((1.0 - offset) + 0.3 * torch.randn(HEAD_DIM if per_head else HQ * HEAD_DIM)).to(dtype)
    wk = ((1.0 - offset) + 0.3 * torch.randn(HEAD_DIM if per_head else HK * HEAD_DIM)).to(dtype)
    freqs = 50 * torch.rand(cos_batch, s, rotary // 2)
    angles = torch.cat((freqs, freqs), -1)
    return q, k, wq, wk, angles.cos().to(dtype), angles.sin().to(dtype)


SPELLINGS = {  # name: (fusion, per_head, rope, rotary dim, q+gate projection)
    "qwen3": ("qk_norm_rope", True, rope_full, HEAD_DIM, False),
    "qwen3_5": ("qk_norm_rope", True, rope_partial, HEAD_DIM // 4, True),
    "qwen3_next_no_gate": ("qk_norm_rope", True, rope_partial, HEAD_DIM // 2, False),
    "minimax_m2": ("qk_norm_rope_whole_row", False, rope_partial, HEAD_DIM // 2, False),
}


def _raised(rope):
    """The rope raise fusion that takes transformers' full / partial spelling (q and k: 2 sites)."""
    return {"rope": 2} if rope is rope_full else {"rope_partial": 2}


# By default each spelling in the norm form its model writes (Qwen3 and MiniMax-M2 the Llama form,
# Qwen 3.5 the (1 + w) form), Qwen3-Next's without the gate in the fp32-weight form: every form.
DEFAULT_FORMS = {
    "qwen3": "llama", "qwen3_5": "offset", "qwen3_next_no_gate": "fp32_weight", "minimax_m2": "llama",
}  # fmt: skip


@pytest.mark.parametrize(
    ("spelling", "form"),
    grid(
        {"spelling": by_str(list(SPELLINGS)), "form": by_str(list(NORMS))},
        default=lambda spelling, form: DEFAULT_FORMS[spelling] == form,
    ),
)
def test_spelling_fuses_bit_exact(spelling, form):
    fusion, per_head, rope, rotary, gate = SPELLINGS[spelling]
    dtype = torch.bfloat16
    fn = _attention_prelude(NORMS[form], per_head, rope, gate)
    out, expected, report = _run(fn, *_args(dtype, form, per_head, rotary, gate))
    assert _matched(report) == {"rms_norm": 2, **_raised(rope), fusion: 1}
    (site,) = report.sites_of(fusion)
    scope = "per_head" if per_head else "whole_row"
    assert site.spelling == f"{scope}_{form}_norm_transposed_rope"
    if not per_head:
        assert site.scalars["head_dim"] == HEAD_DIM
    before, after = report.graphs[0].ops_before, report.graphs[0].ops_after
    assert ROPE_OPS <= set(before) and before["aten.rsqrt.default"] == 2
    assert after["fusion_passes.qk_norm_rope.default"] == 1
    assert not ROPE_OPS & set(after) and "fusion_passes.rms_norm.default" not in after
    assert "fusion_passes.rope.default" not in after and not report.lowered_back()
    assert "aten.rsqrt.default" not in after and "aten.mul.Tensor" not in after
    assert not report.errors and not report.rejected
    for a, e in zip(out, expected, strict=True):
        assert a.dtype == e.dtype and a.shape == e.shape and torch.equal(a, e)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_other_dtypes_batch_and_eps(dtype):
    """fp32 / fp16, cos per sequence (batch 3), another eps: fused, equal to eager."""
    for spelling in ("qwen3_5", "minimax_m2"):
        fusion, per_head, rope, rotary, gate = SPELLINGS[spelling]
        fn = _attention_prelude(NORMS["llama"], per_head, rope, gate, eps=(1e-5, 1e-5))
        args = _args(dtype, "llama", per_head, rotary, gate, tokens=(3, 5), cos_batch=3)
        out, expected, report = _run(fn, *args)
        assert _matched(report) == {"rms_norm": 2, **_raised(rope), fusion: 1}, spelling
        assert report.sites_of(fusion)[0].scalars["eps"] == 1e-5
        for a, e in zip(out, expected, strict=True):
            assert torch.equal(a, e), spelling


def test_rope_without_norm_is_not_fused():
    """Llama's RoPE (no q/k norm): qk_norm_rope requires the norms; the raised rope ops are
    lowered back to plain torch."""

    def fn(q_proj, k_proj, q_weight, k_weight, cos, sin):
        b, s = q_proj.shape[:2]
        q = q_proj.view(b, s, -1, HEAD_DIM).transpose(1, 2)
        k = k_proj.view(b, s, -1, HEAD_DIM).transpose(1, 2)
        return rope_full(q, k, cos, sin)

    args = _args(torch.bfloat16, "llama", True, HEAD_DIM)
    out, expected, report = _run(fn, *args)
    assert _matched(report) == {"rope": 2}
    assert report.lowered_back() == {"fusion_passes.rope.default": 2}
    assert ROPE_OPS <= set(report.graphs[0].ops_after)
    assert_as_stock_inductor(fn, args, out)


def test_norm_over_another_axis_is_not_fused():
    """The norm spans pairs of heads (weight [2 * D]) before the per-head RoPE: neither a per-head
    nor a whole-row norm, so the fused op would compute something else."""

    def fn(q_proj, k_proj, q_weight, k_weight, cos, sin):
        b, s = q_proj.shape[:2]
        q = llama_rms_norm(q_proj.view(b, s, -1, 2 * HEAD_DIM), q_weight, 1e-6)
        k = llama_rms_norm(k_proj.view(b, s, -1, 2 * HEAD_DIM), k_weight, 1e-6)
        q = q.view(b, s, -1, HEAD_DIM).transpose(1, 2)
        k = k.view(b, s, -1, HEAD_DIM).transpose(1, 2)
        return rope_partial(q, k, cos, sin)

    q, k, _, _, cos, sin = _args(torch.bfloat16, "llama", True, HEAD_DIM // 2)
    w = (1 + 0.3 * torch.randn(2, 2 * HEAD_DIM)).to(torch.bfloat16)
    out, expected, report = _run(fn, q, k, w[0], w[1], cos, sin)
    assert _matched(report) == {"rms_norm": 2, "rope_partial": 2}
    assert report.lowered_back() == {"fusion_passes.rms_norm.default": 2, "fusion_passes.rope.default": 2}
    assert not report.sites_of("qk_norm_rope") and not report.errors
    assert_as_stock_inductor(fn, (q, k, w[0], w[1], cos, sin), out)


def test_one_position_for_every_token_is_fused():
    """cos/sin of one position broadcast over the tokens (eager broadcasts them): the kernel reads
    the row for every token (a stride-0 expand)."""
    fusion, per_head, rope, rotary, gate = SPELLINGS["qwen3_5"]
    q, k, wq, wk, cos, sin = _args(torch.bfloat16, "llama", per_head, rotary, gate)
    fn = _attention_prelude(NORMS["llama"], per_head, rope, gate)
    out, expected, report = _run(fn, q, k, wq, wk, cos[:, :1], sin[:, :1])
    assert _matched(report) == {"rms_norm": 2, **_raised(rope), fusion: 1}
    for a, e in zip(out, expected, strict=True):
        assert torch.equal(a, e)


@pytest.mark.parametrize("case", ["cos_fp32", "full_rope_narrow_cos"])
def test_mismatched_cos_sin_is_not_fused(case):
    """cos/sin in fp32 against bf16 q with no cast back (eager's result is fp32), or one column
    wide under the full-head RoPE (eager broadcasts it): the RoPE is not raised, with a reason."""
    spelling = "qwen3" if case == "full_rope_narrow_cos" else "qwen3_5"
    fusion, per_head, rope, rotary, gate = SPELLINGS[spelling]
    q, k, wq, wk, cos, sin = _args(torch.bfloat16, "llama", per_head, rotary, gate)
    if case == "cos_fp32":
        cos, sin = cos.float(), sin.float()
    else:
        cos, sin = cos[..., :1], sin[..., :1]
    fn = _attention_prelude(NORMS["llama"], per_head, rope, gate)
    out, expected, report = _run(fn, q, k, wq, wk, cos, sin)
    assert _matched(report) == {"rms_norm": 2}
    assert report.rejected and all(r.fusion in ROPE_FAMILY for r in report.rejected)
    assert any("cos" in r.reason for r in report.rejected)
    assert_as_stock_inductor(fn, (q, k, wq, wk, cos, sin), out)


def test_whole_row_norm_fused_at_prefill_sizes():
    """MiniMax-M2's whole-row spelling fuses at a static prefill size too (4096 tokens): the kernel
    takes a token's heads a step at a time there, and no token count is left to Inductor."""
    fusion, per_head, rope, rotary, gate = SPELLINGS["minimax_m2"]
    fn = _attention_prelude(NORMS["llama"], per_head, rope, gate)
    args = _args(torch.bfloat16, "llama", per_head, rotary, tokens=(1, 4096))
    out, expected, report = _run(fn, *args)
    assert _matched(report) == {"rms_norm": 2, **_raised(rope), fusion: 1} and not report.rejected
    before, after = report.graphs[0].ops_before, report.graphs[0].ops_after
    assert ROPE_OPS <= set(before) and before["aten.rsqrt.default"] == 2
    assert after["fusion_passes.qk_norm_rope.default"] == 1
    assert not ROPE_OPS & set(after) and "aten.rsqrt.default" not in after
    _assert_close(out, expected)


def test_different_eps_or_normed_value_reused_is_not_fused():
    """q_norm and k_norm with different eps (one op has one eps); a normed q also used elsewhere
    (the fused op does not return it)."""
    _, per_head, rope, rotary, gate = SPELLINGS["qwen3"]
    args = _args(torch.bfloat16, "llama", per_head, rotary, gate)
    fn = _attention_prelude(NORMS["llama"], per_head, rope, gate, eps=(1e-6, 1e-5))
    out, expected, report = _run(fn, *args)
    assert _matched(report) == {"rms_norm": 2, "rope": 2}
    assert any("eps" in r.reason for r in report.rejected)
    assert_as_stock_inductor(fn, args, out)

    def reused(q_proj, k_proj, q_weight, k_weight, cos, sin):
        b, s = q_proj.shape[:2]
        q = llama_rms_norm(q_proj.view(b, s, -1, HEAD_DIM), q_weight, 1e-6).transpose(1, 2)
        k = llama_rms_norm(k_proj.view(b, s, -1, HEAD_DIM), k_weight, 1e-6).transpose(1, 2)
        return (*rope_full(q, k, cos, sin), q * 2)

    out, expected, report = _run(reused, *args)
    assert _matched(report) == {"rms_norm": 2, "rope": 2}
    assert_as_stock_inductor(reused, args, out)


def test_family_is_in_all_after_rms_norm_and_enabled_by_name():
    names = [f.name for f in get_fusions("all")]
    assert set(FAMILY) <= set(names)
    assert min(names.index(n) for n in FAMILY) > names.index("rms_norm")
    assert min(names.index(n) for n in FAMILY) > max(names.index(n) for n in ROPE_FAMILY)
    enabled = [f.name for f in get_fusions(["qk_norm_rope"])]
    assert set(enabled) == {"rms_norm", *ROPE_FAMILY, *FAMILY}


def test_scalars_restored_where_the_recheck_drops_them(monkeypatch):
    """torch 2.11's register_replacement re-checks a match with the scalars burned in and hands
    the check a match without them (torch >= 2.12 copies them over): emulated here, every
    spelling still fuses and reports its eps (and MiniMax-M2's head_dim), and q / k norms of
    different eps are still told apart."""
    import torch._inductor.pattern_matcher as pm

    unflatten = pm._unflatten_match_kwargs

    def as_in_torch_2_11(kwargs, arg_info, defaults=None):
        return unflatten(kwargs, arg_info) if defaults is None else dict(kwargs)

    monkeypatch.setattr(pm, "_unflatten_match_kwargs", as_in_torch_2_11)
    for spelling in ("qwen3", "minimax_m2"):
        fusion, per_head, rope, rotary, gate = SPELLINGS[spelling]
        fn = _attention_prelude(NORMS["llama"], per_head, rope, gate, eps=(1e-5, 1e-5))
        out, expected, report = _run(fn, *_args(torch.bfloat16, "llama", per_head, rotary, gate))
        assert _matched(report) == {"rms_norm": 2, **_raised(rope), fusion: 1}, spelling
        assert report.sites_of(fusion)[0].scalars["eps"] == 1e-5
        assert not report.errors
        for a, e in zip(out, expected, strict=True):
            assert torch.equal(a, e), spelling
    fusion, per_head, rope, rotary, gate = SPELLINGS["qwen3"]
    fn = _attention_prelude(NORMS["llama"], per_head, rope, gate, eps=(1e-6, 1e-5))
    _, _, report = _run(fn, *_args(torch.bfloat16, "llama", per_head, rotary, gate))
    assert _matched(report) == {"rms_norm": 2, "rope": 2} and not report.errors
