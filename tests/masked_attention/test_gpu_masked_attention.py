"""CUDA: the masked attention kernels at real widths (MiniMax-M2's 48 / 8 heads of 128, Qwen 3.5's
16 / 2 of 256, DeepSeek V3.2's q / k of 192 and v of 128), on masks of -inf and of SDPA's cuDNN form
(-65504), against the fp32 reference and SDPA on repeat_kv's copies; tiny MiniMax-M2 / Qwen3-MoE
prefills on a StaticCache with the default fusions (masked_prefill_attention among them) and a tiny
DeepSeek V3.2 prefill with masked_prefill_attention_mha: the kernel launched per layer, the output
within bf16 tolerance of the prefill without it. Skipped without a GPU."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from _gpu_decode import prefill_side_by_side

import fusion_passes
from fusion_passes.lowering.masked_attention.reference import masked_attention_reference
from fusion_passes.lowering.masked_attention.triton import masked_attention_triton
from fusion_passes.numerics import compare, tolerance

pytestmark = pytest.mark.gpu


# after: unwritten cache slots after the prompt (a model's prefill on a cache of S + 1: an odd row)
@pytest.mark.parametrize("heads,kv_heads,dim,batch,s,offset,after", [
    (48, 8, 128, 1, 1000, 0, 16), (16, 2, 256, 2, 700, 37, 16), (64, 4, 128, 1, 4096, 0, 1), (48, 8, 128, 1, 4096, 0, 1)
])  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("closed", [float("-inf"), -65504.0])  # -65504: SDPA's cuDNN form of False
def test_real_widths_against_reference_and_sdpa(heads, kv_heads, dim, batch, s, offset, after, dtype, closed):
    g = torch.Generator(device="cuda").manual_seed(s)
    length = offset + s + after
    q = torch.randn(batch, heads, s, dim, device="cuda", generator=g).to(dtype)
    k, v = (torch.randn(batch, kv_heads, length, dim, device="cuda", generator=g).to(dtype) for _ in range(2))
    keep = (torch.arange(length, device="cuda")[None, :] <= torch.arange(s, device="cuda")[:, None] + offset)
    keep = keep[None, None].expand(batch, 1, s, length)
    bias = torch.zeros(keep.shape, dtype=dtype, device="cuda").masked_fill(~keep, closed)
    out = masked_attention_triton(q, k, v, bias, dim**-0.5)
    tol = tolerance(dtype)
    torch.testing.assert_close(out.float(), masked_attention_reference(q, k, v, bias, dim**-0.5).float(),
                               rtol=tol.rtol, atol=tol.atol)  # fmt: skip
    groups = heads // kv_heads
    sdpa = F.scaled_dot_product_attention(q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1),
                                          attn_mask=keep)  # fmt: skip
    torch.testing.assert_close(out.float(), sdpa.float(), rtol=tol.rtol, atol=tol.atol)


@pytest.mark.parametrize("model", ["minimax-m2", "qwen3-moe"])
def test_prefill_with_the_attention_fused(model):
    assert "masked_prefill_attention" in {f.name for f in fusion_passes.registry.get_fusions("all")}
    report, code, got, want = prefill_side_by_side(model, "masked_prefill_attention")
    assert report.final()["masked_prefill_attention"] == 2
    assert len(re.findall(r"_masked_attention_kernel_\d+\.run\(", code)) == 2
    assert compare(got, want).rel_norm <= tolerance(torch.bfloat16).rel_norm


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("closed", [float("-inf"), -65504.0])
def test_mla_widths_values_of_another_head_dim(dtype, closed):
    """DeepSeek V3.2's attention at prefill (masked_prefill_attention_mha's sites): as many KV heads
    as query heads, q / k of 192 and v of 128, a cache of S + 1 and a mask that also closes keys
    below the diagonal (the index top-k's), against the reference and SDPA."""
    g = torch.Generator(device="cuda").manual_seed(7)
    heads, s, length = 32, 777, 778
    q = torch.randn(1, heads, s, 192, device="cuda", generator=g).to(dtype)
    k = torch.randn(1, heads, length, 192, device="cuda", generator=g).to(dtype)
    v = torch.randn(1, heads, length, 128, device="cuda", generator=g).to(dtype)
    keep = torch.arange(length, device="cuda")[None, :] <= torch.arange(s, device="cuda")[:, None]
    keep &= torch.rand(s, length, device="cuda", generator=g) > 0.3
    keep[:, 0] = True  # every query keeps a key (the index top-k keeps at least one)
    keep = keep[None, None]
    bias = torch.zeros(keep.shape, dtype=dtype, device="cuda").masked_fill(~keep, closed)
    scale = 192**-0.5
    out = masked_attention_triton(q, k, v, bias, scale)
    tol = tolerance(dtype)
    torch.testing.assert_close(out.float(), masked_attention_reference(q, k, v, bias, scale).float(),
                               rtol=tol.rtol, atol=tol.atol)  # fmt: skip
    sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=scale)
    torch.testing.assert_close(out.float(), sdpa.float(), rtol=tol.rtol, atol=tol.atol)


def test_deepseek_v32_prefill_with_the_mha_attention_fused():
    """A tiny DeepSeek V3.2 prefill on a StaticCache with the defaults (masked_prefill_attention_mha
    among them): both layers' attention launched as the kernel, the output within bf16 tolerance of
    the prefill without that fusion."""
    report, code, got, want = prefill_side_by_side("deepseek-v3.2", "masked_prefill_attention_mha")
    assert report.final()["masked_prefill_attention_mha"] == 2
    assert len(re.findall(r"_masked_attention_kernel_\d+\.run\(", code)) == 2
    assert compare(got, want).rel_norm <= tolerance(torch.bfloat16).rel_norm


def test_deepseek_decode_through_the_index_mask():
    """A tiny DeepSeek V3.2 decode step (StaticCache of 64 cached tokens, the indexer's top-k
    keeping fewer) with the defaults and sparse_decode_attention: its SDPA call per layer becomes
    the masked decode kernel, the outputs over 2 steps within bf16 tolerance of the defaults'."""
    from _gpu_decode import compile_step

    from fusion_passes.models import build_model
    from fusion_passes.models.decode import DecodeStep

    torch._dynamo.reset()
    built = build_model("deepseek-v3.2", size="tiny", dtype=torch.bfloat16, layers=2, device="cuda")
    step = DecodeStep(built.module, batch=1, context=64, steps=2)
    defaults = [f.name for f in fusion_passes.registry.get_fusions("all")]
    report = fusion_passes.Report()
    fused, (code,) = compile_step(step, fusion_passes.backend([*defaults, "sparse_decode_attention"], report=report))
    plain, _ = compile_step(step, fusion_passes.backend(defaults))
    assert report.final()["sparse_decode_attention"] == 2 and not report.errors
    assert len(re.findall(r"_masked_decode_kernel_\d+\.run\(", code)) == 2
    runs = []
    for fn in (fused, plain):
        step.restore()
        with torch.no_grad():
            runs.append([fn(*step.inputs(i)).clone() for i in range(2)])
    for got, want in zip(*runs, strict=True):
        assert compare(got, want).rel_norm <= tolerance(torch.bfloat16).rel_norm
