"""JSON Schema (draft 2020-12) of `fusion-passes diff --json`, version "fusion_passes.diff/1".

A new field may be added within a version; renaming or removing one bumps the version.
"""

from __future__ import annotations

_STR = {"type": "string"}
_INT = {"type": "integer", "minimum": 0}
_COUNTS = {"type": "object", "additionalProperties": _INT}
_REGION = {
    "type": "object",
    "required": ["nodes", "edges"],
    "properties": {
        "nodes": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["id", "label", "kind"],
                "properties": {
                    "id": _STR,
                    "label": _STR,
                    "kind": {"enum": ["input", "op", "output"]},
                },
            },
        },
        "edges": {
            "type": "array",
            "items": {"type": "array", "items": _STR, "minItems": 2, "maxItems": 2},
        },
    },
}
_WHERE = {"fusion": _STR, "spelling": _STR, "graph": _INT, "module": _STR, "location": _STR}


def _record(extra: dict, required: list[str]) -> dict:
    return {
        "type": "object",
        "required": [*_WHERE, *required],
        "properties": {**_WHERE, **extra},
    }


DIFF_REPORT_SCHEMA: dict = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "fusion-passes diff report",
    "type": "object",
    "required": [
        "schema", "model", "device", "dtype", "matches", "sites", "rejected", "near_misses",
        "errors", "ops_before", "ops_after", "numerics", "kernels",
    ],
    "properties": {
        "schema": {"const": "fusion_passes.diff/1"},
        "model": _STR,
        "device": _STR,  # as given to --device ("cpu", "cuda", "cuda:1")
        "dtype": {"enum": ["fp32", "bf16", "fp16", "fp64"]},  # the dtype the model ran in
        # where that dtype came from: --dtype, the factory's model itself, or the built-in default
        "dtype_from": {"enum": ["--dtype", "model", "default"]},
        "matches": _COUNTS,  # fusion name -> sites rewritten (taken or lowered later included)
        "final": _COUNTS,  # fusion name -> its rewrites left in the compiled graph
        "sites": {
            "type": "array",
            "items": _record(
                {
                    "ops_removed": {"type": "array", "items": _STR},
                    "ops_added": {"type": "array", "items": _STR},
                    "scalars": {"type": "object", "additionalProperties": {"type": "number"}},
                    "before": _REGION,
                    "after": _REGION,
                    # "" (in the compiled graph), "taken by <fusion>" or "lowered back"
                    "fate": _STR,
                },
                ["ops_removed", "ops_added", "before", "after"],
            ),
        },
        "rejected": {"type": "array", "items": _record({"reason": _STR}, ["reason"])},
        "near_misses": {
            "type": "array",
            "items": _record(
                {"matched": _INT, "total": _INT, "reason": _STR}, ["matched", "total", "reason"]
            ),
        },
        "errors": {"type": "array", "items": _STR},
        "ops_before": _COUNTS,
        "ops_after": _COUNTS,  # what Inductor compiled: after the fusions and the lowering back
        # canonical ops left standalone and decomposed back into plain torch: op name -> calls
        "lowered_back": _COUNTS,
        "expected_rms_norm_sites": {"type": ["integer", "null"]},
        "numerics": {
            "type": "object",
            "additionalProperties": {
                "type": "object",
                "required": ["outputs", "ok"],
                "properties": {
                    "ok": {"type": "boolean"},
                    "outputs": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "required": ["max_abs", "rel_norm", "ok"],
                            "properties": {
                                "max_abs": {"type": "number"},
                                "rel_norm": {"type": "number"},
                                "ok": {"type": "boolean"},
                            },
                        },
                    },
                },
            },
        },
        "kernels": {
            "type": "object",
            "additionalProperties": {
                "type": "object",
                "required": ["generated", "fused_ops", "extern"],
                "properties": {"generated": _INT, "fused_ops": _INT, "extern": _INT},
            },
        },
    },
}
