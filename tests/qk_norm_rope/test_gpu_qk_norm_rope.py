"""CUDA: QK-norm + RoPE as other code bases write it (Olmo2's whole-row norm and fp32 RoPE,
gpt-fast's GPT-J pairs in fp32 before the transpose, vLLM's flat tokens with half-width cos / sin,
GLM's GPT-J partial rotary, transformers' Qwen3), raised and fused into one qk_norm_rope kernel,
in both launch modes, with plain launches and CUDA-graph replay on new inputs. Skipped without a
GPU (run on the GPU machine)."""

from __future__ import annotations

import pytest
import torch
from torch._inductor.utils import run_and_get_code

import fusion_passes
from fusion_passes.numerics import compare

pytestmark = pytest.mark.gpu

# name: (the fusion its site goes to); the spellings and inputs are test_region_spellings'
CASES = {
    "olmo2": "qk_norm_rope_whole_row",
    "gpt_fast": "qk_norm_rope",
    "vllm_neox_8": "qk_norm_rope",
    "vllm_gptj_8": "qk_norm_rope",
    "glm4": "qk_norm_rope",
    "phi3": "qk_norm_rope",
    "vllm_olmo2": "qk_norm_rope_whole_row",
}


@pytest.mark.parametrize("launch", ["direct", "dispatch"])
@pytest.mark.parametrize("name", list(CASES))
def test_spelling_fused_on_cuda(name, launch):
    """One qk_norm_rope kernel (in direct mode, emitted by Inductor), outputs within the dtype's
    tolerance of eager (the kernel sums the squares in its own order; its fp32 RoPE may fuse a
    multiply-add), and a CUDA-graph replay on new inputs."""
    from test_region_spellings import FUSED, _inputs  # this folder's spellings

    fn = FUSED[name][0]

    def inputs():
        return [t.cuda() for t in _inputs(name, torch.bfloat16)]

    args = inputs()
    report = fusion_passes.Report()
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=fusion_passes.backend(["qk_norm_rope"], report=report, launch=launch))
    out, (code,) = run_and_get_code(compiled, *args)
    assert not report.errors and report.matches[CASES[name]] == 1
    assert report.graphs[0].ops_after["fusion_passes.qk_norm_rope.default"] == 1
    if launch == "direct":
        assert "def _qk_norm_rope_kernel(" in code
    for a, e in zip(out, fn(*args), strict=True):
        assert a.dtype == e.dtype and a.shape == e.shape
        assert compare(a, e).ok, (name, compare(a, e))
    static = [t.clone() for t in args]
    for _ in range(2):
        compiled(*static)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = compiled(*static)
    for s, f in zip(static, inputs()):  # the same values again would prove nothing: perturb them
        if s.is_floating_point():
            s.copy_(f * 1.5)
    graph.replay()
    for a, e in zip(captured, fn(*static), strict=True):
        assert compare(a, e).ok
