#!/usr/bin/env bash
# Everything the GPU machine checks and measures, in one run: the CUDA tests, then the benchmarks.
# Usage (repository root): OUT=out benchmarks/run_gpu.sh   (logs and tables go to $OUT)
# Liger-Kernel, if wanted for the comparison, must be importable (e.g. a wheel on PYTHONPATH).
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# NVLink multicast stays off on shared machines.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
python3 - <<'PY' | tee "$OUT/versions.txt"
import torch, triton
print(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}")
PY
status=0
python3 -m pytest -q tests/test_gpu.py tests/test_rms_norm_kernel.py 2>&1 | tee "$OUT/gpu_tests.log" || status=1
python3 benchmarks/bench_launch_overhead.py --layers 16 --tokens 1 4 64 --json "$OUT/launch_overhead.json" 2>&1 | tee "$OUT/launch_overhead.log" || status=1
if [ "${BENCH_RMS_NORM:-1}" = 1 ]; then
  python3 benchmarks/bench_rms_norm.py --out "$OUT/bench_rms_norm.md" --json "$OUT/bench_rms_norm.json" 2>&1 | tail -5 | tee "$OUT/bench_rms_norm.log" || status=1
fi
exit $status
