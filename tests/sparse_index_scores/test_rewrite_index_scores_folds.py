"""The indexer's weights (weights_proj's output upcast and scaled by H^-1/2) and its masked_fill
of the scores by the attention mask, folded into sparse_index_scores' op: as transformers'
DeepseekV32Indexer writes them, at decode and at a prefill's tokens, outputs as eager's; a fill
of another value, an unnegated mask, weights scaled by a tensor and a mask broadcast over the
batch are left alone (the last rejected with the reason)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fusion_passes

FUSIONS = ["sparse_index_scores", "sparse_index_scores_prefill", "sparse_index_scores_weights", "sparse_index_scores_keep"]
OP = "fusion_passes.sparse_index_scores.default"


def _scores(q, k, weights, softmax_scale):
    scores = torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * softmax_scale
    scores = F.relu(scores)
    return torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)


def transformers_indexer(hidden, weights_proj, q, k, softmax_scale, attention_mask, fill=float("-inf")):
    """DeepseekV32Indexer.forward's weights and scores, as it writes them (n_heads = q's heads)."""
    n_heads = q.shape[2]
    weights = F.linear(hidden.to(weights_proj.dtype), weights_proj).float() * (n_heads**-0.5)
    index_scores = _scores(q, k, weights, softmax_scale)
    return index_scores.masked_fill(~attention_mask, fill)


def unnegated_mask(hidden, weights_proj, q, k, softmax_scale, attention_mask):
    weights = F.linear(hidden, weights_proj).float() * (q.shape[2] ** -0.5)
    return _scores(q, k, weights, softmax_scale).masked_fill(attention_mask, float("-inf"))


def weights_times_a_tensor(hidden, weights_proj, q, k, softmax_scale, attention_mask):
    per_head = torch.linspace(0.5, 1.5, q.shape[2], dtype=torch.float32)
    weights = F.linear(hidden, weights_proj).float() * per_head
    return _scores(q, k, weights, softmax_scale).masked_fill(~attention_mask, float("-inf"))


def _inputs(s, batch=2, t=45, heads=6, dtype=torch.bfloat16, causal_broadcast=True):
    g = torch.Generator().manual_seed(s + batch)
    hidden = torch.randn(batch, s, 40, generator=g).to(dtype)
    weights_proj = (torch.randn(heads, 40, generator=g) * 40**-0.5).to(dtype)
    q = torch.randn(batch, s, heads, 32, generator=g).to(dtype)
    k = torch.randn(batch, t, 32, generator=g).to(dtype)
    positions = t - s + torch.arange(s)
    causal = torch.arange(t)[None, :] <= positions[:, None]  # sdpa_mask's, broadcast over the batch
    mask = causal[None].expand(batch, s, t) if causal_broadcast else (torch.rand(batch, s, t, generator=g) > 0.2)
    return hidden, weights_proj, q, k, 32**-0.5, mask


def _compile(fn, *args):
    report = fusion_passes.Report()
    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(fn, backend=fusion_passes.backend(FUSIONS, report=report), fullgraph=True)(*args)
    return out, report


def _assert_as_eager(out, expected):
    finite = expected.isfinite()
    assert torch.equal(finite, out.isfinite()) and torch.equal(out[~finite], expected[~finite])
    torch.testing.assert_close(out[finite], expected[finite], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("s,causal,dtype", [(1, True, torch.bfloat16), (3, False, torch.bfloat16), (1, True, torch.float32),
                                            (20, True, torch.bfloat16)])  # fmt: skip
def test_weights_and_mask_fold_into_the_op(s, causal, dtype):
    """20 tokens: a prefill's (sparse_index_scores_prefill's op, folded the same)."""
    args = _inputs(s, causal_broadcast=causal, dtype=dtype)
    out, report = _compile(transformers_indexer, *args)
    _assert_as_eager(out, transformers_indexer(*args))
    assert report.matches["sparse_index_scores_weights"] == 1 and report.matches["sparse_index_scores_keep"] == 1
    assert report.final()["sparse_index_scores_keep"] == 1 and not report.rejected
    before, after = report.ops_before(), report.ops_after()
    assert (before["aten.where.self"], after["aten.where.self"]) == (1, 0)  # the masked_fill
    assert (before["aten.bitwise_not.default"], after["aten.bitwise_not.default"]) == (1, 0)
    assert after["aten.mul.Tensor"] == 0 and after["prims.convert_element_type.default"] == 0
    assert (before[OP], after[OP]) == (0, 1) and after["aten.mm.default"] == 1  # weights_proj's GEMM stays


@pytest.mark.parametrize("spelling", [unnegated_mask, weights_times_a_tensor])
def test_other_masks_and_weights_are_left_alone(spelling):
    args = _inputs(1)
    out, report = _compile(spelling, *args)
    _assert_as_eager(out, spelling(*args))
    folded_weights = spelling is unnegated_mask
    assert report.matches["sparse_index_scores_weights"] == folded_weights
    # the scores themselves still fuse
    assert report.final()["sparse_index_scores_weights" if folded_weights else "sparse_index_scores"] == 1
    assert report.matches["sparse_index_scores_keep"] == 0
    assert report.ops_after()["aten.where.self"] == report.ops_before()["aten.where.self"] >= 1


def test_a_fill_other_than_minus_inf_is_left_alone():
    args = _inputs(1)

    def zero_fill(*a):
        return transformers_indexer(*a, fill=0.0)

    out, report = _compile(zero_fill, *args)
    _assert_as_eager(out, zero_fill(*args))
    assert report.matches["sparse_index_scores_keep"] == 0 and report.final()["sparse_index_scores_weights"] == 1
    assert report.ops_after()["aten.where.self"] == 1


def test_a_mask_broadcast_over_the_batch_is_rejected_with_the_reason():
    hidden, weights_proj, q, k, scale, mask = _inputs(1)
    args = (hidden, weights_proj, q, k, scale, mask[:1])  # [1, S, T] against [2, S, T] scores
    out, report = _compile(transformers_indexer, *args)
    _assert_as_eager(out, transformers_indexer(*args))
    assert report.final()["sparse_index_scores_keep"] == 0 and report.ops_after()["aten.where.self"] == 1
    assert any("keep must be a bool [2, 1, 45] mask" in r.reason for r in report.rejected)
