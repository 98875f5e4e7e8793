#!/usr/bin/env bash
# The decode benchmark on one GPU in one command: one bench_decode run per model, all compiling at
# once (Inductor's compile threads shared out), then timed one run at a time (--barrier: nothing is
# timed while another run compiles; --lock: one run on the GPU at a time); merged at the end.
#
#   OUT=out MODELS="deepseek-v3.2 minimax-m2" ARGS="--batch 1 64 --context 1024" PREFILL=4096 \
#     PREFILL_MODELS="minimax-m2" benchmarks/run_gpu_decode.sh
#
# PREFILL: tokens of a prefill timed too, for the models in PREFILL_MODELS (default: all).
# ARGS_<model> (the model's name with '.' and '-' as '_', e.g. ARGS_deepseek_v3_2): arguments for
# that model's run alone, after ARGS.
# Writes $OUT/bench_decode.{md,json} and $OUT/bench_decode.log (every run's log, one after
# another: the runs' own files stay in a temporary folder, so $OUT holds few files); TESTS: pytest
# arguments run while the models compile, logged to $OUT/tests.log; CLI: a command run then too
# (its output in $OUT/cli.log).
set -uo pipefail
source "$(dirname "$0")/gpu_run_common.sh"
models=${MODELS:-"deepseek-v3.2 minimax-m2 qwen3.5-moe qwen3-moe"}
sync=$(mktemp -d)
runs=$(mktemp -d)
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
n=$(wc -w <<< "$models")
export TORCHINDUCTOR_COMPILE_THREADS=${THREADS:-$(( $(nproc) / n ))}
pids=()
for m in $models; do
  prefill=()
  if [ -n "${PREFILL:-}" ] && [[ " ${PREFILL_MODELS:-$models} " == *" $m "* ]]; then prefill=(--prefill "$PREFILL"); fi
  own="ARGS_${m//[.-]/_}"
  # shellcheck disable=SC2086  # ARGS is a list of arguments
  python3 -m benchmarks.bench_decode --models "$m" ${ARGS:-} ${!own:-} "${prefill[@]}" --lock "$sync/lock" --barrier "$sync:$n" \
    --json "$runs/$m.json" --out "$runs/$m.md" > "$runs/$m.log" 2>&1 &
  pids+=($!)
done
if [ -n "${TESTS:-}" ]; then
  # shellcheck disable=SC2086
  python3 -m pytest -q -p no:cacheprovider $TESTS > "$OUT/tests.log" 2>&1 || { status=1; echo "   tests FAILED"; }
  tail -3 "$OUT/tests.log"
fi
if [ -n "${CLI:-}" ]; then
  bash -c "$CLI" > "$OUT/cli.log" 2>&1 || { status=1; echo "   CLI FAILED"; }
fi
for pid in "${pids[@]}"; do wait "$pid" || { status=1; echo "   a run FAILED"; }; done
for m in $models; do
  echo "== $m" | tee -a "$OUT/bench_decode.log"; cat "$runs/$m.log" >> "$OUT/bench_decode.log"; tail -3 "$runs/$m.log"
done
run merge python3 -m benchmarks.bench_decode --merge "$runs"/*.json \
  --json "$OUT/bench_decode.json" --out "$OUT/bench_decode.md"
exit $status
