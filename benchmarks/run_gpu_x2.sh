#!/usr/bin/env bash
# Everything the tensor-parallel work checks and measures on two GPUs of one host, in one run: the
# 2-GPU tests, then the allreduce benchmarks (plain, then ending in per-token / per-group FP8), then
# one real-width decoder layer. Usage (repository root): OUT=out benchmarks/run_gpu_x2.sh
# Each part can be switched off: TESTS=0, ALLREDUCE=0, QUANT=0, LAYER=0; extra arguments go in
# ALLREDUCE_ARGS / QUANT_ARGS / LAYER_ARGS (e.g. ALLREDUCE_ARGS="--hidden 7168 --tokens 1 8").
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# NVLink multicast stays off on shared machines.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
python3 - <<'PY' | tee "$OUT/versions.txt"
import torch, triton
print(f"{torch.cuda.device_count()} x {torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}")
PY
status=0
run() {  # run NAME CMD...: log to $OUT/NAME.log, remember a failure
  local name=$1; shift
  echo "== $name: $*"
  "$@" > "$OUT/$name.log" 2>&1 || { status=1; echo "   FAILED (see $name.log)"; }
  tail -3 "$OUT/$name.log"
}
torchrun2() { torchrun --nproc-per-node 2 "$@"; }
[ "${TESTS:-1}" = 1 ] && run gpu_x2_tests python3 -m pytest -q -p no:cacheprovider \
  tests/test_gpu_allreduce_rms_norm.py tests/test_gpu_allreduce_rms_norm_quant_fp8.py
[ "${ALLREDUCE:-1}" = 1 ] && run bench_allreduce torchrun2 benchmarks/bench_allreduce_rms_norm.py \
  --out "$OUT/bench_allreduce.md" --json "$OUT/bench_allreduce.json" ${ALLREDUCE_ARGS:-}
if [ "${QUANT:-1}" = 1 ]; then
  for scheme in per_token per_group; do
    run "bench_allreduce_$scheme" torchrun2 benchmarks/bench_allreduce_rms_norm.py --quant "$scheme" \
      --out "$OUT/bench_allreduce_$scheme.md" --json "$OUT/bench_allreduce_$scheme.json" ${QUANT_ARGS:-}
  done
fi
[ "${LAYER:-1}" = 1 ] && run bench_tp_decoder_layer torchrun2 benchmarks/bench_tp_decoder_layer.py \
  --out "$OUT/bench_tp_decoder_layer.md" --json "$OUT/bench_tp_decoder_layer.json" ${LAYER_ARGS:-}
exit $status
