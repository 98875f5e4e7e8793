"""The user-facing benchmarks: each fusion family against stock Inductor on one H200 (two for the
tensor-parallel ones), run from the repository root as modules:

    python -m benchmarks.bench_rms_norm --help
    OUT=out benchmarks/run_gpu.sh                 # the CUDA tests, then every one-GPU benchmark
    python -m benchmarks.render                   # BENCHMARKS.md from benchmarks/results/*.json

common.py holds what the benchmarks share (command line, device, the JSON writer and its
provenance), timing.py the timers, sweep.py what the FP8 benchmarks share, distributed.py what the
two-GPU ones share. Tuning and research scripts live in tools/.
"""
