"""Real models (tiny configs) with their linears swapped for FP8 ones (fusion_passes.models.fp8_linear):
every norm whose output only feeds FP8 projections is fused with their activation quantization,
and the compiled model is at least as close to eager as stock Inductor on the same FP8 model."""

from __future__ import annotations

import pytest
import torch

import fusion_passes
from _fp8_spellings import (
    bits,
    torchao_quantize_affine_float8,
    vllm_quant_fp8_group_native,
    vllm_ref_dynamic_per_token_quant,
)
from fusion_passes.models import build_model
from fusion_passes.models.fp8_linear import (
    Fp8Linear,
    quantize_per_group,
    quantize_per_token,
    quantize_static,
    swap_fp8_linears,
)
from fusion_passes.numerics import compare


def _norm_quant_fusions(scheme):
    return [f"add_rms_norm_quant_fp8_{scheme}", f"rms_norm_quant_fp8_{scheme}"]


def _compile_both(name, scheme):
    built = build_model(name, size="tiny", dtype=torch.bfloat16)
    module, inputs = built.module, built.example_inputs
    swapped = swap_fp8_linears(module, scheme, inputs)
    names = [f.name for f in fusion_passes.registry.get_fusions("all")] + _norm_quant_fusions(scheme)
    report = fusion_passes.Report()
    with torch.no_grad():
        torch._dynamo.reset()
        fused = torch.compile(module, backend=fusion_passes.backend(names, report=report), fullgraph=True)(*inputs)
        torch._dynamo.reset()
        stock = torch.compile(module, backend="inductor", fullgraph=True)(*inputs)
        expected = module(*inputs)
    _assert_as_close_as_stock(fused, stock, expected)
    return built, swapped, report, fused, stock


def _assert_as_close_as_stock(fused, stock, expected):
    """The fused ops compute eager's quantization exactly (CPU reference); the quantizations no
    fusion covers are Inductor's own (lowered back), which flips an fp8 code (a 2^-3 step) now and then: stock
    Inductor ends 5.0% (relative norm) from eager on the FP8 Qwen3, fusion_passes 2.3%."""
    ours, theirs = compare(fused, expected).rel_norm, compare(stock, expected).rel_norm
    # A quantization no region takes is raised and lowered back: Inductor's compile of the
    # reference, which may round a code otherwise than its compile of the spelling (measured: the
    # per-group Qwen3 3.20% against stock's 3.17%); so within 2% of stock, not below it.
    assert ours <= 1.02 * theirs and ours < 0.05, (ours, theirs)


def _fused_norm_sites(report, scheme):
    """Where each fused site is reported: the module of its quantization, i.e. the first FP8
    projection reading the norm (after CSE the projections share that one quantization)."""
    return sorted(s.module for s in report.sites if s.fusion in _norm_quant_fusions(scheme))


@pytest.mark.slow
def test_qwen3_per_token_every_decoder_norm_fused_with_its_projections_quantization():
    """Qwen3: input_layernorm feeds q / k / v, post_attention_layernorm gate / up, each an FP8
    linear quantizing the same activation (one quantization after CSE): 2 sites per layer. The
    q / k norms go to the QK-norm + RoPE fusion; the final norm feeds no projection here."""
    built, swapped, report, fused, stock = _compile_both("qwen3", "per_token")
    layers = built.config.num_hidden_layers
    assert len(swapped) == 7 * layers
    expected = sorted(f"model.layers.{i}.{n}" for i in range(layers) for n in ("self_attn.q_proj", "mlp.gate_proj"))
    assert _fused_norm_sites(report, "per_token") == expected
    # The first layer's input norm reads the embedding (no residual add); every other one follows one.
    assert report.matches["rms_norm_quant_fp8_per_token"] == 1
    assert report.matches["add_rms_norm_quant_fp8_per_token"] == 2 * layers - 1
    assert report.matches["qk_norm_rope"] == layers
    assert not report.errors and not report.rejected
    assert "fusion_passes.add_rms_norm_quant_fp8.default" in report.ops_after()


@pytest.mark.slow
def test_qwen3_per_group_fp8_linears_fuse_with_the_norm_only_fp8_projections_read():
    """Fp8Linear's per-group activation quantization (DeepSeek V3's block-wise scheme) fuses too.
    k_proj / v_proj (64 outputs, not a multiple of 128) stay bf16, so input_layernorm also feeds
    unquantized projections and stays unfused; post_attention_layernorm feeds gate / up only and
    fuses with their quantization: 1 site per layer, each after a residual add."""
    built, swapped, report, fused, stock = _compile_both("qwen3", "per_group")
    layers = built.config.num_hidden_layers
    assert len(swapped) == 5 * layers
    expected = [f"model.layers.{i}.mlp.gate_proj" for i in range(layers)]
    assert _fused_norm_sites(report, "per_group") == expected
    assert report.matches["add_rms_norm_quant_fp8_per_group"] == layers
    assert report.matches["rms_norm_quant_fp8_per_group"] == 0
    assert not report.errors and not report.rejected
    assert report.ops_after()["fusion_passes.add_rms_norm_quant_fp8.default"] == layers


@pytest.mark.slow
def test_deepseek_v3_per_token_fuses_where_only_fp8_projections_read_the_norm():
    """DeepSeek V3 (MLA; layer 0 dense, layer 1 MoE): input_layernorm feeds q_a_proj and
    kv_a_proj_with_mqa, q_a_layernorm feeds q_b_proj; kv_a_layernorm goes to the MLA kv fusion;
    the dense layer's post-attention norm feeds gate / up, the MoE layer's also the bf16 router and
    grouped experts, so it stays unfused: 2 sites per layer + 1."""
    built, swapped, report, fused, stock = _compile_both("deepseek-v3", "per_token")
    expected = sorted(
        [f"model.layers.{i}.self_attn.{n}" for i in range(2) for n in ("q_a_proj", "q_b_proj")]
        + ["model.layers.0.mlp.gate_proj"]
    )
    assert _fused_norm_sites(report, "per_token") == expected
    assert report.matches["mla_kv_norm_rope"] == 2 and not report.errors
    assert all(isinstance(built.module.get_submodule(p), Fp8Linear) for p in swapped)


def test_fp8_linear_matches_its_dequantized_definition():
    """Fp8Linear's forward = (dequantized activation) @ (dequantized weight)^T, for each scheme,
    and the weight codes reproduce the weight within FP8's relative step (2^-3)."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(256, 128, bias=True)
    x = torch.randn(3, 5, 256)
    for scheme in ("static", "per_token", "per_group"):
        scale = (x.abs().amax() / 448) if scheme == "static" else None
        fp8 = Fp8Linear(linear, scheme, scale)
        w = fp8.weight.float()
        if scheme == "per_group":
            w = w * fp8.weight_scale.repeat_interleave(128, 0).repeat_interleave(128, 1)
        else:
            w = w * fp8.weight_scale
        torch.testing.assert_close(w, linear.weight, rtol=2**-3, atol=fp8.weight_scale.max().item() * 2**-6)
        out, ref = fp8(x), linear(x)
        assert out.shape == ref.shape and out.dtype == ref.dtype
        assert compare(out, ref, dtype=torch.bfloat16).rel_norm < 0.05, scheme  # FP8 error, not a bug's


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_fp8_linear_quantizes_activations_as_the_engines_do(dtype):
    """Fp8Linear's activation codes and scales are, bit for bit, those of the engines' own code it
    follows: torchao's _quantize_affine_float8 (static), vLLM's per-token reference (its amax in
    the activation dtype, a divide by the floored scale) and vLLM's QuantFP8 group-native
    quantization (per group of 128), on rows of every kind: an all-zero row (padding: the floor
    keeps its codes finite), a tiny one (amax below 1/512: the floor decides the scale) and one
    that saturates a static scale."""
    x = torch.randn(2, 7, 256).to(dtype)
    x[0, 3] = 0.0
    x[1, 2] *= 1e-4 / x[1, 2].abs().max()
    x[1, 5] *= 100.0
    scale = torch.tensor(0.02)
    q = quantize_static(x, scale)
    assert q.dtype == torch.float8_e4m3fn
    assert torch.equal(bits(q), bits(torchao_quantize_affine_float8(x, scale)))
    q, s = quantize_per_token(x)
    ref_q, ref_s = vllm_ref_dynamic_per_token_quant(x)
    assert s.shape == (2, 7, 1) and torch.equal(s, ref_s) and torch.equal(bits(q), bits(ref_q))
    q, s = quantize_per_group(x)
    ref_q, ref_s = vllm_quant_fp8_group_native(x)
    assert s.shape == (2, 7, 2) and torch.equal(s, ref_s) and torch.equal(bits(q), bits(ref_q))
    assert not q.float().isnan().any() and (q[0, 3].float() == 0).all()


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(scheme="per_tensor"), "scheme must be one of"),
        (dict(scheme="static"), "calibrated input_scale"),
        (dict(scheme="per_token", input_scale=torch.tensor(1.0)), "calibrated input_scale"),
    ],
)
def test_fp8_linear_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Fp8Linear(torch.nn.Linear(256, 128), **kwargs)
    with pytest.raises(ValueError, match="divisible by 128"):
        Fp8Linear(torch.nn.Linear(256, 64), "per_group")
