"""The MoE dispatch-prep kernel against its plain-torch reference and against the ops transformers
traces (sort, histc, cumsum, the inverse permutation's scatter): on CPU tensors through Triton's
interpreter, or on CUDA tensors, compiled, where a GPU is present."""

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
from fusion_passes.lowering.moe_sort_by_expert.reference import (  # noqa: E402
    moe_sort_by_expert_reference,
    moe_sort_gather_reference,
)
from fusion_passes.lowering.moe_sort_by_expert.triton import moe_sort_by_expert_triton, moe_sort_gather_triton  # noqa: E402


def _transformers_ops(expert_ids, num_experts):
    """What transformers' grouped_mm experts compute (histc on float ids: the CPU's spelling)."""
    sorted_ids, perm = torch.sort(expert_ids)
    counts = torch.histc(sorted_ids.float(), bins=num_experts, min=0, max=num_experts - 1)
    return sorted_ids, perm, torch.cumsum(counts, dim=0, dtype=torch.int32)


def _check(expert_ids, num_experts):
    sorted_ids, perm, offsets, inv_perm = moe_sort_by_expert_triton(expert_ids, num_experts)
    expected = moe_sort_by_expert_reference(expert_ids, num_experts)
    for got, want in zip((sorted_ids, perm, offsets, inv_perm), expected):
        assert got.dtype == want.dtype and torch.equal(got, want)
    # The reference states what the model's ops compute: the same sorted ids and offsets, a
    # permutation that sorts (the model's sort may order equal ids otherwise), its inverse.
    model_sorted, _, model_offsets = _transformers_ops(expert_ids.cpu(), num_experts)
    assert torch.equal(sorted_ids.cpu(), model_sorted)
    if num_experts > 1:  # histc over [0, 0] counts over the data's own range (the pattern refuses E = 1)
        assert torch.equal(offsets.cpu(), model_offsets)
    assert torch.equal(expert_ids[perm], sorted_ids)
    assert torch.equal(inv_perm[perm], torch.arange(expert_ids.numel(), device=expert_ids.device))


@st.composite
def _cases(draw):
    return dict(
        pairs=draw(st.sampled_from([1, 2, 7, 8, 16, 33, 130, 512])),
        num_experts=draw(st.sampled_from([1, 3, 16, 60, 256])),
        dtype=draw(st.sampled_from([torch.int64, torch.int32])),
        sentinels=draw(st.integers(0, 3)),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


@settings(max_examples=examples(40), deadline=None)
@given(case=_cases())
def test_matches_reference_and_the_models_ops(case):
    g = torch.Generator().manual_seed(case["seed"])
    e, s = case["num_experts"], case["pairs"]
    ids = torch.randint(0, e, (s,), generator=g)
    # Expert-parallel sentinels (ids >= E): sorted to the tail, not counted (histc drops them).
    ids[torch.randperm(s, generator=g)[: case["sentinels"]]] = e + torch.arange(min(s, case["sentinels"]))
    _check(ids.to(DEVICE, case["dtype"]), e)


def test_decode_sizes_with_ties():
    """Batch 1 and 64 x top-8 of 256 experts (Qwen 3.5-MoE), and every pair routed to one expert:
    the stable order of equal ids."""
    g = torch.Generator().manual_seed(0)
    for ids in (
        torch.randint(0, 256, (8,), generator=g),
        torch.randint(0, 256, (512,), generator=g),
        torch.full((300,), 5),
        torch.randint(0, 4, (257,), generator=g),
    ):
        _check(ids.to(DEVICE), 256)


def test_op_is_functional_and_checked():
    ids = torch.tensor([3, 1, 1, 0, 7, 3], device=DEVICE)
    torch.library.opcheck(torch.ops.fusion_passes.moe_sort_by_expert.default, (ids, 8))
    out = torch.ops.fusion_passes.moe_sort_by_expert(ids, 8)
    sorted_ids, perm, offsets, inv_perm = (t.tolist() for t in out)
    assert sorted_ids == [0, 1, 1, 3, 3, 7] and perm == [3, 1, 2, 0, 5, 4]
    assert offsets == [1, 3, 3, 5, 5, 5, 5, 6] and inv_perm == [3, 1, 2, 0, 5, 4]


@pytest.mark.parametrize(
    ("ids", "num_experts", "message"),
    [
        (torch.zeros(2, 4, dtype=torch.int64), 8, "flat expert ids"),
        (torch.zeros(4), 8, "integer dtype"),
        (torch.zeros(4, dtype=torch.int64), 0, "num_experts must be positive"),
    ],
)
def test_bad_arguments_raise(ids, num_experts, message):
    with pytest.raises(ValueError, match=message):
        moe_sort_by_expert_triton(ids.to(DEVICE), num_experts)
    with pytest.raises(ValueError, match=message):
        torch.ops.fusion_passes.moe_sort_by_expert(ids.to(DEVICE), num_experts)


@pytest.mark.parametrize("tokens,top_k,experts,hidden", [(1, 8, 256, 700), (3, 2, 5, 33), (17, 4, 16, 1030), (64, 8, 64, 96)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_sort_and_gather_match_reference(tokens, top_k, experts, hidden, dtype):
    """moe_sort_gather's kernel: the sort's outputs as moe_sort_by_expert's, and each pair's hidden
    state in its sorted row, bit for bit; expert-parallel sentinels (id == experts) sorted last
    with zero rows; hidden states read through a row stride."""
    g = torch.Generator().manual_seed(tokens * top_k)
    ids = torch.randint(0, experts + 1, (tokens * top_k,), generator=g).to(DEVICE)
    wide = torch.randn(tokens, hidden + 7, generator=g).to(DEVICE, dtype)
    x = wide[:, 3 : 3 + hidden]
    got = moe_sort_gather_triton(ids, experts, x, top_k)
    want = moe_sort_gather_reference(ids, experts, x, top_k)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    for a, b in zip(got[:4], moe_sort_by_expert_triton(ids, experts), strict=True):
        assert torch.equal(a, b)
    sentinels = got[0] >= experts
    assert got[4][sentinels].abs().sum().item() == 0


def test_sort_and_gather_bad_arguments_and_opcheck():
    ids, x = torch.zeros(6, dtype=torch.int64), torch.zeros(3, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="6 pairs are not 3 tokens x top_k 4"):
        torch.ops.fusion_passes.moe_sort_gather(ids, 4, x, 4)
    with pytest.raises(ValueError, match="hidden states \\[T, H\\] expected"):
        torch.ops.fusion_passes.moe_sort_gather(ids, 4, x[None], 2)
    torch.library.opcheck(torch.ops.fusion_passes.moe_sort_gather.default, (torch.tensor([3, 0, 1, 3, 2, 0]), 4, x, 2))
