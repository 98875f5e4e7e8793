"""CUDA: the Triton kernel against the reference, and the rewritten graphs in both launch modes,
with plain launches and CUDA-graph replay. Skipped without a GPU (run on the GPU machine)."""

from __future__ import annotations

import pytest
import torch
from torch._inductor.utils import run_and_get_code

import fusion_passes
from fusion_passes.lowering.rms_norm.reference import add_rms_norm_reference, rms_norm_reference
from fusion_passes.lowering.rms_norm.triton import rms_norm_triton
from fusion_passes.numerics import compare, fp8_codes_apart
from fusion_passes.patterns.rms_norm import llama_rms_norm, offset_rms_norm
from fusion_passes.patterns.rms_norm_quant_fp8 import quant_per_group, quant_per_token, quant_static

pytestmark = pytest.mark.gpu

SHAPES = [(1, 7168), (17, 4096), (300, 3072), (5, 129), (2, 3, 1000), (4096, 7168)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
FORMS = [(0.0, True), (0.0, False), (1.0, False)]


@pytest.mark.parametrize("form", FORMS, ids=["llama", "fp32_weight", "offset"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_kernel_matches_reference(shape, dtype, form):
    offset, cast = form
    x = torch.randn(shape, device="cuda").to(dtype)
    residual = torch.randn(shape, device="cuda").to(dtype)
    weight = (1 + 0.5 * torch.randn(shape[-1], device="cuda")).to(dtype)
    out, none = rms_norm_triton(x, weight, 1e-6, offset, cast)
    assert none is None
    assert compare(out, rms_norm_reference(x, weight, 1e-6, offset, cast)).ok
    out, new_residual = rms_norm_triton(x, weight, 1e-5, offset, cast, residual=residual)
    ref_out, ref_residual = add_rms_norm_reference(x, residual, weight, 1e-5, offset, cast)
    assert torch.equal(new_residual, ref_residual)  # one rounding of an fp32 sum: bit-exact
    assert compare(out, ref_out).ok


def decoder_like(x, residual, w1, w2, w3):
    h = residual + x
    a = llama_rms_norm(h, w1, 1e-6)
    h2 = h + a * 0.5
    b = llama_rms_norm(h2, w2, 1e-6)
    c = offset_rms_norm(b, w3, 1e-6)
    return c, h2


def decoder_inputs(tokens=8, hidden=4096, dtype=torch.bfloat16):
    x = torch.randn(tokens, hidden, device="cuda", dtype=dtype)
    ws = [(1 + 0.3 * torch.randn(hidden, device="cuda")).to(dtype) for _ in range(3)]
    return (x, torch.randn_like(x), *ws)


@pytest.mark.parametrize("launch", ["direct", "dispatch"])
def test_rewritten_graph_on_cuda(launch):
    args = decoder_inputs()
    report = fusion_passes.Report()
    torch._dynamo.reset()
    compiled = torch.compile(decoder_like, backend=fusion_passes.backend(report=report, launch=launch))
    out, (code,) = run_and_get_code(compiled, *args)
    matched = {name: n for name, n in report.matches.items() if n}
    assert matched == {"add_rms_norm": 2, "rms_norm": 1} and not report.errors
    if launch == "direct":
        assert "_rms_norm_kernel" in code and "fusion_passes.add_rms_norm" not in code
    else:
        assert "fusion_passes.add_rms_norm" in code
    for a, e in zip(out, decoder_like(*args)):
        assert compare(a, e).ok
    # CUDA graphs: capture the compiled call, replay on new inputs written in place.
    static = decoder_inputs()
    for _ in range(2):
        compiled(*static)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = compiled(*static)
    for _ in range(3):
        fresh = decoder_inputs()
        for s, f in zip(static, fresh):
            s.copy_(f)
        graph.replay()
        for a, e in zip(captured, decoder_like(*fresh)):
            assert compare(a, e).ok


def norm_then_quant(x, residual, w1, w2, scale):
    """The decoder's add+norm followed by each scheme's quantization (fallback spellings)."""
    h = residual + x
    q_group, s_group = quant_per_group(llama_rms_norm(h, w1, 1e-6))
    q_token, s_token = quant_per_token(offset_rms_norm(h * 0.5, w2, 1e-5))
    return h, q_group, s_group, q_token, s_token, quant_static(llama_rms_norm(h * 0.25, w2, 1e-6), scale)


QUANT_FUSIONS = ["add_rms_norm", "rms_norm", "add_rms_norm_quant_fp8_per_group"]
QUANT_FUSIONS += ["rms_norm_quant_fp8_per_token", "rms_norm_quant_fp8_static"]


@pytest.mark.parametrize("launch", ["direct", "dispatch"])
def test_rewritten_quant_graph_on_cuda(launch):
    args = (*decoder_inputs(tokens=33, hidden=7168)[:4], torch.tensor(0.01, device="cuda"))
    report = fusion_passes.Report()
    torch._dynamo.reset()
    backend = fusion_passes.backend(fusions=QUANT_FUSIONS, report=report, launch=launch)
    compiled = torch.compile(norm_then_quant, backend=backend)
    out, (code,) = run_and_get_code(compiled, *args)
    matched = {name: n for name, n in report.matches.items() if n}
    assert matched == {  # the norm fusions run first; the quant fusions then take their ops
        "add_rms_norm": 1,
        "rms_norm": 2,
        "add_rms_norm_quant_fp8_per_group": 1,
        "rms_norm_quant_fp8_per_token": 1,
        "rms_norm_quant_fp8_static": 1,
    }, matched
    assert not report.errors
    assert ("_rms_norm_quant_fp8_kernel" in code) == (launch == "direct")
    graph_inputs = [torch.empty_like(a).copy_(a) for a in args]
    for _ in range(2):
        compiled(*graph_inputs)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = compiled(*graph_inputs)
    for outputs in (out, None):
        if outputs is None:  # CUDA-graph replay on new inputs written in place
            fresh = (*decoder_inputs(tokens=33, hidden=7168)[:4], args[4])
            for s, f in zip(graph_inputs, fresh):
                s.copy_(f)
            graph.replay()
            outputs, expected = captured, norm_then_quant(*fresh)
        else:
            expected = norm_then_quant(*args)
        for a, e in zip(outputs, expected):
            if a.dtype == torch.float8_e4m3fn:
                assert fp8_codes_apart(a, e) <= 1  # the sum order may move y by an ulp
            else:  # fp32 scales carry the bf16 activation's error (amax of y over 448)
                assert compare(a, e, dtype=torch.bfloat16).ok


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


@pytest.mark.parametrize("launch", ["direct", "dispatch"])
@pytest.mark.parametrize("interleave", [True, False], ids=["interleave", "rotate_half"])
def test_mla_q_and_kv_in_one_launch_on_cuda(interleave, launch):
    """mla_q_kv_rope on CUDA: one kernel for both branches (in direct mode, emitted by
    Inductor), outputs bit-equal to the two-kernel compile, and a CUDA-graph replay on new inputs."""
    from test_rewrite_mla_rope import _mla_inputs, mla_pre_attention

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
