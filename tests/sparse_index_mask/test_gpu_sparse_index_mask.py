"""CUDA: the index-mask kernel at DeepSeek V3.2's sizes (index_topk 2048 of up to 16k cached
positions) against the reference and against torch's CUDA top-k + scatter, ties included (the
reference's claim: torch's CUDA top-k keeps the lowest positions among scores equal to the k-th),
with a row in one program or split over several that sum their histograms;
and a tiny DeepSeek V3.2 decode step with the opt-in fusion: the kernel launched per layer, the
output bit-equal to the default fusions' step. Skipped without a GPU (run on the GPU machine)."""

from __future__ import annotations

import re

import pytest
import torch
from _gpu_decode import compile_step

import fusion_passes
from fusion_passes.lowering.sparse_index_mask.reference import sparse_index_mask_reference
from fusion_passes.lowering.sparse_index_mask.triton import sparse_index_mask_triton
from fusion_passes.models import build_model
from fusion_passes.models.decode import DecodeStep

pytestmark = pytest.mark.gpu


def _topk_scatter(scores, k):
    idx = scores.topk(k, dim=-1).indices
    return torch.ones(scores.shape, dtype=torch.bool, device=scores.device).scatter(-1, idx, False)


# (rows, positions, programs a row: None the launcher's choice); rows x programs within 132 SMs
CASES = [(1, 1040, None), (1, 1040, 3), (8, 4100, None), (8, 4100, 1), (8, 4100, 16), (64, 8200, None),
         (64, 8200, 1), (2, 16400, None), (2, 16400, 3), (2, 16400, 16), (1, 8208, None), (1, 8208, 16)]  # fmt: skip


@pytest.mark.parametrize("rows,t,split", CASES)
@pytest.mark.parametrize("ties", [False, True])
def test_real_sizes_against_reference_and_torch_top_k(rows, t, split, ties):
    g = torch.Generator(device="cuda").manual_seed(rows * t)
    scores = torch.randn(rows, 1, t, device="cuda", generator=g)
    if ties:  # relu'd, coarse scores: the k-th place is a tie
        scores = scores.clamp_min(0).round(decimals=1)
    scores[..., -5:] = float("-inf")
    k = min(2048, t - 5)
    mask = sparse_index_mask_triton(scores, k, split=split)
    assert torch.equal(mask, sparse_index_mask_reference(scores, k))
    assert torch.equal(mask, _topk_scatter(scores, k))


def test_decode_step_with_a_live_index_mask():
    torch._dynamo.reset()
    built = build_model("deepseek-v3.2", size="tiny", dtype=torch.bfloat16, layers=2, device="cuda")
    step = DecodeStep(built.module, batch=3, context=8, steps=2)
    defaults = [f.name for f in fusion_passes.registry.get_fusions("all")]
    report = fusion_passes.Report()
    live, codes = compile_step(step, fusion_passes.backend(defaults, report=report))
    base, _ = compile_step(step, fusion_passes.backend([n for n in defaults if n != "sparse_index_mask_topk"]))
    assert report.final()["sparse_index_mask_topk"] == 2
    (code,) = codes
    assert len(re.findall(r"_index_mask_kernel_\d+\.run\(", code)) == 2
    step.restore()
    with torch.no_grad():
        got = [live(*step.inputs(i)).clone() for i in range(2)]
        step.restore()
        want = [base(*step.inputs(i)).clone() for i in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
