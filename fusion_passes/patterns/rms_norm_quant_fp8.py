"""RMSNorm (+ residual add) followed by FP8 activation quantization -> one op.

A region fusion of canonical ops: the RMSNorm fusions have turned every norm spelling into
``fusion_passes.rms_norm`` / ``add_rms_norm``, and the quantization fusions (patterns/quant_fp8.py)
every quantization spelling into ``fusion_passes.quant_fp8``; these patterns take a canonical norm
whose output only the canonical quantization reads:

    y = rms_norm(x, w, eps, offset, cast)            (or y, r = add_rms_norm(x, residual, ...))
    q, s = quant_fp8(y, scheme, scale, group_size, scale_ue8m0, floor_site, floor, apply, pow2,
                     saturate, fp8_max, scale_math)

Unfused: norm kernel writes y, an amax reduction reads it, a scale-and-cast kernel reads it again.
Fused:   q, s(, r) = fusion_passes.(add_)rms_norm_quant_fp8(x, (residual,) w, eps, offset, cast,
                                                           *quant)

The quantization's string fields (floor site, apply form, power-of-two form, scale arithmetic) are
pattern arguments (``Fusion.string_args``), its floats and group size too (``scalars``): one
pattern per norm form, scheme and bool fields serves every spelling that raised. The check
rejects what the kernel does not compute (common/fp8_triton.kernel_problem: dynamic per-tensor
scales, log2 power-of-two rounding, fp64 or activation-dtype scale arithmetic, another fp8
maximum) with its reason; the canonical quantization is then lowered back, as stock Inductor
would compile it.
"""

from __future__ import annotations

from typing import Any

import torch

import fusion_passes.lowering.quant_fp8.op  # noqa: F401  (the canonical op matched)
import fusion_passes.lowering.rms_norm_quant_fp8.op  # noqa: F401  (the fused ops)
from fusion_passes.fusion import DEFAULT_SCALAR_SENTINEL, Fusion, Spelling
from fusion_passes.lowering.common.fp8 import QuantFP8
from fusion_passes.lowering.common.fp8 import kernel_problem
from fusion_passes.lowering.launch_tables import RMS_NORM_QUANT_FP8_REGION, fp8_region_refusal

_FORMS = {"llama": (0.0, True), "fp32_weight": (0.0, False), "offset": (1.0, False)}
SCHEMES = ("static", "per_token", "per_group")

# The quantization's arguments that become pattern arguments, and their sentinels: strings
# (string_args) and numbers (scalars), each a value no traced graph holds otherwise.
QUANT_STRINGS = {
    "floor_site": "fusion_passes:floor_site",
    "apply": "fusion_passes:apply",
    "pow2": "fusion_passes:pow2",
    "scale_math": "fusion_passes:scale_math",
}
QUANT_SCALARS = {"floor": 2.0**-19, "fp8_max": 2.0**-21, "group_size": 1000003}
_QUANT_ARGS = (*QUANT_STRINGS, *QUANT_SCALARS)
# The bool fields, literals of the patterns: one spelling per value.
BOOL_FIELDS = {  # (scale_ue8m0, saturate) per scheme kind
    "static": ((False, True), (False, False)),
    "dynamic": ((False, True), (False, False), (True, True), (True, False)),
}


def quant_fp8_call(y, scheme, scale, ue8m0, saturate, q):
    """The canonical quantization of y, its fields from the pattern's arguments ``q``."""
    return torch.ops.fusion_passes.quant_fp8.default(
        y, scheme, scale, q["group_size"], ue8m0, q["floor_site"], q["floor"], q["apply"], q["pow2"],
        saturate, q["fp8_max"], q["scale_math"],
    )  # fmt: skip


def quant_fields(scheme, scale, ue8m0, saturate, q) -> tuple:
    """QuantFP8's fields in order, from the pattern's arguments ``q`` (a fused op's arguments)."""
    return (scheme, scale, q["group_size"], ue8m0, q["floor_site"], q["floor"], q["apply"], q["pow2"],
            saturate, q["fp8_max"], q["scale_math"])  # fmt: skip


def quant_outputs(scheme, q, scales, rest=None):
    """(codes[, scales][, rest]): the static scheme's scale is its input, not an output the
    raised spellings return; one output is returned bare, as the matcher expects."""
    outputs = (q,) + ((scales,) if scheme != "static" else ()) + ((rest,) if rest is not None else ())
    return outputs[0] if len(outputs) == 1 else outputs


def _pattern(offset, cast, scheme, ue8m0, saturate, with_residual):
    if with_residual:

        def pattern(x, residual, weight, scale, floor_site, apply, pow2, scale_math, eps, floor, fp8_max,
                    group_size):  # fmt: skip
            q = dict(floor_site=floor_site, apply=apply, pow2=pow2, scale_math=scale_math, floor=floor,
                     fp8_max=fp8_max, group_size=group_size)  # fmt: skip
            y, new_residual = torch.ops.fusion_passes.add_rms_norm.default(x, residual, weight, eps, offset, cast)
            codes, scales = quant_fp8_call(y, scheme, scale, ue8m0, saturate, q)
            return quant_outputs(scheme, codes, scales, new_residual)

    else:

        def pattern(x, weight, scale, floor_site, apply, pow2, scale_math, eps, floor, fp8_max, group_size):
            q = dict(floor_site=floor_site, apply=apply, pow2=pow2, scale_math=scale_math, floor=floor,
                     fp8_max=fp8_max, group_size=group_size)  # fmt: skip
            y = torch.ops.fusion_passes.rms_norm.default(x, weight, eps, offset, cast)
            codes, scales = quant_fp8_call(y, scheme, scale, ue8m0, saturate, q)
            return quant_outputs(scheme, codes, scales)

    return _signature(pattern, scheme, with_residual)


def _fused(offset, cast, scheme, ue8m0, saturate, with_residual):
    if with_residual:

        def replacement(x, residual, weight, scale, floor_site, apply, pow2, scale_math, eps, floor, fp8_max,
                        group_size):  # fmt: skip
            q = dict(floor_site=floor_site, apply=apply, pow2=pow2, scale_math=scale_math, floor=floor,
                     fp8_max=fp8_max, group_size=group_size)  # fmt: skip
            codes, scales, new_residual = torch.ops.fusion_passes.add_rms_norm_quant_fp8.default(
                x, residual, weight, eps, offset, cast, *quant_fields(scheme, scale, ue8m0, saturate, q)
            )
            return quant_outputs(scheme, codes, scales, new_residual)

    else:

        def replacement(x, weight, scale, floor_site, apply, pow2, scale_math, eps, floor, fp8_max, group_size):
            q = dict(floor_site=floor_site, apply=apply, pow2=pow2, scale_math=scale_math, floor=floor,
                     fp8_max=fp8_max, group_size=group_size)  # fmt: skip
            codes, scales = torch.ops.fusion_passes.rms_norm_quant_fp8.default(
                x, weight, eps, offset, cast, *quant_fields(scheme, scale, ue8m0, saturate, q)
            )
            return quant_outputs(scheme, codes, scales)

    return _signature(replacement, scheme, with_residual)


def _signature(fn, scheme: str, with_residual: bool):
    """Drop the scale argument where the scheme computes its own (the call gets None): the
    matcher names the traced placeholders after the signature and binds every one it lists."""
    if scheme == "static":
        return fn
    if with_residual:

        def bound(x, residual, weight, floor_site, apply, pow2, scale_math, eps, floor, fp8_max, group_size):
            return fn(x, residual, weight, None, floor_site, apply, pow2, scale_math, eps, floor, fp8_max,
                      group_size)  # fmt: skip

    else:

        def bound(x, weight, floor_site, apply, pow2, scale_math, eps, floor, fp8_max, group_size):
            return fn(x, weight, None, floor_site, apply, pow2, scale_math, eps, floor, fp8_max, group_size)

    return bound


def matched_quant(values: dict[str, Any], scheme: str, ue8m0: bool, saturate: bool) -> QuantFP8:
    """The QuantFP8 of a match's values."""
    return QuantFP8(*quant_fields(scheme, values.get("scale"), ue8m0, saturate, values))


def _check(scheme: str, ue8m0: bool, saturate: bool):
    def check(values: dict[str, Any]) -> str | None:
        quant = matched_quant(values, scheme, ue8m0, saturate)
        try:
            quant.check(values["x"])
        except ValueError as e:
            return str(e)
        return kernel_problem(quant) or fp8_region_refusal(RMS_NORM_QUANT_FP8_REGION, scheme, values["x"])

    return check


def _examples(with_residual: bool, scheme: str):
    """Meta tensors: the patterns call only canonical ops, which carry the dtypes and shapes, so
    one trace serves every dtype and shape; the arguments in the patterns' order, sentinels for
    the pattern arguments."""

    def example_inputs():
        x = torch.empty(8, 256, device="meta")
        tensors = (x, torch.empty_like(x)) if with_residual else (x,)
        tensors += (torch.empty(256, device="meta"),)
        tensors += (torch.empty((), device="meta"),) if scheme == "static" else ()
        yield (*tensors, *QUANT_STRINGS.values(), DEFAULT_SCALAR_SENTINEL, *QUANT_SCALARS.values())

    return example_inputs


def _fusion(with_residual: bool, scheme: str) -> Fusion:
    prefix = "add_" if with_residual else ""
    spellings = []
    # The per_token fusion also holds the per_tensor scheme's spellings, whose check always says
    # why the kernel does not compute them (so the report names the norm + quant site).
    for matched in ("per_token", "per_tensor") if scheme == "per_token" else (scheme,):
        for form, (offset, cast) in _FORMS.items():
            for ue8m0, saturate in BOOL_FIELDS["static" if scheme == "static" else "dynamic"]:
                suffix = ("_ue8m0" if ue8m0 else "") + ("" if saturate else "_unsaturated")
                spellings.append(
                    Spelling(
                        f"{prefix}rms_norm_{form}_then_{matched}{suffix}",
                        _pattern(offset, cast, matched, ue8m0, saturate, with_residual),
                        _fused(offset, cast, matched, ue8m0, saturate, with_residual),
                        _check(matched, ue8m0, saturate),
                    )
                )
    return Fusion(
        name=f"{prefix}rms_norm_quant_fp8_{scheme}",
        summary=f"{prefix.replace('_', ' ')}RMSNorm + {scheme} FP8 quantization -> one kernel",
        doc=__doc__.split("\n\n", 1)[1],
        spellings=tuple(spellings),
        example_inputs=_examples(with_residual, scheme),
        scalars={"eps": DEFAULT_SCALAR_SENTINEL, **QUANT_SCALARS},
        string_args=dict(QUANT_STRINGS),
        requires=("add_rms_norm", "rms_norm", "quant_fp8_dynamic", "quant_fp8_unfloored", "quant_fp8_static"),
        # q / k / v (gate / up) each quantize the norm's output: the raise makes one quant_fp8 of
        # each, identical; after CSE one, so the norm has one consumer to fuse with. Here, not on
        # the raise (in fusions="all"): the default pipeline deduplicates nothing it did not.
        cse_before=True,
        cse_when=("fusion_passes.quant_fp8.default",),
        builtin=True,
    )


# In fusion_order's order: with the residual, then without, per scheme.
FUSIONS = tuple(
    _fusion(with_residual, scheme)
    for scheme in SCHEMES
    for with_residual in (True, False)
)
