"""CUDA: a decoder's add + norm and an MLP's SiLU-and-mul, each followed by a code base's own FP8
quantization (tests/_fp8_spellings.py: vLLM's reciprocal multiply, SGLang's floor before the
divide in both forms, DeepGEMM's unsaturated cast, DeepSeek-V3's unfloored one, torchao's bf16 scale), raised to the
canonical quant_fp8 and fused, in both launch modes, with plain launches and CUDA-graph replay on
new inputs. Skipped without a GPU (run on the GPU machine)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._inductor.utils import run_and_get_code

import fusion_passes
from _fp8_spellings import (
    deepgemm_per_token_cast_to_fp8,
    deepseek_v3_act_quant,
    llama_rms_norm,
    qwen3_next_rms_norm,
    sglang_per_token_group_quant_fp8,
    sglang_per_token_group_quant_fp8_reciprocal,
    torchao_float8_per_row,
    vllm_quant_fp8_group_native,
    vllm_quant_fp8_native,
)
from fusion_passes.numerics import compare, fp8_codes_apart

pytestmark = pytest.mark.gpu

NORM_FUSIONS = [f"{p}rms_norm_quant_fp8_{s}" for s in ("static", "per_token", "per_group") for p in ("add_", "")]
SILU_FUSIONS = [f"silu_mul_quant_fp8_{s}" for s in ("static", "per_token", "per_group")]


def decoder_inputs(tokens, hidden, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x, residual = (torch.randn(tokens, hidden, device="cuda", generator=g).to(dtype) for _ in range(2))
    w1, w2 = (1 + 0.1 * torch.randn(hidden, device="cuda", generator=g).to(dtype) for _ in range(2))
    return x, residual, w1, w2


def norms_then_engine_quantizations(x, residual, w1, w2, scale):
    """Each norm's output read by one engine's quantization only (the region fusion's shape)."""
    h = residual + x
    q1, s1 = vllm_quant_fp8_native(llama_rms_norm(h, w1, 1e-6))
    q3, s3 = sglang_per_token_group_quant_fp8_reciprocal(llama_rms_norm(h * 0.25, w2, 1e-6))
    q4, s4 = deepgemm_per_token_cast_to_fp8(llama_rms_norm(h * 2.0, w1, 1e-6))
    q5, s5 = deepseek_v3_act_quant(qwen3_next_rms_norm(h * 4.0, w1, 1e-6))
    (q6,) = vllm_quant_fp8_native(llama_rms_norm(h * 8.0, w2, 1e-6), scale)[:1]
    q7, s7 = torchao_float8_per_row(llama_rms_norm(h * 16.0, w2, 1e-6))
    return h, q1, s1, q3, s3, q4, s4, q5, s5, q6, q7, s7


def norm_then_sglang_divide_group(x, residual, w1, w2, scale):
    """SGLang's divide-form group quantization of a (1 + w) norm's bf16 output."""
    return sglang_per_token_group_quant_fp8(qwen3_next_rms_norm(x * 0.5, w2, 1e-5))


EXPECTED_NORM = {
    "add_rms_norm": 1,
    "rms_norm": 5,
    "quant_fp8_dynamic": 3,
    "quant_fp8_unfloored": 2,
    "quant_fp8_static": 1,
    "add_rms_norm_quant_fp8_per_token": 1,
    "rms_norm_quant_fp8_per_token": 1,
    "rms_norm_quant_fp8_per_group": 3,
    "rms_norm_quant_fp8_static": 1,
}


def _check_outputs(outputs, expected):
    for a, e in zip(outputs, expected, strict=True):
        if a.dtype == torch.float8_e4m3fn:
            assert fp8_codes_apart(a, e) <= 1  # the norm's sum order may move y by an ulp
        else:  # fp32 scales carry the bf16 activation's error (amax of y over 448)
            assert compare(a, e, dtype=torch.bfloat16).ok


def _compile_and_replay(fn, make_args, fusions, expected_matches, kernel, launch, near_misses=None):
    args = make_args(0)
    report = fusion_passes.Report()
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=fusion_passes.backend(fusions=fusions, report=report, launch=launch))
    out, (code,) = run_and_get_code(compiled, *args)
    matched = {name: n for name, n in report.matches.items() if n}
    assert matched == expected_matches, (matched, report.rejected, report.near_misses)
    if near_misses is not None:
        assert [(m.spelling, m.reason) for m in report.near_misses] == list(near_misses), report.near_misses
    assert not report.errors
    assert (kernel in code) == (launch == "direct")
    _check_outputs(out, fn(*args))
    graph_inputs = [torch.empty_like(a).copy_(a) for a in args]
    for _ in range(2):
        compiled(*graph_inputs)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = compiled(*graph_inputs)
    fresh = make_args(1)
    for s, f in zip(graph_inputs, fresh):
        s.copy_(f)
    graph.replay()
    _check_outputs(captured, fn(*fresh))


@pytest.mark.parametrize("launch", ["direct", "dispatch"])
def test_norm_then_engine_quantizations_on_cuda(launch):
    def make_args(seed):
        return (*decoder_inputs(33, 7168, seed=seed), torch.tensor([0.01], device="cuda"))

    _compile_and_replay(
        norms_then_engine_quantizations, make_args, NORM_FUSIONS, EXPECTED_NORM, "_rms_norm_quant_fp8_kernel", launch,
        near_misses=[],
    )  # fmt: skip


# On CUDA (one H200, torch 2.11) this site is not raised: the bf16 x reaches the divide without the
# upcast the bf16 trace has (near miss "x is torch.bfloat16, the spelling expects torch.float32",
# 4/4 ops of the fp32 trace); on the CPU it raises and fuses (tests/rms_norm_quant_fp8). The
# expectation stays what it should be; strict: a fix fails this until the mark is removed.
@pytest.mark.xfail(strict=True, reason="not raised on CUDA: the graph lacks the bf16 trace's upcast")
@pytest.mark.parametrize("launch", ["direct", "dispatch"])
def test_norm_then_sglang_divide_group_quantization_on_cuda(launch):
    def make_args(seed):
        return (*decoder_inputs(33, 7168, seed=seed), torch.tensor([0.01], device="cuda"))

    expected = {"rms_norm": 1, "quant_fp8_dynamic": 1, "rms_norm_quant_fp8_per_group": 1}
    _compile_and_replay(
        norm_then_sglang_divide_group, make_args, NORM_FUSIONS, expected, "_rms_norm_quant_fp8_kernel", launch,
        near_misses=[],
    )  # fmt: skip


def silu_then_engine_quantizations(g1, u1, g2, u2, g3, u3):
    q1, s1 = vllm_quant_fp8_native(F.silu(g1) * u1)
    q2, s2 = vllm_quant_fp8_group_native(F.silu(g2) * u2)
    q3, s3 = deepgemm_per_token_cast_to_fp8(F.silu(g3) * u3)
    return q1, s1, q2, s2, q3, s3


@pytest.mark.parametrize("launch", ["direct", "dispatch"])
@pytest.mark.parametrize("tokens", [1, 16, 300])
def test_silu_mul_then_engine_quantizations_on_cuda(launch, tokens):
    def make_args(seed):
        g = torch.Generator(device="cuda").manual_seed(seed)
        return tuple(torch.randn(tokens, 18432, device="cuda", generator=g).bfloat16() for _ in range(6))

    expected = {"quant_fp8_dynamic": 3, "silu_mul_quant_fp8_per_token": 1, "silu_mul_quant_fp8_per_group": 2}
    _compile_and_replay(
        silu_then_engine_quantizations, make_args, SILU_FUSIONS, expected, "_silu_mul_quant_fp8_kernel", launch
    )
