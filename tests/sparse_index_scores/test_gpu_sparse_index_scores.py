"""CUDA: the indexer-scores kernels at DeepSeek V3.2's sizes (64 heads of 128, up to 16k cached
positions, bf16 q and cache; prefills of 300-1024 tokens through the tiled kernel) against the
reference and transformers' fp32 matmuls; a tiny DeepSeek V3.2 prefill with the tiled kernel; and a tiny
DeepSeek V3.2 decode step with a live index mask: the kernel launched per layer, the step's output
as the step's without the fusion within bf16 tolerance, at batch 1 too (where Inductor has turned
the batch-1 bmms into mm). Skipped without a GPU."""

from __future__ import annotations

import re

import pytest
import torch
from _gpu_decode import compile_step, prefill_side_by_side
from torch._inductor.utils import run_and_get_code

import fusion_passes
from fusion_passes.lowering.sparse_index_scores.reference import sparse_index_scores_reference
from fusion_passes.lowering.sparse_index_scores.triton import sparse_index_scores_triton
from fusion_passes.models import build_model
from fusion_passes.models.decode import DecodeStep
from fusion_passes.numerics import compare, tolerance
from fusion_passes.patterns.sparse_index_scores import transformers_index_scores

pytestmark = pytest.mark.gpu


# s above 16: a prefill's tokens, the tiled kernel
@pytest.mark.parametrize("batch,s,t", [(1, 1, 1040), (8, 1, 8200), (2, 3, 16400), (64, 1, 1000), (1, 1024, 1025),
                                       (2, 300, 777)])  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_real_sizes_against_reference_and_transformers(batch, s, t, dtype):
    g = torch.Generator(device="cuda").manual_seed(batch * t)
    q = torch.randn(batch, s, 64, 128, device="cuda", generator=g).to(dtype)
    k = torch.randn(batch, t, 128, device="cuda", generator=g).to(dtype)
    w = torch.randn(batch, s, 64, device="cuda", generator=g) * 64**-0.5
    out = sparse_index_scores_triton(q, k, w, 128**-0.5)
    for expected in (sparse_index_scores_reference(q, k, w, 128**-0.5), transformers_index_scores(q, k, w, 128**-0.5)):
        assert ((out - expected).abs().max() / expected.abs().max()).item() <= 1e-5


@pytest.mark.parametrize("batch", [1, 3])  # batch 1: the bmm_to_mm form a GPU graph holds
def test_decode_step_with_the_scores_fused(batch):
    torch._dynamo.reset()
    built = build_model("deepseek-v3.2", size="tiny", dtype=torch.bfloat16, layers=2, device="cuda")
    step = DecodeStep(built.module, batch=batch, context=8, steps=2)
    defaults = [f.name for f in fusion_passes.registry.get_fusions("all")]
    report = fusion_passes.Report()
    fused, codes = compile_step(step, fusion_passes.backend(defaults, report=report))
    # the base without the scores' op and the folds into it (which would enable it again)
    base, _ = compile_step(step, fusion_passes.backend([n for n in defaults if not n.startswith("sparse_index_scores")]))
    assert report.matches["sparse_index_scores"] == 2
    # the weights' upcast and scale folded into it at both layers
    assert report.final()["sparse_index_scores_weights"] == 2
    (code,) = codes
    assert len(re.findall(r"_index_scores_kernel_\d+\.run\(", code)) == 2
    step.restore()
    with torch.no_grad():
        got = [fused(*step.inputs(i)).clone() for i in range(2)]
        step.restore()
        want = [base(*step.inputs(i)).clone() for i in range(2)]
    for a, b in zip(got, want, strict=True):
        assert compare(a, b).rel_norm <= tolerance(torch.bfloat16).rel_norm


def test_prefill_with_the_scores_fused():
    """A tiny DeepSeek V3.2 prefill (40 tokens) with the defaults (sparse_index_scores_prefill among
    them): the tiled kernel launched per layer, the output as the prefill's without that fusion
    within bf16 tolerance."""
    report, code, got, want = prefill_side_by_side("deepseek-v3.2", "sparse_index_scores_prefill")
    assert report.matches["sparse_index_scores_prefill"] == 2 and report.final()["sparse_index_scores_weights"] == 2
    assert len(re.findall(r"_index_scores_tiled_kernel_\d+\.run\(", code)) == 2
    assert compare(got, want).rel_norm <= tolerance(torch.bfloat16).rel_norm


@pytest.mark.parametrize("s", [1, 20])
def test_the_models_causal_mask_in_the_kernel_on_cuda(s):
    """sparse_index_scores_causal on CUDA (direct launches): no mask kernel left, the scores
    bit-equal the keep-mask fold's."""
    from test_rewrite_index_scores_folds import CAUSAL, FUSIONS, _inputs, indexer_with_the_models_mask

    hidden, weights_proj, q, k, scale, _ = _inputs(s)
    args = [t.cuda() if isinstance(t, torch.Tensor) else t for t in (hidden, weights_proj, q, k, scale)]
    args.append(torch.tensor(k.shape[1] - s - 2, device="cuda"))
    outs = {}
    for name, fusions in (("causal", CAUSAL), ("keep", FUSIONS)):
        report = fusion_passes.Report()
        torch._dynamo.reset()
        fn = torch.compile(indexer_with_the_models_mask, backend=fusion_passes.backend(fusions, report=report))
        outs[name], (code,) = run_and_get_code(fn, *args)
        assert not report.errors
        if name == "causal":
            assert report.final()["sparse_index_scores_causal"] == 1
            assert not re.search(r"triton_\w*_le_", code.split("def call(")[-1])  # no kernel builds the mask
    assert torch.equal(outs["causal"], outs["keep"])
