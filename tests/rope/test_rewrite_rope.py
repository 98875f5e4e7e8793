"""The RoPE raise rules: every spelling of tests/_rope_spellings.py (transformers Llama / Gemma /
Olmo2 / Phi-3 / GLM4, gpt-fast, vLLM's native NeoX and GPT-J, full and partial rotary) raised to
the canonical ``rope`` op, its reference bit-equal to eager on CPU; lowered back, the compiled
graph bit-equal to stock Inductor's. Spellings that must not raise stay as they were.

All spellings are compiled together (one graph: the raise rules are local to one tensor), once
per configuration and dtype: bf16 by default, fp32 / fp16 marked slow."""

from __future__ import annotations

import collections

import pytest
import torch

import fusion_passes
from fusion_passes.lowering.rope.reference import check_rope_args, rope_reference
from fusion_passes.patterns.rope import COMPLEX_REASON, FAMILY
from _rope_spellings import RAISED_BY, SPELLINGS, inputs

ROPE_OP = "fusion_passes.rope.default"
# The spelling each site is recorded under (q and k: two sites each).
SPELLING_NAMES = {
    "llama": "llama_rope",
    "gemma": "llama_rope",
    "olmo2": "olmo2_rope",
    "phi3": "llama_rope_partial",
    "glm4": "glm_rope_partial",
    "gpt_fast": "gpt_fast_rope",
    "vllm_neox_12": "vllm_neox_rope",
    "vllm_neox_8": "vllm_neox_rope_partial",
    "vllm_gptj_12": "vllm_gptj_rope",
    "vllm_gptj_8": "vllm_gptj_rope_partial",
}


def _zoo_inputs(dtype):
    return {name: inputs(name, dtype, seed=i) for i, name in enumerate(SPELLINGS)}


def zoo(args: dict):
    """Every spelling on its own inputs, in one graph."""
    return {name: SPELLINGS[name](*a) for name, a in args.items()}


def _compile(args, **options):
    report = fusion_passes.Report()
    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(zoo, backend=fusion_passes.backend(list(FAMILY), report=report, **options))(args)
    return out, report


@pytest.fixture(scope="module", params=[torch.bfloat16, pytest.param(torch.float32, marks=pytest.mark.slow),
                                        pytest.param(torch.float16, marks=pytest.mark.slow)], ids=str)  # fmt: skip
def raised(request):
    """The zoo compiled with the raise rules and no lower-back: each rope op runs its reference."""
    args = _zoo_inputs(request.param)
    out, report = _compile(args, lower_back=False)
    return request.param, args, out, report


def test_every_spelling_raises_bit_exact(raised):
    dtype, args, out, report = raised
    expected = zoo(args)
    counts = collections.Counter()
    for name, fusion in RAISED_BY.items():
        counts[fusion] += 2
    assert {k: v for k, v in report.matches.items() if v} == dict(counts)
    by_spelling = collections.Counter((s.fusion, s.spelling) for s in report.sites)
    want = collections.Counter()
    for name in SPELLINGS:
        spelling = SPELLING_NAMES[name]
        if dtype == torch.float32 and name == "olmo2":
            spelling = "llama_rope"  # fp32 cos on fp32 q: no promotion, no cast back to match
        want[(RAISED_BY[name], spelling)] += 2
    assert by_spelling == want
    assert not report.rejected and not report.errors
    before, after = report.graphs[0].ops_before, report.graphs[0].ops_after
    assert after[ROPE_OP] == 2 * len(SPELLINGS) and ROPE_OP not in before
    # rotate_half's negations and the spellings' subtractions are all inside the rope ops now.
    assert before["aten.neg.default"] > 0 and "aten.neg.default" not in after
    assert before["aten.sub.Tensor"] > 0 and "aten.sub.Tensor" not in after
    for name in SPELLINGS:
        for a, e in zip(out[name], expected[name], strict=True):
            assert a.dtype == e.dtype and a.shape == e.shape, name
            assert torch.equal(a, e), (name, dtype, (a.double() - e.double()).abs().max())


# By default one spelling of each raise fusion (two compiles of a smaller graph); every one slow.
LOWER_BACK_DEFAULT = ("llama", "glm4", "gpt_fast", "vllm_neox_12", "vllm_gptj_8")


@pytest.mark.parametrize(
    "dtype,names",
    [
        pytest.param(torch.bfloat16, LOWER_BACK_DEFAULT, id="bf16-one_of_each"),
        pytest.param(torch.bfloat16, tuple(SPELLINGS), id="bf16-all", marks=pytest.mark.slow),
        pytest.param(torch.float32, tuple(SPELLINGS), id="fp32-all", marks=pytest.mark.slow),
    ],
)
def test_lowered_back_equals_stock_inductor(dtype, names):
    """Raised, then lowered back (no region consumes them): the graph Inductor compiles is
    bit-equal to stock Inductor's (in bf16 both compute the RoPE in fp32 without intermediate
    rounding, unlike eager)."""
    args = {name: a for name, a in _zoo_inputs(dtype).items() if name in names}
    out, report = _compile(args)
    assert {k: v for k, v in report.matches.items() if v} == dict(
        collections.Counter(RAISED_BY[n] for n in names for _ in "qk")
    )
    assert report.lowered_back() == {ROPE_OP: 2 * len(names)}
    assert ROPE_OP not in report.graphs[0].ops_after
    torch._dynamo.reset()
    with torch.no_grad():
        stock = torch.compile(zoo, backend="inductor")(args)
    for name in names:
        for a, e in zip(out[name], stock[name], strict=True):
            assert torch.equal(a, e), name


# --- spellings that must not raise ---


def _meta_complex(xq, xk, freqs_cis):
    """Meta's reference Llama / torchtitan apply_rotary_emb, before the head transpose."""

    def reshape_for_broadcast(freqs_cis, x):
        ndim = x.ndim
        shape = [d if i == 1 or i == ndim - 1 else 1 for i, d in enumerate(x.shape)]
        return freqs_cis.view(*shape)

    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = reshape_for_broadcast(freqs_cis, xq_)
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def _inverse_rotation(q, k, cos, sin):
    """q * cos - rotate_half(q) * sin: the inverse rotation, another op."""

    def rotate_half(x):
        x1 = x[..., : x.shape[-1] // 2]
        x2 = x[..., x.shape[-1] // 2 :]
        return torch.cat((-x2, x1), dim=-1)

    return q * cos - rotate_half(q) * sin, k * cos - rotate_half(k) * sin


def _swapped_pairs(q, k, cos, sin):
    """GLM's stack with the pair swapped, stack((x1, -x2)): not a rotation RoPE writes."""

    def rot(x):
        return torch.stack((x[..., 0::2], -x[..., 1::2]), dim=-1).flatten(-2)

    return q * cos + rot(q) * sin, k * cos + rot(k) * sin


def test_complex_form_is_not_raised():
    """Meta's complex multiply stays as written (an eager fallback in Inductor): eager rounds it
    per pair with an FMA on short rows and as separate products on long ones, so no real
    reference reproduces it bit for bit (patterns/rope.py says more)."""
    q = torch.randn(2, 5, 3, 12)
    k = torch.randn(2, 5, 1, 12)
    angles = 50 * torch.rand(5, 6)
    freqs = torch.polar(torch.ones_like(angles), angles)
    out, report = None, fusion_passes.Report()
    torch._dynamo.reset()
    out = torch.compile(_meta_complex, backend=fusion_passes.backend(list(FAMILY), report=report))(q, k, freqs)
    assert sum(report.matches.values()) == 0
    assert [r.reason for r in report.rejected] == [COMPLEX_REASON] * 2  # q's and k's site
    assert report.graphs[0].ops_after["aten.view_as_complex.default"] == 2
    for a, e in zip(out, _meta_complex(q, k, freqs), strict=True):
        torch.testing.assert_close(a, e)


def test_other_rotations_are_not_raised():
    """The inverse rotation and GLM's stack with the pair swapped, in one graph: neither raised."""

    def both(q, k, cos, sin):
        return _inverse_rotation(q, k, cos, sin) + _swapped_pairs(q, k, cos, sin)

    q, k = torch.randn(2, 3, 5, 12), torch.randn(2, 1, 5, 12)
    cos, sin = torch.randn(2, 1, 5, 12), torch.randn(2, 1, 5, 12)
    report = fusion_passes.Report()
    torch._dynamo.reset()
    out = torch.compile(both, backend=fusion_passes.backend(list(FAMILY), report=report))(q, k, cos, sin)
    assert sum(report.matches.values()) == 0 and not report.rejected
    assert ROPE_OP not in report.graphs[0].ops_after
    for a, e in zip(out, both(q, k, cos, sin), strict=True):
        torch.testing.assert_close(a, e)


# --- the op ---


def _rope_args(dtype=torch.bfloat16):
    x = torch.randn(2, 3, 5, 12).to(dtype)
    cos = torch.randn(2, 1, 5, 8).to(dtype)
    return x, cos, torch.randn_like(cos)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("compute_fp32", [False, True])
def test_op_matches_reference_and_opcheck(interleaved, compute_fp32):
    x, cos, sin = _rope_args()
    if compute_fp32:
        cos, sin = cos.float(), sin.float()
    out = torch.ops.fusion_passes.rope(x, cos, sin, interleaved, compute_fp32)
    assert torch.equal(out, rope_reference(x, cos, sin, interleaved, compute_fp32))
    assert out.dtype == x.dtype and out.shape == x.shape and out.is_contiguous()
    assert torch.equal(out[..., 8:], x[..., 8:])  # partial rotary: the rest passed through
    torch.library.opcheck(torch.ops.fusion_passes.rope.default, (x, cos, sin, interleaved, compute_fp32))


def test_reference_is_the_rotation():
    """In float64: each pair (j, j + R/2), or (2j, 2j + 1), rotated by its angle."""
    x = torch.randn(3, 10, dtype=torch.float64)
    theta = torch.rand(3, 4, dtype=torch.float64) * 6
    half = torch.cat([theta, theta], -1)
    out = rope_reference(x, half.cos(), half.sin(), False, False)
    a, b = x[:, :4], x[:, 4:8]
    torch.testing.assert_close(out[:, :4], a * theta.cos() - b * theta.sin())
    torch.testing.assert_close(out[:, 4:8], b * theta.cos() + a * theta.sin())
    pairs = theta.repeat_interleave(2, -1)
    out = rope_reference(x, pairs.cos(), pairs.sin(), True, False)
    a, b = x[:, 0:8:2], x[:, 1:8:2]
    torch.testing.assert_close(out[:, 0:8:2], a * theta.cos() - b * theta.sin())
    torch.testing.assert_close(out[:, 1:8:2], b * theta.cos() + a * theta.sin())
    assert torch.equal(out[:, 8:], x[:, 8:])


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda x, c, s: (x.int(), c, s, False), "x must be float32/bfloat16/float16"),
        (lambda x, c, s: (x, c, s[..., :6], False), "differ"),
        (lambda x, c, s: (x, c.float(), s.float(), False), "must be in x's dtype"),
        (lambda x, c, s: (x, c[..., :7], s[..., :7], False), "must be even"),
        (lambda x, c, s: (x[..., :6], c, s, False), "must be even and in [2, 6]"),
        (lambda x, c, s: (x, c.expand(2, 4, 5, 8), s.expand(2, 4, 5, 8), False), "do not broadcast"),
        (lambda x, c, s: (x, c.double(), s.double(), True), "cos/sin must be float32"),
    ],
)
def test_bad_arguments_raise_one_line(change, message):
    x, cos, sin = _rope_args()
    args = change(x, cos, sin)
    with pytest.raises(ValueError, match=None) as info:
        check_rope_args(*args)
    assert message in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(ValueError):
        torch.ops.fusion_passes.rope(*args)


def test_unraised_rotation_is_a_near_miss():
    """rotate_half with its halves swapped (cat((-x1, x2)): not a rotation any spelling writes) is
    reported with the closest spelling and where it diverged; SiLU's neg is no candidate."""

    def fn(q, cos, sin, h):
        half = q.shape[-1] // 2
        rotated = torch.cat((-q[..., :half], q[..., half:]), dim=-1)
        return q * cos + rotated * sin, torch.nn.functional.silu(h)

    q, cos, sin = torch.randn(2, 3, 5, 12), torch.randn(2, 1, 5, 12), torch.randn(2, 1, 5, 12)
    report = fusion_passes.Report()
    torch._dynamo.reset()
    torch.compile(fn, backend=fusion_passes.backend(list(FAMILY), report=report))(q, cos, sin, torch.randn(7))
    assert sum(report.matches.values()) == 0
    (miss,) = report.near_misses
    assert (miss.fusion, miss.spelling) == ("rope", "llama_rope"), miss
    # the neg reads the first half where rotate_half negates the second
    assert miss.reason == "aten.slice.Tensor argument 2 is 0, the spelling has 6", miss.reason
