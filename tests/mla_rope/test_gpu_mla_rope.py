"""CUDA: DeepSeek V3's MLA q and kv branches merged into one launch, in both launch modes, with
CUDA-graph replay. Skipped without a GPU (run on the GPU machine)."""

from __future__ import annotations

import pytest
import torch
from torch._inductor.utils import run_and_get_code

import fusion_passes
from fusion_passes.numerics import compare

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("launch", ["direct", "dispatch"])
@pytest.mark.parametrize("interleave", [True, False], ids=["interleave", "rotate_half"])
def test_mla_q_and_kv_in_one_launch_on_cuda(interleave, launch):
    """mla_q_kv_rope on CUDA: one kernel for both branches (in direct mode, emitted by
    Inductor), outputs bit-equal to the two-kernel compile, and a CUDA-graph replay on new inputs."""
    from test_rewrite_mla_rope import _mla_inputs, mla_pre_attention  # this folder's spelling

    merge = "mla_q_kv_rope" if interleave else "mla_q_kv_rope_rotate_half"

    def region(*a):
        return mla_pre_attention(*a, interleave=interleave)

    def inputs():
        return [t.cuda() for t in _mla_inputs(torch.bfloat16)]

    args = inputs()
    compiled = {}
    for fusions in ([merge], [merge.replace("q_kv_rope", "kv_norm_rope"), "mla_q_rope"]):
        report = fusion_passes.Report()
        torch._dynamo.reset()
        backend = fusion_passes.backend(fusions=fusions, report=report, launch=launch)
        fn = torch.compile(region, backend=backend)
        out, (code,) = run_and_get_code(fn, *args)
        assert not report.errors
        compiled[fusions[0]] = (fn, out, code, report)
    fn, out, code, report = compiled[merge]
    assert report.matches[merge] == 1
    if launch == "direct":  # the code holds the kernels' sources (whose docstrings name others)
        assert "def _mla_q_kv_rope_kernel(" in code and "def _mla_q_rope_kernel(" not in code
    two_kernels = compiled[merge.replace("q_kv_rope", "kv_norm_rope")][1]
    for a, b, e in zip(out, two_kernels, region(*args), strict=True):
        assert torch.equal(a, b) and compare(a, e).ok
    static = [t.clone() for t in args]
    for _ in range(2):
        fn(*static)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fn(*static)
    for s, f in zip(static, inputs()):  # the same values again would prove nothing: perturb them
        s.copy_(f * 1.5)
    graph.replay()
    for a, e in zip(captured, region(*static), strict=True):
        assert compare(a, e).ok
