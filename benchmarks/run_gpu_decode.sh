#!/usr/bin/env bash
# The decode benchmark on one GPU in one command: one bench_decode run per model, all compiling at
# once (Inductor's compile threads shared out), then timed one run at a time (--barrier: nothing is
# timed while another run compiles; --lock: one run on the GPU at a time); merged at the end.
#
#   OUT=out MODELS="deepseek-v3.2 minimax-m2" ARGS="--batch 1 64 --context 1024 --prefill 4096" \
#     benchmarks/run_gpu_decode.sh
#
# Writes $OUT/bench_decode.{md,json} and each run's log and result; TESTS: pytest arguments run
# while the models compile, logged to $OUT/tests.log.
set -uo pipefail
source "$(dirname "$0")/gpu_run_common.sh"
models=${MODELS:-"deepseek-v3.2 minimax-m2 qwen3.5-moe qwen3-moe"}
sync=$(mktemp -d)
n=$(wc -w <<< "$models")
export TORCHINDUCTOR_COMPILE_THREADS=${THREADS:-$(( $(nproc) / n ))}
pids=()
for m in $models; do
  # shellcheck disable=SC2086  # ARGS is a list of arguments
  python3 -m benchmarks.bench_decode --models "$m" ${ARGS:-} --lock "$sync/lock" --barrier "$sync:$n" \
    --json "$OUT/bench_decode_$m.json" --out "$OUT/bench_decode_$m.md" > "$OUT/bench_decode_$m.log" 2>&1 &
  pids+=($!)
done
if [ -n "${TESTS:-}" ]; then
  # shellcheck disable=SC2086
  python3 -m pytest -q -p no:cacheprovider $TESTS > "$OUT/tests.log" 2>&1 || { status=1; echo "   tests FAILED"; }
  tail -3 "$OUT/tests.log"
fi
for pid in "${pids[@]}"; do wait "$pid" || { status=1; echo "   a run FAILED"; }; done
for m in $models; do echo "== $m"; tail -4 "$OUT/bench_decode_$m.log"; done
run merge python3 -m benchmarks.bench_decode --merge "$OUT"/bench_decode_*.json \
  --json "$OUT/bench_decode.json" --out "$OUT/bench_decode.md"
exit $status
