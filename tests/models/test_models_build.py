"""fusion_passes.models: every model builds (tiny, fp32), runs eagerly, and lists exactly the norms it executes.

No torch.compile here (kept fast); the fullgraph compile of every model is exercised elsewhere.
"""

from __future__ import annotations

import pytest
import torch

from fusion_passes.models import MODEL_NAMES, ModelSites, build_model, executed_norms, norm_kind

EXPECTED_COUNTS = {  # (rms_norm, add_rms_norm, gated_rms_norm, layer_norm) for the 2-layer tiny models
    "deepseek-v3": (9, 4, 0, 0),
    "deepseek-v3.2": (9, 4, 0, 2),
    "qwen3": (9, 4, 0, 0),
    "qwen3-moe": (9, 4, 0, 0),
    "qwen3-next": (7, 4, 1, 0),
    "qwen3.5": (7, 4, 1, 0),
    "qwen3.5-moe": (7, 4, 1, 0),
    "minimax-m2": (9, 4, 0, 0),
}


def test_model_names():
    assert MODEL_NAMES == (
        "deepseek-v3",
        "deepseek-v3.2",
        "qwen3",
        "qwen3-moe",
        "qwen3-next",
        "qwen3.5",
        "qwen3.5-moe",
        "minimax-m2",
    )
    assert set(EXPECTED_COUNTS) == set(MODEL_NAMES)


@pytest.fixture(scope="module", params=MODEL_NAMES)
def built(request):
    return build_model(request.param)


def test_eager_forward(built):
    (input_ids,) = built.example_inputs
    assert input_ids.shape == (1, 8) and input_ids.dtype == torch.int64
    assert int(input_ids.max()) < built.config.vocab_size
    assert not built.module.training
    with torch.no_grad():
        out = built.module(*built.example_inputs)
    assert out.shape == (1, 8, built.config.hidden_size)
    assert out.dtype == torch.float32
    assert torch.isfinite(out).all()


def test_sites_match_executed_norms(built):
    sites = built.sites
    assert isinstance(sites, ModelSites)
    ran = executed_norms(built.module, built.example_inputs)
    assert tuple(ran["rms_norm"]) == sites.rms_norm
    assert tuple(ran["gated_rms_norm"]) == sites.gated_rms_norm
    assert tuple(ran["layer_norm"]) == sites.layer_norm
    counts = (len(sites.rms_norm), sites.add_rms_norm, len(sites.gated_rms_norm), len(sites.layer_norm))
    assert counts == EXPECTED_COUNTS[built.name]
    # the residual-add sites: post-attention norms, input norms of layers >= 1, and the final norm
    adds = [s for s in sites.rms_norm if s.endswith("post_attention_layernorm")]
    adds += [s for s in sites.rms_norm if s.endswith("input_layernorm") and not s.startswith("model.layers.0.")]
    adds += [s for s in sites.rms_norm if s == "model.norm"]
    assert len(adds) == sites.add_rms_norm


def test_norm_weights_are_not_trivial(built):
    for path, m in built.module.named_modules():
        if norm_kind(m) is None:
            continue
        w = m.weight.detach()
        assert not torch.all(w == 1.0) and not torch.all(w == 0.0), path
        assert w.std() > 0.01, path


def test_hybrid_models_mix_linear_and_full_attention():
    for name in ("qwen3-next", "qwen3.5", "qwen3.5-moe"):
        b = build_model(name, layers=2)
        assert b.config.layer_types == ["linear_attention", "full_attention"]


def test_options():
    b = build_model("qwen3", dtype=torch.bfloat16, layers=3, seq_len=5, batch=2)
    assert b.example_inputs[0].shape == (2, 5)
    assert b.config.num_hidden_layers == 3
    assert b.sites.add_rms_norm == 6 and len(b.sites.rms_norm) == 13
    with torch.no_grad():
        out = b.module(*b.example_inputs)
    assert out.shape == (2, 5, 128) and out.dtype == torch.bfloat16


def test_deepseek_bf16_keeps_router_bias_fp32():
    b = build_model("deepseek-v3", dtype=torch.bfloat16)
    bias = b.module.model.layers[1].mlp.gate.e_score_correction_bias
    assert bias.dtype == torch.float32  # as from_pretrained does (_keep_in_fp32_modules_strict)
    assert b.module.model.layers[1].input_layernorm.weight.dtype == torch.bfloat16


def test_unknown_name():
    with pytest.raises(ValueError, match="qwen3-moe"):
        build_model("llama-7b")


def test_unknown_size():
    with pytest.raises(ValueError, match="tiny"):
        build_model("qwen3", size="huge")


def test_missing_model_type_error(monkeypatch):
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    monkeypatch.delitem(CONFIG_MAPPING_NAMES, "qwen3_5")
    monkeypatch.setattr(transformers, "__version__", "5.1.0")
    with pytest.raises(RuntimeError, match=r"^model type 'qwen3_5' needs transformers >= 5\.2\.0 \(installed 5\.1\.0\)$"):
        build_model("qwen3.5")
