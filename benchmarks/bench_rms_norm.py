"""Time RMSNorm and residual-add + RMSNorm (Llama form, bf16) on one GPU, four ways side by side.

    RMSNorm:      y = weight * to_bf16(f32(x) * rsqrt(mean(f32(x)^2) + eps))
    add+RMSNorm:  r = x + residual; y = RMSNorm(r); returns (y, r)

Implementations: eager PyTorch (the Hugging Face LlamaRMSNorm spelling), torch.compile of that
spelling with stock Inductor, ours (rms_norm_triton, one kernel), and Liger-Kernel's RMSNorm (after
a torch add for add+RMSNorm: Liger has no fused add) when liger_kernel is importable.

Each is timed (a) as plain launches: triton.testing.do_bench, median, which flushes L2 before
every call, and (b) in a CUDA graph: GRAPH_CALLS calls, each on its own input set, captured back
to back in one graph, the replay's median over GRAPH_CALLS (no launch gaps; decode-sized inputs
stay in L2 as a model's activations do, large ones come from HBM). The fewest bytes either op can
move: read x (and residual) and weight once, write y (and r); at >= 4096 tokens that over the time
is reported in GB/s and as a percent of the device's own copy bandwidth, measured here on a 2 GB
device-to-device copy (bytes read + written). Ours is checked against the reference first.

    python -m benchmarks.bench_rms_norm [--out bench_rms_norm.md] [--json bench_rms_norm.json]
    python -m benchmarks.bench_rms_norm --smoke     # tiny sizes; on a CPU via Triton's interpreter
"""

from __future__ import annotations

import sys

import torch

from benchmarks import common

INTERPRETED = common.interpret_smoke_run()  # before triton is imported

import triton  # noqa: E402

from benchmarks.timing import copy_bandwidth_gbps, time_graph_us, time_plain_us  # noqa: E402
from fusion_passes.lowering.rms_norm.reference import (  # noqa: E402
    add_rms_norm_reference,
    rms_norm_reference,
)
from fusion_passes.lowering.rms_norm.triton import rms_norm_triton  # noqa: E402

try:
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction
except ImportError as error:
    LigerRMSNormFunction = None
    LIGER_MISSING = f"Liger-Kernel not importable ({error}); its columns are empty."
else:
    LIGER_MISSING = None

HIDDEN = (7168, 4096, 3072)  # DeepSeek V3, Llama 3 8B / Qwen 3 8B, Llama 3.2 3B
TOKENS = (1, 4, 16, 64, 256, 1024, 4096, 16384)
SMOKE_HIDDEN, SMOKE_TOKENS = (100,), (1, 4096)
BANDWIDTH_MIN_TOKENS = 4096  # below this, launch latency, not HBM, sets the time
DTYPE = torch.bfloat16
EPS = 1e-6
# Calls per captured graph, each on its own input set: one replay launch spread over 20 calls,
# and 20 sets of >= 4096 tokens (>= 500 MB) are 10x the 50 MB L2, so those come from HBM.
GRAPH_CALLS = 20
COPY_BYTES = 2 * 10**9  # device copy for the bandwidth ceiling: 2 GB read + 2 GB written
SMOKE_COPY_BYTES = 2 * 10**6
IMPLS = ("eager", "compile", "ours", "liger")
OPS = ("rms_norm", "add_rms_norm")


def eager_rms_norm(x, weight, eps):
    """Hugging Face LlamaRMSNorm.forward: normalise in fp32, round, scale in x.dtype."""
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(x.dtype)


def eager_add_rms_norm(x, residual, weight, eps):
    """The decoder layer's residual add, then RMSNorm of the sum: returns (normed, sum)."""
    r = x + residual
    return eager_rms_norm(r, weight, eps), r


def liger_rms_norm(x, weight, eps):
    """Liger's RMSNorm in its Llama casting mode (the same rounding as eager_rms_norm)."""
    return LigerRMSNormFunction.apply(x, weight, eps, 0.0, "llama")


def liger_add_rms_norm(x, residual, weight, eps):
    """Liger has no fused add: torch add, then Liger's RMSNorm of the sum."""
    r = x + residual
    return liger_rms_norm(r, weight, eps), r


def ours_rms_norm(x, weight, eps):
    """Our kernel, Llama form."""
    return rms_norm_triton(x, weight, eps, 0.0, True)[0]


def ours_add_rms_norm(x, residual, weight, eps):
    """Our kernel, Llama form, with the residual add fused: returns (normed, sum)."""
    return rms_norm_triton(x, weight, eps, 0.0, True, residual=residual)


SPELLINGS = {
    ("rms_norm", "eager"): eager_rms_norm,
    ("rms_norm", "liger"): liger_rms_norm,
    ("rms_norm", "ours"): ours_rms_norm,
    ("add_rms_norm", "eager"): eager_add_rms_norm,
    ("add_rms_norm", "liger"): liger_add_rms_norm,
    ("add_rms_norm", "ours"): ours_add_rms_norm,
}


def make_calls(impl: str, op: str, input_sets: list[dict]) -> list | None:
    """One zero-argument call of `impl` computing `op` per input set; None if impl is missing."""
    if impl == "liger" and LigerRMSNormFunction is None:
        return None
    if impl == "compile":
        fn = torch.compile(SPELLINGS[op, "eager"], dynamic=False)
    else:
        fn = SPELLINGS[op, impl]
    names = ("x", "weight") if op == "rms_norm" else ("x", "residual", "weight")
    return [lambda s=s: fn(*(s[n] for n in names), EPS) for s in input_sets]


def min_bytes(op: str, tokens: int, hidden: int) -> int:
    """Read x (+ residual) and weight once, write y (+ new residual)."""
    rows = tokens * hidden * DTYPE.itemsize
    streams = 4 if op == "add_rms_norm" else 2
    return streams * rows + hidden * DTYPE.itemsize


def _within_ulps(out, ref, ulps: int) -> bool:
    """|out - ref| <= ulps bf16 ulps of ref everywhere (one ulp is at most eps * |ref|)."""
    bound = ulps * torch.finfo(DTYPE).eps * ref.double().abs().clamp_min(torch.finfo(DTYPE).tiny)
    return bool(((out.double() - ref.double()).abs() <= bound).all())


def check_ours(op: str, x, residual, weight) -> dict:
    """Ours against the reference. On a GPU: y within 2 ulps (the sum order and the rsqrt may
    flip the rounding of n and of y once each), the new residual bit for bit (one rounded fp32
    add). The CPU interpreter truncates each bf16 cast instead: up to 1 ulp more per cast."""
    y_ulps, r_ulps = (4, 1) if INTERPRETED else (2, 0)
    if op == "rms_norm":
        out = rms_norm_triton(x, weight, EPS, 0.0, True)[0]
        ref = rms_norm_reference(x, weight, EPS, 0.0, True)
        ok = _within_ulps(out, ref, y_ulps)
    else:
        out, new_residual = rms_norm_triton(x, weight, EPS, 0.0, True, residual=residual)
        ref, ref_residual = add_rms_norm_reference(x, residual, weight, EPS, 0.0, True)
        ok = _within_ulps(out, ref, y_ulps) and _within_ulps(new_residual, ref_residual, r_ulps)
    return {"correct": ok, "max_abs_err": (out.double() - ref.double()).abs().max().item()}


def random_inputs(hidden: int, tokens: int, device: str) -> dict:
    """Fresh bf16 inputs; weight near 1 as in trained norms."""
    return {
        "x": torch.randn(tokens, hidden, device=device).to(DTYPE),
        "residual": torch.randn(tokens, hidden, device=device).to(DTYPE),
        "weight": (1 + 0.1 * torch.randn(hidden, device=device)).to(DTYPE),
    }


def bench_shape(op: str, hidden: int, tokens: int, device: str) -> dict:
    """Check ours, then time every implementation on fresh random inputs of one shape.

    The graph holds GRAPH_CALLS calls, each on its own input set: inputs small enough to share
    L2 stay there (as a decoding model's activations do), large ones come from HBM every call."""
    input_sets = [
        random_inputs(hidden, tokens, device) for _ in range(GRAPH_CALLS if device == "cuda" else 1)
    ]
    record = {"op": op, "hidden": hidden, "tokens": tokens, **check_ours(op, **input_sets[0])}
    if not record["correct"]:
        print(
            f"CORRECTNESS FAILURE: ours {op} hidden={hidden} tokens={tokens} "
            f"max_abs_err={record['max_abs_err']:.3g}",
            flush=True,
        )
    torch._dynamo.reset()  # one static-shape compile per shape, clear of the recompile limit
    record["plain_us"], record["graph_us"] = {}, {}
    for impl in IMPLS:
        calls = make_calls(impl, op, input_sets)
        record["plain_us"][impl] = None if calls is None else time_plain_us(calls[0])
        record["graph_us"][impl] = None if calls is None else time_graph_us(calls)
    record["bytes"] = min_bytes(op, tokens, hidden)
    return record


def latency_table(records: list[dict], mode: str) -> list[str]:
    """Microseconds per call, one row per shape, plus compile's time over ours."""
    lines = [
        "| hidden | tokens | " + " | ".join(IMPLS) + " | compile / ours |",
        "|---:|---:|" + "---:|" * (len(IMPLS) + 1),
    ]
    for r in records:
        t = r[f"{mode}_us"]
        cells = [common.us(t[i]) for i in IMPLS] + [common.ratio(t["compile"], t["ours"])]
        lines.append(f"| {r['hidden']} | {r['tokens']} | " + " | ".join(cells) + " |")
    return lines


def bandwidth_table(records: list[dict], mode: str, copy_gbps: float) -> list[str]:
    """GB/s of the fewest bytes over the time, and that as a percent of the copy bandwidth."""
    lines = [
        "| hidden | tokens | " + " | ".join(IMPLS) + " |",
        "|---:|---:|" + "---:|" * len(IMPLS),
    ]
    for r in records:
        if r["tokens"] < BANDWIDTH_MIN_TOKENS:
            continue
        cells = []
        for impl in IMPLS:
            us = r[f"{mode}_us"][impl]
            gbps = None if us is None else r["bytes"] / us / 1e3
            cells.append("—" if gbps is None else f"{gbps:.0f} ({100 * gbps / copy_gbps:.0f}%)")
        lines.append(f"| {r['hidden']} | {r['tokens']} | " + " | ".join(cells) + " |")
    return lines


def report(records: list[dict], copy_gbps: float, copy_bytes: int, device_name: str) -> str:
    """The markdown report: setup, notes, then per op latency and bandwidth, plain and graph."""
    lines = [
        "# RMSNorm benchmark (Llama form, bf16)",
        "",
        f"Device: {device_name}; torch {torch.__version__}; triton {triton.__version__}; "
        f"copy bandwidth {copy_gbps:.0f} GB/s (read + write, {copy_bytes / 1e9:.3g} GB copy).",
        "",
        "- Times: median microseconds per call. plain: do_bench, L2 flushed before each call. "
        f"graph: {GRAPH_CALLS} calls in one CUDA graph, each on its own input set, per call; "
        "inputs that fit in L2 together (50 MB on an H200: decode sizes) stay there, as in "
        "decoding; at >= 4096 tokens they come from HBM.",
        "- Compare kernels by the graph columns. A plain time is the kernel's only while the "
        "host's launch work hides behind do_bench's 256 MB L2 flush (~60 us of GPU time); past "
        "that the host shows through: on an H200 machine, plain times below 4096 tokens jumped by "
        "25-60 us on rows that moved from run to run, for every implementation.",
        "- Bandwidth: the fewest bytes (x, residual, weight read once; y, r written once) over "
        f"the time, for >= {BANDWIDTH_MIN_TOKENS} tokens, and its percent of the copy bandwidth.",
        "- Liger add+RMSNorm is a torch add then Liger's RMSNorm (Liger has no fused add).",
    ]
    if LIGER_MISSING:
        lines.append(f"- {LIGER_MISSING}")
    failures = [r for r in records if not r["correct"]]
    lines.append(
        f"- Correctness of ours vs the reference: "
        f"{'all shapes pass' if not failures else f'{len(failures)} FAILURES'}."
    )
    for op in OPS:
        rows = [r for r in records if r["op"] == op]
        lines += ["", f"## {op}"]
        for mode, title in (("plain", "Plain launches"), ("graph", "CUDA graph")):
            lines += ["", f"### {title}: us per call", "", *latency_table(rows, mode)]
            lines += [
                "",
                f"### {title}: GB/s (% of copy)",
                "",
                *bandwidth_table(rows, mode, copy_gbps),
            ]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = common.parser(
        __doc__, "bench_rms_norm", smoke="tiny sizes to catch bugs; runs on a CPU under TRITON_INTERPRET=1"
    )
    common.add_sizes(parser, "--hidden", HIDDEN, SMOKE_HIDDEN, "hidden sizes")
    common.add_sizes(parser, "--tokens", TOKENS, SMOKE_TOKENS, "token counts")
    args = common.parse(parser)
    device = common.device(parser, args.smoke)
    device_name = common.device_name(device)

    torch.manual_seed(0)
    copy_bytes = COPY_BYTES if device == "cuda" else SMOKE_COPY_BYTES
    copy_gbps = copy_bandwidth_gbps(copy_bytes, device)
    print(f"{device_name}: copy bandwidth {copy_gbps:.0f} GB/s", flush=True)
    records = []
    with torch.no_grad():
        for op in OPS:
            for h in args.hidden:
                for t in args.tokens:
                    records.append(bench_shape(op, h, t, device))
                    print(
                        f"{op} hidden={h} tokens={t}: "
                        + ", ".join(f"{i} {common.us(records[-1]['plain_us'][i])}" for i in IMPLS),
                        flush=True,
                    )
    text = report(records, copy_gbps, copy_bytes, device_name)
    common.finish(args, text, {
        "device": device_name,
        "dtype": str(DTYPE),
        "eps": EPS,
        "copy_gbps": copy_gbps,
        "graph_calls": GRAPH_CALLS,
        "liger_missing": LIGER_MISSING,
        "records": records,
    })  # fmt: skip
    return 1 if any(not r["correct"] for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())
