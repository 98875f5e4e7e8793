"""Real models (transformers' own modeling code, tiny random-weight configs): every RMSNorm site
rewritten, LayerNorms left alone, and outputs equal to eager and to stock Inductor."""

from __future__ import annotations

import pytest
import torch

from _compiled_models import compiled_model
from _params import models

from fusion_passes.models import MODEL_NAMES
from fusion_passes.numerics import compare, tolerance

# The Qwen3-Next / Qwen 3.5 linear-attention layers normalise with RMSNormGated: its norm is the
# Llama form (fused as rms_norm), its SiLU gate stays an Inductor op.
CASES = [(name, torch.bfloat16) for name in MODEL_NAMES] + [
    ("deepseek-v3.2", torch.float32),
    ("qwen3.5-moe", torch.float16),
]
# Compiling a tiny model takes 5-50 s on 2 cores: stock Inductor is compiled for two of them.
AGAINST_STOCK_INDUCTOR = {("qwen3.5", torch.bfloat16), ("deepseek-v3.2", torch.bfloat16)}
# By default (CI) one model, whose compile test_models_qk_norm_rope shares; the others are slow.
DEFAULT = ("qwen3", torch.bfloat16)


def _rel_norm_error(actual, expected):
    return compare(actual, expected).rel_norm


@pytest.mark.parametrize("name,dtype", models(CASES, DEFAULT))
def test_every_rms_norm_site_is_fused(name, dtype):
    compiled = compiled_model(name, dtype)
    built, report, fused, expected = compiled.built, compiled.report, compiled.fused, compiled.expected
    module, inputs, sites = built.module, built.example_inputs, built.sites
    if (name, dtype) in AGAINST_STOCK_INDUCTOR:
        with torch.no_grad():
            torch._dynamo.reset()
            stock = torch.compile(module, backend="inductor", fullgraph=True)(*inputs)

    norm_sites = set(sites.rms_norm) | set(sites.gated_rms_norm)
    assert report.matches["add_rms_norm"] == sites.add_rms_norm
    assert report.matches["rms_norm"] == len(norm_sites) - sites.add_rms_norm
    norm_fused = {s.module for s in report.sites if s.fusion in ("rms_norm", "add_rms_norm")}
    assert norm_fused == norm_sites
    assert not set(sites.layer_norm) & norm_fused
    assert not report.errors and not report.rejected
    # Every norm a region consumed has lost its rsqrt, and the V3.2 indexer keys' LayerNorm rsqrt
    # with their RoPE, and the chunked delta rule's q / k L2 norms (two rsqrt per GDN layer); the
    # standalone norms were lowered back (their rsqrt is Inductor's again).
    lowered = report.lowered_back()
    standalone = lowered["fusion_passes.rms_norm.default"] + lowered["fusion_passes.add_rms_norm.default"]
    assert set(lowered) <= {"fusion_passes.rms_norm.default", "fusion_passes.add_rms_norm.default"}
    removed = report.ops_before()["aten.rsqrt.default"] - report.ops_after()["aten.rsqrt.default"]
    l2norms = 2 * report.matches["chunk_gated_delta_rule"]
    assert removed == len(norm_sites) - standalone + report.matches["mla_indexer_k_norm_rope"] + l2norms

    bound = tolerance(dtype).rel_norm
    ours = _rel_norm_error(fused, expected)
    assert ours <= bound, f"fusion_passes vs eager: {ours:.3g} > {bound}"
    if (name, dtype) in AGAINST_STOCK_INDUCTOR:
        # Reproducing each spelling's rounding keeps us at least as close to eager as Inductor.
        theirs = _rel_norm_error(stock, expected)
        assert ours <= theirs * 1.5, (ours, theirs)
