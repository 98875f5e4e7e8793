"""RMSNorm spellings found in real model code, mapped to ``rms_norm`` / ``add_rms_norm``.

Spellings (as transformers writes them):
- Llama form: DeepseekV3RMSNorm, DeepseekV32RMSNorm, Qwen3RMSNorm, Qwen3MoeRMSNorm,
  MiniMaxM2RMSNorm (and the norm inside Qwen3-Next / Qwen 3.5 RMSNormGated):
      h = x.to(f32); h = h * rsqrt(h.pow(2).mean(-1, keepdim=True) + eps); weight * h.to(x.dtype)
- ``F.rms_norm`` / ``nn.RMSNorm``: the weight is multiplied in fp32, rounded once at the end.
- Qwen3-Next / Qwen 3.5 / Qwen 3.5-MoE ``(1 + w)`` form (Gemma and Gemma 3 write it alike):
      o = x.float(); o = o * rsqrt(o.pow(2).mean(-1, keepdim=True) + eps);
      (o * (1.0 + weight.float())).type_as(x)
- Meta's reference Llama (and vLLM's native forward without a residual): the Llama form with the
  weight on the right, ``_norm(x.float()).type_as(x) * weight``.
- gpt-fast: the same with the square written ``x * x``: ``mean(x * x, -1)`` (bit-equal to
  ``pow(2)``: both are one correctly rounded product).
- Olmo2: ``(weight * h).to(dtype)``, the weight multiplied in fp32 (promoted) before the one
  cast: the F.rms_norm form.
- ``pow(-0.5)`` for the rsqrt (the Llama and the fp32-weight orders): eager's pow kernels
  special-case -0.5 to rsqrt, so the bits are the rsqrt spelling's.
- No weight (``rms_norm_unweighted``): a weight of ones, exact.
- vLLM's native forward with a residual: the add in fp32, the fp32 sum normalised unrounded,
  its rounding the new residual (``add_rms_norm(..., residual_in_fp32=True)``):
      x = x.to(f32) + residual.to(f32); residual = x.to(dtype); ...; x.to(dtype) * weight
Each with and without the decoder layer's residual add before it (``residual + hidden_states``,
whose sum is the next residual); the add's operand order does not matter (IEEE addition
commutes), so one spelling covers ``x + residual`` and ``residual + x``.

eps is a pattern argument: one traced pattern matches every eps.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from fusion_passes.lowering.rms_norm.reference import check_rms_norm_args
from fusion_passes.fusion import DEFAULT_SCALAR_SENTINEL, Fusion, NotASite, Spelling

# --- the spellings (traced by the pattern matcher; keep them exactly as models write them) ---


def llama_rms_norm(x, weight, eps):
    input_dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(input_dtype)


def functional_rms_norm(x, weight, eps):
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def offset_rms_norm(x, weight, eps):
    o = x.float()
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + eps)
    o = o * (1.0 + weight.float())
    return o.type_as(x)


def meta_rms_norm(x, weight, eps):
    def _norm(h):
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)

    return _norm(x.float()).type_as(x) * weight


def gpt_fast_rms_norm(x, weight, eps):
    def _norm(h):
        return h * torch.rsqrt(torch.mean(h * h, dim=-1, keepdim=True) + eps)

    return _norm(x.float()).type_as(x) * weight


def olmo2_rms_norm(x, weight, eps):
    input_dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return (weight * h).to(input_dtype)


def pow_rms_norm(x, weight, eps):
    """The Llama form with the inverse root written ``pow(-0.5)``: ATen's pow kernel special-cases
    the exponent -0.5 to rsqrt, so eager's bits are the rsqrt spelling's (checked bit for bit on
    the CPU, 10^6 values; on CUDA the fused kernel is held to the per-dtype tolerance as always)."""
    input_dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.pow(variance + eps, -0.5)
    return weight * h.to(input_dtype)


def pow_fp32_weight_rms_norm(x, weight, eps):
    """``pow(-0.5)`` with the weight multiplied in fp32 before the one cast (Olmo2's order)."""
    h = x.float()
    h = h * (h.pow(2).mean(-1, keepdim=True) + eps) ** -0.5
    return (weight * h).to(x.dtype)


def unweighted_rms_norm(x, eps):
    """No weight (``F.rms_norm(x, shape, None, eps)``, scale-free q/k norms): the normalised row
    rounded to x's dtype."""
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).type_as(x)


def functional_unweighted_rms_norm(x, eps):
    """``F.rms_norm(x, shape, None, eps)`` / ``nn.RMSNorm(elementwise_affine=False)``."""
    return F.rms_norm(x, (x.shape[-1],), None, eps)


def pow_unweighted_rms_norm(x, eps):
    """No weight, the inverse root as ``pow(-0.5)`` (transformers' Gemma3n with_scale=False)."""
    h = x.float()
    return (h * torch.pow(h.pow(2).mean(-1, keepdim=True) + eps, -0.5)).type_as(x)


def _unweighted_fused(x, eps):
    # A weight of ones: 1 * n.to(dtype) is exact, so the Llama form of the op is the same math.
    ones = torch.ones(x.shape[-1], dtype=x.dtype, device=x.device)
    return torch.ops.fusion_passes.rms_norm.default(x, ones, eps, 0.0, True)


def _check_unweighted(values: dict[str, Any]) -> str | None:
    x = values["x"]
    try:
        check_rms_norm_args(x, x.new_empty(x.shape[-1]), 0.0, True)
    except ValueError as e:
        return str(e)
    return None


def _scaled_next(match) -> str | None:
    """An unweighted norm whose output a weight of the row's width multiplies next (after casts)
    is a weighted form that its own fusion refused (an fp32 weight on bf16 rows): no site of this
    fusion (that refusal is the report's), not raised by halves."""
    cast = torch.ops.prims.convert_element_type.default
    for out in match.output_nodes():
        if out is None or "val" not in out.meta:
            continue
        width, frontier = out.meta["val"].shape[-1], [out]
        for _ in range(3):
            for node in frontier:
                for user in node.users:
                    other = next((a for a in user.args if a is not node), None) if user.target is torch.ops.aten.mul.Tensor else None
                    val = other.meta.get("val") if isinstance(other, torch.fx.Node) else None
                    if isinstance(val, torch.Tensor) and val.dim() == 1 and val.shape[0] == width:
                        return NotASite("a weight of the row's width multiplies the result next: a weighted form")
            frontier = [u for n in frontier for u in n.users if u.target is cast]
    return None


def vllm_add_rms_norm(x, residual, weight, eps):
    orig_dtype = x.dtype
    x = x.to(torch.float32)
    x = x + residual.to(torch.float32)
    residual = x.to(orig_dtype)
    variance = x.pow(2).mean(dim=-1, keepdim=True)
    x = x * torch.rsqrt(variance + eps)
    x = x.to(orig_dtype)
    x = x * weight
    return x, residual


def _vllm_fused_add_rms_norm(x, residual, weight, eps):
    out, new_residual = torch.ops.fusion_passes.add_rms_norm.default(
        x, residual, weight, eps, 0.0, True, True
    )
    return out, new_residual


def _with_residual(norm):
    def spelling(x, residual, weight, eps):
        hidden = residual + x
        return norm(hidden, weight, eps), hidden

    spelling.__name__ = f"add_{norm.__name__}"
    return spelling


# --- the fused calls: (weight_offset, cast_before_weight) per spelling ---


def _fused_rms_norm(offset: float, cast: bool):
    def replacement(x, weight, eps):
        return torch.ops.fusion_passes.rms_norm.default(x, weight, eps, offset, cast)

    return replacement


def _fused_add_rms_norm(offset: float, cast: bool):
    def replacement(x, residual, weight, eps):
        out, new_residual = torch.ops.fusion_passes.add_rms_norm.default(
            x, residual, weight, eps, offset, cast
        )
        return out, new_residual

    return replacement


def _check_form(offset: float, cast: bool):
    """Reject what the canonical op would compute differently (dtypes, weight shape)."""

    def check(values: dict[str, Any]) -> str | None:
        try:
            check_rms_norm_args(
                values["x"], values["weight"], offset, cast, values.get("residual")
            )
        except ValueError as e:
            return str(e)
        return None

    return check


def _inverse_root(node) -> bool:
    """A near-miss candidate: rsqrt, or a pow of exponent -0.5 (not the squares)."""
    return node.target is not torch.ops.aten.pow.Tensor_Scalar or node.args[1] == -0.5


_CANDIDATES = ("aten.rsqrt.default", "aten.pow.Tensor_Scalar")


def _examples(with_residual: bool):
    """fp32 graphs drop the casts that bf16/fp16 graphs keep: trace both (fp16 matches the bf16
    pattern; the matcher re-traces every candidate with its real dtypes before accepting it)."""

    def example_inputs():
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(8, 16, dtype=dtype)
            w = torch.randn(16, dtype=dtype)
            eps = DEFAULT_SCALAR_SENTINEL
            yield (x, torch.randn_like(x), w, eps) if with_residual else (x, w, eps)

    return example_inputs


_FORMS = (  # spelling, weight_offset, cast_before_weight
    (llama_rms_norm, 0.0, True),
    (functional_rms_norm, 0.0, False),
    (offset_rms_norm, 1.0, False),
    (meta_rms_norm, 0.0, True),
    (gpt_fast_rms_norm, 0.0, True),
    (olmo2_rms_norm, 0.0, False),
    (pow_rms_norm, 0.0, True),
    (pow_fp32_weight_rms_norm, 0.0, False),
)

ADD_RMS_NORM = Fusion(
    name="add_rms_norm",
    summary="residual add + RMSNorm (every form) -> one add_rms_norm kernel",
    doc="""Residual add + RMSNorm, the sum reused as the next residual.

    Unfused: r = residual + x; h = f32(r); n = h * rsqrt(mean(h^2, -1) + eps); y = scale(n, w)
             (3 kernels in eager per norm; Inductor 1, reading x and residual, writing y and r)
    Fused:   y, r = fusion_passes.add_rms_norm(x, residual, w, eps, weight_offset, cast)
    Forms:   Llama (weight * n.to(dtype)), F.rms_norm / nn.RMSNorm (n * f32(w)), Qwen (1 + w);
             the add in fp32, its sum normalised unrounded (vLLM's native forward)""",
    spellings=tuple(
        Spelling(
            f"add_{fn.__name__}",
            _with_residual(fn),
            _fused_add_rms_norm(offset, cast),
            _check_form(offset, cast),
        )
        for fn, offset, cast in _FORMS
    )
    + (
        # After the rounded-add forms: in fp32 graphs the two adds coincide, and the rounded form
        # is the one every region fusion takes.
        Spelling("vllm_add_rms_norm", vllm_add_rms_norm, _vllm_fused_add_rms_norm, _check_form(0.0, True)),
    ),
    example_inputs=_examples(with_residual=True),
    scalars={"eps": DEFAULT_SCALAR_SENTINEL},
    candidate_ops=_CANDIDATES,
    candidate=_inverse_root,
    builtin=True,
)

RMS_NORM = Fusion(
    name="rms_norm",
    summary="RMSNorm (every form) -> one rms_norm kernel",
    doc="""RMSNorm over the last dim, in each model spelling's rounding.

    Unfused: h = f32(x); n = h * rsqrt(mean(h^2, -1) + eps); y = scale(n, w)
    Fused:   y = fusion_passes.rms_norm(x, w, eps, weight_offset, cast)
    Forms:   Llama (weight * n.to(dtype)), F.rms_norm / nn.RMSNorm (n * f32(w)), Qwen (1 + w)""",
    spellings=tuple(
        Spelling(fn.__name__, fn, _fused_rms_norm(offset, cast), _check_form(offset, cast))
        for fn, offset, cast in _FORMS
    ),
    example_inputs=_examples(with_residual=False),
    scalars={"eps": DEFAULT_SCALAR_SENTINEL},
    candidate_ops=_CANDIDATES,
    candidate=_inverse_root,
    builtin=True,
)


def _unweighted_examples():
    for dtype in (torch.float32, torch.bfloat16):
        yield (torch.randn(8, 16, dtype=dtype), DEFAULT_SCALAR_SENTINEL)


RMS_NORM_UNWEIGHTED = Fusion(
    name="rms_norm_unweighted",
    summary="RMSNorm without a weight -> one rms_norm kernel (a weight of ones)",
    doc="""RMSNorm over the last dim with no weight.

    Unfused: h = f32(x); y = (h * rsqrt(mean(h^2, -1) + eps)).to(x.dtype)
    Fused:   y = fusion_passes.rms_norm(x, ones(D), eps, 0.0, cast_before_weight=True)
             (1 * n.to(dtype) is exact: the same bits)""",
    spellings=tuple(
        Spelling(fn.__name__, fn, _unweighted_fused, _check_unweighted)
        for fn in (unweighted_rms_norm, functional_unweighted_rms_norm, pow_unweighted_rms_norm)
    ),
    example_inputs=_unweighted_examples,
    scalars={"eps": DEFAULT_SCALAR_SENTINEL},
    match_check=_scaled_next,
    builtin=True,
)

# add_rms_norm first: it must claim a norm before the plain rms_norm pattern takes it alone; the
# weighted forms before the unweighted one, whose pattern is a prefix of theirs.
FUSIONS = (ADD_RMS_NORM, RMS_NORM, RMS_NORM_UNWEIGHTED)
