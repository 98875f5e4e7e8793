"""SiLU-and-mul (the gated MLP's activation) followed by FP8 activation quantization -> one op.

The activation as the models write it, then the quantization as serving engines write their
native fallback (the spellings of ``rms_norm_quant_fp8``: static, per_token, per_group of 128):

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
Fused:   q, scales = fusion_passes.silu_mul_quant_fp8(gate, up, scheme, scale, 128, False)

Not matched (the check or the matcher rejects them): y or silu(gate) also used by another
consumer (it needs the unfused value), gate and up of different shapes (a broadcast) or dtypes,
another group size, another fp8 format.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from fusion_passes.lowering.common.fp8 import QuantFP8
from fusion_passes.lowering.silu_mul_quant_fp8.reference import check_silu_mul_args
from fusion_passes.patterns.rms_norm_quant_fp8 import (
    GROUP_SIZE,
    quant_per_group,
    quant_per_token,
    quant_static,
)
from fusion_passes.fusion import Fusion, Spelling

SCHEMES = ("static", "per_token", "per_group")


def silu_mul(gate, up):
    """The gated MLP's activation, as transformers' LlamaMLP (and every model copying it) writes it."""
    return F.silu(gate) * up


def _pattern(scheme: str):
    if scheme == "static":

        def pattern(gate, up, scale):
            return quant_static(silu_mul(gate, up), scale)

    elif scheme == "per_token":

        def pattern(gate, up):
            return quant_per_token(silu_mul(gate, up))

    else:

        def pattern(gate, up):
            return quant_per_group(silu_mul(gate, up))

    return pattern


def _replacement(scheme: str):
    op = torch.ops.fusion_passes.silu_mul_quant_fp8.default
    if scheme == "static":

        def replacement(gate, up, scale):
            return op(gate, up, "static", scale, GROUP_SIZE, False)[0]

    else:

        def replacement(gate, up):
            return op(gate, up, scheme, None, GROUP_SIZE, False)

    return replacement


def _check(scheme: str):
    def check(values: dict[str, Any]) -> str | None:
        try:
            check_silu_mul_args(values["gate"], values["up"])
            QuantFP8(scheme, values.get("scale"), GROUP_SIZE).check(values["gate"])
        except ValueError as e:
            return str(e)
        return None

    return check


def _examples(scheme: str):
    def example_inputs():
        # fp32 graphs lack the converts bf16 graphs have; fp16 graphs match the bf16 pattern (the
        # matcher re-traces each candidate with its own dtypes).
        for dtype in (torch.float32, torch.bfloat16):
            gate, up = (torch.randn(4, 2 * GROUP_SIZE, dtype=dtype) for _ in range(2))
            yield (gate, up, torch.tensor(0.05)) if scheme == "static" else (gate, up)

    return example_inputs


def _fusion(scheme: str) -> Fusion:
    return Fusion(
        name=f"silu_mul_quant_fp8_{scheme}",
        summary=f"SiLU-and-mul + {scheme} FP8 quantization -> one kernel",
        doc=__doc__.split("\n\n", 1)[1],
        spellings=(
            Spelling(f"silu_mul_then_{scheme}", _pattern(scheme), _replacement(scheme), _check(scheme)),
        ),
        example_inputs=_examples(scheme),
        opt_in="FP8 models only; on one H200 the static scheme is 0.91x stock Inductor at 1-16 "
        "tokens (per-token and per-group 0.99-2.47x; BENCHMARKS.md)",
        builtin=True,
    )


FUSIONS = tuple(_fusion(scheme) for scheme in SCHEMES)
