"""Rewrite tests of the RMSNorm family: exact match counts, ops before/after, and outputs of the
compiled-with-passes function against eager and against stock Inductor."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fusion_passes
from _params import by_str, grid
from fusion_passes.numerics import compare
from fusion_passes.patterns.rms_norm import functional_rms_norm, llama_rms_norm, offset_rms_norm

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
NORM_OPS = {"aten.pow.Tensor_Scalar", "aten.mean.dim", "aten.rsqrt.default"}


def compile_with_report(fn, *args, fusions="all", **options):
    report = fusion_passes.Report()
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=fusion_passes.backend(fusions, report=report, **options))
    return compiled(*args), report


def matched(report):
    """Sites per fusion, the fusions that matched nothing left out (every fusion runs)."""
    return {name: n for name, n in report.matches.items() if n}


def stock_inductor(fn, *args):
    torch._dynamo.reset()
    return torch.compile(fn, backend="inductor")(*args)


def assert_outputs(actual, expected, dtype):
    actual = actual if isinstance(actual, tuple) else (actual,)
    expected = expected if isinstance(expected, tuple) else (expected,)
    for a, e in zip(actual, expected, strict=True):
        c = compare(a, e, dtype)
        assert c.ok, f"max abs error {c.max_abs}"


def inputs(dtype, shape=(3, 5, 96), seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g).to(dtype)
    residual = torch.randn(shape, generator=g).to(dtype)
    weight = (1 + 0.5 * torch.randn(shape[-1], generator=g)).to(dtype)
    return x, residual, weight


SPELLINGS = {
    "llama": (llama_rms_norm, "llama_rms_norm"),
    "functional": (functional_rms_norm, "functional_rms_norm"),
    "offset": (offset_rms_norm, "offset_rms_norm"),
}


# By default each spelling in one dtype, and each dtype once, here and in the add + norm test
# below (another dtype per spelling there): six of the nine pairs between them.
@pytest.mark.parametrize(
    ("spelling", "dtype"),
    grid(
        {"spelling": by_str(list(SPELLINGS)), "dtype": by_str(DTYPES)},
        default=lambda spelling, dtype: list(SPELLINGS).index(spelling) == DTYPES.index(dtype),
    ),
)
def test_rms_norm_spelling(spelling, dtype):
    norm, name = SPELLINGS[spelling]
    x, _, weight = inputs(dtype)

    def fn(x, w):
        return norm(x, w, 1e-6) * 2  # a consumer, so the norm is not the graph's only op

    # The raise stage alone (the norm has no region to join: kept, not lowered back).
    out, report = compile_with_report(fn, x, weight, lower_back=False)
    assert matched(report) == {"rms_norm": 1}
    (site,) = report.sites
    assert site.spelling == name and NORM_OPS <= set(site.ops_removed)
    assert site.ops_added == ("fusion_passes.rms_norm.default",)
    (graph,) = report.graphs
    assert NORM_OPS <= set(graph.ops_before) and not NORM_OPS & set(graph.ops_after)
    assert graph.ops_after["fusion_passes.rms_norm.default"] == 1
    assert_outputs(out, fn(x, weight), dtype)
    assert_outputs(out, stock_inductor(fn, x, weight), dtype)


@pytest.mark.parametrize(
    ("spelling", "dtype"),
    grid(
        {"spelling": by_str(list(SPELLINGS)), "dtype": by_str(DTYPES)},
        default=lambda spelling, dtype: (list(SPELLINGS).index(spelling) + 1) % 3 == DTYPES.index(dtype),
    ),
)
def test_add_rms_norm_spelling_reuses_residual(spelling, dtype):
    norm, name = SPELLINGS[spelling]
    x, residual, weight = inputs(dtype)

    def fn(x, residual, w):
        hidden = residual + x  # the decoder layer's order
        normed = norm(hidden, w, 1e-5)
        return hidden + normed  # the sum is the next residual

    out, report = compile_with_report(fn, x, residual, weight, lower_back=False)
    assert matched(report) == {"add_rms_norm": 1}
    (site,) = report.sites
    assert site.spelling == f"add_{name}"
    assert "aten.add.Tensor" in site.ops_removed
    (graph,) = report.graphs
    assert graph.ops_after["fusion_passes.add_rms_norm.default"] == 1
    assert not NORM_OPS & set(graph.ops_after)
    assert_outputs(out, fn(x, residual, weight), dtype)
    assert_outputs(out, stock_inductor(fn, x, residual, weight), dtype)


def test_add_order_and_eps_are_pattern_arguments():
    """x + residual and residual + x both fuse; each site keeps its own eps (a wrong eps would
    change the output far beyond tolerance: eps 0.5 against 1e-6)."""
    x, residual, weight = inputs(torch.bfloat16)

    def fn(x, residual, w):
        h1 = x + residual
        a = llama_rms_norm(h1, w, 1e-6)
        h2 = h1 + a
        b = llama_rms_norm(h2, w, 0.5)
        c = llama_rms_norm(b, w, 1e-2)
        return b, c, h2

    out, report = compile_with_report(fn, x, residual, weight)
    assert matched(report) == {"add_rms_norm": 2, "rms_norm": 1}
    eps = sorted(site.scalars["eps"] for site in report.sites_of("add_rms_norm"))
    assert eps == [1e-6, 0.5] and report.sites_of("rms_norm")[0].scalars == {"eps": 1e-2}
    assert_outputs(out, fn(x, residual, weight), torch.bfloat16)


def test_nn_rmsnorm_module_and_final_norm_without_reuse():
    """nn.RMSNorm (F.rms_norm) after an add whose sum is not used again: still add_rms_norm."""
    norm = nn.RMSNorm(64, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(64))
    x, residual, _ = inputs(torch.float32, (2, 7, 64))

    def fn(x, residual):
        return norm(x + residual)

    with torch.no_grad():  # inference: autograd would keep the normalised value for backward
        out, report = compile_with_report(fn, x, residual)
        expected = fn(x, residual)
    assert matched(report) == {"add_rms_norm": 1}
    assert_outputs(out, expected, torch.float32)


def test_training_graph_that_saves_an_intermediate_does_not_match():
    """With a trainable weight, autograd saves x * rsqrt(...) for backward: that intermediate
    escapes the pattern, so fusing would have to recompute it: no match."""
    norm = nn.RMSNorm(64, eps=1e-6)
    x, _, _ = inputs(torch.float32, (2, 7, 64))
    out, report = compile_with_report(norm, x)
    assert sum(report.matches.values()) == 0
    assert_outputs(out, norm(x), torch.float32)


def test_fusions_can_be_enabled_by_name():
    x, residual, weight = inputs(torch.float32)

    def fn(x, residual, w):
        return llama_rms_norm(x + residual, w, 1e-6)

    _, report = compile_with_report(fn, x, residual, weight, fusions=["rms_norm"], lower_back=False)
    # add_rms_norm disabled: the norm alone is fused, the add stays an Inductor op.
    assert matched(report) == {"rms_norm": 1}
    assert report.graphs[0].ops_after["aten.add.Tensor"] == 1


# --- must not match --------------------------------------------------------------------------


def _unfused(fn, *args):
    out, report = compile_with_report(fn, *args)
    assert sum(report.matches.values()) == 0, report.summary()
    assert report.graphs[0].ops_after == report.graphs[0].ops_before
    return out, report


def test_layer_norm_does_not_match():
    x, _, weight = inputs(torch.float32)
    _unfused(lambda x, w: F.layer_norm(x, (x.shape[-1],), w, None, 1e-5), x, weight)


def test_norm_over_another_dim_does_not_match():
    x, _, weight = inputs(torch.float32, (4, 96, 96))

    def over_dim_1(x, w):
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(1, keepdim=True) + 1e-6)
        return w * h.to(x.dtype)

    out, _ = _unfused(over_dim_1, x, weight)
    assert_outputs(out, over_dim_1(x, weight), torch.float32)


def test_sum_based_l2_norm_does_not_match():
    x, _, weight = inputs(torch.float32)

    def l2(x, w):
        return w * (x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6))

    _unfused(l2, x, weight)


def test_mismatched_weight_dtype_is_rejected_with_reason():
    """Llama form with an fp32 weight on bf16 activations promotes to fp32: another op."""
    x, _, _ = inputs(torch.bfloat16)
    weight = 1 + torch.randn(x.shape[-1])

    def fn(x, w):
        return llama_rms_norm(x, w, 1e-6)

    out, report = _unfused(fn, x, weight)
    assert out.dtype == torch.float32
    assert not report.errors
    # one reason, the weighted form's; its inner half is not raised as a norm without weight
    assert report.rejected and all(r.fusion == "rms_norm" and "dtype" in r.reason for r in report.rejected)
    # Stock Inductor skips the bf16 rounding of n (emulate_precision_casts is off): bf16 tolerance.
    assert_outputs(out, fn(x, weight), torch.bfloat16)


def test_broadcast_residual_is_not_add_rms_norm():
    """A bias-like add (shape [H]) is no residual: only the norm itself fuses."""
    x, _, weight = inputs(torch.float32)
    bias = torch.randn(x.shape[-1])

    def fn(x, b, w):
        return llama_rms_norm(x + b, w, 1e-6)

    out, report = compile_with_report(fn, x, bias, weight)
    assert report.matches["add_rms_norm"] == 0 and report.matches["rms_norm"] == 1
    assert any("residual must match" in r.reason for r in report.rejected)
    assert_outputs(out, fn(x, bias, weight), torch.float32)


def test_dynamic_token_count_one_graph():
    """dynamic=True: one graph with a symbolic token count serves every size (verify uses the
    size hints)."""
    report = fusion_passes.Report()
    torch._dynamo.reset()

    def fn(x, residual, w):
        hidden = residual + x
        return llama_rms_norm(hidden, w, 1e-6), hidden

    compiled = torch.compile(
        fn, backend=fusion_passes.backend(report=report, verify=True), dynamic=True
    )
    for tokens in (3, 7, 20):
        x, residual, weight = inputs(torch.bfloat16, (tokens, 64), seed=tokens)
        assert_outputs(compiled(x, residual, weight), fn(x, residual, weight), torch.bfloat16)
    assert len(report.graphs) == 1 and matched(report) == {"add_rms_norm": 1}


def test_strided_input_of_a_split_like_deepseek_kv_a_layernorm():
    """DeepSeek's kv_a_layernorm normalises a torch.split slice (rows of 512 in a row of 576):
    fused, verified on random inputs with the same strides, equal to eager."""
    kv = torch.randn(3, 5, 80, dtype=torch.bfloat16)
    weight = (1 + 0.3 * torch.randn(64)).to(torch.bfloat16)

    def fn(kv, w):
        compressed, k_pe = torch.split(kv, [64, 16], dim=-1)
        return llama_rms_norm(compressed, w, 1e-6), k_pe * 2

    out, report = compile_with_report(fn, kv, weight, verify=True)
    assert matched(report) == {"rms_norm": 1} and not report.rejected
    assert_outputs(out, fn(kv, weight), torch.bfloat16)
