"""RMSNorm as other code bases write it, each raised to the canonical op bit for bit.

Each spelling is written here from how its project writes its forward (not imported from the
patterns): compiled with the raise stage alone (``lower_back=False``, so the canonical op stays and
runs its reference on CPU), the output must equal eager's bit for bit, with one site of the named
spelling and the norm's aten ops gone.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fusion_passes

NORM_OPS = {"aten.mean.dim", "aten.rsqrt.default"}


class MetaLlamaRMSNorm(nn.Module):
    """Meta's reference Llama: normalise in fp32, round, then scale (weight on the right)."""

    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(dim))

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        output = self._norm(x.float()).type_as(x)
        return output * self.weight


class GptFastRMSNorm(MetaLlamaRMSNorm):
    """gpt-fast: the square as x * x, torch.mean."""

    def _norm(self, x):
        return x * torch.rsqrt(torch.mean(x * x, dim=-1, keepdim=True) + self.eps)


class Olmo2RMSNorm(nn.Module):
    """transformers' Olmo2: the weight multiplied in fp32 before the one cast."""

    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.variance_epsilon, self.weight = eps, nn.Parameter(torch.ones(dim))

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return (self.weight * hidden_states).to(input_dtype)


class GemmaRMSNorm(nn.Module):
    """transformers' Gemma / Gemma 3: (1 + w), weights stored around zero."""

    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.zeros(dim))

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        output = self._norm(x.float())
        output = output * (1.0 + self.weight.float())
        return output.type_as(x)


class VllmNativeRMSNorm(nn.Module):
    """vLLM's RMSNorm.forward_native: the residual added in fp32, the unrounded sum normalised."""

    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.variance_epsilon, self.weight = eps, nn.Parameter(torch.ones(dim))

    def forward(self, x, residual=None):
        orig_dtype = x.dtype
        x = x.to(torch.float32)
        if residual is not None:
            x = x + residual.to(torch.float32)
            residual = x.to(orig_dtype)
        variance = x.pow(2).mean(dim=-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.variance_epsilon)
        x = x.to(orig_dtype)
        x = x * self.weight
        return x if residual is None else (x, residual)


class PowLlamaRMSNorm(Olmo2RMSNorm):
    """The Llama form with the inverse root written as a power: ``(variance + eps) ** -0.5``."""

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * (variance + self.variance_epsilon) ** -0.5
        return self.weight * hidden_states.to(input_dtype)


class PowFp32WeightRMSNorm(Olmo2RMSNorm):
    """``torch.pow(variance + eps, -0.5)``, the weight multiplied in fp32 before the cast."""

    def forward(self, hidden_states):
        h = hidden_states.float()
        h = h * torch.pow(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon, -0.5)
        return (self.weight * h).to(hidden_states.dtype)


class ScaleFreeRMSNorm(nn.Module):
    """transformers' Gemma3n with_scale=False: no weight, the fp32 row normalised and cast back."""

    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps

    def forward(self, x):
        h = x.float()
        return (h * torch.pow(h.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)).type_as(x)


def _unweighted_nn_rmsnorm(dim):
    """torch's nn.RMSNorm without the affine weight (F.rms_norm(x, shape, None, eps))."""
    return nn.RMSNorm(dim, eps=1e-6, elementwise_affine=False)


def _torchtitan_norm(dim):
    """torchtitan: nn.RMSNorm (F.rms_norm)."""
    return nn.RMSNorm(dim, eps=1e-6)


# name: (module factory, whether it takes the residual, the spelling that must match, fusion)
CASES = {
    "meta": (MetaLlamaRMSNorm, False, "meta_rms_norm", "rms_norm"),
    "gpt_fast": (GptFastRMSNorm, False, "gpt_fast_rms_norm", "rms_norm"),
    "olmo2": (Olmo2RMSNorm, False, "olmo2_rms_norm", "rms_norm"),
    "gemma": (GemmaRMSNorm, False, "offset_rms_norm", "rms_norm"),
    "torchtitan": (_torchtitan_norm, False, "functional_rms_norm", "rms_norm"),
    "vllm": (VllmNativeRMSNorm, False, "meta_rms_norm", "rms_norm"),
    "vllm_residual": (VllmNativeRMSNorm, True, "vllm_add_rms_norm", "add_rms_norm"),
    "pow": (PowLlamaRMSNorm, False, "pow_rms_norm", "rms_norm"),
    "pow_fp32_weight": (PowFp32WeightRMSNorm, False, "pow_fp32_weight_rms_norm", "rms_norm"),
    "unweighted_nn": (_unweighted_nn_rmsnorm, False, "functional_unweighted_rms_norm", "rms_norm_unweighted"),
    "scale_free": (ScaleFreeRMSNorm, False, "pow_unweighted_rms_norm", "rms_norm_unweighted"),
}
POW_CASES = {"pow", "pow_fp32_weight", "scale_free"}
# By default bf16 (the graphs keep every cast there); fp32 and fp16 for each in the slow set.
PARAMS = [pytest.param(c, torch.bfloat16, id=f"{c}-bf16") for c in CASES] + [
    pytest.param(c, dtype, id=f"{c}-{name}", marks=pytest.mark.slow)
    for c in CASES
    for dtype, name in ((torch.float32, "fp32"), (torch.float16, "fp16"))
]


@pytest.mark.parametrize(("case", "dtype"), PARAMS)
def test_spelling_raises_bit_exact(case, dtype):
    factory, with_residual, spelling, fusion = CASES[case]
    g = torch.Generator().manual_seed(hash(case) % 1000)
    dim = 72  # not a power of two
    norm = factory(dim).to(dtype)
    if getattr(norm, "weight", None) is not None:
        with torch.no_grad():
            norm.weight.copy_(torch.randn(dim, generator=g).to(dtype))
    x, residual = (torch.randn(2, 5, dim, generator=g).to(dtype) for _ in range(2))
    args = (x, residual) if with_residual else (x,)

    def fn(*args):
        out = norm(*args)
        return tuple(o * 2 for o in out) if isinstance(out, tuple) else out * 2

    torch._dynamo.reset()
    report = fusion_passes.Report()
    fusions = ["add_rms_norm", "rms_norm", "rms_norm_unweighted"]
    backend = fusion_passes.backend(fusions, report=report, lower_back=False)
    with torch.no_grad():
        out = torch.compile(fn, backend=backend)(*args)
        expected = fn(*args)
    # In fp32 the Llama and fp32-weight forms coincide (no casts): either spelling may take it.
    assert {k: v for k, v in report.matches.items() if v} == {fusion: 1}
    (site,) = report.sites
    if dtype != torch.float32:
        assert site.spelling == spelling
    (graph,) = report.graphs
    norm_ops = {"aten.mean.dim", "aten.pow.Tensor_Scalar"} if case in POW_CASES else NORM_OPS
    assert norm_ops <= set(graph.ops_before) and not {"aten.rsqrt.default", "aten.mean.dim"} & set(graph.ops_after)
    op = "rms_norm" if fusion == "rms_norm_unweighted" else fusion  # a weight of ones, the same op
    assert graph.ops_after[f"fusion_passes.{op}.default"] == 1
    for a, e in zip(*(o if isinstance(o, tuple) else (o,) for o in (out, expected)), strict=True):
        assert torch.equal(a, e)


def test_vllm_fp32_residual_differs_from_the_rounded_form():
    """The parameter matters: normalising the rounded sum gives other bits in bf16."""
    from fusion_passes.lowering.rms_norm.reference import add_rms_norm_reference

    g = torch.Generator().manual_seed(3)
    x, r = (torch.randn(64, 256, generator=g).bfloat16() for _ in range(2))
    w = torch.randn(256, generator=g).bfloat16()
    fp32_add, new_r = add_rms_norm_reference(x, r, w, 1e-6, 0.0, True, True)
    rounded, new_r2 = add_rms_norm_reference(x, r, w, 1e-6, 0.0, True, False)
    assert torch.equal(new_r, new_r2) and not torch.equal(fp32_add, rounded)
