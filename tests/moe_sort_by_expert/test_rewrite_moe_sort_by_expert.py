"""transformers' grouped_mm experts (the MoE blocks of Qwen 3.5-MoE, MiniMax-M2 and DeepSeek V3,
each with its own router) compiled with moe_sort_by_expert: the dispatch prep (sort, histc,
cumsum, the inverse permutation's scatter) becomes one op and the block's output is bit-equal to
stock Inductor's; torchtitan's dispatch (histc over [0, E], argsort) does not match and is
reported as a near miss."""

from __future__ import annotations

import pytest
import torch

import fusion_passes
from _moe_blocks import EXPERTS, HIDDEN, TOP_K, moe_block
from fusion_passes.numerics import compare, tolerance

FUSIONS = ["moe_sort_by_expert"]
DISPATCH_OPS = ("aten.sort.default", "aten.histc.default", "aten.cumsum.default", "aten.index_put.default")


def _compile(fn, fusions=FUSIONS):
    report = fusion_passes.Report()
    torch._dynamo.reset()
    return torch.compile(fn, backend=fusion_passes.backend(fusions, report=report), fullgraph=True), report


@pytest.mark.parametrize("model", ["qwen3.5-moe", "minimax-m2", "deepseek-v3"])
@pytest.mark.parametrize("tokens", [1, 7])
def test_transformers_dispatch_fuses_bit_equal_to_stock_inductor(model, tokens):
    block = moe_block(model)
    x = torch.randn(1, tokens, HIDDEN, dtype=torch.bfloat16)
    compiled, report = _compile(block)
    with torch.no_grad():
        out = compiled(x)
        torch._dynamo.reset()
        stock = torch.compile(block, fullgraph=True)(x)
        eager = block(x)
    assert report.final() == {"moe_sort_by_expert": 1}
    before, after = report.ops_before(), report.ops_after()
    assert [before[op] for op in DISPATCH_OPS] == [1, 1, 1, 1]
    assert [after[op] for op in DISPATCH_OPS] == [0, 0, 0, 0]
    assert after["fusion_passes.moe_sort_by_expert.default"] == 1
    assert torch.equal(out, stock)
    # Against eager: the block's bf16 roundings differ (Inductor's, not the dispatch's).
    assert compare(out, eager).rel_norm < tolerance(torch.bfloat16).rel_norm


def test_tied_expert_ids_keep_stock_inductors_output():
    """Every token the same: each expert's pairs tie, and the stable order the op returns (not
    the model's unstable sort's) must not change the block's output."""
    block = moe_block("qwen3.5-moe")
    x = torch.randn(1, 1, HIDDEN, dtype=torch.bfloat16).expand(1, 9, HIDDEN).contiguous()
    compiled, report = _compile(block)
    with torch.no_grad():
        out = compiled(x)
        torch._dynamo.reset()
        stock = torch.compile(block, fullgraph=True)(x)
    assert report.final() == {"moe_sort_by_expert": 1}
    before, after = report.ops_before(), report.ops_after()
    assert [before[op] for op in DISPATCH_OPS] == [1, 1, 1, 1]
    assert [after[op] for op in DISPATCH_OPS] == [0, 0, 0, 0]
    assert torch.equal(out, stock)


def torchtitan_dispatch(x, top_scores, selected_experts_indices, num_experts, top_k):
    """torchtitan's LocalTokenDispatcher.dispatch (histc over [0, num_experts], on float ids as its
    CPU path needs; argsort stable)."""
    num_tokens_per_expert = torch.histc(
        selected_experts_indices.view(-1).float(), bins=num_experts, min=0, max=num_experts
    )
    token_indices_experts_sorted = torch.argsort(selected_experts_indices.view(-1), stable=True)
    top_scores_experts_sorted = top_scores.view(-1)[token_indices_experts_sorted]
    token_indices_experts_sorted = token_indices_experts_sorted // top_k
    routed_input = x[token_indices_experts_sorted]
    return routed_input, top_scores_experts_sorted, num_tokens_per_expert


def test_torchtitan_dispatch_is_a_near_miss_not_a_match():
    """Its histc bins [0, E] (an id equal to E lands in the last bin: not the expert counts the op
    returns), and it returns counts, not offsets."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, HIDDEN, generator=g)
    scores = torch.rand(5, TOP_K, generator=g)
    ids = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range(5)])
    fn = lambda x, s, i: torchtitan_dispatch(x, s, i, EXPERTS, TOP_K)  # noqa: E731
    compiled, report = _compile(fn)
    with torch.no_grad():
        out = compiled(x, scores, ids)
    assert report.final() == {"moe_sort_by_expert": 0}
    assert report.ops_after() == report.ops_before() and report.ops_after()["aten.histc.default"] == 1
    assert [m.fusion for m in report.near_misses] == ["moe_sort_by_expert"]
    for got, want in zip(out, fn(x, scores, ids)):
        assert torch.equal(got, want)


def test_descending_sort_does_not_match():
    def fn(ids):
        ids_g, perm = torch.sort(ids, descending=True)
        counts = torch.histc(ids_g.float(), bins=EXPERTS, min=0, max=EXPERTS - 1)
        offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
        inv_perm = torch.empty_like(perm)
        inv_perm[perm] = torch.arange(perm.size(0))
        return ids_g, perm, offsets, inv_perm

    ids = torch.randint(0, EXPERTS, (12,), generator=torch.Generator().manual_seed(1))
    compiled, report = _compile(fn)
    with torch.no_grad():
        out = compiled(ids)
    assert report.final() == {"moe_sort_by_expert": 0}
    assert report.ops_after() == report.ops_before()
    for got, want in zip(out, fn(ids)):
        assert torch.equal(got, want)


def _dispatch(ids, num_experts):
    """transformers' lines (CPU branch) on flat ids."""
    ids_g, perm = torch.sort(ids)
    counts = torch.histc(ids_g.float(), bins=num_experts, min=0, max=num_experts - 1)
    offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
    inv_perm = torch.empty_like(perm)
    inv_perm[perm] = torch.arange(perm.size(0))
    return ids_g, perm, offsets, inv_perm


def test_one_expert_is_not_fused():
    """histc(bins=1, min=0, max=0) bins the ids' own range (a sentinel id is counted): the traced
    graph drops those bounds, histc's defaults, and the pattern's explicit ones do not match."""
    ids = torch.tensor([0, 0, 1, 0])
    compiled, report = _compile(lambda ids: _dispatch(ids, 1))
    with torch.no_grad():
        out = compiled(ids)
    assert report.final() == {"moe_sort_by_expert": 0} and not report.rejected
    assert [m.fusion for m in report.near_misses] == ["moe_sort_by_expert"]
    assert report.ops_after() == report.ops_before()
    assert out[2].tolist() == [4]


def test_dynamic_shapes_fuse_the_sort_and_leave_the_scatter():
    """Compiled with dynamic shapes (a serving engine's varying batch): the inverse permutation's
    arange takes its size from the token count (4 * s0), which the whole spelling does not match;
    the sort and offsets still fuse (the second spelling), the scatter stays Inductor's, and the
    block's output is bit-equal to stock Inductor's at every token count."""
    block = moe_block("qwen3.5-moe")
    report = fusion_passes.Report()
    torch._dynamo.reset()
    ours = torch.compile(block, backend=fusion_passes.backend(FUSIONS, report=report), fullgraph=True, dynamic=True)
    inputs = [torch.randn(1, t, HIDDEN, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(t)) for t in (3, 7, 12)]
    with torch.no_grad():
        outs = [ours(x) for x in inputs]
        torch._dynamo.reset()
        stock = torch.compile(block, fullgraph=True, dynamic=True)
        assert all(torch.equal(out, stock(x)) for out, x in zip(outs, inputs, strict=True))
    assert report.final() == {"moe_sort_by_expert": 1}  # one graph for every token count
    assert [s.spelling for s in report.sites] == ["transformers_grouped_mm_dispatch_sort"]
    before, after = report.ops_before(), report.ops_after()
    assert [before[op] for op in DISPATCH_OPS] == [1, 1, 1, 1]
    assert [after[op] for op in DISPATCH_OPS] == [0, 0, 0, 1]
