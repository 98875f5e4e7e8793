"""build_model(): real transformers model graphs with random weights, plus the norm sites a fusion should find."""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass

import torch
from torch import nn

from .configs import SPECS, ModelSpec

MODEL_NAMES: tuple[str, ...] = tuple(SPECS)
SIZES = ("tiny", "real")
TESTED_TRANSFORMERS = "5.17.0"  # the version these builders were written and verified against


@dataclass(frozen=True)
class ModelSites:
    """The norm sites of a built model, as module paths in execution order (relative to BuiltModel.module)."""

    rms_norm: tuple[str, ...]  # RMSNorm-family modules (Llama form and (1+w) form), incl. q/k, MLA and final norms
    gated_rms_norm: tuple[str, ...]  # RMSNormGated modules inside linear attention
    layer_norm: tuple[str, ...]  # nn.LayerNorm modules: a fusion must NOT match these
    add_rms_norm: int  # rms_norm sites fed by a residual add whose sum is the next residual
    attention: tuple[str, ...] = ()  # full-attention modules: one pre-attention QK-norm / RoPE path each


@dataclass
class BuiltModel:
    name: str
    model_type: str
    module: torch.nn.Module
    example_inputs: tuple
    sites: ModelSites
    config: object


class LastHiddenState(nn.Module):
    """forward(input_ids) -> last_hidden_state of the wrapped base model (no cache, no mask: causal)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, use_cache=False).last_hidden_state


def _version_tuple(v: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", v)[:3])


def _transformers_classes(spec: ModelSpec):
    """Return (config_class, model_class) or raise a one-line RuntimeError naming the needed version."""
    installed = "not installed"
    try:
        import transformers
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

        installed = transformers.__version__
        ok = (
            _version_tuple(installed) >= _version_tuple(spec.min_transformers)
            and spec.model_type in CONFIG_MAPPING_NAMES
            and hasattr(transformers, spec.config_class)
            and hasattr(transformers, spec.model_class)
        )
    except ImportError:
        ok = False
    if not ok:
        need = spec.min_transformers
        if installed != "not installed" and _version_tuple(installed) >= _version_tuple(need):
            need = TESTED_TRANSFORMERS
        raise RuntimeError(f"model type '{spec.model_type}' needs transformers >= {need} (installed {installed})")
    return getattr(transformers, spec.config_class), getattr(transformers, spec.model_class)


def _expected_sites(spec: ModelSpec, config) -> ModelSites:
    """The norm sites, derived from the decoder-layer code (see configs.py) and the config's layer layout.

    Every decoder layer is ``r = h; h = input_layernorm(h); h = mixer(h); h = r + h; r = h;
    h = post_attention_layernorm(h); h = mlp(h); h = r + h`` and the model ends with ``norm(h)``: the
    post-attention norm of every layer, the input norm of layers >= 1 and the final norm read a residual
    sum, so add_rms_norm = 2 * num_layers.
    """
    layer_types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    rms, gated, ln, attn = [], [], [], []
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        rms.append(p + "input_layernorm")
        if layer_types[i] == "linear_attention":
            rms += [p + n for n in spec.linear_attn_norms]
            gated += [p + n for n in spec.linear_attn_gated_norms]
        else:
            rms += [p + n for n in spec.attn_norms]
            ln += [p + n for n in spec.attn_layer_norms]
            attn.append(p + "self_attn")
        rms.append(p + "post_attention_layernorm")
    rms.append("model.norm")
    return ModelSites(
        rms_norm=tuple(rms),
        gated_rms_norm=tuple(gated),
        layer_norm=tuple(ln),
        add_rms_norm=2 * config.num_hidden_layers,
        attention=tuple(attn),
    )


def norm_kind(module: nn.Module) -> str | None:
    """'rms_norm' / 'gated_rms_norm' / 'layer_norm' for the norm modules ModelSites lists, else None."""
    cls = type(module).__name__
    if cls.endswith("RMSNormGated"):
        return "gated_rms_norm"
    if cls.endswith("RMSNorm"):
        return "rms_norm"
    if isinstance(module, nn.LayerNorm):
        return "layer_norm"
    return None


def _check_sites(module: nn.Module, sites: ModelSites) -> None:
    """Every listed site exists with the right kind, and no norm module of the tree is left unlisted."""
    listed = {n: "rms_norm" for n in sites.rms_norm}
    listed.update({n: "gated_rms_norm" for n in sites.gated_rms_norm})
    listed.update({n: "layer_norm" for n in sites.layer_norm})
    found = {n: k for n, m in module.named_modules() if (k := norm_kind(m)) is not None}
    if found != listed:
        diff = sorted(set(found.items()) ^ set(listed.items()))
        raise AssertionError(f"norm sites disagree with the module tree (transformers changed?): {diff[:6]}")
    modules = dict(module.named_modules())
    for path in sites.attention:
        if not type(modules.get(path)).__name__.endswith("Attention"):
            raise AssertionError(f"{path}: expected an attention module, found {type(modules.get(path)).__name__}")


@torch.no_grad()
def _randomize_norm_weights(module: nn.Module, zero_centered: bool, seed: int) -> None:
    """transformers initialises norm weights to ones (zeros for the (1+w) form): make them non-trivial."""
    g = torch.Generator().manual_seed(seed)
    for name, m in module.named_modules():
        kind = norm_kind(m)
        if kind is None:
            continue
        w = m.weight
        offset = 0.0 if (kind == "rms_norm" and zero_centered) else 1.0
        if not w.is_meta and not torch.all(w == offset):
            raise AssertionError(f"{name}: unexpected initial norm weight (expected all {offset})")
        noise = 0.1 * torch.randn(w.shape, generator=g)
        w.copy_((offset + noise).to(w.device, w.dtype))
        if kind == "layer_norm" and m.bias is not None:
            m.bias.copy_((0.1 * torch.randn(m.bias.shape, generator=g)).to(m.bias.device, m.bias.dtype))


def _keep_in_fp32(model: nn.Module, dtype: torch.dtype) -> None:
    """Mimic from_pretrained(dtype=...): `_keep_in_fp32_modules_strict` stay fp32 for fp16/bf16 and
    `_keep_in_fp32_modules` for fp16 (e.g. DeepSeek's router e_score_correction_bias)."""
    keep = set()
    if dtype in (torch.float16, torch.bfloat16):
        keep |= set(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
    if dtype == torch.float16:
        keep |= set(getattr(model, "_keep_in_fp32_modules", None) or ())
    if not keep:
        return
    pattern = re.compile(r"(^|\.)(" + "|".join(re.escape(k) for k in sorted(keep)) + r")($|\.)")
    for name, mod in model.named_modules():
        for pname, p in list(mod.named_parameters(recurse=False)) + list(mod.named_buffers(recurse=False)):
            full = f"{name}.{pname}" if name else pname
            if pattern.search(full) and p.is_floating_point():
                p.data = p.data.float()


def build_model(
    name: str,
    size: str = "tiny",
    dtype: torch.dtype = torch.float32,
    layers: int | None = None,
    seq_len: int = 8,
    batch: int = 1,
    device: str | torch.device | None = None,
) -> BuiltModel:
    """Build ``name`` (one of MODEL_NAMES) from a tiny or published-width config with seeded random weights.

    The module is the base model (e.g. Qwen3Model) wrapped as ``forward(input_ids) -> last_hidden_state``,
    in eval mode, sdpa attention, grouped_mm experts, ``use_cache=False``. ``device`` (optional) builds
    the weights directly there (useful for size="real").
    """
    if name not in SPECS:
        raise ValueError(f"unknown model {name!r}; choose one of: {', '.join(MODEL_NAMES)}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of: {', '.join(SIZES)}")
    layers = 2 if layers is None else int(layers)
    if layers < 1:
        raise ValueError(f"layers must be >= 1, got {layers}")
    spec = SPECS[name]
    config_cls, model_cls = _transformers_classes(spec)

    kwargs = (spec.tiny if size == "tiny" else spec.real)(layers)
    config = config_cls(**kwargs)
    config._attn_implementation = "sdpa"
    moe = model_cls._can_set_experts_implementation()  # the class uses @use_experts_implementation
    if moe:
        # the eager per-expert loop (data-dependent `for expert in expert_hit`) graph-breaks under compile
        config._experts_implementation = "grouped_mm"
    config.use_cache = False

    torch.manual_seed(0)
    with torch.device(device) if device is not None else contextlib.nullcontext():
        base = model_cls(config)
    base.eval()
    # post_init() resolves the implementations; make sure nothing fell back behind our back
    if base.config._attn_implementation != "sdpa":
        raise AssertionError(f"{name}: attention implementation is {base.config._attn_implementation!r}")
    if moe and base.config._experts_implementation != "grouped_mm":
        raise AssertionError(f"{name}: experts implementation is {base.config._experts_implementation!r}")
    _randomize_norm_weights(base, spec.zero_centered_norm, seed=1)
    base.to(dtype)
    _keep_in_fp32(base, dtype)

    module = LastHiddenState(base).eval()
    sites = _expected_sites(spec, config)
    _check_sites(module, sites)

    gen = torch.Generator().manual_seed(2)
    input_ids = torch.randint(0, config.vocab_size, (batch, seq_len), generator=gen, dtype=torch.int64)
    if device is not None:
        input_ids = input_ids.to(device)
    return BuiltModel(
        name=name,
        model_type=spec.model_type,
        module=module,
        example_inputs=(input_ids,),
        sites=sites,
        config=config,
    )


def executed_norms(module: nn.Module, example_inputs: tuple) -> dict[str, list[str]]:
    """Run ``module(*example_inputs)`` eagerly with forward hooks and return the norm modules executed, by
    kind (see norm_kind), in execution order. A module called twice is listed twice."""
    calls: dict[str, list[str]] = {"rms_norm": [], "gated_rms_norm": [], "layer_norm": []}
    handles = []
    for path, m in module.named_modules():
        kind = norm_kind(m)
        if kind is not None:
            handles.append(m.register_forward_hook(lambda _m, _i, _o, p=path, k=kind: calls[k].append(p)))
    try:
        with torch.no_grad():
            module(*example_inputs)
    finally:
        for h in handles:
            h.remove()
    return calls
