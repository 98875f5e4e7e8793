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
