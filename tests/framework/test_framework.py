"""The framework: entry point, FX graph cache, failure handling, verify, registration, errors."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch._inductor.utils import fresh_cache

import fusion_passes
from fusion_passes import report_cache
from fusion_passes.numerics import compare
from fusion_passes.pass_manager import FusionPassManager
from fusion_passes.patterns.rms_norm import llama_rms_norm
from fusion_passes.registry import get_fusions

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository


def norm_fn(x, residual, w):
    h = x + residual
    return llama_rms_norm(h, w, 1e-6), h


def norm_inputs(dtype=torch.float32):
    x = torch.randn(4, 64, dtype=dtype)
    return x, torch.randn_like(x), (1 + 0.2 * torch.randn(64)).to(dtype)


def profiled_ops(fn, *args):
    """Names of the ops a call ran (the compiled code calls fused ops by name on CPU)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn(*args)
    return {e.name for e in prof.events()}


def test_backend_by_name_without_import():
    """The torch_dynamo_backends entry point: a fresh interpreter that never imports the package."""
    script = textwrap.dedent(
        """
        import torch
        from torch._inductor.utils import run_and_get_code
        assert "fusion_passes" in torch._dynamo.list_backends()
        def norm(x, w):
            h = x.to(torch.float32)
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
            return w * h.to(x.dtype)
        def rotate_half(x):
            return torch.cat((-x[..., 8:], x[..., :8]), dim=-1)
        def f(q, k, w, cos, sin):  # q / k norm + RoPE: a region, so its fused op stays
            q, k = norm(q, w).transpose(1, 2), norm(k, w).transpose(1, 2)
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
            return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        q, k, w = torch.randn(1, 3, 4, 16), torch.randn(1, 3, 2, 16), torch.randn(16)
        cos, sin = torch.randn(1, 3, 16), torch.randn(1, 3, 16)
        out, code = run_and_get_code(torch.compile(f, backend="fusion_passes"), q, k, w, cos, sin)
        assert "fusion_passes.qk_norm_rope" in "".join(code), code
        torch.testing.assert_close(out, f(q, k, w, cos, sin))
        print("ok")
        """
    )
    env = {**os.environ, "TORCHINDUCTOR_FX_GRAPH_CACHE": "0"}
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300
    )
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]


def test_fx_graph_cache_hit_still_carries_the_fusion_and_its_report():
    args = norm_inputs()
    with fresh_cache():
        first = fusion_passes.Report()
        torch._dynamo.reset()
        # lower_back=False: the standalone norm stays a call of its op, which the profile shows.
        torch.compile(norm_fn, backend=fusion_passes.backend(report=first, lower_back=False))(*args)
        assert first.matches["add_rms_norm"] == 1 and not first.graphs[0].from_cache

        hits = counters["inductor"]["fxgraph_cache_hit"]
        second = fusion_passes.Report()
        torch._dynamo.reset()
        compiled = torch.compile(norm_fn, backend=fusion_passes.backend(report=second, lower_back=False))
        out = compiled(*args)
        assert counters["inductor"]["fxgraph_cache_hit"] == hits + 1
        # The cached code calls the fused op, and the report replays the stored sites.
        assert "fusion_passes::add_rms_norm" in profiled_ops(compiled, *args)
        assert second.matches["add_rms_norm"] == 1 and second.graphs[0].from_cache
        assert second.sites == first.sites
        for a, e in zip(out, norm_fn(*args)):
            assert compare(a, e).ok


def test_cache_hit_without_stored_records_recompiles_for_the_report():
    args = norm_inputs()
    with fresh_cache():
        torch._dynamo.reset()
        torch.compile(norm_fn, backend=fusion_passes.backend())(*args)
        shutil.rmtree(report_cache._directory())
        report = fusion_passes.Report()
        torch._dynamo.reset()
        torch.compile(norm_fn, backend=fusion_passes.backend(report=report))(*args)
        assert report.matches["add_rms_norm"] == 1 and not report.graphs[0].from_cache
        assert dict(report.lowered_back()) == {"fusion_passes.add_rms_norm.default": 1}
        # Served from the cache with the records kept: the lowering is replayed too.
        again = fusion_passes.Report()
        torch._dynamo.reset()
        torch.compile(norm_fn, backend=fusion_passes.backend(report=again))(*args)
        assert again.graphs[0].from_cache and again.lowered_back() == report.lowered_back()


def test_enabled_fusions_and_options_change_the_cache_key():
    both = FusionPassManager(get_fusions("all"))
    assert both.uuid() == FusionPassManager(get_fusions("all")).uuid()
    keys = {
        both.uuid(),
        FusionPassManager(get_fusions(["rms_norm"])).uuid(),
        FusionPassManager(get_fusions(["add_rms_norm"])).uuid(),
        FusionPassManager(get_fusions("all"), verify=True).uuid(),
        FusionPassManager(get_fusions("all"), launch="dispatch").uuid(),
        FusionPassManager(get_fusions("all"), lower_back=False).uuid(),
    }
    assert len(keys) == 6
    # And Inductor uses it: another enabled set is a cache miss, compiled with its own fusions.
    args = norm_inputs()
    with fresh_cache():
        for fusions, expected in ((["rms_norm"], "rms_norm"), (["add_rms_norm"], "add_rms_norm")):
            report = fusion_passes.Report()
            misses = counters["inductor"]["fxgraph_cache_miss"]
            torch._dynamo.reset()
            torch.compile(norm_fn, backend=fusion_passes.backend(fusions, report=report))(*args)
            assert counters["inductor"]["fxgraph_cache_miss"] == misses + 1
            assert dict(report.matches) == {expected: 1}


def _explode_on_second_match():
    seen = []

    def check(values):
        seen.append(values)
        if len(seen) == 2:
            raise RuntimeError("boom")
        return None

    return check


def _two_silu_muls(gate, up):
    return F.silu(gate) * up, F.silu(up) * gate


@pytest.fixture
def exploding_fusion():
    fusion = fusion_passes.register_fusion(
        "exploding_silu_mul",
        pattern=lambda gate, up: F.silu(gate) * up,
        replacement=lambda gate, up: (F.silu(gate) * up).clone(),
        example_inputs=lambda: [(torch.randn(4, 8), torch.randn(4, 8))],
        check=_explode_on_second_match(),
        summary="test fusion that raises on its second match",
    )
    yield fusion
    fusion_passes.unregister_fusion(fusion.name)


def test_failing_fusion_warns_and_leaves_the_graph_unchanged(exploding_fusion):
    gate, up = torch.randn(4, 8), torch.randn(4, 8)
    report = fusion_passes.Report()
    torch._dynamo.reset()
    backend = fusion_passes.backend([exploding_fusion.name], report=report)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = torch.compile(_two_silu_muls, backend=backend)(gate, up)
    assert any("exploding_silu_mul" in str(w.message) and "boom" in str(w.message) for w in caught)
    assert report.errors and "boom" in report.errors[0]
    # The first match had been applied when the second raised: it was rolled back too.
    assert report.matches[exploding_fusion.name] == 0
    assert report.graphs[0].ops_after == report.graphs[0].ops_before
    for a, e in zip(out, _two_silu_muls(gate, up)):
        assert compare(a, e).ok


def test_strict_reraises(exploding_fusion):
    torch._dynamo.reset()
    backend = fusion_passes.backend([exploding_fusion.name], strict=True)
    with pytest.raises(Exception, match="boom"):
        torch.compile(_two_silu_muls, backend=backend)(torch.randn(4, 8), torch.randn(4, 8))


@pytest.fixture
def wrong_fusion():
    """A replacement that is wrong by a factor: what verify=True exists to catch."""
    fusion = fusion_passes.register_fusion(
        "wrong_scale",
        pattern=lambda x: torch.sigmoid(x) * 3.0,
        replacement=lambda x: torch.sigmoid(x) * 3.001,
        example_inputs=lambda: [(torch.randn(4, 8),)],
    )
    yield fusion
    fusion_passes.unregister_fusion(fusion.name)


def test_verify_rejects_a_wrong_rewrite(wrong_fusion):
    x = torch.randn(16, 32)

    def fn(x):
        return torch.sigmoid(x) * 3.0

    report = fusion_passes.Report()
    torch._dynamo.reset()
    out = torch.compile(fn, backend=fusion_passes.backend(["wrong_scale"], report=report, verify=True))(x)
    assert report.matches["wrong_scale"] == 0
    (rejection,) = report.rejected
    assert rejection.reason.startswith("verify: output 0 differs") and "seed" in rejection.reason
    torch.testing.assert_close(out, fn(x))

    # Without verify the wrong rewrite is applied: the check above is what stopped it.
    report = fusion_passes.Report()
    torch._dynamo.reset()
    out = torch.compile(fn, backend=fusion_passes.backend(["wrong_scale"], report=report))(x)
    assert report.matches["wrong_scale"] == 1 and not compare(out, fn(x)).ok


def test_verify_accepts_the_builtin_fusions():
    args = norm_inputs(torch.bfloat16)
    report = fusion_passes.Report()
    torch._dynamo.reset()
    torch.compile(norm_fn, backend=fusion_passes.backend(report=report, verify=True))(*args)
    assert report.matches["add_rms_norm"] == 1 and not report.rejected


@pytest.fixture
def wrong_ids_fusion():
    """A replacement whose integer output (a top-k's indices) is off by one: a float tolerance
    cannot judge it, so verify=True compares integer outputs exactly."""
    fusion = fusion_passes.register_fusion(
        "wrong_ids",
        pattern=lambda x: torch.topk(x, 2).indices * 2,
        replacement=lambda x: torch.topk(x, 2).indices * 2 + 1,
        example_inputs=lambda: [(torch.randn(4, 8),)],
    )
    yield fusion
    fusion_passes.unregister_fusion(fusion.name)


def test_verify_compares_integer_outputs_exactly(wrong_ids_fusion):
    def fn(x):
        return torch.topk(x, 2).indices * 2

    x = torch.randn(6, 16)
    report = fusion_passes.Report()
    torch._dynamo.reset()
    out = torch.compile(fn, backend=fusion_passes.backend(["wrong_ids"], report=report, verify=True))(x)
    assert report.matches["wrong_ids"] == 0 and not report.errors
    (rejection,) = report.rejected
    assert rejection.reason.startswith("verify: output 0's values differ") and "seed" in rejection.reason
    assert torch.equal(out, fn(x))


def test_verify_accepts_the_moe_dispatch_and_the_index_mask():
    """verify=True on fusions with integer or boolean outputs: a MoE block's routing (expert ids),
    its dispatch prep (a stable sort may order equal ids otherwise than the model's: perm checked
    to sort the ids, the gathered rows per pair) and DeepSeek V3.2's index mask (the model
    scatters into a mask of ones: the check passes ones, not a random mask)."""
    from _moe_blocks import moe_block

    from fusion_passes.patterns.sparse_index_mask import transformers_index_mask

    block = moe_block("qwen3.5-moe")
    x = torch.randn(1, 5, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    report = fusion_passes.Report()
    torch._dynamo.reset()
    fusions = ["moe_route_softmax", "moe_sort_by_expert", "moe_sort_gather"]
    with torch.no_grad():
        torch.compile(block, backend=fusion_passes.backend(fusions, report=report, verify=True), fullgraph=True)(x)
    assert not report.rejected and not report.errors, (report.rejected, report.errors)
    assert report.final()["moe_route_softmax"] == 1 and report.final()["moe_sort_gather"] == 1

    def index_mask(scores):
        return transformers_index_mask(scores, torch.ones_like(scores, dtype=torch.bool), 7)

    report = fusion_passes.Report()
    torch._dynamo.reset()
    scores = torch.randn(2, 30)
    out = torch.compile(index_mask, backend=fusion_passes.backend(["sparse_index_mask_topk"], report=report,
                                                                verify=True))(scores)  # fmt: skip
    assert report.matches["sparse_index_mask_topk"] == 1 and not report.rejected and not report.errors
    assert torch.equal(out, index_mask(scores))


def test_bad_requests_are_one_line_errors():
    with pytest.raises(fusion_passes.FusionError, match="unknown fusion 'rms_nrom'"):
        fusion_passes.backend(["rms_nrom"])
    with pytest.raises(fusion_passes.FusionError, match="unknown Inductor option"):
        fusion_passes.backend(not_an_inductor_option=True)
    with pytest.raises(ValueError, match="launch must be one of"):
        fusion_passes.backend(launch="sideways")
    with pytest.raises(fusion_passes.FusionError, match="already registered"):
        fusion_passes.register_fusion(
            "rms_norm", pattern=llama_rms_norm, replacement=llama_rms_norm, example_inputs=list
        )


def test_list_fusions_has_the_builtins_in_application_order():
    names = [f.name for f in fusion_passes.list_fusions()]
    assert names[:2] == ["add_rms_norm", "rms_norm"]
    for fusion in fusion_passes.list_fusions()[:2]:
        assert "Unfused:" in fusion.doc and "Fused:" in fusion.doc and fusion.summary


def test_report_names_module_path_and_source_line():
    norm = torch.nn.RMSNorm(64, eps=1e-5)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.post_norm = norm

        def forward(self, x, residual):
            return self.post_norm(x + residual)

    block = Block().eval()
    x, residual, _ = norm_inputs()
    report = fusion_passes.Report()
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(block, backend=fusion_passes.backend(report=report))(x, residual)
    (site,) = report.sites
    assert site.module == "post_norm"
    assert site.location.startswith("test_framework.py:") and site.location.endswith("in forward")


def test_custom_fusion_example():
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    try:
        import custom_fusion
    finally:
        sys.path.pop(0)
    torch._dynamo.reset()
    report = custom_fusion.main()
    assert dict(report.matches) == {"silu_mul": 1, "rms_norm": 1}
    assert not report.rejected and not report.errors
    fusion_passes.unregister_fusion("silu_mul")


def test_direct_launch_rejects_ops_inductor_cannot_lower_post_grad():
    """A launcher returning a transpose (decomposed by Inductor before its post-grad passes, so
    without a lowering there) is refused before it can fail the compile; permute is fine."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from fusion_passes.lowering.common.direct_launch import check_lowerable

    x = torch.randn(2, 3, 4, 5)
    check_lowerable(make_fx(lambda t: torch.empty_like(t).permute(0, 2, 1, 3))(x).graph)
    with pytest.raises(RuntimeError, match="transpose"):
        check_lowerable(make_fx(lambda t: torch.empty_like(t).transpose(1, 2))(x).graph)
