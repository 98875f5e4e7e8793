"""CUDA: `fusion-passes diff --device cuda` counts the kernels a forward launches, by class. Skipped
without a GPU (run on the GPU machine)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu


def test_cli_diff_counts_launched_kernels_by_class(tmp_path):
    """`fusion-passes diff --device cuda` profiles one forward per variant and classifies the
    kernels; the fusions leave the GEMMs and the attention kernels as they were."""
    import json
    import subprocess
    import sys

    path = tmp_path / "diff.json"
    cmd = [sys.executable, "-m", "fusion_passes.cli", "diff", "minimax-m2", "--dtype", "bf16"]
    cmd += ["--device", "cuda", "--json", str(path)]
    subprocess.run(cmd, check=True, timeout=600)
    kernels = json.loads(path.read_text())["kernels"]
    stock, ours = kernels["inductor"]["launched"], kernels["fusion_passes"]["launched"]
    assert set(stock) == {"gemm", "attention", "moe", "other"}
    assert ours["gemm"] == stock["gemm"] and ours["attention"] == stock["attention"]
    assert stock["gemm"] > 0 and stock["attention"] > 0 and ours["other"] > 0
