"""CUDA: the RMSNorm Triton kernel against the reference, and a rewritten decoder graph in both
launch modes, with plain launches and CUDA-graph replay. Skipped without a GPU (run on the GPU
machine)."""

from __future__ import annotations

import pytest
import torch
from torch._inductor.utils import run_and_get_code

import fusion_passes
from fusion_passes.lowering.rms_norm.reference import add_rms_norm_reference, rms_norm_reference
from fusion_passes.lowering.rms_norm.triton import rms_norm_triton
from fusion_passes.numerics import compare
from fusion_passes.patterns.rms_norm import llama_rms_norm, offset_rms_norm

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
    # vLLM's native form: the fp32 sum normalised before its rounding.
    out, new_residual = rms_norm_triton(x, weight, 1e-5, offset, cast, True, residual=residual)
    ref_out, ref_residual = add_rms_norm_reference(x, residual, weight, 1e-5, offset, cast, True)
    assert torch.equal(new_residual, ref_residual) and compare(out, ref_out).ok


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


@pytest.mark.parametrize("launch", ["direct", "dispatch", "lowered_back"])
def test_rewritten_graph_on_cuda(launch):
    """The standalone norms kept as kernels (lower_back=False) in both launch modes, and by default
    lowered back: Inductor's own kernels, no fused op in the code."""
    args = decoder_inputs()
    report = fusion_passes.Report()
    torch._dynamo.reset()
    options = {"lower_back": True} if launch == "lowered_back" else {"launch": launch, "lower_back": False}
    compiled = torch.compile(decoder_like, backend=fusion_passes.backend(report=report, **options))
    out, (code,) = run_and_get_code(compiled, *args)
    matched = {name: n for name, n in report.matches.items() if n}
    assert matched == {"add_rms_norm": 2, "rms_norm": 1} and not report.errors
    if launch == "direct":
        assert "_rms_norm_kernel" in code and "fusion_passes.add_rms_norm" not in code
    elif launch == "dispatch":
        assert "fusion_passes.add_rms_norm" in code
    else:
        # No fused op is called or launched: the kernels are stock Inductor's for this graph.
        from fusion_passes.kernels import count_kernels

        torch._dynamo.reset()
        _, (stock,) = run_and_get_code(torch.compile(decoder_like, backend="inductor"), *args)
        assert "torch.ops.fusion_passes" not in code and "def _rms_norm_kernel" not in code
        assert count_kernels([code]) == count_kernels([stock])
        assert sum(report.lowered_back().values()) == 3
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
