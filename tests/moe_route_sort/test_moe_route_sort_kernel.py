"""The route + dispatch-prep launch (moe_route_sort, and moe_route_sort_gather with the hidden
states' gather) against its plain-torch reference, in its one-launch form and past its token bound
(the route's kernel and the sort's): on CPU tensors through Triton's interpreter, or on CUDA
tensors, compiled, where a GPU is present."""

import os

import torch  # torch does not import triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    # Chosen before triton is first imported; only without a GPU (see test_rms_norm_kernel.py).
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
from _hypothesis import examples  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import fusion_passes  # noqa: E402,F401  (registers torch.ops.fusion_passes)
from fusion_passes.lowering.moe_route_sort.reference import (  # noqa: E402
    moe_route_sort_gather_reference,
    moe_route_sort_reference,
)
from fusion_passes.lowering.moe_route_sort.triton import ROUTE_SORT_MAX_TOKENS, moe_route_sort_triton  # noqa: E402


def _logits(tokens, experts, dtype, g, distinct=True):
    """Logits with no two equal in a row where ``distinct`` (a permutation of spaced values: the
    selected experts are then the same for every correct top-k), else few distinct values (ties)."""
    if distinct:
        rows = [torch.randperm(experts, generator=g).float() for _ in range(tokens)]
        return (torch.stack(rows) * (4.0 / experts) - 2.0).to(DEVICE, dtype)
    return torch.randint(-2, 3, (tokens, experts), generator=g).to(DEVICE, dtype)


def _check(args, hidden_states=None):
    """The op's outputs against the reference's: integers and the gathered rows equal (copies),
    the weights within fp32 rounding."""
    if hidden_states is None:
        got, want = moe_route_sort_triton(*args), moe_route_sort_reference(*args)
    else:
        got = moe_route_sort_triton(*args, hidden_states)
        want = moe_route_sort_gather_reference(*args, hidden_states)
    (weights, *exact), (want_weights, *want_exact) = got, want
    assert weights.dtype == torch.float32 and all(t.dtype == w.dtype for t, w in zip(exact, want_exact, strict=True))
    names = ("ids", "sorted_ids", "perm", "offsets", "inv_perm", "gathered")
    for name, t, w in zip(names[: len(want_exact)], exact, want_exact, strict=True):
        assert torch.equal(t, w), name
    # softmax's sum over E in another order: fp32 rounding
    torch.testing.assert_close(weights, want_weights, rtol=2e-6, atol=1e-7)


@st.composite
def _cases(draw):
    form = draw(st.sampled_from(["softmax", "sigmoid", "sigmoid_bias", "grouped"]))
    if form == "grouped":
        groups = draw(st.sampled_from([2, 4, 8]))
        experts = groups * draw(st.sampled_from([2, 5, 8, 32]))
        kept = draw(st.integers(1, groups))
        top_k = draw(st.integers(1, min(8, kept * (experts // groups))))
    else:
        groups, kept = 0, 0
        experts = draw(st.sampled_from([4, 16, 60, 256, 512]))
        top_k = draw(st.integers(1, min(10, experts)))
    return dict(
        form=form, groups=groups, kept=kept, experts=experts, top_k=top_k,
        tokens=draw(st.integers(1, ROUTE_SORT_MAX_TOKENS + 3)),
        extra_experts=draw(st.sampled_from([0, 3])),  # offsets longer than the routed experts
        renormalize=draw(st.booleans()),
        distinct=draw(st.booleans()),
        hidden=draw(st.sampled_from([0, 0, 40, 700])),  # 0: no gather; 700: two column blocks, strided rows
        dtype=draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16])),
        seed=draw(st.integers(0, 2**31 - 1)),
    )  # fmt: skip


@settings(max_examples=examples(40), deadline=None)
@given(case=_cases())
def test_matches_reference(case):
    g = torch.Generator().manual_seed(case["seed"])
    e, form = case["experts"], case["form"]
    logits = _logits(case["tokens"], e, case["dtype"], g, case["distinct"])
    bias = torch.randn(e, generator=g).to(DEVICE) if form in ("sigmoid_bias", "grouped") else None
    scale = 2.5 if form == "grouped" else 1.0
    hidden = None
    if case["hidden"]:
        hidden = torch.randn(case["tokens"], case["hidden"] + 5, generator=g).to(DEVICE, case["dtype"])[:, 5:]
    _check((logits, bias, case["top_k"], form == "softmax", case["renormalize"], case["groups"], case["kept"], scale,
            e + case["extra_experts"]), hidden)  # fmt: skip


@pytest.mark.parametrize("tokens", [1, 4, ROUTE_SORT_MAX_TOKENS, ROUTE_SORT_MAX_TOKENS + 1])
def test_real_routers(tokens):
    """Qwen 3.5-MoE's softmax over 512 experts, top-10; MiniMax-M2's sigmoid + bias over 256, top-8;
    DeepSeek V3's 8 groups of 32, 4 kept, top-8, scaled by 2.5 (bf16 logits; DeepSeek's fp32)."""
    g = torch.Generator().manual_seed(tokens)
    bf16 = torch.bfloat16
    _check((_logits(tokens, 512, bf16, g), None, 10, True, True, 0, 0, 1.0, 512))
    _check((_logits(tokens, 256, bf16, g), torch.randn(256, generator=g).to(DEVICE), 8, False, True, 0, 0, 1.0, 256))
    deepseek = (_logits(tokens, 256, torch.float32, g), torch.randn(256, generator=g).to(DEVICE), 8, False, True, 8,
                4, 2.5, 256)  # fmt: skip
    _check(deepseek)
    # with the gather of DeepSeek V3's 7168-wide hidden states for the first grouped GEMM (narrower
    # rows at many tokens: the interpreter runs each of the 14 x pairs / 4 copy programs' routes)
    width = 7168 if tokens <= 4 or DEVICE == "cuda" else 600
    _check(deepseek, torch.randn(tokens, width, generator=g).to(DEVICE, bf16))


def test_ops_are_functional_and_checked():
    g = torch.Generator().manual_seed(2)
    args = (_logits(3, 16, torch.float32, g), torch.randn(16, generator=g).to(DEVICE), 4, False, True, 4, 2, 2.5, 16)
    torch.library.opcheck(torch.ops.fusion_passes.moe_route_sort.default, args)
    hidden = torch.randn(3, 24, generator=g).to(DEVICE, torch.bfloat16)
    torch.library.opcheck(torch.ops.fusion_passes.moe_route_sort_gather.default, (*args, hidden))


def test_gather_of_other_rows_raises():
    logits = torch.randn(3, 16, device=DEVICE)
    with pytest.raises(ValueError, match=r"moe_route_sort_gather: hidden states \[3, H\] expected, got \(4, 8\)"):
        moe_route_sort_triton(logits, None, 4, True, True, 0, 0, 1.0, 16, torch.randn(4, 8, device=DEVICE))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((None, 4, True, True, 2, 1, 1.0, 16), "sigmoid, not softmax"),  # groups with softmax
        ((None, 4, False, True, 2, 1, 1.0, 16), "needs the correction bias"),
        ((None, 4, True, True, 0, 0, 2.0, 16), "does not scale"),  # a scale on the ungrouped route
        ((None, 17, True, True, 0, 0, 1.0, 16), "top_k 17"),
        ((None, 4, True, True, 0, 0, 1.0, 8), "8 experts counted, 16 routed to"),
    ],
)
def test_bad_arguments_raise(args, message):
    logits = torch.randn(3, 16, device=DEVICE)
    with pytest.raises(ValueError, match=f"moe_route_sort: .*{message}"):
        moe_route_sort_triton(logits, *args)
