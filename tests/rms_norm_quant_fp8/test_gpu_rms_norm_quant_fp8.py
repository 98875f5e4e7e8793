"""CUDA: a decoder's add + norm followed by each scheme's FP8 quantization, as real code bases write
it (tests/_fp8_spellings.py), rewritten in both launch modes, with plain launches and CUDA-graph
replay. Skipped without a GPU (run on the GPU machine)."""

from __future__ import annotations

import pytest
import torch
from torch._inductor.utils import run_and_get_code

import fusion_passes
from _fp8_spellings import llama_rms_norm, per_group_quant, per_token_quant, qwen3_next_rms_norm
from _fp8_spellings import torchao_quantize_affine_float8
from fusion_passes.numerics import compare, fp8_codes_apart

pytestmark = pytest.mark.gpu


def decoder_inputs(tokens, hidden, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(0)
    x, residual = (torch.randn(tokens, hidden, device="cuda", generator=g).to(dtype) for _ in range(2))
    w1, w2 = (1 + 0.1 * torch.randn(hidden, device="cuda", generator=g).to(dtype) for _ in range(2))
    return x, residual, w1, w2


def norm_then_quant(x, residual, w1, w2, scale):
    """The decoder's add+norm followed by each scheme's quantization, as serving engines' fallbacks write it."""
    h = residual + x
    q_group, s_group = per_group_quant(llama_rms_norm(h, w1, 1e-6))
    q_token, s_token = per_token_quant(qwen3_next_rms_norm(h * 0.5, w2, 1e-5))
    return h, q_group, s_group, q_token, s_token, torchao_quantize_affine_float8(llama_rms_norm(h * 0.25, w2, 1e-6), scale)


QUANT_FUSIONS = ["add_rms_norm", "rms_norm", "add_rms_norm_quant_fp8_per_group"]
QUANT_FUSIONS += ["rms_norm_quant_fp8_per_token", "rms_norm_quant_fp8_static"]


@pytest.mark.parametrize("launch", ["direct", "dispatch"])
def test_rewritten_quant_graph_on_cuda(launch):
    args = (*decoder_inputs(33, 7168), torch.tensor(0.01, device="cuda"))
    report = fusion_passes.Report()
    torch._dynamo.reset()
    backend = fusion_passes.backend(fusions=QUANT_FUSIONS, report=report, launch=launch)
    compiled = torch.compile(norm_then_quant, backend=backend)
    out, (code,) = run_and_get_code(compiled, *args)
    matched = {name: n for name, n in report.matches.items() if n}
    assert matched == {  # the norms and quantizations raise first; the quant fusions then take their ops
        "add_rms_norm": 1,
        "rms_norm": 2,
        "quant_fp8_dynamic": 2,
        "quant_fp8_static": 1,
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
            fresh = (*decoder_inputs(33, 7168), args[4])
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
