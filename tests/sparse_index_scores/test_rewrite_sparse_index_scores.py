"""DeepSeek V3.2's indexer scores rewritten to one op: transformers' two matmuls, scale and relu
at decode (one and a few query tokens, bf16 and fp32), outputs as eager's within fp32 sum order;
a prefill's tokens are not its site but sparse_index_scores_prefill's; weights summed over another dim (not the pattern)
and keys shared across the batch (rejected, with the reason). On the tiny DeepseekV32 decode step with a
live index mask: the scores of both layers fused, the step's output as stock Inductor's."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch._inductor.fx_passes.joint_graph as joint_graph
import torch.nn.functional as F

import fusion_passes
from fusion_passes.models import build_model
from fusion_passes.models.decode import DecodeStep
from fusion_passes.numerics import compare, tolerance

FUSION = ["sparse_index_scores"]
OP = "fusion_passes.sparse_index_scores.default"


def transformers_indexer_tail(q, k, weights, softmax_scale, attention_mask):
    """DeepseekV32Indexer.forward from its scores to the masked index scores, as it writes them."""
    scores = torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * softmax_scale
    scores = F.relu(scores)
    index_scores = torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)
    return index_scores.masked_fill(~attention_mask, float("-inf"))


def weights_over_positions(q, k, weights, softmax_scale, attention_mask):
    """The same matmuls, but the weights summed over the positions, not the heads: not the pattern."""
    scores = F.relu(torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * softmax_scale)
    return torch.matmul(scores, weights.unsqueeze(-1)).squeeze(-1)


def _compile(fn, *args, fusions=FUSION):
    report = fusion_passes.Report()
    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(fn, backend=fusion_passes.backend(fusions, report=report), fullgraph=True)(*args)
    return out, report


def _inputs(s, dtype=torch.bfloat16, wdtype=torch.float32, t=45, batch=2):
    g = torch.Generator().manual_seed(s)
    q = torch.randn(batch, s, 6, 32, generator=g).to(dtype)
    k = torch.randn(batch, t, 32, generator=g).to(dtype)
    w = (torch.randn(batch, s, 6, generator=g) * 6**-0.5).to(wdtype)
    mask = torch.rand(batch, s, t, generator=g) > 0.2
    return q, k, w, 32**-0.5, mask


@pytest.mark.parametrize("s,dtype", [(1, torch.bfloat16), (3, torch.bfloat16), (1, torch.float32)])
def test_indexer_scores_become_one_op(s, dtype):
    args = _inputs(s, dtype)
    out, report = _compile(transformers_indexer_tail, *args)
    expected = transformers_indexer_tail(*args)
    finite = expected.isfinite()
    assert torch.equal(finite, out.isfinite())
    torch.testing.assert_close(out[finite], expected[finite], rtol=1e-5, atol=1e-5)
    assert report.final()["sparse_index_scores"] == 1
    before, after = report.ops_before(), report.ops_after()
    assert (before["aten.bmm.default"], after["aten.bmm.default"]) == (2, 0)
    assert (before["aten.relu.default"], after["aten.relu.default"]) == (1, 0)
    assert (before[OP], after[OP]) == (0, 1)


def _as_on_a_gpu():
    """Inductor's joint-graph pass turns a batch-1 bmm into mm(a.squeeze(0), b.squeeze(0)).unsqueeze(0)
    on GPUs only (bmm_to_mm checks the device): the graph a single-sequence decode step has there."""
    return mock.patch.object(joint_graph, "check_device", lambda a, b, device=None: True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_one_sequence_matches_in_the_form_a_gpu_graph_holds(dtype):
    q, k, w, scale, mask = _inputs(1, dtype)
    args = (q[:1], k[:1], w[:1], scale, mask[:1])
    with _as_on_a_gpu():
        out, report = _compile(transformers_indexer_tail, *args)
    expected = transformers_indexer_tail(*args)
    finite = expected.isfinite()
    torch.testing.assert_close(out[finite], expected[finite], rtol=1e-5, atol=1e-5)
    assert report.final()["sparse_index_scores"] == 1
    before, after = report.ops_before(), report.ops_after()
    assert (before["aten.mm.default"], after["aten.mm.default"]) == (2, 0)  # bmm_to_mm's, both undone
    assert after["aten.bmm.default"] == 0 and after[OP] == 1


def test_other_batch_one_matmuls_keep_the_gpu_form():
    """A batch-1 bmm that is not the indexer's (no relu between the two) is left as mm."""
    def two_matmuls(a, b, c):
        return torch.bmm(torch.bmm(a, b) * 2, c)

    g = torch.Generator().manual_seed(0)
    a, b, c = (torch.randn(1, 6, 6, generator=g) for _ in range(3))
    with _as_on_a_gpu():
        out, report = _compile(two_matmuls, a, b, c)
    torch.testing.assert_close(out, two_matmuls(a, b, c))
    assert report.final()["sparse_index_scores"] == 0
    assert report.ops_after() == report.ops_before()
    assert report.ops_after()["aten.mm.default"] == 2 and report.ops_after()["aten.bmm.default"] == 0


def test_a_prefill_is_not_a_site():
    args = _inputs(20)  # 20 query tokens > MAX_QUERY_TOKENS
    out, report = _compile(transformers_indexer_tail, *args)
    torch.testing.assert_close(out, transformers_indexer_tail(*args), rtol=1e-5, atol=1e-5)
    assert report.final()["sparse_index_scores"] == 0 and not report.rejected
    assert report.ops_after() == report.ops_before()


@pytest.mark.parametrize("dtype,batch", [(torch.bfloat16, 2), (torch.float32, 2), (torch.bfloat16, 1)])
def test_a_prefill_is_the_prefill_fusions_site(dtype, batch):
    """With both fusions: 20 query tokens go to sparse_index_scores_prefill (the tiled kernel on
    a GPU), a decode step's to sparse_index_scores; either way the two matmuls and the relu go.
    One sequence (a model's prefill) traces the keys' broadcast as a view, not a copy."""
    both = ["sparse_index_scores", "sparse_index_scores_prefill"]
    for s, fusion in ((20, "sparse_index_scores_prefill"), (1, "sparse_index_scores")):
        args = _inputs(s, dtype, batch=batch)
        out, report = _compile(transformers_indexer_tail, *args, fusions=both)
        expected = transformers_indexer_tail(*args)
        finite = expected.isfinite()
        assert torch.equal(finite, out.isfinite())
        torch.testing.assert_close(out[finite], expected[finite], rtol=1e-5, atol=1e-5)
        assert {name: report.final()[name] for name in both} == {name: int(name == fusion) for name in both}
        before, after = report.ops_before(), report.ops_after()
        assert (before["aten.bmm.default"], after["aten.bmm.default"]) == (2, 0)
        assert (before["aten.relu.default"], after["aten.relu.default"]) == (1, 0)
        assert (before[OP], after[OP]) == (0, 1)


def test_weights_over_another_dim_are_not_the_pattern():
    q, k, _, scale, mask = _inputs(1)
    w = torch.randn(2, 1, 6, 45)  # [B, S, H, T] @ [B, S, T, 1]: summed over the positions
    out, report = _compile(weights_over_positions, q, k, w, scale, mask)
    torch.testing.assert_close(out, weights_over_positions(q, k, w, scale, mask), rtol=1e-5, atol=1e-5)
    assert report.matches["sparse_index_scores"] == 0
    assert report.ops_after() == report.ops_before() and report.ops_after()["aten.bmm.default"] == 2


def test_keys_shared_across_the_batch_are_rejected_with_the_reason():
    """One key row set broadcast to every sequence (k [1, T, D]): matmul broadcasts it, the op
    takes one cache per sequence; rejected, the reason in the report."""
    q, k, w, scale, mask = _inputs(1)
    out, report = _compile(transformers_indexer_tail, q, k[:1], w, scale, mask)
    torch.testing.assert_close(out, transformers_indexer_tail(q, k[:1], w, scale, mask), rtol=1e-5, atol=1e-5)
    assert report.final()["sparse_index_scores"] == 0
    assert any("must be [2, T >= 1, 32]" in r for r in map(str, report.rejected))
    assert report.ops_after() == report.ops_before() and report.ops_after()[OP] == 0


@pytest.mark.slow  # a whole-model decode step compiled twice (about 30 s on 2 cores)
def test_deepseek_v32_decode_with_a_live_index_mask_fuses_both_layers():
    """The tiny config keeps 4 of the cache's 10 positions (index_topk 4): the scores feed a live
    top-k. The fused step's output equals stock Inductor's within bf16 tolerance (its scores differ
    in fp32 sum order: its random inputs tie nowhere near the 4th place)."""
    built = build_model("deepseek-v3.2", size="tiny", dtype=torch.bfloat16, layers=2)
    step = DecodeStep(built.module, batch=2, context=8, steps=1)
    outs = {}
    for name, fusions in (("fused", FUSION), ("stock", [])):
        report = fusion_passes.Report()
        torch._dynamo.reset()
        compiled = torch.compile(step, backend=fusion_passes.backend(fusions, report=report), fullgraph=True)
        with torch.no_grad():
            step.restore()
            outs[name] = (compiled(*step.inputs(0)).clone(), report)
    with torch.no_grad():
        step.restore()
        eager = step(*step.inputs(0))
    report = outs["fused"][1]
    assert report.final()["sparse_index_scores"] == 2
    before, after = report.ops_before(), report.ops_after()
    assert (before[OP], after[OP]) == (0, 2)
    assert before["aten.relu.default"] - after["aten.relu.default"] == 2
    assert compare(outs["fused"][0], outs["stock"][0]).rel_norm <= tolerance(torch.bfloat16).rel_norm
    assert compare(outs["fused"][0], eager).rel_norm <= compare(outs["stock"][0], eager).rel_norm + tolerance(torch.bfloat16).rel_norm
