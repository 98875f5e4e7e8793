"""BENCHMARKS.md from benchmarks/results/*.json: per fusion family one table of its latest numbers,
with where, when and how they were measured.

    python -m benchmarks.render            # writes BENCHMARKS.md
    python -m benchmarks.render --check    # exit status 1 if BENCHMARKS.md is not what it would write
    python -m benchmarks.render --merge a.json b.json --into benchmarks/results/bench_NAME.json

--merge makes one result of several runs of one benchmark, each over a part of its shapes (a
command of limited length): see merge().

A result file is what a benchmark's --json writes (benchmarks/common.py's write_json): the numbers
under the benchmark's own keys and a "provenance" (date, GPU, GPUs used, torch, triton, command).
A file transcribed from the dated log (docs/notes/benchmarks-history.md) says so in
provenance["source"], naming the sections; its command is the log's, in today's python -m form, or
a list of commands where the numbers come from several runs of one day; its records hold the times
the log states, and the log's own rounded ratios under "as_logged" ("speedup": stock Inductor's
time over ours, or the baseline's named in the table; "pct_of_copy"), which the tables prefer to
ratios of rounded times. "notes" (a list of sentences) are shown under the table.

This module reads JSON only (no torch), so the page renders anywhere.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
PAGE = REPO / "BENCHMARKS.md"
HISTORY = "docs/notes/benchmarks-history.md"
BANDWIDTH_MIN_TOKENS = 4096  # the benchmarks count % of copy bandwidth from here on


# ---------------------------------------------------------------------------------------------
# Numbers


def _us(value: float | None) -> str:
    if value is None:
        return "—"
    return f"{value:.0f}" if value >= 1000 or float(value).is_integer() else f"{value:.1f}"


def _x(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}x"


def _logged(record: dict, key: str):
    return record.get("as_logged", {}).get(key)


def _speedup(record: dict, base: str, ours: str, times="graph_us", logged="speedup") -> float | None:
    """The log's ratio where the record was transcribed, else base's time over ours."""
    if _logged(record, logged) is not None:
        return _logged(record, logged)
    t = record.get(times) or {}
    return t[base] / t[ours] if t.get(base) and t.get(ours) else None


def _pct(record: dict, us: float | None, copy_gbps: float | None, logged="pct_of_copy") -> int | None:
    """Percent of the copy bandwidth from 4096 tokens on: the log's, or the fewest bytes over us."""
    if record["tokens"] < BANDWIDTH_MIN_TOKENS:
        return None
    if logged and _logged(record, logged) is not None:
        return _logged(record, logged)
    if not (us and copy_gbps and record.get("bytes")):
        return None
    return round(100 * record["bytes"] / us / 1e3 / copy_gbps)


def _cell(us: float | None, speedup: float | None, pct: int | None) -> str:
    """"us (speedup, pct%)", leaving out what is missing; a dash where nothing was measured."""
    inside = ", ".join(p for p in (speedup is not None and _x(speedup), pct is not None and f"{pct}%") if p)
    if us is None:
        return inside or "—"
    return f"{_us(us)} ({inside})" if inside else _us(us)


def _table(header: list[str], rows: list[list[str]], numeric_from: int) -> list[str]:
    align = ["---" if i < numeric_from else "---:" for i in range(len(header))]
    lines = [header, None, *rows]
    return ["|" + "|".join(align) + "|" if r is None else "| " + " | ".join(r) + " |" for r in lines]


def _grid(records: list[dict], keys: tuple[str, ...], cell: Callable[[dict], str],
          extra: tuple[str, Callable[[list[dict]], str]] | None = None) -> list[str]:  # fmt: skip
    """One row per distinct value of keys (in the records' order), one column per token count; extra:
    a column (its label, and its cell from the row's records) after the keys."""
    tokens = sorted({r["tokens"] for r in records})
    rows: dict[tuple, dict] = {}
    for r in records:
        rows.setdefault(tuple(r[k] for k in keys), {})[r["tokens"]] = r
    body = []
    for key, by in rows.items():
        more = [extra[1](list(by.values()))] if extra else []
        body.append([*map(str, key), *more, *(cell(by[t]) if t in by else "" for t in tokens)])
    labels = [*keys, *([extra[0]] if extra else [])]
    return _table([*labels, *map(str, tokens)], body, len(labels))


# ---------------------------------------------------------------------------------------------
# One table per benchmark: (the payloads of its result files) -> (what its cells are, the table)


def _ours_cell(payload: dict, base: str, ours: str, show_us: bool = True) -> Callable[[dict], str]:
    """A cell of ours: its time inside a CUDA graph (show_us), base's time over it, and from 4096
    tokens its % of copy bandwidth."""

    def cell(r):
        us = (r.get("graph_us") or {}).get(ours)
        return _cell(us if show_us else None, _speedup(r, base, ours), _pct(r, us, payload.get("copy_gbps")))

    return cell


def _graph_change(r: dict) -> str:
    """Stock Inductor's time → ours inside a CUDA graph, with the speedup."""
    g = r["graph_us"]
    return f"{_us(g['inductor'])} → {_cell(g['ours'], _speedup(r, 'inductor', 'ours'), None)}"


def _kernel_change(r: dict) -> str:
    """Stock Inductor's kernels per call → ours ("—" where none were counted)."""
    kernels = r.get("kernels") or {}
    return f"{kernels.get('inductor')} → {kernels.get('ours')}" if kernels else "—"


def _plain_speedup(r: dict | None) -> str:
    """Stock Inductor's time over ours in plain launches ("—" where either is missing)."""
    t = (r or {}).get("plain_us") or {}
    return _x(t["inductor"] / t["ours"]) if t.get("ours") and t.get("inductor") else "—"


def rms_norm(payloads):
    (p,) = payloads
    what = (
        "Ours (`rms_norm_triton`, one kernel), us per call inside a CUDA graph, with stock Inductor's time "
        "over ours (`torch.compile` of the Hugging Face spelling) and, from 4096 tokens, % of copy bandwidth:"
    )
    return what, _grid(p["records"], ("op", "hidden"), _ours_cell(p, "compile", "ours"))


def rms_norm_quant_fp8(payloads):
    (p,) = payloads
    what = ("Stock Inductor's time over ours inside a CUDA graph (one kernel per site; Inductor takes two "
            "for per_group), and from 4096 tokens % of copy bandwidth:")  # fmt: skip
    cell = _ours_cell(p, "inductor", "fusion_passes", show_us=False)
    return what, _grid(p["records"], ("op", "scheme", "hidden"), cell)


def host_cost_fp8(payloads):
    (p,) = payloads
    records = p["records"]

    def cell(r):
        h = r["host_us"]
        return f"{_us(h['inductor'])} / {_us(h['fusion_passes'])}"

    what = (f"The host's cost per call without CUDA graphs at hidden {records[0]['hidden']} (mean of "
            f"{p.get('iters', 'many')} back-to-back calls, one synchronize), us, stock Inductor / ours:")
    return what, _grid(records, ("op", "scheme"), cell)


def silu_mul_quant_fp8(payloads):
    (p,) = payloads
    records = [r for r in p["records"] if r.get("layout", "chunked") == "chunked"]
    what = ("Gate and up the halves of one `gate_up` projection, bf16. Stock Inductor's time over ours "
            "inside a CUDA graph, and from 4096 tokens % of copy bandwidth:")  # fmt: skip
    cell = _ours_cell(p, "inductor", "fusion_passes", show_us=False)
    return what, _grid(records, ("scheme", "intermediate"), cell)


def qk_norm_rope(payloads):
    (p,) = payloads
    def kernels(rows):
        counts = {tuple((r.get("kernels") or {}).get(i) for i in ("inductor", "ours")) for r in rows}
        return ", ".join(f"{i} → {o}" for i, o in sorted(counts) if None not in (i, o)) or "—"

    table = _grid(p["records"], ("model",), _ours_cell(p, "inductor", "ours"), ("kernels", kernels))
    what = (
        "Each model's pre-attention region (q / k RMSNorm + RoPE, bf16; kernels: stock Inductor's → ours). "
        "Ours, us per call inside a CUDA graph, with stock Inductor's time over ours and, from 4096 tokens, "
        "% of copy bandwidth:"
    )
    return what, table


def gated_delta_step(payloads):
    (p,) = payloads
    copy = p.get("copy_gbps")
    rows = []
    for r in p["records"]:
        g = r["graph_us"]
        floor = 2 * r["state_bytes"] / copy / 1e3 if copy and r["region"] == "recurrent" else None
        pct = lambda impl: round(100 * floor / g[impl]) if floor and g.get(impl) else None  # noqa: E731
        rows.append([
            r["region"], str(r["batch"]), _kernel_change(r),
            _us(g["inductor"]), _cell(g["ours"], _speedup(r, "inductor", "ours"), pct("ours")),
            _cell(g["fla"], None, pct("fla")) if g.get("fla") else "—",
        ])  # fmt: skip
    what = (
        "A Gated DeltaNet layer's decode-step regions (Qwen3-Next / Qwen 3.5 widths: 16 key / 32 value heads "
        "of 128, fp32 state, bf16; `benchmarks/bench_gated_delta_step.py`): the recurrent step with its gating "
        "and the state's write into the cache, and the conv with its state shift. us per call inside a CUDA "
        "graph; for ours, stock Inductor's time over ours; in brackets, the state-traffic floor (one read and "
        "one write of the state at copy bandwidth) over the time. fla: flash-linear-attention's fused "
        "recurrent kernel with the same gating and l2norms, its new state not copied into a cache:"
    )
    header = ["region", "batch", "kernels", "stock Inductor", "ours", "fla-core 0.6.0"]
    return what, _table(header, rows, 3)


def _chunk_inputs_line(p) -> str:
    """bench_chunk_inputs' two A/Bs as one paragraph under the chunked rule's table."""
    cells = []
    for r in p["records"]:
        (_, fla), (_, ours) = r["prep"]["graph_us"].items()
        (_, repeated), (_, grouped) = r["heads"]["graph_us"].items()
        cells.append(f"{r['tokens']} tokens {_us(fla)} → {_us(ours)} ({_x(fla / ours)}), "
                     f"{_us(repeated)} → {_us(grouped)} ({_x(repeated / grouped)})")  # fmt: skip
    return (
        "The op alone on its input forms (`benchmarks/bench_chunk_inputs.py`: Qwen 3.5's 16 key / 32 value heads of "
        "128, q / k / v as views of the conv's [B, C, T] output; us inside a CUDA graph, the median of 3 alternating "
        "rounds): flash-linear-attention's own input copies and l2norms → our prep kernel (`QKV_PREP_KERNEL`), then "
        "q / k repeated to the value heads → the key heads as they are (`chunk_gated_delta_rule_gva`): "
        + "; ".join(cells) + "."
    )


def chunk_gated_delta_rule(payloads):
    p = next(q for q in payloads if "prep" not in q["records"][0])
    inputs = [q for q in payloads if q is not p]
    rows = []
    for r in p["records"]:
        g = r["graph_us"]
        rows.append([
            str(r["tokens"]), _kernel_change(r),
            _us(g["eager"]), _graph_change(r), _us(g.get("fla")), _plain_speedup(r),
        ])  # fmt: skip
    what = (
        "Gated DeltaNet's prefill, batch 1 (Qwen 3.5 widths: 32 heads of 128, bf16 activations, fp32 state; "
        "`benchmarks/bench_chunk_gated_delta_rule.py`): transformers' chunked delta rule as torch.compile traces "
        "it, stock Inductor vs ours (`chunk_gated_delta_rule`: flash-linear-attention's chunk kernels inside "
        "one op): us per call inside a CUDA graph (speedup); plain launches: the "
        "speedup alone. Eager and fla: fla-core 0.6.0's kernels:"
    )
    header = ["tokens", "kernels", "eager", "stock Inductor → ours", "fla", "plain"]
    return what, _table(header, rows, 1) + [line for q in inputs for line in ("", _chunk_inputs_line(q))]


def causal_conv1d(payloads):
    (p,) = payloads
    rows = []
    for r in p["records"]:
        g = r["graph_us"]
        rows.append([
            "after the cached state" if r.get("after_state") else "first", str(r["tokens"]), _kernel_change(r),
            _us(g["eager"]), _graph_change(r), _plain_speedup(r),
            f"{r['floor_bytes'] / g['ours'] / 1e3:.0f}" if r.get("floor_bytes") and g.get("ours") else "—",
        ])  # fmt: skip
    what = (
        f"Gated DeltaNet's prefill conv, batch 1 (Qwen 3.5 widths: {p['records'][0]['channels']} channels, 4 taps, "
        "bf16; `benchmarks/bench_causal_conv1d.py`): transformers' causal_conv1d_fn on the transposed projection "
        "with SiLU, a first prompt or one after the StaticCache's conv state (`--after-state`: the cache's cat "
        "and write too), stock Inductor vs ours (`causal_conv1d`, `causal_conv1d_after_state`: one kernel and "
        "the state's copy), us per call inside a CUDA graph (speedup); plain launches: the speedup alone; GB/s: "
        "one read of the input and one write of the output over ours' CUDA-graph time:"
    )
    header = ["prompt", "tokens", "kernels", "eager", "stock Inductor → ours", "plain", "ours, GB/s"]
    return what, _table(header, rows, 1)


def sparse_index_mask(payloads):
    (p,) = payloads
    contexts = sorted({r["context"] for r in p["records"]})
    by_batch: dict[int, dict[int, dict]] = {}
    for r in p["records"]:
        by_batch.setdefault(r["batch"], {})[r["context"]] = r

    def cell(r):
        return "—" if r is None else f"{_graph_change(r)}; plain {_plain_speedup(r)}"

    rows = [[str(b), *(cell(by.get(c)) for c in contexts)] for b, by in sorted(by_batch.items())]
    k = sorted({r["k"] for r in p["records"]})
    what = (
        f"DeepSeek V3.2's index mask at decode (top-k {'/'.join(map(str, k))} of the cached tokens' fp32 scores, "
        "one token per sequence; `benchmarks/bench_sparse_index_mask.py`): transformers' top-k + scatter into a "
        "mask of ones, stock Inductor → ours (`sparse_index_mask_topk`: one kernel, a radix select of the k-th "
        "score, 5 bits a pass), us per call inside a CUDA graph (speedup); plain: the speedup in plain launches:"
    )
    return what, _table(["batch", *(f"{c} cached tokens" for c in contexts)], rows, 1)


def sparse_index_scores(payloads):
    (p,) = payloads

    def kernel_cell(r):
        g = r["graph_us"]
        return _cell(g.get("ours_kernel"), _speedup(r, "inductor", "ours_kernel"), None)

    rows = [[str(r["batch"]), str(r.get("tokens", 1)), str(r["context"]), _kernel_change(r), _us(r["graph_us"]["eager"]),
             _graph_change(r), kernel_cell(r), _plain_speedup(r)] for r in p["records"]]  # fmt: skip
    what = (
        "DeepSeek V3.2's indexer scores (64 heads of 128, bf16 q and key cache; one query token per sequence at "
        "decode, a prompt's at prefill; `benchmarks/bench_sparse_index_scores.py`): transformers' two fp32 matmuls, "
        "scale and relu, stock Inductor → ours (`sparse_index_scores`, and `sparse_index_scores_prefill`'s tiled "
        "kernel above 16 query tokens, compiled), and the kernel launched directly; us per call inside a CUDA "
        "graph (speedup over stock Inductor); plain: ours' speedup in plain launches:"
    )
    header = ["batch", "query tokens", "cached tokens", "kernels", "eager", "stock Inductor → ours", "kernel alone",
              "plain"]  # fmt: skip
    return what, _table(header, rows, 3)


def moe_sort_by_expert(payloads):
    (p,) = payloads
    by_tokens: dict[int, dict[str, dict]] = {}
    for r in p["records"]:
        by_tokens.setdefault(r["tokens"], {})[r.get("region", "sort")] = r

    def cells(r):
        if r is None:
            return ["—", "—", "—"]
        return [_kernel_change(r), _graph_change(r), _plain_speedup(r)]

    rows = []
    for tokens in sorted(by_tokens):
        regions = by_tokens[tokens]
        any_r = next(iter(regions.values()))
        rows.append([f"{tokens} x {any_r['top_k']} ({any_r['pairs']})", *cells(regions.get("route")),
                     *cells(regions.get("route_grouped")), *cells(regions.get("sort"))])  # fmt: skip
    experts = sorted({r["experts"] for r in p["records"]})
    what = (
        f"A MoE layer's routing and dispatch prep, {'/'.join(map(str, experts))} experts "
        "(`benchmarks/bench_moe_sort_by_expert.py`). Route: the Qwen 3.5-MoE router after its gate GEMM "
        "(softmax, sorted top-k, renormalisation). Grouped route: DeepSeek V3 / V3.2's group-limited router after "
        "its fp32 gate GEMM (sigmoid + correction bias, group top-2 sums, 4 of 8 groups kept, top-k, gather, "
        "renormalisation, routed scaling). Sort: transformers' grouped_mm experts before the grouped "
        "GEMMs (the sort of the flat top-k expert ids, histc + cumsum offsets, the inverse permutation); the "
        "launch table leaves it to Inductor from the first pair count where ours is slower. us per call inside "
        "a CUDA graph, stock Inductor → ours (speedup); plain launches: the speedup alone:"
    )
    header = ["tokens x top-k (pairs)", "route kernels", "route, CUDA graph", "route, plain",
              "grouped route kernels", "grouped route, CUDA graph", "grouped route, plain",
              "sort kernels", "sort, CUDA graph", "sort, plain"]  # fmt: skip
    return what, _table(header, rows, 1)


def gqa_decode_attention(payloads):
    (p,) = payloads
    groups: dict[tuple, dict[int, dict]] = {}
    for r in p["records"]:
        groups.setdefault((r["shape"], r["heads"], r["kv_heads"], r["head_dim"], r["context"]), {})[r["batch"]] = r
    batches = sorted({r["batch"] for r in p["records"]})
    rows = []
    for (shape, heads, kv_heads, head_dim, context), by_batch in groups.items():
        def cell(r):
            return "—" if r is None else f"{_graph_change(r)} (floor {_us(r['floor_us'])})"

        any_r = next(iter(by_batch.values()))
        rows.append([f"{shape} ({heads} / {kv_heads} x {head_dim})", str(context),
                     _kernel_change(any_r),
                     *(cell(by_batch.get(b)) for b in batches), " / ".join(_plain_speedup(by_batch.get(b)) for b in batches)])  # fmt: skip
    what = (
        "A decode step's attention on a StaticCache with fewer KV heads than query heads "
        "(`benchmarks/bench_gqa_decode_attention.py`): transformers' repeat_kv + SDPA (query heads / KV heads "
        "x head dim), stock Inductor → ours (SDPA's grouped-query attention on the cache as it is), us per "
        "call inside a CUDA graph (speedup); floor: one read of the keys and values at 4.3 TB/s; plain "
        "launches: the speedups alone. Eager `enable_gqa=True` (the peer) is in the result file:"
    )
    header = ["shape", "context", "kernels", *(f"batch {b}" for b in batches), "plain, " + " / ".join(map(str, batches))]
    return what, _table(header, rows, 1)


def masked_attention(payloads):
    (p,) = payloads
    tokens = sorted({r["tokens"] for r in p["records"]})
    by_row: dict[tuple, dict[int, dict]] = {}
    for r in p["records"]:
        dims = f"{r['dim']}" if r.get("v_dim", r["dim"]) == r["dim"] else f"{r['dim']} / {r['v_dim']}"
        by_row.setdefault((r["model"], r["heads"], r["kv_heads"], dims, r["cache"] - r["tokens"]), {})[r["tokens"]] = r

    def cell(r):
        if r is None:
            return "—"
        t = r["graph_us"]
        return (f"{_us(t['inductor'])} → {_us(t['ours'])} ({_x(_speedup(r, 'inductor', 'ours'))}); "
                f"launched directly {_us(t['ours_kernel'])}")  # fmt: skip

    rows = [[f"{m} ({h} / {kv} x {d})", f"S + {after}", *(cell(by.get(t)) for t in tokens)]
            for (m, h, kv, d, after), by in by_row.items()]  # fmt: skip
    what = (
        "A prefill's attention on a StaticCache, batch 1, bf16 (`benchmarks/bench_masked_attention.py`): "
        "transformers' SDPA through the prompt's mask (after repeat_kv where the model has fewer KV heads) over a "
        "cache of S + 1 slots (a model's prefill) or S + N (a few tokens after a long context), stock Inductor → "
        "torch.compile with the fusion, us inside a CUDA graph (speedup); the masked_attention kernels launched "
        "directly beside it:"
    )
    header = ["model (query heads / KV heads x head dim)", "cache", *(f"{t} tokens" for t in tokens)]
    return what, _table(header, rows, 2)


def mla_rope(payloads):
    (p,) = payloads
    records = p["records"]
    tokens = [r["tokens"] for r in records]

    def kernels(impl):
        counts = sorted({(r.get("kernels") or {}).get(impl) for r in records} - {None})
        return "-".join(map(str, (counts[0], counts[-1]) if len(counts) > 1 else counts)) or "—"

    rows = [["stock Inductor", kernels("inductor"), *(_us(r["graph_us"]["inductor"]) for r in records)]]
    for impl, label in (("ours", "ours"), ("ours_two_launches", "ours, two launches")):
        cells = []
        for r in records:
            ours = r["graph_us"][impl]
            logged = "speedup" if impl == "ours" else "speedup_two_launches"
            pct = _pct(r, ours, p.get("copy_gbps"), logged="pct_of_copy" if impl == "ours" else None)
            cells.append(_cell(ours, _speedup(r, "inductor", impl, logged=logged), pct))
        rows.append([label, kernels(impl), *cells])
    what = (
        "DeepSeek V3's MLA region before attention (kv_a_layernorm + RoPE of k_pe, q_pe RoPE and the cat "
        "into the query; bf16, 128 heads). us per call inside a CUDA graph; for ours, stock Inductor's time "
        "over ours and, from 4096 tokens, % of copy bandwidth:"
    )
    return what, _table(["", "kernels", *map(str, tokens)], rows, 2)


def allreduce_rms_norm(payloads):
    records = [{**r, "scheme": p.get("quant") or "—"} for p in payloads for r in p["records"]]

    def cell(r):
        ours = r["graph_us"]["ours"]
        vs_nccl = _speedup(r, "nccl", "ours")
        vs_symm = _speedup(r, "symm_mem", "ours", logged="speedup_vs_symm_mem")
        return f"{_us(ours)} ({_x(vs_nccl)} / {_x(vs_symm)})"

    keys = ("scheme", "hidden") if any(p.get("quant") for p in payloads) else ("hidden",)
    what = (
        "Ours (one launch: the one-shot kernel over symmetric memory reads every peer's rows over NVLink, "
        "sums, adds, normalises), us per call inside a CUDA graph, with the time of NCCL allreduce + stock "
        "Inductor over ours / of torch's one-shot symm_mem allreduce + stock Inductor over ours:"
    )
    return what, _grid(records, keys, cell)


def tp_decoder_layer(payloads):
    (p,) = payloads
    rows = []
    for record in p["records"]:
        base = record["variants"]["inductor"]
        for variant, r in record["variants"].items():
            speedup = _logged(r, "speedup")
            if speedup is None and base.get("graph_us") and r.get("graph_us"):
                speedup = base["graph_us"] / r["graph_us"]
            total = (r.get("kernels") or {}).get("total")
            kernels = "—" if total is None else str(total)
            times = [_us(r.get("plain_us")), _us(r.get("graph_us"))]
            rows.append([str(record["tokens"]), variant, kernels, *times, _x(speedup)])
    what = (
        f"{p.get('model')} at {p.get('size')} width, {p.get('layers')} layer(s), bf16, tensor parallel "
        f"over {p.get('world_size', 2)} GPUs; one step is one forward. us per step:"
    )
    header = ["tokens", "variant", "kernels / step", "plain us", "CUDA graph us", "graph: Inductor / variant"]
    return what, _table(header, rows, 2)


def models(payloads):
    (p,) = payloads
    rows = []
    for r in p["rows"]:
        if r.get("kernels") is None:
            continue
        layers = r.get("layers", p.get("layers"))
        kernels = [str(r["total_kernels"]), f"{r['other_per_layer']:.1f}"]
        times = [_us(r["plain_us"]), _us(r["graph_us"])]
        key = [f"{r['model']} ({layers})", str(r["tokens"]), r["variant"]]
        rows.append([*key, *kernels, *times, f"{r['rel_err_vs_eager']:.4f}"])
    what = (
        "Real widths, bf16, a few layers (in parentheses). Kernels per forward from the CUDA profiler; "
        '"other" is everything outside GEMMs, attention and MoE. us per forward:'
    )
    header = ["model (layers)", "tokens", "variant", "kernels", "other / layer", "plain us", "CUDA graph us"]
    header.append("rel. error vs eager")
    return what, _table(header, rows, 3)


def decode(payloads):
    (p,) = payloads
    rows = []

    def pair(stock: dict, ours: dict, key: str, fmt) -> str:
        return f"{fmt(stock.get(key))} -> {fmt(ours.get(key))}"

    for point in p["points"] + p.get("prefill", []):
        stock, ours = point["variants"]["inductor"], point["variants"]["fusion_passes"]
        if "graph_us" not in ours:
            continue
        where = (f"{point['batch']} x {point['context']}" if "batch" in point else f"prefill {point['tokens']}")
        other = "-"
        if "per_layer" in ours:
            s_o, o_o = stock["per_layer"]["other"], ours["per_layer"]["other"]
            other = f"{s_o['kernels']:.1f} / {s_o['us']:.0f} -> {o_o['kernels']:.1f} / {o_o['us']:.0f}"
        kernels = pair(stock, ours, "kernels", str) if "kernels" in ours else "-"
        speed = [_x(stock[k] / ours[k] if stock.get(k) and ours.get(k) else None) for k in ("plain_us", "graph_us")]
        rounds = [stock.get("plain_rounds_us"), ours.get("plain_rounds_us")]
        if all(rounds) and len(rounds[0]) == len(rounds[1]) > 1:  # the rounds' ratios, low to high
            ratios = [a / b for a, b in zip(*rounds)]
            speed[0] += f" ({_x(min(ratios))}-{_x(max(ratios))})"
        errors = "-"
        if ours.get("numerics"):
            errors = f"{stock['numerics']['out_rel_err']:.3f} / {ours['numerics']['out_rel_err']:.3f}"
        rows.append([f"{point['model']} ({point['layers']})", where, kernels, other,
                     pair(stock, ours, "graph_us", _us), *speed, errors])  # fmt: skip
    what = (
        "Real widths, bf16, a few layers (in parentheses): one decode step on a transformers StaticCache "
        "(batch x cached tokens; `benchmarks/bench_decode.py`), and a prefill that writes the cache; "
        'stock Inductor -> fusion_passes. "other / layer": kernels / GPU us per layer outside GEMM, '
        "attention and MoE. Errors: the largest relative error of a step's output against eager over 16 "
        "teacher-forced steps, Inductor / fusion_passes (MoE routing turns last-bit differences into "
        'other experts). Plain: back-to-back steps, the median of rounds that take the variants in turn '
        "(in parentheses, where recorded: the lowest and highest round's speedup). "
        'The ranked "what is left" lists and eager are in the result file.'
    )
    header = ["model (layers)", "step", "kernels", "other / layer", "CUDA graph us",
              "speedup, plain", "speedup, graph", "errors vs eager"]  # fmt: skip
    return what, _table(header, rows, 2)


def launch_overhead(payloads):
    (p,) = payloads
    layers = p.get("layers", 1)
    rows = []
    for r in p["rows"]:
        times = map(_us, (r["plain_us"], r["plain_us"] / layers, r["graph_us"]))
        rows.append([str(r["tokens"]), r["variant"], str(r["kernels"]), *times])
    what = (
        f"{layers} decoder-layer tails (residual add + RMSNorm + a rank-64 GEMM pair), hidden "
        f"{p.get('hidden')}, bf16: the fused norm launched through the dispatcher (`launch=\"dispatch\"`) "
        "or by Inductor's own code (`launch=\"direct\"`, the default). us per call of the chain:"
    )
    header = ["tokens", "variant", "kernels", "plain launches", "plain, per layer", "CUDA graph"]
    return what, _table(header, rows, 2)


@dataclass(frozen=True)
class Section:
    title: str
    files: tuple[str, ...]  # result files (benchmarks/results/NAME.json), in the table's order
    table: Callable
    level: int = 2


ALLREDUCE_FP8 = tuple(f"bench_allreduce_rms_norm_quant_fp8_{scheme}" for scheme in ("per_group", "per_token"))
SECTIONS = (
    Section("Whole models", ("bench_models",), models),
    Section("Decode steps with a KV cache", ("bench_decode",), decode, 3),
    Section("RMSNorm and add + RMSNorm (`rms_norm`, `add_rms_norm`)", ("bench_rms_norm",), rms_norm),
    Section(
        "(Add +) RMSNorm + FP8 quantization (`(add_)rms_norm_quant_fp8_*`)",
        ("bench_rms_norm_quant_fp8",),
        rms_norm_quant_fp8,
    ),
    Section("Without CUDA graphs: the host's cost per call", ("bench_host_cost_fp8",), host_cost_fp8, 3),
    Section(
        "SiLU-and-mul + FP8 quantization (`silu_mul_quant_fp8_*`)",
        ("bench_silu_mul_quant_fp8",),
        silu_mul_quant_fp8,
    ),
    Section("QK-norm + RoPE (`qk_norm_rope*`)", ("bench_qk_norm_rope",), qk_norm_rope),
    Section("DeepSeek V3 MLA: norm + RoPE (`mla_*`)", ("bench_mla_rope",), mla_rope),
    Section(
        "Gated DeltaNet decode step (`causal_conv1d_update`, `gated_delta_step`)",
        ("bench_gated_delta_step",),
        gated_delta_step,
    ),
    Section(
        "Gated DeltaNet prefill (`chunk_gated_delta_rule`)",
        ("bench_chunk_gated_delta_rule", "bench_chunk_inputs"),
        chunk_gated_delta_rule,
    ),
    Section("Gated DeltaNet prefill conv (`causal_conv1d`)", ("bench_causal_conv1d",), causal_conv1d),
    Section("DeepSeek V3.2 index mask (`sparse_index_mask_topk`)", ("bench_sparse_index_mask",), sparse_index_mask),
    Section("DeepSeek V3.2 indexer scores (`sparse_index_scores`)", ("bench_sparse_index_scores",), sparse_index_scores),
    Section("MoE routing and dispatch prep (`moe_route_*`, `moe_sort_by_expert`)", ("bench_moe_sort_by_expert",), moe_sort_by_expert),
    Section("GQA attention at decode (`gqa_decode_attention`)", ("bench_gqa_decode_attention",), gqa_decode_attention),
    Section("GQA attention at prefill (`masked_prefill_attention`)", ("bench_masked_attention",), masked_attention),
    Section(
        "Tensor parallel: allreduce + add + RMSNorm (`allreduce_add_rms_norm`)",
        ("bench_allreduce_rms_norm",),
        allreduce_rms_norm,
    ),
    Section(
        "Tensor parallel: allreduce + add + RMSNorm + FP8 (`allreduce_add_rms_norm_quant_fp8_*`)",
        ALLREDUCE_FP8,
        allreduce_rms_norm,
    ),
    Section("Tensor parallel: a real-width decoder layer", ("bench_tp_decoder_layer",), tp_decoder_layer),
    Section(
        "The launch path: direct Triton launch vs custom-op dispatch",
        ("bench_launch_overhead",),
        launch_overhead,
    ),
)


# ---------------------------------------------------------------------------------------------
# The page


def readme_torch(readme: Path = REPO / "README.md") -> str | None:
    """The torch version the README installs (pip install torch==X)."""
    found = re.search(r"pip install torch==([\w.+]+)", readme.read_text()) if readme.exists() else None
    return found and found.group(1)


def _gpus(provenance: dict) -> str:
    if not provenance.get("gpu"):
        return "a CPU (a smoke run: no GPU times)"
    gpu = provenance["gpu"].removeprefix("NVIDIA ")
    count = provenance.get("gpus", 1)
    return {1: f"one {gpu}", 2: f"two {gpu}s"}.get(count, f"{count} x {gpu}")


def _measured(provenances: list[dict], torch_of_readme: str | None) -> list[str]:
    """Where, when and how: one line of facts per distinct provenance, then the commands."""
    facts = []
    for prov in provenances:
        torch = prov["torch"]
        if torch_of_readme and torch.split("+")[0] != torch_of_readme.split("+")[0]:
            torch += f" (not the README's {torch_of_readme})"
        fact = (f"Measured on {_gpus(prov)} on {str(prov['date'])[:10]} with torch {torch} and triton "
                f"{prov['triton']}")  # fmt: skip
        source = prov.get("source")
        if source:
            sections = re.findall(r'"([^"]+)"', source)
            named = ", ".join(f"“{s}”" for s in sections)
            fact += f"; transcribed from [the history]({HISTORY}) ({named})"
        elif prov.get("commit"):
            fact += f", at commit {prov['commit']}"
        facts.append(fact + ".")
    commands = []
    for prov in provenances:
        commands += [prov["command"]] if isinstance(prov["command"], str) else prov["command"]
    facts = [line for fact in dict.fromkeys(facts) for line in (fact, "")]
    return [*facts, "```", *dict.fromkeys(commands), "```", ""]


def render_section(section: Section, results: Path, torch_of_readme: str | None) -> list[str]:
    lines = ["#" * section.level + " " + section.title, ""]
    paths = [results / f"{name}.json" for name in section.files]
    payloads = [json.loads(p.read_text()) for p in paths if p.exists()]
    if not payloads:
        return lines + [f"No result yet (`benchmarks/results/{section.files[0]}.json`).", ""]
    distinct = {json.dumps(p["provenance"], sort_keys=True): p["provenance"] for p in payloads}
    provenances = list(distinct.values())
    what, table = section.table(payloads)
    lines += _measured(provenances, torch_of_readme)
    lines += [what, "", *table, ""]
    notes = list(dict.fromkeys(n for p in payloads for n in p.get("notes", [])))
    if notes:
        lines += [*(f"- {n}" for n in notes), ""]
    return lines


INTRO = """# Benchmarks

The latest numbers of each fusion family against stock Inductor, on H200 GPUs. This page is
written by `python -m benchmarks.render` from `benchmarks/results/*.json`; each section says where,
when and how its numbers were measured. The dated log of every run, with what each kernel change
was and why, is [docs/notes/benchmarks-history.md]({history}).

Times are medians in microseconds. "Inside a CUDA graph": 20 calls, each on its own inputs,
captured in one graph and replayed; plain launches at decode sizes mostly measure the host. A
ratio is stock Inductor's time (or the named baseline's) over ours: above 1.00x ours is faster.
"% of copy": the fewest bytes the op must move over its time, against the device's own copy
bandwidth, from 4096 tokens on.

## Reproduce

On one H200, from the repository root (the GPU machine: Python 3.12, torch 2.11.0+cu130, triton
3.6.0; NCCL_NVLS_ENABLE=0 and TORCH_SYMM_MEM_DISABLE_MULTICAST=1 are set by the scripts):

```
OUT=out benchmarks/run_gpu.sh                                 # CUDA tests, then each one-GPU benchmark
OUT=out BENCH=rms_norm_quant_fp8 benchmarks/run_gpu_sweep.sh  # an FP8 sweep: compiles in parallel, then times
OUT=out benchmarks/run_gpu_x2.sh                              # two GPUs: tensor-parallel tests, benchmarks
cp out/bench_*.json benchmarks/results/ && python -m benchmarks.render
```

Each benchmark also runs alone (`python -m benchmarks.bench_rms_norm --help`, the command under each
table); its `--json` output is a result file: its numbers with their provenance (date, GPU,
torch and triton versions, command line).
"""


def render(results: Path = RESULTS) -> str:
    """The page, from the result files in ``results``."""
    torch_of_readme = readme_torch()
    lines = [INTRO.format(history=HISTORY)]
    for section in SECTIONS:
        lines += render_section(section, results, torch_of_readme)
    return "\n".join(lines).rstrip("\n") + "\n"


def merge(runs: list[dict]) -> dict:
    """One result from several runs of one benchmark, each over a part of its shapes: the first
    run's settings, every run's records (or rows) in order, the fastest copy bandwidth (the
    ceiling: no "% of copy" inflated by a slower copy), and the first run's provenance with every
    run's command and the latest date. The runs must share their GPU, torch and triton."""
    for key in ("gpu", "gpus", "torch", "triton"):
        values = {json.dumps(run["provenance"].get(key)) for run in runs}
        if len(values) > 1:
            raise SystemExit(f"--merge: the runs differ in {key}: {', '.join(sorted(values))}")
    merged = dict(runs[0])
    for key in ("records", "rows"):
        if key in merged:
            merged[key] = [item for run in runs for item in run[key]]
    if "copy_gbps" in merged:
        merged["copy_gbps"] = max(run["copy_gbps"] for run in runs)
    commands = []
    for run in runs:
        command = run["provenance"]["command"]
        commands += [command] if isinstance(command, str) else command
    merged["provenance"] = {
        **runs[0]["provenance"],
        "date": max(run["provenance"]["date"] for run in runs),
        "command": list(dict.fromkeys(commands)),
    }
    return merged


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, default=RESULTS, help="folder of result files")
    parser.add_argument("--out", type=Path, default=PAGE, help="the page to write")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if --out differs")
    parser.add_argument("--merge", type=Path, nargs="+", metavar="JSON", help="runs of a benchmark to merge")
    parser.add_argument("--into", type=Path, help="--merge's result file")
    args = parser.parse_args()
    if args.merge:
        if args.into is None:
            parser.error("--merge needs --into RESULT.json")
        merged = merge([json.loads(path.read_text()) for path in args.merge])
        args.into.write_text(json.dumps(merged, indent=1) + "\n")
        print(f"{args.into}: {len(merged.get('records', merged.get('rows', [])))} records")
        return 0
    text = render(args.results)
    if args.check:
        current = args.out.read_text() if args.out.exists() else ""
        if current != text:
            print(f"{args.out} is not what python -m benchmarks.render writes: run it", file=sys.stderr)
            return 1
        return 0
    args.out.write_text(text)
    print(f"{args.out}: {text.count(chr(10))} lines")
    return 0


if __name__ == "__main__":
    sys.exit(main())
