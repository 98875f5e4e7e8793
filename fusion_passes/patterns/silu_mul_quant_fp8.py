"""SiLU-and-mul (the gated MLP's activation) followed by FP8 activation quantization -> one op.

The activation as the models write it, then the canonical ``quant_fp8`` that every quantization
spelling raises to (patterns/quant_fp8.py); its fields are pattern arguments, as in
``rms_norm_quant_fp8``:

    transformers  down_proj(act_fn(gate_proj(x)) * up_proj(x)), act_fn = SiLU: F.silu(gate) * up
    vLLM-style    gate, up = gate_up_proj(x).chunk(2, -1) (or .split(d, -1), or [..., :d] and
                  [..., d:]); F.silu(gate) * up

What Inductor's post-grad graph makes of it (dumped, torch 2.13; the patterns are traced through
the same decompositions, so they are written as the model writes them):
    bf16/fp16  s = convert(div(g32, add(exp(neg(g32)), 1)), bf16) with g32 = convert(gate, f32);
               y = mul(s, up) in bf16 (Inductor computes it in fp32 and rounds once)
    fp32       the same without the converts
The fused-projection form adds only ``split`` + ``getitem`` (chunk and split alike) or two
``slice`` nodes in front of gate and up: they are the pattern's inputs, so one spelling per
scheme matches both forms, and the fused op reads the two halves in place (row-strided views).

Unfused: a silu-and-mul kernel writes y, an amax reduction reads it, a scale-and-cast kernel
         reads it again.
Fused:   q, scales = fusion_passes.silu_mul_quant_fp8(gate, up, *quant)      (QuantFP8's fields)

Not matched (the check or the matcher rejects them): y or silu(gate) also used by another
consumer (it needs the unfused value), gate and up of different shapes (a broadcast) or dtypes,
a quantization the kernel does not compute (common/fp8_triton.kernel_problem; its canonical op
is then lowered back).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

import fusion_passes.lowering.quant_fp8.op  # noqa: F401  (the canonical op matched)
import fusion_passes.lowering.silu_mul_quant_fp8.op  # noqa: F401  (the fused op)
from fusion_passes.fusion import Fusion, Spelling
from fusion_passes.lowering.common.fp8 import kernel_problem
from fusion_passes.lowering.launch_tables import SILU_MUL_QUANT_FP8_REGION, fp8_region_refusal
from fusion_passes.lowering.silu_mul_quant_fp8.reference import check_silu_mul_args
from fusion_passes.patterns.rms_norm_quant_fp8 import (
    BOOL_FIELDS,
    QUANT_SCALARS,
    QUANT_STRINGS,
    quant_outputs,
    matched_quant,
    quant_fields,
    quant_fp8_call,
)

SCHEMES = ("static", "per_token", "per_group")


def silu_mul(gate, up):
    """The gated MLP's activation, as transformers' LlamaMLP (and every model copying it) writes it."""
    return F.silu(gate) * up


def _pattern(scheme: str, ue8m0: bool, saturate: bool):
    def pattern(gate, up, scale, floor_site, apply, pow2, scale_math, floor, fp8_max, group_size):
        q = dict(floor_site=floor_site, apply=apply, pow2=pow2, scale_math=scale_math, floor=floor,
                 fp8_max=fp8_max, group_size=group_size)  # fmt: skip
        codes, scales = quant_fp8_call(silu_mul(gate, up), scheme, scale, ue8m0, saturate, q)
        return quant_outputs(scheme, codes, scales)

    return _signature(pattern, scheme)


def _replacement(scheme: str, ue8m0: bool, saturate: bool):
    def replacement(gate, up, scale, floor_site, apply, pow2, scale_math, floor, fp8_max, group_size):
        q = dict(floor_site=floor_site, apply=apply, pow2=pow2, scale_math=scale_math, floor=floor,
                 fp8_max=fp8_max, group_size=group_size)  # fmt: skip
        codes, scales = torch.ops.fusion_passes.silu_mul_quant_fp8.default(
            gate, up, *quant_fields(scheme, scale, ue8m0, saturate, q)
        )
        return quant_outputs(scheme, codes, scales)

    return _signature(replacement, scheme)


def _signature(fn, scheme: str):
    """No scale argument where the scheme computes its own (the call gets None)."""
    if scheme == "static":
        return fn

    def bound(gate, up, floor_site, apply, pow2, scale_math, floor, fp8_max, group_size):
        return fn(gate, up, None, floor_site, apply, pow2, scale_math, floor, fp8_max, group_size)

    return bound


def _check(scheme: str, ue8m0: bool, saturate: bool):
    def check(values: dict[str, Any]) -> str | None:
        quant = matched_quant(values, scheme, ue8m0, saturate)
        try:
            check_silu_mul_args(values["gate"], values["up"])
            quant.check(values["gate"])
        except ValueError as e:
            return str(e)
        return kernel_problem(quant) or fp8_region_refusal(SILU_MUL_QUANT_FP8_REGION, scheme, values["gate"])

    return check


def _examples(scheme: str):
    def example_inputs():
        # fp32 graphs lack the converts bf16 graphs have, and fp16 graphs convert to fp16: the
        # patterns are traced once per dtype (used as traced: string_args).
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            # Meta tensors: the canonical op is traced with the sentinels, which only its fake
            # kernel accepts.
            gate, up = (torch.empty(4, 256, dtype=dtype, device="meta") for _ in range(2))
            scale = torch.empty((), device="meta")
            tensors = (gate, up, scale) if scheme == "static" else (gate, up)
            yield (*tensors, *QUANT_STRINGS.values(), *QUANT_SCALARS.values())

    return example_inputs


def _fusion(scheme: str) -> Fusion:
    spellings = []
    # per_token also holds per_tensor's spellings, refused by the check with the reason.
    for matched in ("per_token", "per_tensor") if scheme == "per_token" else (scheme,):
        for ue8m0, saturate in BOOL_FIELDS["static" if scheme == "static" else "dynamic"]:
            suffix = ("_ue8m0" if ue8m0 else "") + ("" if saturate else "_unsaturated")
            spellings.append(
                Spelling(
                    f"silu_mul_then_{matched}{suffix}",
                    _pattern(matched, ue8m0, saturate),
                    _replacement(matched, ue8m0, saturate),
                    _check(matched, ue8m0, saturate),
                )
            )
    return Fusion(
        name=f"silu_mul_quant_fp8_{scheme}",
        summary=f"SiLU-and-mul + {scheme} FP8 quantization -> one kernel",
        doc=__doc__.split("\n\n", 1)[1],
        spellings=tuple(spellings),
        example_inputs=_examples(scheme),
        scalars=dict(QUANT_SCALARS),
        string_args=dict(QUANT_STRINGS),
        requires=("quant_fp8_dynamic", "quant_fp8_unfloored", "quant_fp8_static"),
        builtin=True,
    )


FUSIONS = tuple(_fusion(scheme) for scheme in SCHEMES)
