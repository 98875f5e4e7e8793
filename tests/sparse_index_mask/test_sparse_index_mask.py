"""The DeepSeek sparse-attention index mask where top-k takes every cached position: rewritten to
all False (bit-equal to eager's scatter for any scores, ties and NaN included); left alone where
the mask is live (k < T), along another dim, or into a mask of another shape. On the real
DeepseekV32 attention: a decode step whose cache fits in index_topk drops the indexer's top-k,
scatter and score GEMMs, its output as eager's."""

from __future__ import annotations

import pytest
import torch

import fusion_passes
from _rewrites import compile_with, decode_steps, defaults_without
from fusion_passes.models import build_model
from fusion_passes.models.decode import DecodeStep
from fusion_passes.numerics import compare, tolerance

FUSION = ["sparse_index_mask_all"]


def transformers_mask(index_scores, attention_mask, index_topk):
    """transformers' DeepseekV32 indexer tail and attention (sdpa path), as it writes them."""
    b, s, t = index_scores.shape
    topk = min(index_topk, index_scores.shape[-1])
    topk_indices = index_scores.topk(topk, dim=-1).indices.to(torch.int32)
    index_mask = topk_indices.new_ones((b, s, t), dtype=torch.bool).scatter(-1, topk_indices.long(), False).unsqueeze(1)
    return attention_mask & ~index_mask


def along_dim_1(index_scores, attention_mask, index_topk):
    """A top-k over the tokens and a scatter along them: not the pattern (another dim)."""
    idx = index_scores.topk(index_scores.shape[1], dim=1).indices
    return attention_mask & ~torch.ones_like(attention_mask[:, 0]).scatter(1, idx, False).unsqueeze(1)


def _compile(fn, *args):
    report = fusion_passes.Report()
    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(fn, backend=fusion_passes.backend(FUSION, report=report), fullgraph=True)(*args)
    return out, report


def _inputs(t: int, ties: bool = False):
    g = torch.Generator().manual_seed(t)
    scores = torch.randn(3, 2, t, generator=g)
    if ties:  # ties, -inf (masked positions) and a NaN: the indices stay a permutation
        scores[..., : t // 2] = 0.5
        scores[..., -3:] = float("-inf")
        scores[0, 0, 1] = float("nan")
    causal = torch.rand(3, 1, 2, t, generator=g) > 0.3
    return scores, causal


@pytest.mark.parametrize("t,ties", [(37, False), (64, True)])
def test_top_k_over_every_position_is_all_false(t, ties):
    scores, causal = _inputs(t, ties)
    expected = transformers_mask(scores, causal, 2048)
    out, report = _compile(transformers_mask, scores, causal, 2048)
    assert torch.equal(out, expected)
    assert report.final()["sparse_index_mask_all"] == 1
    before, after = report.ops_before(), report.ops_after()
    assert (before["aten.topk.default"], after["aten.topk.default"]) == (1, 0)
    assert (before["aten.scatter.value"], after["aten.scatter.value"]) == (1, 0)


def test_a_live_mask_is_left_alone():
    scores, causal = _inputs(37)
    out, report = _compile(transformers_mask, scores, causal, 8)  # top-8 of 37: live
    assert torch.equal(out, transformers_mask(scores, causal, 8))
    assert report.final()["sparse_index_mask_all"] == 0
    assert not report.rejected  # the sparse attention at work: no site, no report entry
    assert report.ops_after() == report.ops_before() and report.ops_after()["aten.scatter.value"] == 1


def test_another_dim_is_not_the_pattern():
    g = torch.Generator().manual_seed(5)
    scores = torch.randn(3, 5, 2, generator=g)  # top-k over dim 1 (all 5), scattered along it
    causal = torch.rand(3, 1, 5, 2, generator=g) > 0.3
    out, report = _compile(along_dim_1, scores, causal, 0)
    assert torch.equal(out, along_dim_1(scores, causal, 0))
    assert report.matches["sparse_index_mask_all"] == 0 and not report.rejected
    assert report.ops_after() == report.ops_before() and report.ops_after()["aten.scatter.value"] == 1


def test_deepseek_v32_decode_within_index_topk_drops_the_indexer_selection():
    built = build_model("deepseek-v3.2", size="tiny", dtype=torch.bfloat16, layers=2)
    indexers = [m for m in built.module.modules() if hasattr(m, "index_topk")]
    assert len(indexers) == 2
    for m in indexers:  # the tiny config's index_topk (4) keeps its mask live; a real one (2048) is not
        m.index_topk = 64
    step = DecodeStep(built.module, batch=2, context=8, steps=1)
    report = fusion_passes.Report()
    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(step, backend=fusion_passes.backend(report=report), fullgraph=True)(*step.inputs(0))
        step.restore()
        expected = step(*step.inputs(0))
    assert report.final()["sparse_index_mask_all"] == 2
    before, after = report.ops_before(), report.ops_after()
    assert (before["aten.scatter.value"], after["aten.scatter.value"]) == (2, 0)
    # the indexers' top-k go, and so do the MoE router's (3 per layer with experts: 1 here), which
    # moe_route_grouped_one_group takes
    assert (before["aten.topk.default"], after["aten.topk.default"]) == (5, 0)
    assert report.final()["moe_route_grouped_one_group"] == 1
    assert compare(out, expected).rel_norm <= tolerance(torch.bfloat16).rel_norm


LIVE = ["sparse_index_mask_all", "sparse_index_mask_topk"]


@pytest.mark.parametrize("t,k", [(37, 8), (64, 63)])
def test_a_live_mask_is_one_kernel_when_enabled(t, k):
    scores, causal = _inputs(t)
    report = fusion_passes.Report()
    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(transformers_mask, backend=fusion_passes.backend(LIVE, report=report), fullgraph=True)(
            scores, causal, k
        )
    assert torch.equal(out, transformers_mask(scores, causal, k))  # randn scores: no ties
    assert (report.final()["sparse_index_mask_all"], report.final()["sparse_index_mask_topk"]) == (0, 1)
    before, after = report.ops_before(), report.ops_after()
    assert (before["aten.topk.default"], after["aten.topk.default"]) == (1, 0)
    assert (before["aten.scatter.value"], after["aten.scatter.value"]) == (1, 0)
    assert after["fusion_passes.sparse_index_mask.default"] == 1


def test_every_position_stays_the_constant_mask_with_both_enabled():
    scores, causal = _inputs(37)
    report = fusion_passes.Report()
    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(transformers_mask, backend=fusion_passes.backend(LIVE, report=report), fullgraph=True)(
            scores, causal, 2048
        )
    assert torch.equal(out, transformers_mask(scores, causal, 2048))
    assert (report.final()["sparse_index_mask_all"], report.final()["sparse_index_mask_topk"]) == (1, 0)
    assert report.ops_after()["fusion_passes.sparse_index_mask.default"] == 0


@pytest.mark.slow  # two whole-model compiles
def test_deepseek_v32_decode_with_a_live_index_mask():
    """The tiny config's index_topk (4) keeps 4 of the cache's 10 positions: the mask is live. With
    the kernel (a default) the step computes what the step without it computes, bit for bit (its
    index scores tie nowhere at the 4th place); the tiny model's routing makes both differ from
    eager by more than bf16's tolerance, so eager is not the yardstick here."""
    built = build_model("deepseek-v3.2", size="tiny", dtype=torch.bfloat16, layers=2)
    step = DecodeStep(built.module, batch=2, context=8, steps=2)
    runs = {}
    # without the kernel (and the fusions starting from its op); with the defaults, which write the
    # additive mask by it from the step's first position (sparse_attention_mask_causal)
    for name, fusions in (("without", defaults_without("sparse_index_mask_topk")), ("live", "all")):
        report = fusion_passes.Report()
        torch._dynamo.reset()
        compiled = torch.compile(step, backend=fusion_passes.backend(fusions, report=report), fullgraph=True)
        with torch.no_grad():
            step.restore()
            runs[name] = ([compiled(*step.inputs(i)).clone() for i in range(2)], report)
    report = runs["live"][1]
    assert (report.final()["sparse_index_mask_all"], report.matches["sparse_index_mask_topk"]) == (0, 2)
    # the SDPA's additive mask written by the kernel, the causal mask compared there, not read
    assert (report.final()["sparse_attention_mask"], report.final()["sparse_attention_mask_causal"]) == (0, 2)
    before, after = report.ops_before(), report.ops_after()
    assert (before["aten.scatter.value"], after["aten.scatter.value"]) == (2, 0)
    # the indexers' two, and the MoE router's three, which moe_route_grouped_one_group takes
    assert (before["aten.topk.default"], after["aten.topk.default"]) == (5, 0)
    assert after["fusion_passes.sparse_attention_mask.default"] == 2
    assert (before["aten.bitwise_and.Tensor"], after["aten.bitwise_and.Tensor"]) == (2, 0)
    assert all(torch.equal(a, b) for a, b in zip(runs["live"][0], runs["without"][0], strict=True))


ADDITIVE = ["sparse_index_mask_all", "sparse_index_mask_topk", "sparse_attention_mask"]


def transformers_sdpa_mask(index_scores, attention_mask, index_topk, q, kv):
    """The same, then SDPA through the boolean mask (which it makes additive in q's dtype)."""
    mask = transformers_mask(index_scores, attention_mask, index_topk)
    return torch.nn.functional.scaled_dot_product_attention(q, kv, kv, attn_mask=mask)


def cudnn_bias(index_scores, attention_mask, index_topk, q, kv):
    """The same mask made additive as SDPA's cuDNN path does (convert_boolean_attn_mask_cudnn: a
    bias of -65504, not -inf), then SDPA through the bias."""
    mask = transformers_mask(index_scores, attention_mask, index_topk)
    bias = torch.where(mask.logical_not(), -65504.0, torch.scalar_tensor(0.0, dtype=q.dtype))
    return torch.nn.functional.scaled_dot_product_attention(q, kv, kv, attn_mask=bias)


def eager_float_mask(index_scores, attention_mask, index_topk, q, kv):
    """transformers' eager attention path: a float mask, the dropped positions at finfo.min."""
    b, s, t = index_scores.shape
    idx = index_scores.topk(index_topk, dim=-1).indices.to(torch.int32)
    index_mask = idx.new_ones((b, s, t), dtype=torch.bool).scatter(-1, idx.long(), False).unsqueeze(1)
    mask = torch.where(attention_mask, 0.0, torch.finfo(q.dtype).min).to(q.dtype)
    return torch.softmax(q @ kv.transpose(-1, -2) + mask.masked_fill(index_mask, torch.finfo(q.dtype).min), -1) @ kv


def _sdpa_inputs(t, dtype, broadcast=True):
    scores, causal = _inputs(t)
    if broadcast:  # sdpa_mask's causal mask: one row set, expanded over the batch
        causal = causal[:1].expand(3, 1, 2, t)
    g = torch.Generator().manual_seed(t + 1)
    q, kv = torch.randn(3, 4, 2, 16, generator=g).to(dtype), torch.randn(3, 4, t, 16, generator=g).to(dtype)
    return scores, causal, 8, q, kv


@pytest.mark.parametrize("spelling", [transformers_sdpa_mask, cudnn_bias])
@pytest.mark.parametrize("dtype,broadcast", [(torch.bfloat16, True), (torch.float32, False), (torch.float16, True)])
def test_the_sdpa_mask_is_written_by_the_kernel(dtype, broadcast, spelling):
    args = _sdpa_inputs(37, dtype, broadcast)
    out, report = compile_with(ADDITIVE, spelling, args)
    torch.testing.assert_close(out, spelling(*args))
    assert report.matches["sparse_index_mask_topk"] == 1 and report.final()["sparse_attention_mask"] == 1
    before, after = report.ops_before(), report.ops_after()
    assert (before["aten.bitwise_and.Tensor"], after["aten.bitwise_and.Tensor"]) == (1, 0)
    assert (before["aten.bitwise_not.default"], after["aten.bitwise_not.default"]) == (1, 0)
    assert after["fusion_passes.sparse_attention_mask.default"] == 1
    assert after["fusion_passes.sparse_index_mask.default"] == 0


def test_the_eager_paths_float_mask_is_left_alone():
    args = _sdpa_inputs(37, torch.float32)
    out, report = compile_with(ADDITIVE, eager_float_mask, args)
    torch.testing.assert_close(out, eager_float_mask(*args))
    assert report.final()["sparse_index_mask_topk"] == 1 and report.matches["sparse_attention_mask"] == 0
    before, after = report.ops_before(), report.ops_after()
    assert (before["aten.topk.default"], after["aten.topk.default"]) == (1, 0)
    assert after["fusion_passes.sparse_index_mask.default"] == 1 and after["fusion_passes.sparse_attention_mask.default"] == 0


def test_a_prefills_mask_is_left_to_the_prefill_attention():
    """More than 16 query tokens: the mask stays boolean, for masked_prefill_attention's kernel."""
    g = torch.Generator().manual_seed(3)
    scores, causal = torch.randn(3, 20, 37, generator=g), torch.rand(3, 1, 20, 37, generator=g) > 0.3
    q, kv = torch.randn(3, 4, 20, 16, generator=g), torch.randn(3, 4, 37, 16, generator=g)
    args = (scores, causal, 8, q, kv)
    out, report = compile_with(ADDITIVE, transformers_sdpa_mask, args)
    torch.testing.assert_close(out, transformers_sdpa_mask(*args))
    assert report.final()["sparse_index_mask_topk"] == 1 and report.matches["sparse_attention_mask"] == 0
    assert not report.rejected
    before, after = report.ops_before(), report.ops_after()
    assert (before["aten.bitwise_and.Tensor"], after["aten.bitwise_and.Tensor"]) == (1, 1)  # the boolean mask stays
    assert after["fusion_passes.sparse_index_mask.default"] == 1 and after["fusion_passes.sparse_attention_mask.default"] == 0


CAUSAL = [*ADDITIVE, "sparse_attention_mask_causal"]


def step_mask_sdpa(index_scores, cache_position, index_topk, q, kv, kv_offset=0):
    """A decode step as transformers writes it: masking_utils.sdpa_mask's causal mask from the
    cache position (a full static cache: no kv offset), the index mask dropped from it, SDPA."""
    from transformers.masking_utils import sdpa_mask

    b, s, t = index_scores.shape
    attention_mask = sdpa_mask(b, s, t, q_offset=cache_position[0], kv_offset=kv_offset,
                               allow_is_causal_skip=False, device=index_scores.device)  # fmt: skip
    mask = transformers_mask(index_scores, attention_mask, index_topk)
    return torch.nn.functional.scaled_dot_product_attention(q, kv, kv, attn_mask=mask)


@pytest.mark.parametrize("dtype,s", [(torch.bfloat16, 1), (torch.float32, 2), (torch.float16, 1)])
def test_the_causal_mask_is_compared_in_the_kernel(dtype, s):
    """The step's causal mask, built by transformers' own sdpa_mask, is not built at all: the op
    takes the first position and compares each key's with it (the op then takes the mask's place)."""
    g = torch.Generator().manual_seed(s)
    t = 37
    scores = torch.randn(3, s, t, generator=g)
    q, kv = torch.randn(3, 4, s, 16, generator=g).to(dtype), torch.randn(3, 4, t, 16, generator=g).to(dtype)
    args = (scores, torch.tensor([30]), 8, q, kv)
    out, report = compile_with(CAUSAL, step_mask_sdpa, args)
    torch.testing.assert_close(out, step_mask_sdpa(*args))
    assert report.matches["sparse_attention_mask"] == 1 and report.final()["sparse_attention_mask_causal"] == 1
    before, after = report.ops_before(), report.ops_after()
    assert (before["aten.le.Tensor"], after["aten.le.Tensor"]) == (1, 0)
    assert (before["prims.iota.default"], after["prims.iota.default"]) == (2, 0)
    assert after["fusion_passes.sparse_attention_mask.default"] == 1


def test_a_causal_mask_with_a_cache_offset_is_read_not_recomputed():
    """A kv offset (a sliding window's cache) is not the full cache's causal mask: the op keeps
    reading the mask, and the report says why."""
    g = torch.Generator().manual_seed(5)
    scores = torch.randn(3, 1, 37, generator=g)
    q, kv = torch.randn(3, 4, 1, 16, generator=g), torch.randn(3, 4, 37, 16, generator=g)
    args = (scores, torch.tensor([30]), 8, q, kv, 4)
    out, report = compile_with(CAUSAL, step_mask_sdpa, args)
    torch.testing.assert_close(out, step_mask_sdpa(*args))
    assert report.final()["sparse_attention_mask"] == 1 and report.final()["sparse_attention_mask_causal"] == 0
    assert any("cache offset" in r.reason for r in report.rejected if r.fusion == "sparse_attention_mask_causal")
    before, after = report.ops_before(), report.ops_after()
    assert (before["aten.le.Tensor"], after["aten.le.Tensor"]) == (1, 1)


@pytest.mark.slow  # two whole-model compiles
def test_deepseek_v32_decode_causal_attention_mask_from_the_position():
    """A tiny DeepSeek V3.2 decode step with a live index mask: with the causal fold (and the
    indexer's, which reads the same mask) no causal mask is built, and the outputs and caches
    equal the step with the mask read, bit for bit, over 2 steps."""
    built = build_model("deepseek-v3.2", size="tiny", dtype=torch.bfloat16, layers=2)
    step = DecodeStep(built.module, batch=2, context=8, steps=2)
    read, _ = decode_steps(step, ["all", "sparse_attention_mask"])
    folded, report = decode_steps(step, ["all", "sparse_attention_mask_causal", "sparse_index_scores_causal"])
    assert report.final()["sparse_attention_mask_causal"] == 2 and report.final()["sparse_index_scores_causal"] == 2
    before, after = report.ops_before(), report.ops_after()
    assert before["aten.le.Tensor"] >= 1 and after["aten.le.Tensor"] == 0
    assert all(torch.equal(a, b) for a, b in zip(folded, read, strict=True))
