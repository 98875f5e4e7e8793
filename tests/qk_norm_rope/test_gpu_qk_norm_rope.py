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


@pytest.mark.parametrize("launch", ["direct", "dispatch"])
@pytest.mark.parametrize("spelling", ["qwen3", "minimax_m2"])
def test_prologue_writes_the_kv_cache_on_cuda(spelling, launch):
    """qk_norm_rope_cache on CUDA: in direct mode Inductor emits the kernel, which writes both
    caches in place (no index_put kernel left); query and caches within bf16's tolerance of
    eager, and a CUDA-graph replay on new inputs writes theirs."""
    from test_rewrite_qk_norm_rope import NORMS, SPELLINGS, _attention_prelude
    from test_rewrite_qk_norm_rope_cache import FORMS, OPT_IN, _inputs, static_layer_update

    fusion, per_head, rope, _, gate = SPELLINGS[spelling]
    fn = static_layer_update(_attention_prelude(NORMS[FORMS[spelling]], per_head, rope, gate))
    args = [t.cuda() for t in _inputs(spelling, (2, 1), torch.tensor(5))]
    report = fusion_passes.Report()
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=fusion_passes.backend(OPT_IN, report=report, launch=launch))
    ours = [t.clone() for t in args]
    (q, _, _), (code,) = run_and_get_code(compiled, *ours)
    assert report.final()[f"{fusion}_cache"] == 1 and not report.errors
    if launch == "direct":
        assert "def _qk_norm_rope_cache_kernel(" in code and "index_put" not in code.split("def call(")[-1]
    eager = [t.clone() for t in args]
    expected_q = fn(*eager)[0]
    for a, e in zip((q, ours[7], ours[8], ours[9]), (expected_q, eager[7], eager[8], eager[9]), strict=True):
        assert compare(a, e).ok
    static = [t.clone() for t in args]
    for _ in range(2):
        static[9].fill_(5)
        compiled(*static)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        compiled(*static)
    static[1].mul_(1.5)  # new keys; the counter back at slot 5
    static[9].fill_(5)
    expected = [t.clone() for t in static]
    graph.replay()
    fn(*expected)
    for i in (7, 8, 9):
        assert compare(static[i], expected[i]).ok
