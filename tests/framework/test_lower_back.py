"""The lower-back stage: a canonical op that no region fusion consumed is decomposed back into its
reference, so the compiled graph is what stock Inductor compiles for the model's own spelling
(same outputs bit for bit, same kernels), and a consumed one is left to its fused op."""

from __future__ import annotations

import pytest
import torch

import fusion_passes
from fusion_passes.kernels import count_kernels
from fusion_passes.lower_back import lower_back
from fusion_passes.lowering.common.ops import LOWER_BACK
from fusion_passes.patterns.rms_norm import functional_rms_norm, llama_rms_norm, offset_rms_norm

NORMS = {"llama": llama_rms_norm, "functional": functional_rms_norm, "offset": offset_rms_norm}


def _compile(fn, args, **options):
    """(outputs, report, kernel counts of the generated code)."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    report = fusion_passes.Report()
    backend = fusion_passes.backend(report=report, **options) if options.get("lower_back") is not None else "inductor"
    compiled = torch.compile(fn, backend=backend)
    # Without the FX graph cache: a hit whose report records were written by another checkout
    # (another path in the stack traces) compiles twice, and both codes would be counted.
    with torch._inductor.config.patch(fx_graph_cache=False):
        out, codes = run_and_get_code(compiled, *args)
    return out, report, count_kernels(codes)


def rope_full(q, k, cos, sin):
    """transformers' apply_rotary_pos_emb (unsqueeze_dim=1)."""

    def rotate_half(x):
        return torch.cat((-x[..., x.shape[-1] // 2 :], x[..., : x.shape[-1] // 2]), dim=-1)

    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def _decoder_step(norm):
    """A residual add, the norm, and consumers Inductor fuses with a plain norm (a scale, the
    next add), as between two projections."""

    def fn(x, residual, w):
        h = residual + x
        y = norm(h, w, 1e-6)
        return y * 0.5 + h, h

    return fn


@pytest.mark.parametrize(
    ("form", "dtype"), [("llama", torch.bfloat16), ("functional", torch.float32), ("offset", torch.float16)]
)
def test_standalone_norm_is_lowered_back_to_stock_inductor(form, dtype):
    g = torch.Generator().manual_seed(1)
    x, residual = (torch.randn(3, 5, 72, generator=g).to(dtype) for _ in range(2))
    w = (1 + 0.3 * torch.randn(72, generator=g)).to(dtype)
    fn = _decoder_step(NORMS[form])
    stock, _, stock_kernels = _compile(fn, (x, residual, w))
    lowered, report, kernels = _compile(fn, (x, residual, w), lower_back=True)
    kept, kept_report, kept_kernels = _compile(fn, (x, residual, w), lower_back=False)

    # Raised, then lowered back: no fusion_passes op reaches Inductor.
    assert report.matches["add_rms_norm"] == 1 and kept_report.matches["add_rms_norm"] == 1
    assert dict(report.lowered_back()) == {"fusion_passes.add_rms_norm.default": 1}
    assert not any(op.startswith("fusion_passes.") for op in report.graphs[0].ops_after)
    assert kept_report.graphs[0].ops_after["fusion_passes.add_rms_norm.default"] == 1
    assert not kept_report.lowered_back()
    # Bit for bit what stock Inductor computes, with its kernels; kept, the opaque op is a call of
    # its own and Inductor cannot fuse the consumers into it.
    for a, b in zip(lowered, stock, strict=True):
        assert torch.equal(a, b)
    assert kernels == stock_kernels
    assert kept_kernels["fused_ops"] == 1 and kept_kernels["generated"] >= 1


def test_consumed_norms_are_not_lowered_back():
    """q_norm / k_norm consumed by the QK-norm + RoPE region stay in its fused op; the layer's
    own input norm, standalone, is lowered back."""
    
    g = torch.Generator().manual_seed(2)
    b, s, hq, hk, d = 1, 3, 4, 2, 16
    x = torch.randn(b, s, 32, generator=g)
    wq, wk = torch.randn(32, hq * d, generator=g) / 6, torch.randn(32, hk * d, generator=g) / 6
    n_w, q_w, k_w = (1 + 0.2 * torch.randn(n, generator=g) for n in (32, d, d))
    cos, sin = torch.randn(b, s, d, generator=g), torch.randn(b, s, d, generator=g)

    def attention_prelude(x, cos, sin):
        h = llama_rms_norm(x, n_w, 1e-6)
        q = llama_rms_norm((h @ wq).view(b, s, hq, d), q_w, 1e-6).transpose(1, 2)
        k = llama_rms_norm((h @ wk).view(b, s, hk, d), k_w, 1e-6).transpose(1, 2)
        return rope_full(q, k, cos, sin)

    out, report, _ = _compile(attention_prelude, (x, cos, sin), lower_back=True)
    assert report.matches["rms_norm"] == 3 and report.matches["qk_norm_rope"] == 1
    assert dict(report.lowered_back()) == {"fusion_passes.rms_norm.default": 1}
    ops = report.graphs[0].ops_after
    assert ops["fusion_passes.qk_norm_rope.default"] == 1 and "fusion_passes.rms_norm.default" not in ops
    # Each rewrite's fate: the q / k norms taken by the region, the input norm lowered back; the
    # final counts hold only what the compiled graph runs.
    assert report.fates("rms_norm") == {"taken by qk_norm_rope": 2, "lowered back": 1}
    assert report.final()["rms_norm"] == 0 and report.final()["qk_norm_rope"] == 1
    assert "rms_norm: 0 site(s) (3 rewritten, 1 lowered back, 2 taken by qk_norm_rope)" in report.summary()
    for a, e in zip(out, attention_prelude(x, cos, sin), strict=True):
        torch.testing.assert_close(a, e)


def test_a_direct_call_with_defaults_left_out_is_lowered_with_them():
    """A model that calls the canonical op itself, trailing defaults left out, standalone: lowered
    back with the defaults the op saw (the fp32-weight form), and other nodes untouched."""
    op = torch.ops.fusion_passes.rms_norm.default
    assert op in LOWER_BACK and lower_back is not None

    def fn(x, w):
        return op(x, w, 1e-6) + 1

    x, w = torch.randn(2, 8, dtype=torch.bfloat16), torch.randn(8, dtype=torch.bfloat16)
    stock, _, _ = _compile(lambda x, w: functional_rms_norm(x, w, 1e-6) + 1, (x, w))
    out, report, kernels = _compile(fn, (x, w), lower_back=True)
    assert dict(report.lowered_back()) == {"fusion_passes.rms_norm.default": 1}
    assert kernels["fused_ops"] == 0 and report.graphs[0].ops_after["aten.rsqrt.default"] == 1
    assert torch.equal(out, stock)


def test_lower_back_option_is_checked():
    with pytest.raises(TypeError, match="lower_back must be a bool"):
        fusion_passes.backend(lower_back="no")
