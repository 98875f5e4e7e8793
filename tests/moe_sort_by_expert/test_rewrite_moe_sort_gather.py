"""transformers' grouped_mm experts (Qwen 3.5-MoE's, MiniMax-M2's and DeepSeek V3's MoE blocks, each
with its own router) compiled with moe_sort_gather: the sort op and the gather of the first grouped
GEMM's rows (``hidden_states[perm // top_k]``, the sentinels' rows zeroed) become one op, the
block's output bit-equal to moe_sort_by_expert's alone; without moe_sort_by_expert's op (a
refused sort) there is nothing to take."""

from __future__ import annotations


import pytest
import torch
from _moe_blocks import HIDDEN, moe_block

import fusion_passes

GATHER = "fusion_passes.moe_sort_gather.default"
SORT = "fusion_passes.moe_sort_by_expert.default"


def _run(block, x, fusions):
    report = fusion_passes.Report()
    torch._dynamo.reset()
    compiled = torch.compile(block, backend=fusion_passes.backend(fusions, report=report), fullgraph=True)
    with torch.no_grad():
        return compiled(x), report


@pytest.mark.parametrize("model", ["qwen3.5-moe", "minimax-m2", "deepseek-v3"])
@pytest.mark.parametrize("tokens", [1, 7])
def test_the_gather_joins_the_sort(model, tokens):
    block = moe_block(model)
    x = torch.randn(1, tokens, HIDDEN, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(tokens))
    sort_only, _ = _run(block, x, ["moe_sort_by_expert"])
    out, report = _run(block, x, ["moe_sort_gather"])  # requires enables the sort's fusion
    assert report.final()["moe_sort_gather"] == 1 and report.final()["moe_sort_by_expert"] == 0
    before, after = report.ops_before(), report.ops_after()
    assert (after[GATHER], after[SORT]) == (1, 0)
    assert before["aten.index.Tensor"] - after["aten.index.Tensor"] == 1  # the rows' gather
    assert before["aten.div.Tensor_mode"] - after["aten.div.Tensor_mode"] == 1  # perm // top_k
    assert torch.equal(out, sort_only)


def test_a_refused_sort_leaves_the_gather(monkeypatch):
    """A launch table that refuses every sort (as a prefill's beyond its limit): no sort op, no gather
    site; the block as stock Inductor compiles it."""
    from fusion_passes.lowering import launch_tables

    monkeypatch.setitem(launch_tables.MOE_SORT_BY_EXPERT, "default", launch_tables.MoeSortRule(1, evidence="test"))
    block = moe_block("qwen3.5-moe")
    x = torch.randn(1, 5, HIDDEN, dtype=torch.bfloat16)
    out, report = _run(block, x, ["moe_sort_gather"])
    assert report.final()["moe_sort_gather"] == 0 and GATHER not in report.ops_after()
    torch._dynamo.reset()
    with torch.no_grad():
        assert torch.equal(out, torch.compile(block, fullgraph=True)(x))
