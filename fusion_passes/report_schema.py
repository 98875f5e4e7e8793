"""JSON Schema (draft 2020-12) of `fusion-passes diff --json`, version "fusion_passes.diff/1".

A new field may be added within a version; renaming or removing one bumps the version. Every
field carries a ``description``; docs/report-schema.md is ``render_markdown()`` of this schema (a
test keeps the two equal).
"""

from __future__ import annotations

from typing import Any


def _d(schema: dict, description: str) -> dict:
    """``schema`` with its description."""
    return {**schema, "description": description}


_STR = {"type": "string"}
_INT = {"type": "integer", "minimum": 0}
_NUM = {"type": "number"}
_COUNTS = {"type": "object", "additionalProperties": _INT}
_REGION = {
    "type": "object",
    "required": ["nodes", "edges"],
    "properties": {
        "nodes": _d(
            {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["id", "label", "kind"],
                    "properties": {
                        "id": _d(_STR, "the node's name in the graph"),
                        "label": _d(_STR, "its op, or the argument's name for an input"),
                        "kind": _d({"enum": ["input", "op", "output"]}, "its role in the region"),
                    },
                },
            },
            "the region's nodes",
        ),
        "edges": _d(
            {"type": "array", "items": {"type": "array", "items": _STR, "minItems": 2, "maxItems": 2}},
            "[from id, to id] pairs: a value flowing from one node to the next",
        ),
    },
}
_WHERE = {
    "fusion": _d(_STR, "the fusion's name (`fusion-passes list`)"),
    "spelling": _d(_STR, "which of the fusion's spellings (the way model code writes it)"),
    "graph": _d(_INT, "index of the compiled graph (a graph break makes several)"),
    "module": _d(_STR, 'the nn.Module path, e.g. "model.layers.0.input_layernorm" ("" unknown)'),
    "location": _d(_STR, 'the model source line of the site, "file.py:123 in forward"'),
}


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
    ],  # fmt: skip
    "properties": {
        "schema": _d({"const": "fusion_passes.diff/1"}, "this schema's name and version"),
        "model": _d(_STR, "the built-in model's name, or path/to/file.py:factory"),
        "decode": _d(
            {
                "oneOf": [
                    {"type": "null"},
                    {
                        "type": "object",
                        "required": ["batch", "context"],
                        "properties": {
                            "batch": _d(_INT, "sequences in the step"),
                            "context": _d(_INT, "tokens in the StaticCache before the step"),
                        },
                    },
                ]
            },
            "--decode: the compared program is one cached decode step, not a forward (null: a forward)",
        ),
        "device": _d(_STR, 'the device as given to --device ("cpu", "cuda", "cuda:1")'),
        "dtype": _d({"enum": ["fp32", "bf16", "fp16", "fp64"]}, "the dtype the model ran in"),
        "dtype_from": _d(
            {"enum": ["--dtype", "model", "default"]},
            "where that dtype came from: --dtype, the factory's model itself, or the built-in default",
        ),
        "summary": _d(_STR, 'the report in one line, e.g. "9 sites in 3 fusions, 0 rejected, numerics ok"'),
        "matches": _d(
            _COUNTS,
            "fusion name -> rewrites made, those later taken by another fusion or lowered back "
            "included (every fusion that ran is present)",
        ),
        "final": _d(_COUNTS, "fusion name -> its rewrites left in the compiled graph"),
        "sites": _d(
            {
                "type": "array",
                "items": _record(
                    {
                        "ops_removed": _d({"type": "array", "items": _STR}, "ops of the matched region"),
                        "ops_added": _d({"type": "array", "items": _STR}, "ops of its replacement"),
                        "scalars": _d(
                            {"type": "object", "additionalProperties": _NUM},
                            "the scalar arguments matched (eps, head dim...)",
                        ),
                        "before": _d(_REGION, "the matched region"),
                        "after": _d(_REGION, "what replaced it"),
                        "fate": _d(
                            _STR,
                            '"" (in the compiled graph), "taken by <fusion>" (a later fusion\'s '
                            'region consumed it) or "lowered back" (left standalone: plain torch again)',
                        ),
                    },
                    ["ops_removed", "ops_added", "before", "after"],
                ),
            },
            "every rewrite, in the order made",
        ),
        "rejected": _d(
            {
                "type": "array",
                "items": _record({"reason": _d(_STR, "why the rewrite was refused")}, ["reason"]),
            },
            "candidates that matched a spelling but failed a check (dtypes, shapes, --verify)",
        ),
        "near_misses": _d(
            {
                "type": "array",
                "items": _record(
                    {
                        "matched": _d(_INT, "ops of the closest spelling that lined up"),
                        "total": _d(_INT, "ops in that spelling"),
                        "reason": _d(_STR, "the first divergence from it"),
                    },
                    ["matched", "total", "reason"],
                ),
            },
            "candidate sites left unfused (a norm's rsqrt, an all_reduce feeding a norm, a float8 "
            "conversion...), each with the closest spelling (fusion, spelling) and where it diverged",
        ),
        "errors": _d({"type": "array", "items": _STR}, "fusions that failed and were skipped (the graph left as it was)"),
        "ops_before": _d(_COUNTS, "op -> calls in the graphs Inductor handed over, summed"),
        "ops_after": _d(_COUNTS, "op -> calls in the graphs Inductor compiled: after the fusions and the lowering back"),
        "lowered_back": _d(_COUNTS, "canonical op -> calls left standalone and decomposed back into plain torch"),
        "expected_rms_norm_sites": _d(
            {"type": ["integer", "null"]},
            "RMSNorm modules a built-in model holds (null for a factory's model)",
        ),
        "numerics": _d(
            {
                "type": "object",
                "additionalProperties": {
                    "type": "object",
                    "required": ["outputs", "ok"],
                    "properties": {
                        "ok": _d({"type": "boolean"}, "every output within the tolerance"),
                        "outputs": {
                            "type": "array",
                            "items": {
                                "type": "object",
                                "required": ["max_abs", "rel_norm", "ok"],
                                "properties": {
                                    "max_abs": _d(_NUM, "largest absolute difference"),
                                    "rel_norm": _d(_NUM, "||a - e|| / ||e||, computed in float64"),
                                    "ok": _d({"type": "boolean"}, "rel_norm <= tolerance"),
                                },
                            },
                        },
                    },
                },
            },
            '"inductor vs eager", "fusion_passes vs eager" -> per output errors',
        ),
        "tolerance": _d(
            {"type": "object", "required": ["rel_norm"], "properties": {"rel_norm": _NUM}},
            "the bound behind each ok: the relative norm error allowed at the model's dtype "
            "(fusion_passes.numerics' per-dtype table)",
        ),
        "compile_seconds": _d(
            {"type": "object", "additionalProperties": _NUM},
            "wall time of each compile and first run, in order (inductor first): the second starts "
            "with warm caches (imports, Dynamo), so the two are not a comparison",
        ),
        "kernels": _d(
            {
                "type": "object",
                "additionalProperties": {
                    "type": "object",
                    "required": ["generated", "fused_ops", "extern"],
                    "properties": {
                        "generated": _d(_INT, "kernels Inductor generated (Triton on CUDA, C++ on CPU)"),
                        "fused_ops": _d(_INT, "fusion_passes ops called through the dispatcher"),
                        "extern": _d(_INT, "library calls (GEMMs, attention, fallbacks)"),
                        "launched": _d(_COUNTS, "CUDA only: kernels launched per forward, by class"),
                        "gpu_us": _d(
                            {"type": "object", "additionalProperties": _NUM},
                            "CUDA only: GPU microseconds of those kernels, by class",
                        ),
                        "left": _d(
                            {
                                "type": "array",
                                "items": {
                                    "type": "object",
                                    "required": ["kernel", "region", "launches", "us"],
                                    "properties": {
                                        "kernel": _d(_STR, "the kernel's name as the CUDA profiler reports it"),
                                        "region": _d(
                                            _STR,
                                            'the classes of the kernels around it, "gemm -> attention" '
                                            '("start" / "end": none before / after)',
                                        ),
                                        "launches": _d(_INT, "its launches there per forward"),
                                        "us": _d(_NUM, "their GPU microseconds"),
                                    },
                                },
                            },
                            'CUDA only: "what is left": the kernels outside GEMM / attention / MoE, by '
                            "name and region, ranked by GPU time: candidates no fusion takes yet",
                        ),
                    },
                },
            },
            '"inductor", "fusion_passes" -> kernels in the generated code',
        ),
    },
}


def render_markdown(schema: dict = DIFF_REPORT_SCHEMA) -> str:
    """The schema as a field list (docs/report-schema.md)."""
    lines = [
        "# The `fusion-passes diff --json` report",
        "",
        f"Schema `{schema['properties']['schema']['const']}` (JSON Schema draft 2020-12:",
        "`fusion_passes.report_schema.DIFF_REPORT_SCHEMA`). A new field may be added within a",
        "version; renaming or removing one bumps it. Generated from the schema's descriptions",
        "(`python -c \"from fusion_passes.report_schema import render_markdown; print(render_markdown(), end='')\"`).",
        "",
    ]
    required = set(schema["required"])
    for name, field in schema["properties"].items():
        optional = "" if name in required else " (optional)"
        lines.append(f"- `{name}`{optional}: {field['description']}")
        lines += _nested(field, "  ")
    return "\n".join(lines) + "\n"


def _nested(field: dict, indent: str) -> list[str]:
    """The described fields of a record (or of an array's / a map's records), indented."""
    inner: Any = field
    for key in ("items", "additionalProperties"):
        if isinstance(inner, dict) and isinstance(inner.get(key), dict):
            inner = inner[key]
            if isinstance(inner.get("items"), dict):
                inner = inner["items"]
    out = []
    for name, sub in (inner.get("properties") or {}).items() if isinstance(inner, dict) else ():
        if "description" in sub:
            out.append(f"{indent}- `{name}`: {sub['description']}")
            if sub.get("type") == "array" or "properties" in sub:
                out += _nested(sub, indent + "  ")
    return out
