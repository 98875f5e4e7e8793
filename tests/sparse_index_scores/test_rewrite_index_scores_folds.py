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
from _rewrites import compile_with

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


# --- the causal mask from the first position, computed in the kernel (opt-in) ---

CAUSAL = ["sparse_index_scores", "sparse_index_scores_prefill", "sparse_index_scores_weights", "sparse_index_scores_causal"]


def indexer_with_the_models_mask(hidden, weights_proj, q, k, softmax_scale, first, kv_offset=0):
    """The decode step's mask as transformers builds it (masking_utils.sdpa_mask from the first
    cache position, [B, 1, S, T]; the indexer reads its [:, 0]), then DeepseekV32Indexer's scores
    and masked_fill."""
    from transformers.masking_utils import sdpa_mask

    b, s, t = q.shape[0], q.shape[1], k.shape[1]
    mask = sdpa_mask(batch_size=b, q_length=s, kv_length=t, q_offset=first, kv_offset=kv_offset,
                     allow_is_causal_skip=False, device=q.device)  # fmt: skip
    return transformers_indexer(hidden, weights_proj, q, k, softmax_scale, mask[:, 0])


@pytest.mark.parametrize("s", [1, 3, 20])  # 20: a prefill's tokens, the tiled kernel
def test_the_models_causal_mask_is_computed_in_the_kernel(s):
    """The mask's construction, its negation and the masked_fill go (the mask is never written);
    the scores bit-equal the keep-mask fold's and as eager's."""
    hidden, weights_proj, q, k, scale, _ = _inputs(s)
    first = torch.tensor(k.shape[1] - s - 2)  # the last 2 positions past every token
    args = (hidden, weights_proj, q, k, scale, first)
    out, report = compile_with(CAUSAL, indexer_with_the_models_mask, args)
    _assert_as_eager(out, indexer_with_the_models_mask(*args))
    assert report.final()["sparse_index_scores_causal"] == 1 and not report.rejected and not report.errors
    before, after = report.ops_before(), report.ops_after()
    assert before["aten.where.self"] >= 1 and "aten.where.self" not in after
    assert not {"aten.le.Tensor", "aten.bitwise_not.default", "prims.iota.default"} & set(after)
    assert after[OP] == 1
    keep_fold, _ = compile_with(FUSIONS, indexer_with_the_models_mask, args)
    assert torch.equal(out, keep_fold)


def test_a_mask_with_a_cache_offset_is_left_alone():
    """kv positions from an offset (a sliding window's cache): not arange(T); the matched literal
    is checked on the nodes and the site left to Inductor with the reason."""
    hidden, weights_proj, q, k, scale, _ = _inputs(1)
    args = (hidden, weights_proj, q, k, scale, torch.tensor(50), 5)
    out, report = compile_with(CAUSAL, indexer_with_the_models_mask, args)
    _assert_as_eager(out, indexer_with_the_models_mask(*args))
    assert report.final()["sparse_index_scores_causal"] == 0
    assert any("cache offset" in r.reason for r in report.rejected), report.rejected
    assert report.ops_after()["aten.where.self"] == report.ops_before()["aten.where.self"] >= 1
