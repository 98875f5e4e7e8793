"""Near misses: a candidate site left unfused is reported with the closest spelling and the first
node where the graph diverged from it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fusion_passes
from fusion_passes.patterns.rms_norm import llama_rms_norm


def over_dim_1(x, w):
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(1, keepdim=True) + 1e-6)
    return w * h.to(x.dtype)


def sum_based_l2(x, w):
    h = x.float()
    return w * (h * torch.rsqrt(h.pow(2).sum(-1, keepdim=True) + 1e-6)).to(x.dtype)


def fp32_weight(x, w):
    w = w.float()
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    return w * h.to(x.dtype)


def layer_norm(x, w):
    return F.layer_norm(x, (x.shape[-1],), w, None, 1e-5)


def cube_instead_of_square(x, w):
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(3).mean(-1, keepdim=True) + 1e-6)
    return w * h.to(x.dtype)


def pow_over_dim_1(x, w):
    h = x.to(torch.float32)
    h = h * torch.pow(h.pow(2).mean(1, keepdim=True) + 1e-6, -0.5)
    return w * h.to(x.dtype)


CASES = {
    pow_over_dim_1: ("pow_rms_norm", "aten.mean.dim argument 1 is [1], the spelling has [-1]"),
    over_dim_1: ("llama_rms_norm", "aten.mean.dim argument 1 is [1], the spelling has [-1]"),
    sum_based_l2: ("llama_rms_norm", "expected aten.mean.dim, found aten.sum.dim_IntList"),
    fp32_weight: ("llama_rms_norm", "weight is torch.float32, the spelling expects torch.bfloat16"),
    layer_norm: ("llama_rms_norm", "expected aten.mean.dim, found an output of aten.var_mean"),
    cube_instead_of_square: ("llama_rms_norm", "aten.pow.Tensor_Scalar argument 1 is 3, the spelling has 2"),
}


@pytest.mark.parametrize("fn", CASES, ids=lambda f: f.__name__)
def test_near_miss_names_closest_spelling_and_divergence(fn):
    spelling, reason = CASES[fn]
    x = torch.randn(4, 64, 64, dtype=torch.bfloat16)
    w = torch.randn(64, dtype=torch.bfloat16)
    report = fusion_passes.Report()
    torch._dynamo.reset()
    torch.compile(fn, backend=fusion_passes.backend(report=report))(x, w)
    assert sum(report.matches.values()) == 0
    assert report.graphs[0].ops_after == report.graphs[0].ops_before
    (miss,) = report.near_misses
    assert miss.spelling == spelling and miss.reason.startswith(reason), miss
    assert 0 < miss.matched <= miss.total and miss.location.endswith(f"in {fn.__name__}")


def test_an_intermediate_read_elsewhere_is_named():
    """Every op lines up, but the normalised fp32 value is also returned: the near miss names the
    intermediate and its other reader."""

    def norm_and_its_fp32_value(x, w):
        h = x.to(torch.float32)
        n = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return w * n.to(x.dtype), n.sum()

    x = torch.randn(4, 64, dtype=torch.bfloat16)
    w = torch.randn(64, dtype=torch.bfloat16)
    report = fusion_passes.Report()
    torch._dynamo.reset()
    torch.compile(norm_and_its_fp32_value, backend=fusion_passes.backend(report=report))(x, w)
    assert report.matches["rms_norm"] == 0
    assert report.graphs[0].ops_after == report.graphs[0].ops_before
    (miss,) = report.near_misses
    assert miss.matched == miss.total, miss
    assert "every op lined up, but the intermediate aten.mul.Tensor" in miss.reason, miss
    assert "is also read by aten.sum" in miss.reason and "the rewrite would drop it" in miss.reason


def test_fused_sites_leave_no_near_miss():
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    w = torch.randn(64, dtype=torch.bfloat16)
    report = fusion_passes.Report()
    torch._dynamo.reset()
    torch.compile(lambda x, w: llama_rms_norm(x, w, 1e-6), backend=fusion_passes.backend(report=report))(x, w)
    assert report.matches["rms_norm"] == 1 and report.near_misses == []
