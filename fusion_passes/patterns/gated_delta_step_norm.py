"""The Gated DeltaNet decode step with the layer's gated RMSNorm: one launch for both.

transformers' Qwen3_5GatedDeltaNet / Qwen3NextGatedDeltaNet after the step (gated_delta_step's
op, and the norm inside Qwen3_5RMSNormGated raised to rms_norm's op by the rms_norm family):

    out, S = fusion_passes.gated_delta_step(q, k, v, a, b, A_log, dt_bias, S, ...)
    n = fusion_passes.rms_norm(out.reshape(-1, V), norm.weight, eps, ...)   the norm, per value head
    y = (n * silu(z.reshape(-1, V).float())).to(v.dtype)                     the gate (Llama form)

Unfused: the step's kernel writes out; Inductor's kernel (the lowered-back norm and the gate)
         reads it back with z: 2 launches a layer.
Fused:   y, S = fusion_passes.gated_delta_step_norm(q, k, v, a, b, A_log, dt_bias, S, z, norm.weight,
                                                     ..., eps, offset, cast)
         one launch where a program holds a whole value row (GATED_DELTA_STEP_NORM's rule), the
         norm in the step's epilogue; else the step's narrow tiles and a norm launch of its own.

Not a site: a gate multiplied in the activations' dtype (``n * F.silu(z)`` without the upcast: the
product rounds otherwise), a norm that is not the step's output's (another tensor, or over another
dim than the value head's V), a LayerNorm.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.nn.functional as F

from fusion_passes.fusion import DEFAULT_SCALAR_SENTINEL, Fusion, Spelling
from fusion_passes.lowering.gated_delta_step.reference import check_gated_delta_step_norm_args
from fusion_passes.patterns.gated_delta_step import L2NORM_EPS

# The rms_norm op's forms a gated norm is raised to: (weight_offset, cast_before_weight).
# Qwen3_5RMSNormGated / Qwen3NextRMSNormGated normalise in the Llama form; the fp32-weight forms
# (F.rms_norm's order, and (1 + w)) are the op's other spellings of the same norm.
_FORMS = {"llama": (0.0, True), "fp32_weight": (0.0, False), "offset": (1.0, False)}
_STEP_ARGS = ("query", "key", "value", "a", "b", "A_log", "dt_bias", "recurrent_state")


def _spelling(form: str) -> Spelling:
    offset, cast = _FORMS[form]

    def pattern(query, key, value, a, b, A_log, dt_bias, recurrent_state, z, weight, eps):
        out, state = torch.ops.fusion_passes.gated_delta_step.default(
            query, key, value, a, b, A_log, dt_bias, recurrent_state, query.shape[-1] ** 0.5, True, True, L2NORM_EPS
        )
        n = torch.ops.fusion_passes.rms_norm.default(out.reshape(-1, out.shape[-1]), weight, eps, offset, cast)
        return (n * F.silu(z.to(torch.float32))).to(value.dtype), state

    def replacement(query, key, value, a, b, A_log, dt_bias, recurrent_state, z, weight, eps):
        return torch.ops.fusion_passes.gated_delta_step_norm.default(
            query, key, value, a, b, A_log, dt_bias, recurrent_state, z, weight,
            query.shape[-1] ** 0.5, True, True, L2NORM_EPS, eps, offset, cast,
        )  # fmt: skip

    def check(values: dict[str, Any]) -> str | None:
        try:
            check_gated_delta_step_norm_args(*(values[n] for n in _STEP_ARGS), values["z"], values["weight"], offset, cast)
        except ValueError as e:
            return str(e).removeprefix("gated_delta_step_norm: ")
        return None

    return Spelling(f"gated_delta_step_then_{form}_gated_rms_norm", pattern, replacement, check)


def _examples():
    """Two sequences, 2 key / 4 value heads of 16 / 8: the step's arguments, the gate rows
    [B * HV, V] and the norm's weight in the activations' dtype (the Llama form's)."""
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        yield (
            torch.randn(2, 1, 2, 16, dtype=dtype),
            torch.randn(2, 1, 2, 16, dtype=dtype),
            torch.randn(2, 1, 4, 8, dtype=dtype),
            torch.randn(2, 1, 4, dtype=dtype),
            torch.randn(2, 1, 4, dtype=dtype),
            torch.randn(4, dtype=dtype),
            torch.randn(4, dtype=dtype),
            torch.randn(2, 4, 16, 8),
            torch.randn(8, 8, dtype=dtype),
            torch.randn(8, dtype=dtype),
            DEFAULT_SCALAR_SENTINEL,
        )


def _normalises_a_step(node) -> bool:
    """A near-miss candidate: a canonical rms_norm of a gated_delta_step op's output (through views)."""
    value = node.args[0] if node.args else None
    while getattr(value, "target", None) in (torch.ops.aten.view.default, torch.ops.aten.reshape.default):
        value = value.args[0]
    value = value.args[0] if getattr(value, "target", None) is operator.getitem else value
    return getattr(value, "target", None) is torch.ops.fusion_passes.gated_delta_step.default


GATED_DELTA_STEP_NORM = Fusion(
    name="gated_delta_step_norm",
    summary="Gated DeltaNet decode step + the layer's gated RMSNorm (norm(o) * silu(z)) -> one launch",
    doc=__doc__.split("\n\n", 1)[1],
    spellings=tuple(_spelling(form) for form in _FORMS),
    example_inputs=_examples,
    scalars={"eps": DEFAULT_SCALAR_SENTINEL},
    requires=("rms_norm", "gated_delta_step"),
    candidate_ops=("fusion_passes.rms_norm.default",),
    candidate=_normalises_a_step,
    opt_in="not yet timed on a GPU (bench_gated_delta_step --regions recurrent_norm decides it): its whole-row "
    "epilogue runs a program per (sequence, value head), an eighth of the step's programs at batch 1 on one "
    "H200's launch table (16 columns a program), a half from batch 32 (64 columns)",
    builtin=True,
)

FUSIONS = (GATED_DELTA_STEP_NORM,)
