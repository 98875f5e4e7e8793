#!/usr/bin/env bash
# One benchmark's sweep in a command of limited length: Inductor's caches filled first by PARALLEL
# compile-only shards at once, then one timed process with the GPU to itself (nothing is timed
# while another process uses the GPU). The CUDA tests named in TESTS run during the compile phase.
#
#   OUT=out BENCH=rms_norm_quant_fp8 ARGS="--ops add_rms_norm" benchmarks/run_gpu_sweep.sh
#
# BENCH: rms_norm_quant_fp8 or silu_mul_quant_fp8 (python -m benchmarks.bench_$BENCH); ARGS: its arguments;
# PARALLEL (default 8) compile processes; LIMIT_S (default 560): seconds for the whole script, where
# the timed process stops and its report covers the shapes it reached (the JSON is written shape by
# shape); TESTS: pytest arguments. Writes $OUT/bench_$BENCH.{md,json,log}, $OUT/tests.log and
# $OUT/phases.txt (with every compile shard's failing lines); the shards' own logs stay in a temporary
# folder, so $OUT holds few files.
set -uo pipefail
source "$(dirname "$0")/gpu_run_common.sh"
bench="benchmarks.bench_${BENCH:?BENCH=rms_norm_quant_fp8 or silu_mul_quant_fp8}"
parallel=${PARALLEL:-8}
start=$SECONDS
shards=$(mktemp -d)
phase() { echo "$(date +%T) $*" | tee -a "$OUT/phases.txt"; }

phase "compile: $parallel shards"
pids=()
for i in $(seq 0 $((parallel - 1))); do
  # shellcheck disable=SC2086  # ARGS is a list of arguments
  python3 -m "$bench" ${ARGS:-} --compile-only --shard "$i/$parallel" --json "$shards/$i.json" \
    > "$shards/$i.log" 2>&1 &
  pids+=($!)
done
if [ -n "${TESTS:-}" ]; then
  # shellcheck disable=SC2086
  python3 -m pytest -q -p no:cacheprovider $TESTS > "$OUT/tests.log" 2>&1 || { status=1; echo "   tests FAILED"; }
  tail -3 "$OUT/tests.log"
fi
for pid in "${pids[@]}"; do wait "$pid" || { status=1; echo "   a compile shard FAILED"; }; done
phase "compiled: $(cat "$shards"/*.log | grep -cE "correct=True .*fused=1 equal=True") shapes pass"
grep -h -vE "correct=True .*fused=1 equal=True" "$shards"/*.log | tail -5 | tee -a "$OUT/phases.txt"

left=$(( ${LIMIT_S:-560} - (SECONDS - start) - 15 ))
phase "timed: ${left}s"
# shellcheck disable=SC2086
timeout $(( left > 30 ? left : 30 )) python3 -m "$bench" ${ARGS:-} --json "$OUT/bench_$BENCH.json" \
  --out "$OUT/bench_$BENCH.md" > "$OUT/bench_$BENCH.log" 2>&1
rc=$?
phase "timed: exit $rc, $(grep -c "graph_us=" "$OUT/bench_$BENCH.log") shapes"
if [ "$rc" = 124 ]; then  # cut short: the report of what was reached
  python3 -m "$bench" --merge "$OUT/bench_$BENCH.json" --out "$OUT/bench_$BENCH.md" > /dev/null || status=1
elif [ "$rc" != 0 ]; then
  status=1
fi
exit $status
