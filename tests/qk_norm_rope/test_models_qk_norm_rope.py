"""Real models (transformers' modeling code, tiny random-weight configs): every full-attention
layer's QK-norm + RoPE path fused into one qk_norm_rope call, outputs equal to eager."""

from __future__ import annotations

import pytest
import torch

from _compiled_models import compiled_model
from _params import models

from fusion_passes.numerics import compare, tolerance
from fusion_passes.patterns.qk_norm_rope import FAMILY

EXPECTED = {  # model: the fusion its attention spelling maps to (per-head norm or whole row)
    "qwen3": "qk_norm_rope",
    "qwen3-moe": "qk_norm_rope",
    "qwen3-next": "qk_norm_rope",
    "qwen3.5": "qk_norm_rope",
    "qwen3.5-moe": "qk_norm_rope",
    "minimax-m2": "qk_norm_rope_whole_row",
}
RAISED_BY = {  # model: the rope raise fusion of its RoPE spelling (full or partial rotary)
    "qwen3": "rope", "qwen3-moe": "rope", "qwen3-next": "rope_partial", "qwen3.5": "rope_partial",
    "qwen3.5-moe": "rope_partial", "minimax-m2": "rope_partial",
}  # fmt: skip
# One compile per model (5-50 s each on 2 cores, shared with the other model tests): bf16,
# and fp32 for one. By default (CI) Qwen3's, whose compile test_models_fusion shares; the others
# are slow.
CASES = [(name, torch.bfloat16) for name in EXPECTED] + [("minimax-m2", torch.float32)]
DEFAULT = ("qwen3", torch.bfloat16)


@pytest.mark.parametrize("name,dtype", models(CASES, DEFAULT))
def test_every_attention_prelude_is_fused(name, dtype):
    compiled = compiled_model(name, dtype)
    report, fused, expected, sites = compiled.report, compiled.fused, compiled.expected, compiled.built.sites
    assert sites.attention
    fusion = EXPECTED[name]
    assert {f: report.matches[f] for f in FAMILY if report.matches[f]} == {
        fusion: len(sites.attention)
    }
    fused_modules = {s.module for s in report.sites if s.fusion == fusion}
    assert fused_modules == set(sites.attention), (fused_modules, sites.attention)
    assert not report.errors and not report.rejected
    # q's and k's RoPE raised to rope ops, every one consumed by the region (none lowered back).
    assert report.matches[RAISED_BY[name]] == 2 * len(sites.attention)
    assert "fusion_passes.rope.default" not in report.lowered_back()
    after = report.ops_after()
    assert after["fusion_passes.qk_norm_rope.default"] == len(sites.attention)
    # rotate_half's negations (q and k) are gone from every attention layer, and the SiLU's
    # (its sigmoid's exp(-x)) from every Gated DeltaNet conv the conv fusions took.
    removed = report.ops_before()["aten.neg.default"] - after["aten.neg.default"]
    convs = sum(n for f, n in report.matches.items() if f.startswith("causal_conv1d"))
    assert removed == 2 * len(sites.attention) + convs
    ours = compare(fused, expected).rel_norm
    assert ours <= tolerance(dtype).rel_norm, ours
