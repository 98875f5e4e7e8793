#!/usr/bin/env bash
# Everything the tensor-parallel work checks and measures on two GPUs of one host, in one run: the
# 2-GPU tests, then the allreduce benchmarks (plain, then ending in per-token / per-group FP8), then
# one real-width decoder layer. Usage (repository root): OUT=out benchmarks/run_gpu_x2.sh
# Each part can be switched off: TESTS=0, ALLREDUCE=0, QUANT=0, LAYER=0; extra arguments go in
# ALLREDUCE_ARGS / QUANT_ARGS / LAYER_ARGS (e.g. ALLREDUCE_ARGS="--hidden 7168 --tokens 1 8").
set -uo pipefail
source "$(dirname "$0")/gpu_run_common.sh"
torchrun2() { torchrun --nproc-per-node 2 "$@"; }
[ "${TESTS:-1}" = 1 ] && run gpu_x2_tests python3 -m pytest -q -p no:cacheprovider \
  tests/allreduce_rms_norm/test_gpu_allreduce_rms_norm.py tests/allreduce_rms_norm_quant_fp8/test_gpu_allreduce_rms_norm_quant_fp8.py
[ "${ALLREDUCE:-1}" = 1 ] && run bench_allreduce_rms_norm torchrun2 -m benchmarks.bench_allreduce_rms_norm \
  --out "$OUT/bench_allreduce_rms_norm.md" --json "$OUT/bench_allreduce_rms_norm.json" ${ALLREDUCE_ARGS:-}
if [ "${QUANT:-1}" = 1 ]; then
  for scheme in per_token per_group; do
    name="bench_allreduce_rms_norm_quant_fp8_$scheme"
    run "$name" torchrun2 -m benchmarks.bench_allreduce_rms_norm --quant "$scheme" \
      --out "$OUT/$name.md" --json "$OUT/$name.json" ${QUANT_ARGS:-}
  done
fi
[ "${LAYER:-1}" = 1 ] && run bench_tp_decoder_layer torchrun2 -m benchmarks.bench_tp_decoder_layer \
  --out "$OUT/bench_tp_decoder_layer.md" --json "$OUT/bench_tp_decoder_layer.json" ${LAYER_ARGS:-}
exit $status
