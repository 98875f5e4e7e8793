#!/usr/bin/env bash
# Everything the GPU machine checks and measures, in one run: the CUDA tests, then the benchmarks.
# Usage (repository root): OUT=out benchmarks/run_gpu.sh   (logs and tables go to $OUT)
# Each part can be switched off: TESTS=0, LAUNCH=0, RMS_NORM=0, QUANT=0, SILU=0, QK=0, MLA=0, MODELS=0,
# and the decode-path and Gated DeltaNet regions: GDN=0, CONV=0, CHUNK=0, MOE=0, GQA=0, INDEX=0;
# extra arguments for a benchmark go in QUANT_ARGS / SILU_ARGS / QK_ARGS / MLA_ARGS / MODELS_ARGS
# (e.g. MODELS_ARGS="--models qwen3.5-moe", QK_ARGS="--tokens 1 64 4096").
# Liger-Kernel, if wanted for the comparison, must be importable (e.g. a wheel on PYTHONPATH).
# Each benchmark writes $OUT/bench_NAME.json (its numbers and their provenance); copied over
# benchmarks/results/bench_NAME.json, python -m benchmarks.render puts them into BENCHMARKS.md.
set -uo pipefail
source "$(dirname "$0")/gpu_run_common.sh"
# Every family's CUDA tests (tests/*/test_gpu_*.py: the two-GPU ones skip on one GPU) and kernel tests.
[ "${TESTS:-1}" = 1 ] && run gpu_tests python3 -m pytest -q -p no:cacheprovider -m "" \
  tests/*/test_gpu_*.py tests/*/test_*_kernel.py
[ "${LAUNCH:-1}" = 1 ] && run bench_launch_overhead python3 -m benchmarks.bench_launch_overhead --layers 16 \
  --tokens 1 4 64 --json "$OUT/bench_launch_overhead.json"
[ "${RMS_NORM:-1}" = 1 ] && run bench_rms_norm python3 -m benchmarks.bench_rms_norm \
  --out "$OUT/bench_rms_norm.md" --json "$OUT/bench_rms_norm.json"
[ "${QUANT:-1}" = 1 ] && run bench_rms_norm_quant_fp8 python3 -m benchmarks.bench_rms_norm_quant_fp8 \
  --out "$OUT/bench_rms_norm_quant_fp8.md" --json "$OUT/bench_rms_norm_quant_fp8.json" ${QUANT_ARGS:-}
[ "${SILU:-1}" = 1 ] && run bench_silu_mul_quant_fp8 python3 -m benchmarks.bench_silu_mul_quant_fp8 \
  --out "$OUT/bench_silu_mul_quant_fp8.md" --json "$OUT/bench_silu_mul_quant_fp8.json" ${SILU_ARGS:-}
[ "${QK:-1}" = 1 ] && run bench_qk_norm_rope python3 -m benchmarks.bench_qk_norm_rope \
  --out "$OUT/bench_qk_norm_rope.md" --json "$OUT/bench_qk_norm_rope.json" ${QK_ARGS:-}
[ "${MLA:-1}" = 1 ] && run bench_mla_rope python3 -m benchmarks.bench_mla_rope \
  --out "$OUT/bench_mla_rope.md" --json "$OUT/bench_mla_rope.json" ${MLA_ARGS:-}
[ "${GDN:-1}" = 1 ] && run bench_gated_delta_step python3 -m benchmarks.bench_gated_delta_step \
  --out "$OUT/bench_gated_delta_step.md" --json "$OUT/bench_gated_delta_step.json"
[ "${GDN_LAYER:-1}" = 1 ] && run bench_gdn_layer python3 -m benchmarks.bench_gdn_layer \
  --out "$OUT/bench_gdn_layer.md" --json "$OUT/bench_gdn_layer.json" ${GDN_LAYER_ARGS:-}
[ "${CONV:-1}" = 1 ] && run bench_causal_conv1d python3 -m benchmarks.bench_causal_conv1d \
  --out "$OUT/bench_causal_conv1d.md" --json "$OUT/bench_causal_conv1d.json"
[ "${CHUNK:-1}" = 1 ] && run bench_chunk_gated_delta_rule python3 -m benchmarks.bench_chunk_gated_delta_rule \
  --out "$OUT/bench_chunk_gated_delta_rule.md" --json "$OUT/bench_chunk_gated_delta_rule.json"
[ "${CHUNK:-1}" = 1 ] && run bench_chunk_inputs python3 -m benchmarks.bench_chunk_inputs \
  --out "$OUT/bench_chunk_inputs.md" --json "$OUT/bench_chunk_inputs.json"
[ "${MOE:-1}" = 1 ] && run bench_moe_sort_by_expert python3 -m benchmarks.bench_moe_sort_by_expert \
  --out "$OUT/bench_moe_sort_by_expert.md" --json "$OUT/bench_moe_sort_by_expert.json"
[ "${GQA:-1}" = 1 ] && run bench_gqa_decode_attention python3 -m benchmarks.bench_gqa_decode_attention \
  --out "$OUT/bench_gqa_decode_attention.md" --json "$OUT/bench_gqa_decode_attention.json"
[ "${INDEX:-1}" = 1 ] && run bench_sparse_index_mask python3 -m benchmarks.bench_sparse_index_mask \
  --out "$OUT/bench_sparse_index_mask.md" --json "$OUT/bench_sparse_index_mask.json"
[ "${INDEX:-1}" = 1 ] && run bench_sparse_index_scores python3 -m benchmarks.bench_sparse_index_scores \
  --out "$OUT/bench_sparse_index_scores.md" --json "$OUT/bench_sparse_index_scores.json"
[ "${MODELS:-1}" = 1 ] && run bench_models python3 -m benchmarks.bench_models \
  --json "$OUT/bench_models.json" ${MODELS_ARGS:-}
exit $status
