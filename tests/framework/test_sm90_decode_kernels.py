"""A tiny DeepSeek V3.2 decode step as Inductor writes it for sm_90 (tools/sm90_kernels, in a
process of its own: it answers CUDA's queries as an H200's for the whole process): with the
decode-path opt-ins, the launches the folds remove are gone from the generated code, a layer's
pre-attention path is four launches, the MoE dispatch is one kernel, and fewer than half of stock
Inductor's "other" kernels a layer are left."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

OPT_IN = ["mla_indexer_qk_rope_cache", "mla_kv_cache_write", "sparse_index_scores_causal", "sparse_attention_mask",
          "sparse_attention_mask_causal", "cache_lengths", "mla_indexer_qk_rope_kv_cache", "mla_decode_regroup"]  # fmt: skip


@pytest.mark.slow  # two compiles for sm_90 and a C++ extension built once (about 80 s)
def test_deepseek_v32_decode_kernels_for_sm90(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "counts.json"
    run = subprocess.run(
        [sys.executable, "-m", "tools.sm90_kernels", "deepseek-v3.2", "--opt-in", *OPT_IN, "--json", str(out)],
        cwd=root, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    record = json.loads(out.read_text())
    ours, stock = record["per_layer"]["fusion_passes"], record["per_layer"]["inductor"]
    assert ours["other"] * 2 < stock["other"], record["per_layer"]
    other = record["other"]["fusion_passes"]
    # no cache write nor counter written by an Inductor kernel: the folds write them
    assert not [k for k in other if "index_copy" in k or "index_put" in k and "sort" not in k or "add_copy_" in k], other
    launches = {prefix: sum(n for k, n in other.items() if k.startswith(prefix))
                for prefix in ("_advance_lengths_kernel", "_mla_q_a_kv_norm_rope_kernel", "_mla_q_indexer_kv_kernel",
                               "_index_scores_kernel", "_index_mask_kernel")}  # fmt: skip
    # a layer's attention path: four launches between its GEMMs and the attention
    assert launches == {"_advance_lengths_kernel": 1, "_mla_q_a_kv_norm_rope_kernel": 2, "_mla_q_indexer_kv_kernel": 2,
                        "_index_scores_kernel": 2, "_index_mask_kernel": 2}, launches  # fmt: skip
    assert not [k for k in other if "rms_norm" not in k and "mean" in k and "rsqrt" in k], other  # q_a's norm launched with kv
    assert not [k for k in other if "_le_" in k], other  # no causal mask built: both folds compare positions
    # the MoE dispatch as a GPU traces it (the tool turns the CPU's float histc into the GPU's int
    # one): one sort kernel, no histc nor cumsum
    assert record["fusions"]["moe_sort_by_expert"] == 1, record["fusions"]
    assert not [k for k in other if "histc" in k or "cumsum" in k], other


@pytest.mark.slow  # two compiles for sm_90 (about 40 s)
def test_minimax_m2_prefill_with_the_causal_mask_computed(tmp_path):
    """A tiny MiniMax-M2 prefill as Inductor writes it for sm_90, with masked_prefill_attention_causal:
    no kernel builds the causal mask or summarizes its blocks; the attention is one launch a layer."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "counts.json"
    run = subprocess.run(
        [sys.executable, "-m", "tools.sm90_kernels", "minimax-m2", "--prefill", "64", "--opt-in",
         "masked_prefill_attention_causal", "--json", str(out)],
        cwd=root, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    record = json.loads(out.read_text())
    assert record["prefill"] and record["fusions"]["masked_prefill_attention_causal"] == 2, record["fusions"]
    other = record["other"]["fusion_passes"]
    assert not [k for k in other if "_mask_blocks" in k or ("_le_" in k and "where" in k)], other
    assert record["per_layer"]["fusion_passes"]["attention"] == 1.0, record["per_layer"]
