"""Tensor-parallel allreduce + (residual add +) RMSNorm + FP8 quantization ->
``allreduce_(add_)rms_norm_quant_fp8``.

In a TP model whose projections are FP8 linears, each row-wise projection (o_proj, down_proj)
ends in an allreduce of the ranks' partial sums; the decoder layer adds the residual, applies the
next RMSNorm, and the next (column-wise) FP8 projections quantize the normed activation. Under
torch.compile the allreduce is the functional collective pair (patterns/allreduce_rms_norm.py says
which model spellings trace to it):

    s = _c10d_functional.wait_tensor(_c10d_functional.all_reduce(x, "sum", group_name))

Canonicalize, then fuse: the RMSNorm fusions turn the add and every norm spelling into the
canonical norm ops, and the RMSNorm + FP8 quantization fusions (``requires=``) turn a canonical
norm followed by its activation quantization into ``fusion_passes.(add_)rms_norm_quant_fp8``; these
patterns take such a call fed by the allreduce. As in allreduce_rms_norm, the sum may sit in either
operand slot of the canonical add (``residual + s`` or ``s + residual``), and the new residual is
an output only where later code reads it (every norm but the model's last).

Unfused: s = wait(all_reduce(x)); q, scales, r = add_rms_norm_quant_fp8(s, residual, w, eps, ...)
         (a collective writing s, then the norm + quantization kernel reading s and residual)
Fused:   q, scales, r = allreduce_add_rms_norm_quant_fp8(x, residual, w, eps, ..., group_name)
         q, scales, s = allreduce_rms_norm_quant_fp8(x, w, eps, ..., group_name)  (no residual add)

One fusion per (residual or not, scheme), as patterns/rms_norm_quant_fp8.py splits them, each
requiring the quantization fusion it starts from. A fusion's spellings: the norm forms (llama /
fp32_weight / offset: weight_offset and cast_before_weight are literals of the canonical call) x
the slot of the sum x whether the new residual is read, x for per_group plain or power-of-two
(UE8M0) scales (a bool literal). eps and the group name are pattern arguments, so one spelling
matches every value; the group size is the one the quantization fusion registers (128: GROUP_SIZE
says why it is not an argument). The patterns hold no casts and no shapes (the canonical ops carry
them): one trace on meta tensors serves every dtype and shape.
"""

from __future__ import annotations

from typing import Any

import torch

# The fused ops' registration (the patterns' replacements call them).
import fusion_passes.lowering.allreduce_rms_norm_quant_fp8.op  # noqa: F401
import fusion_passes.lowering.rms_norm_quant_fp8.op  # noqa: F401  (the canonical ops matched)
from fusion_passes.lowering.allreduce_rms_norm_quant_fp8.reference import (
    check_allreduce_rms_norm_quant_fp8_args,
)
from fusion_passes.lowering.common.fp8 import QuantFP8
from fusion_passes.lowering.rms_norm.reference import RMSNormForm
from fusion_passes.patterns.allreduce_rms_norm import (
    GROUP_SENTINEL,
    NORM_FORMS,
    reduced_sum,
    views_into_allreduce,
)
from fusion_passes.fusion import DEFAULT_SCALAR_SENTINEL, Fusion, Spelling

SCHEMES = ("static", "per_token", "per_group")


def _default(op, name: str):
    return next(a.default_value for a in op._schema.arguments if a.name == name)


# The group size of the canonical calls matched: the default of the canonical quantization ops,
# which the quantization fusion passes (its spellings reshape by 128). Not a pattern argument,
# because a traced call drops its trailing default arguments (the dispatcher hands Python the
# arguments up to the last non-default one): the quantization fusion's call is in the graph as
# (..., scheme) or (..., "static", scale), with no group size to bind, while a UE8M0 call keeps it,
# (..., "per_group", None, 128, True). The matcher compares argument lists by length, and the
# registry traces a fusion's spellings on one example tuple, so the group size cannot be an
# argument of one form and absent from the other. The patterns pass the same literals and are
# traced through the same dispatcher: they drop the same arguments.
GROUP_SIZE = _default(torch.ops.fusion_passes.add_rms_norm_quant_fp8.default, "group_size")
# scale_ue8m0 literals of each scheme's spellings (only per_group defines power-of-two scales).
_UE8M0 = {"static": (False,), "per_token": (False,), "per_group": (False, True)}

# Outputs of a canonical call that exist in the graph (getitem nodes), so pattern outputs: the
# codes always; the scales for the dynamic schemes (the static scheme's are its input, and the
# quantization fusion's replacement leaves the copy unread); the new residual where it is read.


def _allreduce_add_norm_quant(offset, cast, scheme, ue8m0, reduced_first, residual_used):
    """reduced_first: the sum sits in the canonical call's x slot (the model wrote
    ``residual + s``), else in its residual slot; residual_used: the new residual feeds later
    code."""
    add_norm_quant = torch.ops.fusion_passes.add_rms_norm_quant_fp8.default

    def pattern(x, residual, weight, scale, group_name, eps):
        s = reduced_sum(x, group_name)
        a, b = (s, residual) if reduced_first else (residual, s)
        q, scales, new_residual = add_norm_quant(
            a, b, weight, eps, offset, cast, scheme, scale, GROUP_SIZE, ue8m0
        )
        return _outputs(scheme, q, scales, new_residual if residual_used else None)

    return pattern


def _fused_add_norm_quant(offset, cast, scheme, ue8m0, residual_used):
    fused = torch.ops.fusion_passes.allreduce_add_rms_norm_quant_fp8.default

    def replacement(x, residual, weight, scale, group_name, eps):
        q, scales, new_residual = fused(
            x, residual, weight, eps, offset, cast, scheme, scale, GROUP_SIZE, ue8m0, group_name
        )
        return _outputs(scheme, q, scales, new_residual if residual_used else None)

    return replacement


def _allreduce_norm_quant(offset, cast, scheme, ue8m0):
    """The sum is an output too (it is the next residual where no residual is added); being the
    norm's input it is in the graph whether or not later code reads it, so one spelling serves."""
    norm_quant = torch.ops.fusion_passes.rms_norm_quant_fp8.default

    def pattern(x, residual, weight, scale, group_name, eps):
        s = reduced_sum(x, group_name)
        q, scales = norm_quant(s, weight, eps, offset, cast, scheme, scale, GROUP_SIZE, ue8m0)
        return _outputs(scheme, q, scales, s)

    return pattern


def _fused_norm_quant(offset, cast, scheme, ue8m0):
    fused = torch.ops.fusion_passes.allreduce_rms_norm_quant_fp8.default

    def replacement(x, residual, weight, scale, group_name, eps):
        q, scales, s = fused(x, weight, eps, offset, cast, scheme, scale, GROUP_SIZE, ue8m0, group_name)
        return _outputs(scheme, q, scales, s)

    return replacement


def _outputs(scheme, q, scales, rest):
    """(codes[, scales][, rest]) as the graph holds them; one output is returned bare."""
    outputs = (q,) + ((scales,) if scheme != "static" else ()) + ((rest,) if rest is not None else ())
    return outputs[0] if len(outputs) == 1 else outputs


def _signature(fn, with_residual: bool, static: bool):
    """``fn(x, residual, weight, scale, group_name, eps)`` with the arguments its form takes (the
    matcher names the traced placeholders after the signature and binds every one it lists): no
    residual without the add, no scale unless static (the call gets None). eps comes last: the
    matcher takes scalars from their sentinels and the other arguments from the example in order."""
    if with_residual and static:
        return fn
    if with_residual:

        def bound(x, residual, weight, group_name, eps):
            return fn(x, residual, weight, None, group_name, eps)

    elif static:

        def bound(x, weight, scale, group_name, eps):
            return fn(x, None, weight, scale, group_name, eps)

    else:

        def bound(x, weight, group_name, eps):
            return fn(x, None, weight, None, group_name, eps)

    return bound


def _check(offset: float, cast: bool, scheme: str, ue8m0: bool):
    def check(values: dict[str, Any]) -> str | None:
        if not isinstance(values.get("group_name"), str):
            return f"group name is not a constant string ({values.get('group_name')!r})"
        try:
            check_allreduce_rms_norm_quant_fp8_args(
                values["x"], values["weight"], RMSNormForm(values.get("eps", 0.0), offset, cast),
                QuantFP8(scheme, values.get("scale"), GROUP_SIZE, ue8m0), values.get("residual"),
            )
        except ValueError as e:
            return str(e)
        return None

    return check


def _examples(with_residual: bool, scheme: str):
    """Meta tensors: the patterns call only ops with fake kernels (the collective's included), so
    they trace without a process group; they hold no dtype, so one example serves all."""

    def example_inputs():
        x = torch.empty(8, 16, device="meta")
        tensors = (x, torch.empty_like(x)) if with_residual else (x,)
        tensors += (torch.empty(16, device="meta"),)
        tensors += (torch.empty((), device="meta"),) if scheme == "static" else ()
        yield (*tensors, GROUP_SENTINEL, DEFAULT_SCALAR_SENTINEL)

    return example_inputs


def _fusion(with_residual: bool, scheme: str) -> Fusion:
    prefix = "add_" if with_residual else ""
    static = scheme == "static"
    spellings = []
    for form, (offset, cast) in NORM_FORMS.items():
        for ue8m0 in _UE8M0[scheme]:
            then = f"then_{scheme}" + ("_ue8m0" if ue8m0 else "")
            check = _check(offset, cast, scheme, ue8m0)
            if not with_residual:
                spellings.append(
                    Spelling(
                        f"allreduce_rms_norm_{form}_{then}",
                        _signature(_allreduce_norm_quant(offset, cast, scheme, ue8m0), False, static),
                        _signature(_fused_norm_quant(offset, cast, scheme, ue8m0), False, static),
                        check,
                    )
                )
                continue
            for first in (True, False):
                slot = "residual_plus_sum" if first else "sum_plus_residual"
                # The new residual read first; "_last": the model's final norm, nothing reads it.
                for used in (True, False):
                    pattern = _allreduce_add_norm_quant(offset, cast, scheme, ue8m0, first, used)
                    replacement = _fused_add_norm_quant(offset, cast, scheme, ue8m0, used)
                    spellings.append(
                        Spelling(
                            f"allreduce_{slot}_add_rms_norm_{form}_{then}" + ("" if used else "_last"),
                            _signature(pattern, True, static),
                            _signature(replacement, True, static),
                            check,
                        )
                    )
    quant_fusion = f"{prefix}rms_norm_quant_fp8_{scheme}"
    return Fusion(
        name=f"allreduce_{prefix}rms_norm_quant_fp8_{scheme}",
        summary=(
            f"TP allreduce + {prefix.replace('_', ' ')}RMSNorm + {scheme} FP8 quantization "
            f"-> one allreduce_{prefix}rms_norm_quant_fp8"
        ),
        doc=__doc__.split("\n\n", 1)[1],
        spellings=tuple(spellings),
        example_inputs=_examples(with_residual, scheme),
        scalars={"eps": DEFAULT_SCALAR_SENTINEL},
        # get_fusions adds a fusion's requirements one level deep: list the norms too.
        requires=(
            "add_rms_norm", "rms_norm", "quant_fp8_dynamic", "quant_fp8_unfloored", "quant_fp8_static",
            quant_fusion,
        ),  # fmt: skip
        opt_in="tensor parallel FP8 only; as allreduce_rms_norm, measured on two H200s over "
        "NVLink and on no other topology",
        string_args={"group_name": GROUP_SENTINEL},
        canonicalize=views_into_allreduce,
        builtin=True,
    )


# In fusion_order's order: with the residual, then without, per scheme.
FUSIONS = tuple(_fusion(with_residual, scheme) for scheme in SCHEMES for with_residual in (True, False))
