"""The MoE routing kernel against its plain-torch reference and against torch.topk (the ops the
routers trace): on CPU tensors through Triton's interpreter, or on CUDA tensors, compiled, where a
GPU is present."""

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
from fusion_passes.lowering.moe_route.reference import moe_route_reference  # noqa: E402
from fusion_passes.lowering.moe_route.triton import moe_route_triton  # noqa: E402


def _distinct_logits(tokens, experts, dtype, g):
    """Logits with no two equal in a row (a permutation of spaced values): the selected experts
    and their order are then the same for every correct top-k."""
    rows = [torch.randperm(experts, generator=g).float() for _ in range(tokens)]
    return (torch.stack(rows) * (4.0 / experts) - 2.0).to(dtype)


def _check(logits, bias, top_k, softmax, renormalize):
    weights, ids = moe_route_triton(logits, bias, top_k, softmax, renormalize)
    want_w, want_ids = moe_route_reference(logits, bias, top_k, softmax, renormalize)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    assert torch.equal(ids, want_ids)
    # softmax's sum over E in another order: fp32 rounding
    torch.testing.assert_close(weights, want_w, rtol=2e-6, atol=1e-7)
    return weights, ids


@st.composite
def _cases(draw):
    experts = draw(st.sampled_from([4, 16, 60, 128, 256, 512]))
    return dict(
        tokens=draw(st.integers(1, 9)),
        experts=experts,
        top_k=draw(st.integers(1, min(10, experts))),
        softmax=draw(st.booleans()),
        bias=draw(st.booleans()),
        renormalize=draw(st.booleans()),
        dtype=draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16])),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


@settings(max_examples=examples(40), deadline=None)
@given(case=_cases())
def test_matches_reference_and_torch_topk(case):
    g = torch.Generator().manual_seed(case["seed"])
    e = case["experts"]
    logits = _distinct_logits(case["tokens"], e, case["dtype"], g).to(DEVICE)
    bias = None
    if case["bias"] and not case["softmax"]:
        # small distinct steps: the choice order stays tie-free
        bias = (torch.randperm(e, generator=g).float() * 1e-3).to(DEVICE)
    weights, ids = _check(logits, bias, case["top_k"], case["softmax"], case["renormalize"])
    scores = torch.softmax(logits.float(), -1) if case["softmax"] else torch.sigmoid(logits.float())
    choice = scores if bias is None else scores + bias
    assert torch.equal(ids, torch.topk(choice, case["top_k"], dim=-1).indices)


def test_ties_take_the_lower_expert_ids():
    """bf16 logits repeat often: equal scores are ordered, and chosen at the k-th place, by id."""
    logits = torch.tensor([[1.0, 3.0, 2.0, 3.0, 2.0, 2.0, 0.5, 3.0]], dtype=torch.bfloat16).to(DEVICE)
    _, ids = _check(logits, None, 5, True, True)
    assert ids.tolist() == [[1, 3, 7, 2, 4]]


def test_real_router_widths():
    """256 experts top-8 (Qwen 3.5-MoE, MiniMax-M2 with its bias), 512 top-10 (Qwen3-Next), random bf16."""
    g = torch.Generator().manual_seed(0)
    for experts, top_k, softmax in ((256, 8, True), (256, 8, False), (512, 10, True)):
        logits = torch.randn(33, experts, generator=g).to(DEVICE, torch.bfloat16)
        bias = None if softmax else (torch.rand(experts, generator=g) * 0.1).to(DEVICE)
        _check(logits, bias, top_k, softmax, True)


def test_op_is_functional_and_checked():
    logits = torch.randn(3, 16, device=DEVICE)
    torch.library.opcheck(torch.ops.fusion_passes.moe_route.default, (logits, None, 4, True, True))
    bias = torch.rand(16, device=DEVICE)
    torch.library.opcheck(torch.ops.fusion_passes.moe_route.default, (logits, bias, 4, False, True))


@pytest.mark.parametrize(
    ("logits", "bias", "top_k", "softmax", "message"),
    [
        (torch.zeros(16), None, 4, True, r"router logits \[T, E\]"),
        (torch.zeros(2, 16), None, 17, True, r"top_k 17 must be in \[1, 16\]"),
        (torch.zeros(2, 16), torch.zeros(16), 4, True, "a correction bias goes with sigmoid"),
        (torch.zeros(2, 16), torch.zeros(8), 4, False, r"must be \[16\]"),
        (torch.zeros(2, 16, dtype=torch.int32), None, 4, True, "logits are torch.int32"),
    ],
)
def test_bad_arguments_raise(logits, bias, top_k, softmax, message):
    bias = None if bias is None else bias.to(DEVICE)
    with pytest.raises(ValueError, match=message):
        moe_route_triton(logits.to(DEVICE), bias, top_k, softmax, True)
    with pytest.raises(ValueError, match=message):
        torch.ops.fusion_passes.moe_route(logits.to(DEVICE), bias, top_k, softmax, True)


@st.composite
def _grouped_cases(draw):
    n_group = draw(st.sampled_from([1, 2, 3, 4, 7, 8]))
    group = draw(st.sampled_from([2, 3, 6, 8, 32]))
    topk_group = draw(st.integers(1, n_group))
    return dict(
        tokens=draw(st.integers(1, 6)),
        n_group=n_group,
        group=group,
        topk_group=topk_group,
        top_k=draw(st.integers(1, min(8, topk_group * group))),
        renormalize=draw(st.booleans()),
        dtype=draw(st.sampled_from([torch.float32, torch.bfloat16])),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


@settings(max_examples=examples(40), deadline=None)
@given(case=_grouped_cases())
def test_grouped_matches_reference(case):
    from fusion_passes.lowering.moe_route.reference import moe_route_grouped_reference
    from fusion_passes.lowering.moe_route.triton import moe_route_grouped_triton

    g = torch.Generator().manual_seed(case["seed"])
    experts = case["n_group"] * case["group"]
    logits = _distinct_logits(case["tokens"], experts, case["dtype"], g).to(DEVICE)
    bias = (torch.randperm(experts, generator=g).float() * 1e-3).to(DEVICE)
    args = (logits, bias, case["top_k"], case["n_group"], case["topk_group"], case["renormalize"], 2.5)
    weights, ids = moe_route_grouped_triton(*args)
    want_w, want_ids = moe_route_grouped_reference(*args)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_w, rtol=2e-6, atol=1e-7)


def test_grouped_deepseek_width_and_bad_arguments():
    """256 experts in 8 groups of 32, 4 kept, top-8 (DeepSeek V3 / V3.2), against the reference;
    a top-k larger than the kept groups hold is refused."""
    from fusion_passes.lowering.moe_route.reference import moe_route_grouped_reference
    from fusion_passes.lowering.moe_route.triton import moe_route_grouped_triton

    g = torch.Generator().manual_seed(5)
    logits = torch.randn(17, 256, generator=g).to(DEVICE)
    bias = (torch.rand(256, generator=g) * 0.1).to(DEVICE)
    weights, ids = moe_route_grouped_triton(logits, bias, 8, 8, 4, True, 2.5)
    want_w, want_ids = moe_route_grouped_reference(logits, bias, 8, 8, 4, True, 2.5)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_w, rtol=2e-6, atol=1e-7)
    torch.library.opcheck(torch.ops.fusion_passes.moe_route_grouped.default, (logits, bias, 8, 8, 4, True, 2.5))
    with pytest.raises(ValueError, match="top_k 9 of 1 kept groups of 8"):
        torch.ops.fusion_passes.moe_route_grouped(logits[:, :32], bias[:32], 9, 4, 1, True, 1.0)
    with pytest.raises(ValueError, match="do not split into 3 groups"):
        moe_route_grouped_triton(logits[:, :32], bias[:32], 2, 3, 1, True, 1.0)
