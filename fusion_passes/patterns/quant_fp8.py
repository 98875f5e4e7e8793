"""FP8 (float8_e4m3fn) activation quantization as code bases write it -> the canonical ``quant_fp8``.

Raise rules: each spelling below is one code base's way of writing the quantization, and its
replacement is ``fusion_passes.quant_fp8(x, *QuantFP8(...))`` with the fields that reproduce that
spelling's codes and scales bit for bit (lowering/quant_fp8/reference.py). The region fusions
(``rms_norm_quant_fp8``, ``silu_mul_quant_fp8``) start from the canonical op, so every spelling
raised here reaches them at once; one left standalone is decomposed back into its reference
(``lower_back``): raising it costs nothing.

Unfused: amax = max |x| (per token / group / tensor); s = scale(amax); q = fp8(clamp(x op s))
Fused:   q, s = fusion_passes.quant_fp8(x, scheme, scale, group_size, scale_ue8m0, floor_site,
                                         floor, apply, pow2, saturate, fp8_max, scale_math)

Spellings (facts from each code base; the code is written here):
    vllm_per_token        vLLM ``QuantFP8.forward_native`` (input_quant_fp8.py), dynamic per token:
                          amax in x's dtype (max.dim), scale = amax / 448 floored AFTER the divide,
                          applied as ``x * scale.reciprocal()``
    vllm_per_tensor       the same branch, dynamic per tensor (scale of shape [1])
    vllm_static           the same, a given scale: ``x * scale.reciprocal()``
    vllm_group(_ue8m0)    vLLM ``QuantFP8._quantize_group_native``: groups of 128, amax / 448,
                          optionally ``exp2(ceil(log2(s)))`` (UE8M0) before the floor, a divide
    sglang_group          SGLang's native per-token-group quant: amax in x's dtype floored at eps
                          (1e-10) BEFORE the divide, in x's dtype; a divide
    sglang_group_reciprocal  SGLang's Triton group kernel, in torch: fp32 amax floored at eps,
                          ``y * (1 / s)``
    deepgemm_group        DeepGEMM's ``per_token_cast_to_fp8``: fp32 amax clamped at 1e-4,
                          ``x * (1 / s)``, no saturating clamp
    deepseek_v3_group     DeepSeek-V3's ``act_quant``: ``s = amax / 448; y = x / s``, no floor,
                          no clamp
    torchao_per_row / torchao_per_tensor  torchao's inference Float8 (``_choose_scale_float8`` +
                          ``_quantize_affine_float8``): amax and ``/ 448`` in x's dtype (bf16),
                          then fp32; no floor; a divide
    torchao_training(_pow2)  torchao's training float8 (``amax_to_scale``): fp64 amax clamped at
                          EPS, multiplier ``448 / amax``, fp32, optionally rounded down to a power
                          of two (``exp2(floor(log2(s)))``); ``x * s``
    te_multiplier(_two_upcasts)  a Transformer-Engine-style multiplier: ``448 / max(amax, eps)``
                          in fp32, ``x * s`` (the activation upcast once, or once for each use)
    static / per_token / per_group  the forms the norm and SiLU fusions matched before (torchao
                          ``_quantize_affine_float8``; vLLM's per-token math in DeepSeek-V3's
                          order, per token or per group of 128)

The floor (vLLM's 1 / (448 * 512), SGLang's 1e-10, DeepGEMM's 1e-4, torchao's 1e-12) is a pattern
argument: one pattern matches every value. Groups are of 128 columns (the value every code base
above uses; GROUP_SIZES lists those registered). Not raised: e5m2 (another format and maximum;
its per-token and static forms are matched to be refused with that reason),
a group size that does not divide the row (the spellings' reshapes then straddle rows), a scale
or amax that another op also reads (the matcher keeps a spelling whose intermediate is used).
"""

from __future__ import annotations

from typing import Any

import torch

import fusion_passes.lowering.quant_fp8.op  # noqa: F401  (the canonical op)
from fusion_passes.fusion import Fusion, Spelling
from fusion_passes.lowering.common.fp8 import MIN_SCALE, QuantFP8

E4M3 = torch.float8_e4m3fn
MAX = 448.0
GROUP = 128  # the group size of the group spellings
GROUP_SIZES = (GROUP,)
# The floor's sentinel: traced as this value, matched as any (a pattern argument).
FLOOR_SENTINEL = 2.0**-19
QUANT_OP = torch.ops.fusion_passes.quant_fp8.default

# --- vLLM ---


def vllm_per_token(x, floor):
    x_max, _ = x.abs().max(dim=-1)
    x_max = x_max.unsqueeze(-1).to(torch.float32)
    scale = (x_max / MAX).clamp(min=floor)
    out = x.to(torch.float32) * scale.to(torch.float32).reciprocal()
    return out.clamp(-MAX, MAX).to(E4M3), scale


def vllm_per_tensor(x, floor):
    x_max = x.abs().max().unsqueeze(-1).to(torch.float32)
    scale = (x_max / MAX).clamp(min=floor)
    out = x.to(torch.float32) * scale.to(torch.float32).reciprocal()
    return out.clamp(-MAX, MAX).to(E4M3), scale


def vllm_static(x, scale):
    out = x.to(torch.float32) * scale.to(torch.float32).reciprocal()
    return out.clamp(-MAX, MAX).to(E4M3)


def _vllm_group(ue8m0: bool):
    def spelling(x, floor):
        orig_shape = x.shape
        hidden_dim = x.shape[-1]
        num_groups = hidden_dim // GROUP
        x_grouped = x.view(-1, num_groups, GROUP)
        absmax = x_grouped.abs().max(dim=-1, keepdim=True)[0].float()
        scales_raw = absmax / MAX
        if ue8m0:
            scales_raw = torch.exp2(torch.ceil(torch.log2(scales_raw)))
        scales = scales_raw.clamp(min=floor)
        x_quant = (x_grouped / scales).clamp(-MAX, MAX).to(E4M3)
        x_quant = x_quant.view(-1, hidden_dim).view(orig_shape)
        scales = scales.squeeze(-1).reshape(orig_shape[:-1] + (num_groups,))
        return x_quant, scales

    spelling.__name__ = "vllm_group_ue8m0" if ue8m0 else "vllm_group"
    return spelling


# --- SGLang ---


def sglang_group(x, floor):
    x_ = x.reshape(x.numel() // GROUP, GROUP)
    amax = x_.abs().max(dim=-1, keepdim=True)[0].clamp(min=floor).to(torch.float32)
    x_s = amax / MAX
    x_q = (x_ / x_s).clamp(min=-MAX, max=MAX).to(E4M3)
    return x_q.reshape(x.shape), x_s.reshape(x.shape[:-1] + (x.shape[-1] // GROUP,))


def sglang_group_reciprocal(x, floor):
    y = x.reshape(-1, GROUP).to(torch.float32)
    absmax = torch.clamp(y.abs().amax(dim=-1, keepdim=True), min=floor)
    y_s = absmax / MAX
    y_s_inv = 1.0 / y_s
    y_q = torch.clamp(y * y_s_inv, -MAX, MAX).to(E4M3)
    return y_q.reshape(x.shape), y_s.reshape(*x.shape[:-1], -1)


# --- DeepGEMM, DeepSeek-V3 ---


def deepgemm_group(x, floor):
    # DeepGEMM writes ``amax(dim=2).view(m, -1)``: a view to the shape it has, which Inductor's
    # post-grad graph drops (so the pattern has none).
    # It takes [m, n] only and views the codes back as (m, n): here x.shape, so that the pattern
    # also traces at the other ranks the family is traced at (the 2D graph is DeepGEMM's).
    m = x.shape[0]
    x_view = x.view(m, -1, GROUP)
    x_amax = x_view.abs().float().amax(dim=2).clamp(floor)
    sf = x_amax / MAX
    return (x_view * (1.0 / sf.unsqueeze(2))).to(E4M3).view(x.shape), sf


def deepseek_v3_group(x):
    x32 = x.to(torch.float32).unflatten(-1, (-1, GROUP))
    s = x32.abs().amax(dim=-1, keepdim=True) / MAX
    y = (x32 / s).to(E4M3)
    return y.flatten(-2), s.squeeze(-1)


# --- torchao ---


def torchao_per_row(x):
    # torchao reduces over the block's dims, counted from the front (the last: x.dim() - 1).
    max_abs = x.abs().amax(dim=x.dim() - 1, keepdim=True)
    scale = (max_abs / MAX).to(torch.float32)
    q = (x.to(torch.float32) / scale).clamp(min=-MAX, max=MAX)
    return q.to(E4M3), scale


def torchao_per_tensor(x):
    max_abs = x.abs().amax(dim=tuple(range(x.dim())), keepdim=True)
    scale = (max_abs / MAX).to(torch.float32)
    q = (x.to(torch.float32) / scale).clamp(min=-MAX, max=MAX)
    return q.to(E4M3), scale


def _torchao_training(pow2: bool):
    def spelling(x, floor):
        amax = torch.max(torch.abs(x))
        amax = amax.to(torch.float64)
        res = MAX / torch.clamp(amax, min=floor)
        res = res.to(torch.float32)
        if pow2:
            res = torch.exp2(torch.floor(torch.log2(res)))
        q = (x.to(torch.float32) * res).clamp(min=-MAX, max=MAX)
        return q.to(E4M3), res

    spelling.__name__ = "torchao_training_pow2" if pow2 else "torchao_training"
    return spelling


def _te_multiplier(upcasts: int):
    def spelling(x, floor):
        # The activation upcast once for the amax and the product, or once for each (no CSE
        # runs before the raise: the two are apart in the graph).
        x32 = x.to(torch.float32)
        amax = torch.max(torch.abs(x32))
        scale = MAX / torch.clamp(amax, min=floor)
        q = ((x.to(torch.float32) if upcasts == 2 else x32) * scale).clamp(-MAX, MAX)
        return q.to(E4M3), scale

    spelling.__name__ = "te_multiplier" if upcasts == 1 else "te_multiplier_two_upcasts"
    return spelling


# --- the forms the region fusions matched before ---


def static(x, scale):
    return (x.to(torch.float32) / scale).clamp(-MAX, MAX).to(E4M3)


def per_token(x, floor):
    y32 = x.to(torch.float32)
    scale = (y32.abs().amax(-1, keepdim=True) / MAX).clamp(min=floor)
    return (y32 / scale).clamp(-MAX, MAX).to(E4M3), scale


def per_group(x, floor):
    y32 = x.to(torch.float32).unflatten(-1, (-1, GROUP))
    scale = (y32.abs().amax(-1, keepdim=True) / MAX).clamp(min=floor)
    q = (y32 / scale).clamp(-MAX, MAX).to(E4M3)
    return q.flatten(-2), scale.squeeze(-1)


# --- float8_e5m2: matched to be refused with the reason (the canonical op is e4m3 only) ---

E5M2_MAX = 57344.0  # torch.finfo(torch.float8_e5m2).max


def per_token_e5m2(x, floor):
    y32 = x.to(torch.float32)
    scale = (y32.abs().amax(-1, keepdim=True) / E5M2_MAX).clamp(min=floor)
    return (y32 / scale).clamp(-E5M2_MAX, E5M2_MAX).to(torch.float8_e5m2), scale


def static_e5m2(x, scale):
    return (x.to(torch.float32) / scale).clamp(-E5M2_MAX, E5M2_MAX).to(torch.float8_e5m2)


def _refuse_e5m2(values: dict[str, Any]) -> str:
    return "float8_e5m2 codes: quant_fp8 and its fused kernels define float8_e4m3fn (max 448) only"


# --- each spelling's fields (QuantFP8 less scale and floor, which are its arguments) and how it
#     shapes the scales it returns ---


def _quant(scheme, floor_site="scale", apply="divide", pow2="none", saturate=True, math="fp32", ue8m0=False):
    return dict(scheme=scheme, group_size=GROUP, scale_ue8m0=ue8m0, floor_site=floor_site, apply=apply,
                pow2=pow2, saturate=saturate, scale_math=math)  # fmt: skip


def _same(s, x):
    return s


def _one(s, x):
    return s.reshape(1)


def _ones(s, x):
    return s.reshape([1] * x.dim())


# The static scheme computes no scale: its floor fields keep QuantFP8's defaults, so a call
# equal to the default form is one (the allreduce fusions match the fused op's defaults).
STATIC = (  # (spelling, fields): (x, scale) -> codes
    (vllm_static, _quant("static", apply="reciprocal")),
    (static, _quant("static")),
)
FLOORED = (  # (spelling, fields, scale shape): (x, floor) -> (codes, scales)
    (vllm_per_token, _quant("per_token", apply="reciprocal"), _same),
    (vllm_per_tensor, _quant("per_tensor", apply="reciprocal"), _one),
    (_vllm_group(False), _quant("per_group"), _same),
    (_vllm_group(True), _quant("per_group", pow2="ceil"), _same),
    (sglang_group, _quant("per_group", floor_site="amax", math="input_amax"), _same),
    (sglang_group_reciprocal, _quant("per_group", floor_site="amax", apply="reciprocal"), _same),
    (deepgemm_group, _quant("per_group", floor_site="amax", apply="reciprocal", saturate=False), _same),
    (_torchao_training(False), _quant("per_tensor", floor_site="amax", apply="multiplier", math="fp64"), _same),
    (_torchao_training(True), _quant("per_tensor", floor_site="amax", apply="multiplier", math="fp64", pow2="floor"),
     _same),
    (_te_multiplier(1), _quant("per_tensor", floor_site="amax", apply="multiplier"), _same),
    (_te_multiplier(2), _quant("per_tensor", floor_site="amax", apply="multiplier"), _same),
    (per_token, _quant("per_token"), _same),
    (per_group, _quant("per_group"), _same),
)
UNFLOORED = (  # (spelling, fields, scale shape): (x) -> (codes, scales)
    (deepseek_v3_group, _quant("per_group", floor_site="none", saturate=False), _same),
    (torchao_per_row, _quant("per_token", floor_site="none", math="input"), _same),
    (torchao_per_tensor, _quant("per_tensor", floor_site="none", math="input"), _ones),
)


def _call(x, scale, floor, fields):
    f = fields
    return QUANT_OP(x, f["scheme"], scale, f["group_size"], f["scale_ue8m0"], f["floor_site"], floor, f["apply"],
                    f["pow2"], f["saturate"], MAX, f["scale_math"])  # fmt: skip


def _static_replacement(fields):
    def replacement(x, scale):
        return _call(x, scale, MIN_SCALE, fields)[0]

    return replacement


def _floored_replacement(fields, shape):
    def replacement(x, floor):
        q, s = _call(x, None, floor, fields)
        return q, shape(s, x)

    return replacement


def _unfloored_replacement(fields, shape):
    def replacement(x):
        q, s = _call(x, None, 0.0, fields)
        return q, shape(s, x)

    return replacement


def quant_of(values: dict[str, Any], fields: dict[str, Any]) -> QuantFP8:
    """The QuantFP8 a match of a spelling with ``fields`` raises to."""
    return QuantFP8(fields["scheme"], values.get("scale"), fields["group_size"], fields["scale_ue8m0"],
                    fields["floor_site"], float(values.get("floor", MIN_SCALE)), fields["apply"], fields["pow2"],
                    fields["saturate"], MAX, fields["scale_math"])  # fmt: skip


def _check(fields):
    def check(values: dict[str, Any]) -> str | None:
        try:
            quant_of(values, fields).check(values["x"])
        except ValueError as e:
            return str(e)
        return None

    return check


def _examples(kind: str):
    """fp32 graphs lack the casts bf16 graphs have (fp16 matches the bf16 pattern: the matcher
    re-traces each candidate with its own dtypes). bf16 first: the fp32 pattern also matches a
    bf16 graph's quantization from its upcast on, and the canonical op must take the activation
    itself (the norm's or SiLU's output, for the region fusions). Not cast by ``Fusion.dtypes``:
    the static scale stays fp32."""

    def example_inputs():
        # Rank 2 and 3: the spellings' reshapes back to the input's shape are no-ops at one rank
        # and real at the other, and Inductor drops the no-ops.
        for dtype in (torch.bfloat16, torch.float32):
            for shape in ((4, 2 * GROUP), (2, 3, 2 * GROUP)):
                x = torch.randn(shape, dtype=dtype)
                if kind == "static":
                    yield (x, torch.tensor([0.05]))
                elif kind == "floored":
                    yield (x, FLOOR_SENTINEL)
                else:
                    yield (x,)

    return example_inputs


_DOC = __doc__.split("\n\n", 1)[1]
# A conversion to float8 left in the graph is where a quantization did not raise (near misses).
_CANDIDATES = ("prims.convert_element_type.default",)

_FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def converts_to_float8(node) -> bool:
    """A near-miss candidate: a conversion to a float8 dtype (not the upcasts every spelling has)."""
    return len(node.args) > 1 and node.args[1] in _FLOAT8


# Each conversion to float8 that no spelling raised is a near miss, with the closest spelling.
_CANDIDATE = {"candidate_ops": ("prims.convert_element_type.default",), "candidate": converts_to_float8}

QUANT_FP8_STATIC = Fusion(
    name="quant_fp8_static",
    summary="FP8 quantization with a given scale (every spelling) -> the canonical quant_fp8",
    doc=_DOC,
    spellings=tuple(
        Spelling(fn.__name__, fn, _static_replacement(fields), _check(fields)) for fn, fields in STATIC
    )
    + (Spelling("static_e5m2", static_e5m2, _static_replacement(_quant("static")), _refuse_e5m2),),
    example_inputs=_examples("static"),
    **_CANDIDATE,
    builtin=True,
)
QUANT_FP8_DYNAMIC = Fusion(
    name="quant_fp8_dynamic",
    summary="FP8 quantization with computed, floored scales (every spelling) -> the canonical quant_fp8",
    doc=_DOC,
    spellings=tuple(
        Spelling(fn.__name__, fn, _floored_replacement(fields, shape), _check(fields))
        for fn, fields, shape in FLOORED
    )
    + (Spelling("per_token_e5m2", per_token_e5m2, _floored_replacement(_quant("per_token"), _same), _refuse_e5m2),),
    example_inputs=_examples("floored"),
    scalars={"floor": FLOOR_SENTINEL},
    **_CANDIDATE,
    builtin=True,
)
QUANT_FP8_UNFLOORED = Fusion(
    name="quant_fp8_unfloored",
    summary="FP8 quantization with computed scales and no floor (every spelling) -> the canonical quant_fp8",
    doc=_DOC,
    spellings=tuple(
        Spelling(fn.__name__, fn, _unfloored_replacement(fields, shape), _check(fields))
        for fn, fields, shape in UNFLOORED
    ),
    example_inputs=_examples("unfloored"),
    **_CANDIDATE,
    builtin=True,
)

# The computed scales first: a static spelling's ops (x * reciprocal(scale), clamp, cast) are the
# tail of a dynamic one, whose scale would then pass for a given one.
FUSIONS = (QUANT_FP8_DYNAMIC, QUANT_FP8_UNFLOORED, QUANT_FP8_STATIC)
