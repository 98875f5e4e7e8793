# Sourced by run_gpu.sh, run_gpu_x2.sh and run_gpu_sweep.sh (run from the repository root, where
# python -m finds fusion_passes and benchmarks): $OUT made, NVLink multicast off, the versions
# logged, and run NAME CMD... which logs CMD's output to $OUT/NAME.log and sets status=1 when it fails.
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
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
