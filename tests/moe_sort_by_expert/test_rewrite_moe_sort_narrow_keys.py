"""A prefill's sort of MoE router ids, left to Inductor by moe_sort_by_expert's launch table, on
16-bit keys: transformers' MoE blocks (the ids a fused router's, moe_route's) and a hand-written
top-k dispatch, their outputs bit-equal to the blocks' with the 64-bit sort. Not rewritten: ids of
unknown provenance (a graph input: an expert-parallel remap's sentinels are not bounded), a
descending sort, a top-k over more entries than 16-bit keys hold, a sort moe_sort_by_expert
takes (a decode step's)."""

from __future__ import annotations

import pytest
import torch
from _moe_blocks import moe_block
from _rewrites import compile_with, op_changes

from fusion_passes.lowering import launch_tables

NARROW = "moe_sort_narrow_keys"


@pytest.fixture
def prefill_sized(monkeypatch):
    """moe_sort_by_expert's limit at 8 pairs: the tests' few tokens stand for a prefill's many."""
    monkeypatch.setitem(launch_tables.MOE_SORT_BY_EXPERT, "default", launch_tables.MoeSortRule(8))


@pytest.mark.parametrize(
    "name", ["qwen3.5-moe", pytest.param("minimax-m2", marks=pytest.mark.slow), pytest.param("deepseek-v3", marks=pytest.mark.slow)]
)
def test_moe_blocks(name, prefill_sized):
    block = moe_block(name)
    x = torch.randn(1, 9, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    out, report = compile_with(["all", NARROW], block, (x,))
    assert report.final()[NARROW] == 1 and report.final()["moe_sort_by_expert"] == 0 and not report.errors
    changes = op_changes(report)
    assert changes["aten.sort.default"] == (1, 0) and changes["aten.sort.stable"] == (0, 1)
    defaults, _ = compile_with("all", block, (x,))
    assert torch.equal(out, defaults)


def topk_dispatch(logits, top_k):
    """A hand-written router and dispatch prep: top-k indices, flattened, sorted."""
    ids = torch.topk(logits.float().softmax(-1), top_k, dim=-1).indices.reshape(-1)
    sorted_ids, perm = torch.sort(ids)
    return sorted_ids, perm.argsort()


def test_a_topk_dispatch(prefill_sized):
    logits = torch.randn(7, 40, generator=torch.Generator().manual_seed(2))
    out, report = compile_with([NARROW], topk_dispatch, (logits, 3))
    assert report.final()[NARROW] == 1
    changes = op_changes(report)
    # the ids' sort narrowed; perm's argsort (a sort of positions, not router ids) left as it was
    assert changes["aten.sort.default"] == (2, 1) and changes["aten.sort.stable"] == (0, 1)
    expected = topk_dispatch(logits, 3)
    assert torch.equal(out[0], expected[0])  # the sorted ids; perm may order equal ids otherwise
    ids = torch.topk(logits.softmax(-1), 3, dim=-1).indices.reshape(-1)
    assert torch.equal(ids[out[1].argsort()], out[0])  # a permutation that sorts the ids


def unknown_ids(ids):
    return torch.sort(ids)


def descending(logits):
    return torch.sort(torch.topk(logits, 2).indices.reshape(-1), descending=True)


def wide_topk(logits):
    return torch.sort(torch.topk(logits, 2).indices.reshape(-1))


def test_not_sites(prefill_sized):
    cases = [(unknown_ids, (torch.randint(0, 50, (30,)),)), (descending, (torch.randn(9, 40),)),
             (wide_topk, (torch.randn(2, 40000),))]  # fmt: skip
    for fn, args in cases:
        out, report = compile_with([NARROW], fn, args)
        assert report.final()[NARROW] == 0, fn.__name__
        assert "aten.sort.stable" not in report.ops_after(), fn.__name__
        assert "aten.sort.default" not in op_changes(report), fn.__name__  # the sort as it was


def test_a_decode_steps_sort_is_moe_sort_by_experts():
    block = moe_block("minimax-m2")
    x = torch.randn(2, 1, 64, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    _, report = compile_with(["all", NARROW], block, (x,))
    assert report.final()[NARROW] == 0 and report.final()["moe_sort_by_expert"] == 1
    changes = op_changes(report)  # the sort is moe_sort_by_expert's op, none narrowed
    assert changes["aten.sort.default"] == (1, 0) and "aten.sort.stable" not in changes
