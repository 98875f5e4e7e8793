"""The Triton kernels compile for Hopper (sm_90) down to a cubin, on this CPU machine: the
interpreter that runs them in the other tests accepts code the compiler rejects. And their
launches trace, on fake CUDA tensors, into graphs Inductor emits (``launch="direct"``)."""

import os
import subprocess
import sys
from pathlib import Path


def test_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[2]
    run = subprocess.run(
        [sys.executable, "-m", "tests._hopper_compile"], cwd=root, env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stdout + run.stderr[-2000:]
    assert "FAILED" not in run.stdout, run.stdout
    compiled, traced = run.stdout.count("ok      compiled "), run.stdout.count("ok      traced ")
    assert compiled >= 30 and traced == compiled, run.stdout
