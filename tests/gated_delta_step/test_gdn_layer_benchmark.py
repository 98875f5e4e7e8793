"""The Gated DeltaNet layer benchmark's CPU path (tiny widths, no times): transformers' own layer
on its StaticCache takes the decode path, fusion_passes fuses its step and conv update, and the
outputs and states stay within bf16's tolerance of eager's over the checked steps."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from fusion_passes.numerics import tolerance


@pytest.mark.slow  # three compiles of a layer in a subprocess (about 14 s); the CI keeps the decode benchmark's smoke run
def test_gdn_layer_benchmark_smoke(tmp_path):
    out = tmp_path / "gdn.json"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_gdn_layer", "--smoke", "--batch", "2", "--check-steps", "3",
         "--json", str(out), "--out", str(tmp_path / "gdn.md")],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    (record,) = json.loads(out.read_text())["records"]
    assert record["batch"] == 2 and list(record["variants"]) == ["eager", "inductor", "fusion_passes"]
    ours = record["variants"]["fusion_passes"]
    assert ours["final"]["gated_delta_step"] == 1 and ours["final"]["causal_conv1d_update"] == 1 and not ours["errors"]
    for label in ("inductor", "fusion_passes"):
        v = record["variants"][label]
        assert v["out_rel_err"] <= tolerance(torch.bfloat16).rel_norm and v["state_rel_err"] <= tolerance(torch.bfloat16).rel_norm


@pytest.mark.slow  # compiles of the region in a subprocess, the kernels under Triton's interpreter
def test_step_with_gated_norm_benchmark_smoke(tmp_path):
    """bench_gated_delta_step's recurrent_norm region: the opt-in fold fuses the step with
    transformers' Qwen3_5RMSNormGated, and every implementation's output and state lie within
    bf16's reach of the reference (each launch form of the kernel included)."""
    out = tmp_path / "step.json"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_gated_delta_step", "--smoke", "--batch", "3", "--regions",
         "recurrent_norm", "--json", str(out), "--out", str(tmp_path / "step.md")],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    (record,) = json.loads(out.read_text())["records"]
    assert record["region"] == "recurrent_norm" and record["fused_sites"] == 1
    errors = record["errors"]
    assert list(errors) == ["eager", "inductor", "ours", "ours_norm", "epilogue", "step_norm"]
    # Outputs of a few units (silu(z) times a normalised row): Inductor's own error is a bf16 ulp
    # there; the interpreter's bf16 sigmoid(b) truncation moves the kernels' states (and outputs) a
    # little more (test_gated_delta_step_kernel.py's TOLERANCE).
    assert all(e["out"] <= 4 * errors["inductor"]["out"] and e["state"] <= 2e-2 for e in errors.values())
