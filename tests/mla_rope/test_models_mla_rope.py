"""Real DeepSeek V3 / V3.2 models (transformers' own modeling code, tiny random-weight configs):
every attention layer's pre-attention path fused (MLA kv and q branches; the V3.2 indexer's key and
query), and the output equal to eager within the dtype's tolerance. One compile per case, shared with the
other model tests."""

from __future__ import annotations

import pytest
import torch

from _compiled_models import compiled_model
from _rewrites import decode_steps, defaults_without

import fusion_passes
from fusion_passes.numerics import compare, tolerance

# (model, dtype, rope_interleave): the tiny configs interleave (as the published ones do); V3 also
# runs with rope_interleave=False (apply_rotary_pos_emb), which V3.2's MLA does not support.
CASES = [
    ("deepseek-v3", torch.bfloat16, True),
    ("deepseek-v3", torch.bfloat16, False),
    ("deepseek-v3.2", torch.bfloat16, True),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    "name,dtype,interleave", CASES, ids=[f"{n}-{str(d)[6:]}-{'il' if i else 'rh'}" for n, d, i in CASES]
)
def test_every_attention_pre_path_is_fused(name, dtype, interleave):
    # The tiny configs interleave: that case shares the default compile of the other model tests.
    compiled = compiled_model(name, dtype, None if interleave else False)
    built, report, fused, expected = compiled.built, compiled.report, compiled.fused, compiled.expected
    sites = built.sites

    attention = set(sites.attention)
    assert len(attention) == built.config.num_hidden_layers
    kv = "mla_kv_norm_rope" if interleave else "mla_kv_norm_rope_rotate_half"
    merge = "mla_q_kv_rope" if interleave else "mla_q_kv_rope_rotate_half"
    expected_matches = {kv: len(attention), "mla_q_rope": len(attention), merge: len(attention)}
    if name == "deepseek-v3.2":
        expected_matches |= {"mla_indexer_k_norm_rope": len(attention), "mla_indexer_q_rope": len(attention)}
    assert {k: v for k, v in report.matches.items() if k.startswith("mla_") and v} == expected_matches
    for fusion in expected_matches:
        # A site is named by its first output's module (the kv site by kv_a_layernorm's): one
        # site inside each attention module (inside each indexer for the indexer fusions).
        scope = ".indexer" if "indexer" in fusion else ""
        owners = sorted(
            a for s in report.sites_of(fusion) for a in attention
            if s.module == a + scope or s.module.startswith(a + scope + ".")
        )  # fmt: skip
        assert owners == sorted(attention), (fusion, [s.module for s in report.sites_of(fusion)])
    assert not report.errors and not report.rejected
    after = report.ops_after()
    # The two MLA ops of each layer merged into one launch (a tiny prompt is a decode size).
    assert after["fusion_passes.mla_q_kv_rope.default"] == len(attention)
    assert "fusion_passes.mla_kv_norm_rope.default" not in after
    # The cats of every RoPE and of every query assembly are inside the fused ops: per layer, MLA
    # q's rope and query cats and k_pe's rope cat; the indexer's rope + reassembly cats of q and k.
    cats_per_layer = 3 + (4 if name == "deepseek-v3.2" else 0)
    removed = report.ops_before()["aten.cat.default"] - after["aten.cat.default"]
    assert removed == cats_per_layer * len(attention)

    result = compare(fused, expected)
    assert result.rel_norm <= tolerance(dtype).rel_norm, result


@pytest.mark.slow
def test_q_and_kv_branches_merge_into_one_launch_per_layer():
    """mla_q_kv_rope on DeepSeek V3: one op per attention layer in place of its q and kv ops, and
    the model's output equal bit for bit to the compile without the merge (the merged op is the
    two ops' math side by side)."""
    two_launches = compiled_model("deepseek-v3", torch.bfloat16, opt_out=("mla_q_kv_rope",))
    merged = compiled_model("deepseek-v3", torch.bfloat16)
    layers = len(set(merged.built.sites.attention))
    report = merged.report
    assert report.matches["mla_q_kv_rope"] == layers
    assert not report.errors and not report.rejected
    before, after = report.ops_before(), report.ops_after()
    assert after["fusion_passes.mla_q_kv_rope.default"] == layers
    # Per layer: the q rope, query and k_pe rope cats, inside the one op now as before in two.
    assert before["aten.cat.default"] - after["aten.cat.default"] == 3 * layers
    assert not {"fusion_passes.mla_q_rope.default", "fusion_passes.mla_kv_norm_rope.default"} & set(after)
    assert two_launches.report.ops_after()["fusion_passes.mla_kv_norm_rope.default"] == layers
    assert torch.equal(merged.fused, two_launches.fused)


@pytest.mark.slow  # four whole-model compiles
def test_deepseek_v32_decode_writes_its_caches_in_the_kernels():
    """A real decode step on transformers' StaticCache with the cache-write fusions: each layer's
    indexer key goes into the indexer cache (mla_indexer_k_norm_rope_cache) in the launch of the
    indexer's query (mla_indexer_qk_rope_cache), and its key and value into the KV cache through
    one mla_kv_cache_write (every cache write's index_put gone), and the indexer scores' causal
    mask is computed in their kernel; every step's output and every cache tensor equal the default
    fusions' bit for bit. Merged further (mla_indexer_qk_rope_kv_cache: the indexer's launch and
    the KV cache write in one; cache_lengths: the four counters in one kernel), the same bits."""
    from fusion_passes.models import build_model
    from fusion_passes.models.decode import DecodeStep

    built = build_model("deepseek-v3.2", size="tiny", dtype=torch.bfloat16, layers=2)
    step = DecodeStep(built.module, batch=2, context=8, steps=2)
    folds = ["mla_indexer_k_norm_rope_cache", "mla_kv_cache_write", "mla_indexer_qk_rope_cache", "sparse_index_scores_causal"]
    # the steps built up from the defaults without the decode folds (all of them defaults now)
    before = defaults_without(*folds, "cache_lengths")
    merged = [*before, *folds, "mla_indexer_qk_rope_kv_cache", "cache_lengths"]
    runs = {name: decode_steps(step, fusions)
            for name, fusions in (("defaults", before), ("cache", [*before, *folds]), ("merged", merged),
                                  ("regrouped", [*merged, "mla_decode_regroup"]))}  # fmt: skip
    assert set(runs["regrouped"][1].final()) >= {f.name for f in fusion_passes.registry.get_fusions("all")}
    report = runs["cache"][1]
    # the key's cache fold is merged on with the indexer's query: its op is gone from the final graph
    final = report.final()
    assert (final["mla_indexer_qk_rope_cache"], final["mla_kv_cache_write"], report.matches["mla_indexer_k_norm_rope_cache"]) == (2, 2, 2)
    assert final["sparse_index_scores_causal"] == 2  # the indexer's causal masked_fill, in the scores kernel
    assert not report.errors
    after = report.ops_after()
    assert after["fusion_passes.mla_indexer_qk_rope.default"] == 2 and after["fusion_passes.mla_kv_cache_write.default"] == 2
    assert not {"fusion_passes.mla_indexer_k_norm_rope.default", "fusion_passes.mla_indexer_k_norm_rope_cache.default",
                "fusion_passes.mla_q_rope.default"} & set(after)  # fmt: skip
    # per layer the defaults keep three cache writes (key, value, indexer key); none is left
    assert runs["defaults"][1].ops_after()["aten.index_put.default"] == 6 and "aten.index_put.default" not in after
    assert report.ops_before()["aten.index_put.default"] == runs["defaults"][1].ops_before()["aten.index_put.default"]
    for ours, theirs in zip(runs["cache"][0], runs["defaults"][0], strict=True):
        assert torch.equal(ours, theirs)
    report = runs["merged"][1]
    final, after = report.final(), report.ops_after()
    assert (final["mla_indexer_qk_rope_kv_cache"], final["cache_lengths"]) == (2, 1) and not report.errors
    assert (final["mla_indexer_qk_rope_cache"], final["mla_kv_cache_write"]) == (0, 0)  # taken by the merge
    assert after["fusion_passes.mla_indexer_qk_rope_kv_cache.default"] == 2
    assert not {"fusion_passes.mla_indexer_qk_rope.default", "fusion_passes.mla_kv_cache_write.default"} & set(after)
    assert after["fusion_passes.advance_lengths.default"] == 1
    for ours, theirs in zip(runs["merged"][0], runs["defaults"][0], strict=True):
        assert torch.equal(ours, theirs)
    # regrouped: q_a_layernorm with the kv branch before the up-projections, MLA's query with the
    # indexer and the KV write after them: two launches where there were three
    report = runs["regrouped"][1]
    final, after = report.final(), report.ops_after()
    assert final["mla_decode_regroup"] == 2 and final["mla_indexer_qk_rope_kv_cache"] == 0 and not report.errors
    assert after["fusion_passes.mla_q_a_kv_norm_rope.default"] == 2 and after["fusion_passes.mla_q_indexer_kv_cache.default"] == 2
    assert not {"fusion_passes.mla_q_kv_rope.default", "fusion_passes.mla_indexer_qk_rope_kv_cache.default"} & set(after)
    # q_a's norm is now the kv branch's norm rows, not Inductor's kernel of the reference: the
    # bits may differ, within bf16's tolerance of the defaults' step (outputs and every cache)
    for ours, theirs in zip(runs["regrouped"][0], runs["defaults"][0], strict=True):
        if ours.is_floating_point():
            assert compare(ours, theirs).ok, compare(ours, theirs)
        else:  # the write counters
            assert torch.equal(ours, theirs)
