"""CUDA: cache_lengths launched by Inductor (direct launch): every StaticLayer counter written in
place by one kernel, no other kernel writing a counter, counters and caches as eager's over
several steps. Skipped without a GPU."""

from __future__ import annotations

import re

import pytest
import torch
from test_rewrite_cache_lengths import StaticLayers
from torch._inductor.utils import run_and_get_code

import fusion_passes

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("n", [3, 40])  # 40: three launches of the kernel
def test_counters_written_in_place_by_one_kernel(n):
    torch.manual_seed(0)
    layers = {name: StaticLayers(n).cuda() for name in ("eager", "compiled")}
    for layer_set in layers.values():  # the same prefill, eager
        torch.manual_seed(1)
        layer_set(torch.randn(1, 2, 3, 8, device="cuda"), torch.randn(1, 2, 3, 8, device="cuda"))
    report = fusion_passes.Report()
    step = torch.compile(layers["compiled"], backend=fusion_passes.backend(["cache_lengths"], report=report),
                         fullgraph=True)  # fmt: skip
    for i in range(3):
        k, v = torch.randn(1, 2, 1, 8, device="cuda"), torch.randn(1, 2, 1, 8, device="cuda")
        if i == 0:
            out, (code,) = run_and_get_code(step, k, v)
        else:
            out = step(k, v)
        torch.testing.assert_close(out, layers["eager"](k, v))
    assert not report.errors and report.final()["cache_lengths"] == 1
    before, after = report.ops_before(), report.ops_after()
    assert after["fusion_passes.advance_lengths.default"] == 1
    assert before["aten.add.Tensor"] - after["aten.add.Tensor"] == n  # each counter's add
    for a, b in zip(layers["compiled"].state(), layers["eager"].state(), strict=True):
        assert torch.equal(a, b)
    call = code.split("def call(")[-1]
    assert len(re.findall(r"_advance_lengths_kernel\w*\.run\(", call)) == -(-n // 16)
    assert not re.search(r"triton_\w*add_copy_\w*\.run\(", call)  # no counter written by an Inductor kernel
