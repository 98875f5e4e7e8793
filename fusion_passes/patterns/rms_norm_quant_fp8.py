"""RMSNorm (+ residual add) followed by FP8 activation quantization -> one op.

Canonicalize, then fuse: the RMSNorm fusions have already turned every norm spelling into
``fusion_passes.rms_norm`` / ``add_rms_norm``; these patterns take such a call followed by the
quantization of its output as serving engines write their native (plain torch) fallback:

    static     q = (y.float() / scale).clamp(-448, 448).to(float8_e4m3fn)
    per_token  amax = y32.abs().amax(-1, keepdim=True); s = (amax / 448).clamp(min=1/(448*512))
               q = (y32 / s).clamp(-448, 448).to(float8_e4m3fn)
    per_group  the same over y32.unflatten(-1, (-1, 128)) (DeepSeek V3's block-wise activations),
               codes flattened back, scales squeezed to [..., N / 128]

Unfused: norm kernel writes y, an amax reduction reads it, a scale-and-cast kernel reads it again.
Fused:   q, scales(, r) = fusion_passes.(add_)rms_norm_quant_fp8(x, (residual,) w, eps, ...)
"""

from __future__ import annotations

from typing import Any

import torch

from fusion_passes.lowering.common.fp8 import FP8_MAX, MIN_SCALE, QuantFP8
from fusion_passes.fusion import DEFAULT_SCALAR_SENTINEL, Fusion, Spelling

GROUP_SIZE = 128  # DeepSeek V3 / V3.2 block-wise activation quantization
_FORMS = {"llama": (0.0, True), "fp32_weight": (0.0, False), "offset": (1.0, False)}

# --- the quantization spellings (plain torch, as a serving engine's fallback writes them) ---


def quant_static(y, scale):
    return (y.to(torch.float32) / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def quant_per_token(y):
    y32 = y.to(torch.float32)
    scale = (y32.abs().amax(-1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)
    return (y32 / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def quant_per_group(y):
    y32 = y.to(torch.float32).unflatten(-1, (-1, GROUP_SIZE))
    scale = (y32.abs().amax(-1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)
    q = (y32 / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.flatten(-2), scale.squeeze(-1)


# --- spellings: canonical norm op -> quantization, per rounding form and scheme ---


def _norm_then_quant(offset: float, cast: bool, scheme: str, with_residual: bool):
    norm = torch.ops.fusion_passes.add_rms_norm.default if with_residual else None

    def quantize(y, scale):
        if scheme == "static":
            return (quant_static(y, scale),)
        return quant_per_token(y) if scheme == "per_token" else quant_per_group(y)

    def single(outputs):  # one output is returned bare, as the matcher expects
        return outputs[0] if len(outputs) == 1 else outputs

    if with_residual:

        def pattern(x, residual, weight, scale, eps):
            y, new_residual = norm(x, residual, weight, eps, offset, cast)
            return (*quantize(y, scale), new_residual)

    else:

        def pattern(x, weight, scale, eps):
            y = torch.ops.fusion_passes.rms_norm.default(x, weight, eps, offset, cast)
            return single(quantize(y, scale))

    return _signature(pattern, scheme)


def _fused(offset: float, cast: bool, scheme: str, with_residual: bool):
    group = GROUP_SIZE

    if with_residual:

        def replacement(x, residual, weight, scale, eps):
            q, scales, new_residual = torch.ops.fusion_passes.add_rms_norm_quant_fp8.default(
                x, residual, weight, eps, offset, cast, scheme, scale, group, False
            )
            return (q, new_residual) if scheme == "static" else (q, scales, new_residual)

    else:

        def replacement(x, weight, scale, eps):
            q, scales = torch.ops.fusion_passes.rms_norm_quant_fp8.default(
                x, weight, eps, offset, cast, scheme, scale, group, False
            )
            return q if scheme == "static" else (q, scales)

    return _signature(replacement, scheme)


def _signature(fn, scheme: str):
    """Drop the scale argument where the scheme computes its own (the pattern takes none).
    Scalars (eps) come last: the matcher names the traced placeholders by position."""
    if scheme == "static":
        return fn
    if fn.__code__.co_varnames[1] == "residual":
        return lambda x, residual, weight, eps: fn(x, residual, weight, None, eps)
    return lambda x, weight, eps: fn(x, weight, None, eps)


def _check(scheme: str):
    def check(values: dict[str, Any]) -> str | None:
        try:
            QuantFP8(scheme, values.get("scale"), GROUP_SIZE).check(values["x"])
        except ValueError as e:
            return str(e)
        return None

    return check


def _examples(with_residual: bool, scheme: str):
    def example_inputs():
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(4, 2 * GROUP_SIZE, dtype=dtype)
            w = torch.randn(2 * GROUP_SIZE, dtype=dtype)
            args = (x, torch.randn_like(x), w) if with_residual else (x, w)
            args += (torch.tensor(0.05),) if scheme == "static" else ()
            yield args + (DEFAULT_SCALAR_SENTINEL,)

    return example_inputs


def _fusion(with_residual: bool, scheme: str) -> Fusion:
    prefix = "add_" if with_residual else ""
    spellings = []
    for form, (offset, cast) in _FORMS.items():
        pattern = _norm_then_quant(offset, cast, scheme, with_residual)
        spellings.append(
            Spelling(
                f"{prefix}rms_norm_{form}_then_{scheme}",
                pattern,
                _fused(offset, cast, scheme, with_residual),
                _check(scheme),
            )
        )
    return Fusion(
        name=f"{prefix}rms_norm_quant_fp8_{scheme}",
        summary=f"{prefix.replace('_', ' ')}RMSNorm + {scheme} FP8 quantization -> one kernel",
        doc=__doc__.split("\n\n", 1)[1],
        spellings=tuple(spellings),
        example_inputs=_examples(with_residual, scheme),
        scalars={"eps": DEFAULT_SCALAR_SENTINEL},
        requires=("add_rms_norm", "rms_norm"),
        cse_before=True,  # q / k / v (gate / up) each quantize the norm's output: one after CSE
        opt_in="FP8 models only; on one H200 0.95-0.97x stock Inductor at some decode shapes "
        "(1.07-2.74x from 4096 tokens; BENCHMARKS.md)",
        builtin=True,
    )


# In fusion_order's order: with the residual, then without, per scheme.
FUSIONS = tuple(
    _fusion(with_residual, scheme)
    for scheme in ("static", "per_token", "per_group")
    for with_residual in (True, False)
)
