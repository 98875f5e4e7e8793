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


@pytest.mark.parametrize("launch", ["direct", "dispatch"])
def test_indexer_key_written_into_its_cache_on_cuda(launch):
    """mla_indexer_k_norm_rope_cache on CUDA: in direct mode Inductor emits the kernel, which
    writes the cache in place (no copy of it, no index_put kernel); the cache and the write
    counter bit-equal to the defaults' (the key op, then Inductor's write), and a CUDA-graph
    replay on new keys writes theirs."""
    from test_rewrite_mla_rope import _cache_inputs, indexer_key_into_cache

    args = [t.cuda() for t in _cache_inputs(torch.bfloat16, torch.tensor(3))]
    results = {}
    for fusions in (["all", "mla_indexer_k_norm_rope_cache"], "all"):
        report = fusion_passes.Report()
        torch._dynamo.reset()
        fn = torch.compile(indexer_key_into_cache, backend=fusion_passes.backend(fusions, report=report, launch=launch))
        copies = [t.clone() for t in args]
        _, (code,) = run_and_get_code(fn, *copies)
        assert not report.errors
        results[str(fusions)] = (fn, copies, code, report)
    fn, fused, code, report = results[str(["all", "mla_indexer_k_norm_rope_cache"])]
    assert report.final()["mla_indexer_k_norm_rope_cache"] == 1
    if launch == "direct":
        assert "def _mla_indexer_k_norm_rope_cache_kernel(" in code and "index_put" not in code.split("def call(")[-1]
    defaults = results[str("all")][1]
    assert torch.equal(fused[5], defaults[5]) and torch.equal(fused[6], defaults[6])
    static = [t.clone() for t in args]
    for _ in range(2):
        static[6].fill_(3)
        fn(*static)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(*static)
    static[0].mul_(1.5)  # new keys; the counter back at slot 3
    static[6].fill_(3)
    expected_cache, expected_counter = static[5].clone(), static[6].clone()
    graph.replay()
    indexer_key_into_cache(*static[:5], expected_cache, expected_counter)
    assert compare(static[5], expected_cache).ok and torch.equal(static[6], expected_counter)


@pytest.mark.parametrize("launch", ["direct", "dispatch"])
def test_mla_key_and_value_written_into_the_cache_on_cuda(launch):
    """mla_kv_cache_write on CUDA: in direct mode Inductor emits the kernel, which writes both
    caches in place (no index_put kernel left); the caches bit-equal the defaults' and eager's,
    and a CUDA-graph replay on new inputs writes theirs."""
    from test_rewrite_mla_rope import _kv_write_inputs, expand_kv_into_cache

    args = [t.cuda() for t in _kv_write_inputs(torch.bfloat16, torch.tensor(3))]
    results = {}
    for name, fusions in (("fused", ["all", "mla_kv_cache_write"]), ("defaults", "all")):
        report = fusion_passes.Report()
        torch._dynamo.reset()
        fn = torch.compile(expand_kv_into_cache, backend=fusion_passes.backend(fusions, report=report, launch=launch))
        copies = [t.clone() for t in args]
        _, (code,) = run_and_get_code(fn, *copies)
        assert not report.errors
        results[name] = (fn, copies, code, report)
    fn, fused, code, report = results["fused"]
    assert report.final()["mla_kv_cache_write"] == 1
    if launch == "direct":
        assert "def _mla_kv_cache_write_kernel(" in code and "index_put" not in code.split("def call(")[-1]
    eager = [t.clone() for t in args]
    expand_kv_into_cache(*eager)
    for i in (3, 4, 5):
        assert torch.equal(fused[i], results["defaults"][1][i]) and torch.equal(fused[i], eager[i])
    static = [t.clone() for t in args]
    for _ in range(2):
        static[5].fill_(3)
        fn(*static)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(*static)
    static[2].mul_(1.5)  # a new rotated key part; the counter back at slot 3
    static[5].fill_(3)
    expected = [t.clone() for t in static]
    graph.replay()
    expand_kv_into_cache(*expected)
    for i in (3, 4, 5):
        assert torch.equal(static[i], expected[i])


@pytest.mark.parametrize("launch", ["direct", "dispatch"])
def test_indexer_query_and_key_in_one_launch_on_cuda(launch):
    """mla_indexer_qk_rope_cache on CUDA: one kernel for the indexer's query and its key into the
    cache (in direct mode emitted by Inductor), bit-equal to the two-launch compile."""
    from test_rewrite_mla_rope import B, CACHE_SLOTS, ROPE, _indexer_inputs, indexer_q_and_key_into_cache

    q, k, w, b, cos, sin = (t.cuda() for t in _indexer_inputs(torch.bfloat16))
    cache = torch.randn(B, CACHE_SLOTS, 2 * ROPE, device="cuda", dtype=torch.bfloat16)
    args = (q, k, w, b, cos, sin, cache, torch.tensor(3, device="cuda"))
    results = {}
    for name, fusions in (("one", ["all", "mla_indexer_qk_rope_cache"]), ("two", ["all", "mla_indexer_k_norm_rope_cache"])):
        report = fusion_passes.Report()
        torch._dynamo.reset()
        fn = torch.compile(indexer_q_and_key_into_cache, backend=fusion_passes.backend(fusions, report=report, launch=launch))
        copies = [t.clone() for t in args]
        out, (code,) = run_and_get_code(fn, *copies)
        assert not report.errors
        results[name] = (out, code, report)
    out, code, report = results["one"]
    assert report.final()["mla_indexer_qk_rope_cache"] == 1
    if launch == "direct":
        assert "def _mla_indexer_qk_rope_kernel(" in code and "def _mla_q_rope_kernel(" not in code
    assert all(torch.equal(a, e) for a, e in zip(out, results["two"][0], strict=True))
