"""Time the tensor-parallel allreduce + residual add + RMSNorm (bf16, Llama form) on 2 GPUs, three
ways side by side:

    s = sum over the ranks of x;  r = s + residual;  y = weight * to_bf16(f32(r) * rsqrt(mean(f32(r)^2) + eps))
    returns (y, r)

  nccl      NCCL all_reduce (the functional collective + wait, as a compiled TP graph calls it),
            then torch.compile (stock Inductor) of the add + RMSNorm spelling: two+ launches
  symm_mem  torch.ops.symm_mem.one_shot_all_reduce on a symmetric buffer (its _copy variant when
            present, which copies x in inside the kernel; else a copy_ first), then the same
            Inductor add + RMSNorm
  ours      torch.ops.fusion_passes.allreduce_add_rms_norm: the one-shot kernel (reduce + add +
            norm in one launch) when symm_mem_eligible allows, else its NCCL fallback; the "path"
            column says which, and why

Each is timed on every rank with the same fixed number of calls (a collective must be called as
often on every rank: adaptive repeat counts such as do_bench's would hang), rank 0 reports:
  plain  median over PLAIN_ITERS calls of CUDA events around each call, after a synchronize and a
         dist.barrier; includes the host's launch time where the host is the bottleneck
  graph  GRAPH_CALLS calls, each on its own input set, captured in one CUDA graph; the median over
         GRAPH_REPLAYS replays, per call
Ours is checked against nccl first (within the bf16 tolerance; the two sums may differ by one
rounding) and for bit-identical outputs on every rank. The table's speedups are the baseline's
time over ours; where ours fell back they compare NCCL with NCCL. Above MAX_ROWS rows the op
runs the one-shot kernel in launches of MAX_ROWS rows (two ranks; the path column counts them);
--max-rows N times a workspace of N rows instead (one launch), to compare the two.

With --quant per_token|per_group the block ends in an FP8 linear: the norm is followed by the
dynamic FP8 quantization (float8_e4m3fn, one scale per row or per 128 columns), written as
serving engines write it (benchmarks.bench_rms_norm_quant_fp8.eager_fn), and ours is
fusion_passes::allreduce_add_rms_norm_quant_fp8 (reduce + add + norm + quantize in one launch);
each call returns (codes, scales, r), checked as codes at most one fp8 code apart from nccl's.

    torchrun --nproc-per-node 2 -m benchmarks.bench_allreduce_rms_norm [--hidden 7168 4096 3072]
        [--tokens 1 8 64 256 512 2048 16384] [--max-rows N] [--quant per_token|per_group]
        [--out bench_allreduce_rms_norm.md]
        [--json bench_allreduce_rms_norm.json]
    python -m benchmarks.bench_allreduce_rms_norm --smoke   # CPU, gloo, 2 spawned ranks: fallback only
"""

from __future__ import annotations

import sys

import torch

from benchmarks import common
from benchmarks import distributed  # first: no multicast, the smoke run's interpreter, before triton

import torch.distributed as dist  # noqa: E402
import triton  # noqa: E402

import fusion_passes  # noqa: E402, F401 - registers the ops
from fusion_passes.lowering.allreduce_rms_norm import symm_mem as one_shot_module  # noqa: E402
from fusion_passes.lowering.allreduce_rms_norm.reference import all_reduce_sum  # noqa: E402
from fusion_passes.lowering.allreduce_rms_norm.symm_mem import symm_mem_eligible  # noqa: E402
from fusion_passes.lowering.common.collective_ops import runtime_fallbacks  # noqa: E402
from fusion_passes.numerics import compare, fp8_codes_apart  # noqa: E402
from benchmarks.spellings import GROUP_SIZE  # noqa: E402

HIDDEN = (7168, 4096, 3072)  # DeepSeek V3, Llama 3 8B / Qwen 3 8B, Llama 3.2 3B
TOKENS = (1, 8, 64, 256, 512, 2048, 16384)
SMOKE_HIDDEN, SMOKE_TOKENS = (256,), (1, 4)  # 256: two quantization groups of 128
DTYPE = torch.bfloat16
EPS = 1e-6
IMPLS = ("nccl", "symm_mem", "ours")


def add_rms_norm(s, residual, weight, eps):
    """The decoder layer after the collective (Hugging Face spelling): returns (normed, r)."""
    r = s + residual
    h = r.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(r.dtype), r


QUANT = None  # None, or the --quant scheme: set by run() before any shape


def unfused_after_allreduce(s, residual, weight, eps):
    """What follows the collective in the baselines: add + RMSNorm, then (--quant) the FP8
    quantization as serving engines write it; returns (normed, r) or (codes, scales, r)."""
    if QUANT is None:
        return add_rms_norm(s, residual, weight, eps)
    from benchmarks.bench_rms_norm_quant_fp8 import eager_fn

    return eager_fn("add_rms_norm", QUANT)(s, residual, weight, None)


def ours(inputs, group_name):
    """The fused op on one input set: (normed, r), or (codes, scales, r) under --quant."""
    if QUANT is None:
        return torch.ops.fusion_passes.allreduce_add_rms_norm(
            inputs["x"], inputs["residual"], inputs["weight"], EPS, 0.0, True, group_name
        )
    return torch.ops.fusion_passes.allreduce_add_rms_norm_quant_fp8(
        inputs["x"], inputs["residual"], inputs["weight"], EPS, 0.0, True, QUANT, None, GROUP_SIZE,
        False, group_name,
    )  # fmt: skip


def _symm_mem_one_shot():
    """(op, fused copy?) for torch's own one-shot all_reduce, or (None, reason)."""
    ops = torch.ops.symm_mem
    if not torch.cuda.is_available():
        return None, "no CUDA"
    if hasattr(ops, "one_shot_all_reduce_copy"):
        return ops.one_shot_all_reduce_copy, True
    if hasattr(ops, "one_shot_all_reduce"):
        return ops.one_shot_all_reduce, False
    return None, "torch.ops.symm_mem.one_shot_all_reduce missing in this torch"


def make_calls(impl, input_sets, group_name, norm, symm_buffer):
    """One zero-argument call of `impl` per input set, each returning (normed, r); None if the
    implementation is unavailable here."""
    if impl == "nccl":
        return [lambda s=s: norm(all_reduce_sum(s["x"], group_name), s["residual"], s["weight"], EPS)
                for s in input_sets]
    if impl == "ours":
        return [lambda s=s: ours(s, group_name) for s in input_sets]
    one_shot, fused_copy = _symm_mem_one_shot()
    if one_shot is None or symm_buffer is None:
        return None
    if fused_copy:
        def call(s):
            return norm(one_shot(symm_buffer, s["x"], "sum", group_name), s["residual"], s["weight"], EPS)
    else:
        def call(s):
            symm_buffer.copy_(s["x"])
            return norm(one_shot(symm_buffer, "sum", group_name), s["residual"], s["weight"], EPS)
    return [lambda s=s: call(s) for s in input_sets]


def random_inputs(hidden, tokens, device, rank, seed) -> dict:
    """x differs per rank (each holds a partial sum); residual and weight are replicated; weight
    near 1 as in trained norms."""
    shared = torch.Generator(device=device).manual_seed(seed)
    own = torch.Generator(device=device).manual_seed(seed * 7919 + 1 + rank)
    return {
        "x": torch.randn(tokens, hidden, device=device, generator=own).to(DTYPE),
        "residual": torch.randn(tokens, hidden, device=device, generator=shared).to(DTYPE),
        "weight": (1 + 0.1 * torch.randn(hidden, device=device, generator=shared)).to(DTYPE),
    }


def check_ours(inputs, group_name, norm) -> dict:
    """Ours against nccl (bf16 tolerance; fp8 codes at most one code apart) and the same bits on
    every rank."""
    out = ours(inputs, group_name)
    ref = norm(all_reduce_sum(inputs["x"], group_name), inputs["residual"], inputs["weight"], EPS)
    codes_apart = 0
    if QUANT is not None:
        codes_apart = fp8_codes_apart(out[0], ref[0])
        out, ref = out[1:], ref[1:]
    comparisons = [compare(o, r, DTYPE) for o, r in zip(out, ref, strict=True)]  # scales: y's rounding
    identical = all(distributed.same_on_every_rank(o) for o in out)
    return {
        "correct": all(c.ok for c in comparisons) and codes_apart <= 1,
        "identical_across_ranks": identical,
        "max_abs_err": max(c.max_abs for c in comparisons),
        **({"max_code_diff": codes_apart} if QUANT is not None else {}),
    }


def bench_shape(hidden, tokens, device, rank, group_name, norm_for_shape) -> dict:
    """Check ours, then time the three implementations on fresh inputs of one shape."""
    sets = distributed.GRAPH_CALLS if device.type == "cuda" else 1
    input_sets = [random_inputs(hidden, tokens, device, rank, seed) for seed in range(sets)]
    norm = norm_for_shape()
    # Path first: the gate is collective at its first call per shape, on every rank alike.
    # The quantizing kernel runs at most MAX_ROWS rows (above: its NCCL fallback).
    reason = symm_mem_eligible(input_sets[0]["x"], group_name, chunked=QUANT is None)
    launches = -(-tokens // one_shot_module.MAX_ROWS)
    path = "one-shot" + (f" ({launches} launches)" if launches > 1 else "")
    record = {"hidden": hidden, "tokens": tokens, "path": path if reason is None else f"fallback: {reason}"}
    record.update(check_ours(input_sets[0], group_name, norm))
    symm_buffer = None
    if _symm_mem_one_shot()[0] is not None:
        import torch.distributed._symmetric_memory as symm_mem

        symm_buffer = symm_mem.empty((tokens, hidden), dtype=DTYPE, device=device)
        symm_mem.rendezvous(symm_buffer, group_name)
    record["plain_us"], record["graph_us"] = {}, {}
    for impl in IMPLS:
        calls = make_calls(impl, input_sets, group_name, norm, symm_buffer)
        record["plain_us"][impl] = None if calls is None else distributed.time_plain_us(calls[0], device)
        record["graph_us"][impl] = None if calls is None else distributed.time_graph_us(calls, device)
    del symm_buffer
    return record


def table(records, mode) -> list[str]:
    lines = [
        "| hidden | tokens | nccl | symm_mem | ours | vs nccl | vs symm_mem | path |",
        "|---:|---:|---:|---:|---:|---:|---:|:---|",
    ]
    for r in records:
        t = r[f"{mode}_us"]
        times = " | ".join(common.us(t[i]) for i in IMPLS)
        lines.append(
            f"| {r['hidden']} | {r['tokens']} | {times} "
            f"| {common.ratio(t['nccl'], t['ours'])} | {common.ratio(t['symm_mem'], t['ours'])} | {r['path']} |"
        )
    return lines


def report(records, device_name, world_size, symm_note) -> str:
    failures = [r for r in records if not (r["correct"] and r["identical_across_ranks"])]
    quant = "" if QUANT is None else f" + {QUANT} FP8 quantization"
    lines = [
        f"# allreduce + add + RMSNorm{quant} benchmark (Llama form, bf16)",
        "",
        f"Device: {device_name} x {world_size}; torch {torch.__version__}; triton {triton.__version__}; "
        f"MAX_ROWS {one_shot_module.MAX_ROWS}; NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1.",
        "",
        "- Times: median microseconds per call on rank 0 (every rank makes the same calls). plain: "
        f"CUDA events around each of {distributed.PLAIN_ITERS} calls (host launch time included where it "
        f"dominates). graph: {distributed.GRAPH_CALLS} calls on their own input sets in one CUDA graph, "
        f"median of {distributed.GRAPH_REPLAYS} replays, per call. Compare by the graph columns."
        + (" (This CPU smoke run: a host clock over 3 calls; no graphs; the op's CPU path is "
           "its reference.)" if device_name.startswith("CPU") else ""),
        "- nccl: NCCL all_reduce + torch.compile (stock Inductor) add+RMSNorm. symm_mem: "
        f"torch.ops.symm_mem one-shot all_reduce ({symm_note}) + the same Inductor add+RMSNorm. "
        f"ours: fusion_passes::allreduce_add_rms_norm{'' if QUANT is None else '_quant_fp8'} (path column: one-shot, or the NCCL fallback "
        "and why). Speedup = baseline time / ours.",
        f"- Ours vs nccl within bf16 tolerance and bit-identical across ranks: "
        f"{'all shapes pass' if not failures else f'{len(failures)} FAILURES'}.",
    ]
    for mode, title in (("plain", "Plain launches"), ("graph", "CUDA graph")):
        lines += ["", f"## {title}: us per call", "", *table(records, mode)]
    return "\n".join(lines) + "\n"


def run(rank, world_size, args, device) -> int:
    """Every rank runs every shape; rank 0 writes the report. Returns the exit status."""
    if args.max_rows is not None:
        # Before any workspace exists (they are sized by it): lets one run time the one-shot path
        # past the default bound, to find where it stops winning.
        one_shot_module.MAX_ROWS = args.max_rows
    group_name = dist.group.WORLD.group_name
    global QUANT
    QUANT = args.quant
    one_shot, fused_copy = _symm_mem_one_shot()
    symm_note = (
        ("one_shot_all_reduce_copy: copy-in fused" if fused_copy else "copy_ + one_shot_all_reduce")
        if one_shot is not None else f"unavailable: {fused_copy}"
    )

    def norm_for_shape():
        # One static-shape compile per shape, clear of the recompile limit; the smoke run keeps the
        # eager spelling (an Inductor C++ compile on a CPU would dominate a short check).
        if args.smoke:
            return unfused_after_allreduce
        torch._dynamo.reset()
        return torch.compile(unfused_after_allreduce, dynamic=False)

    records = []
    with torch.no_grad():
        for h in args.hidden:
            for t in args.tokens:
                records.append(bench_shape(h, t, device, rank, group_name, norm_for_shape))
                r = records[-1]
                if rank == 0:
                    print(
                        f"hidden={h} tokens={t} [{r['path']}] plain "
                        + ", ".join(f"{i} {common.us(r['plain_us'][i])}" for i in IMPLS)
                        + " | graph " + ", ".join(f"{i} {common.us(r['graph_us'][i])}" for i in IMPLS),
                        flush=True,
                    )
                    if not (r["correct"] and r["identical_across_ranks"]):
                        print(f"CORRECTNESS FAILURE: hidden={h} tokens={t} {r}", flush=True)
    status = 1 if any(not (r["correct"] and r["identical_across_ranks"]) for r in records) else 0
    if rank == 0:
        text = report(records, distributed.device_name(device), world_size, symm_note)
        distributed.finish(args, text, device, world_size, {
            "dtype": str(DTYPE),
            "eps": EPS,
            "quant": QUANT,
            "max_rows": one_shot_module.MAX_ROWS,
            "symm_mem_baseline": symm_note,
            "runtime_fallbacks": {op: dict(g) for op, g in runtime_fallbacks.items()},
            "records": records,
        })  # fmt: skip
    return status


def main() -> int:
    parser = distributed.parser(__doc__, "bench_allreduce_rms_norm", "tiny sizes", "fallback only")
    common.add_sizes(parser, "--hidden", HIDDEN, SMOKE_HIDDEN, "hidden sizes")
    common.add_sizes(parser, "--tokens", TOKENS, SMOKE_TOKENS, "token counts")
    parser.add_argument(
        "--max-rows", type=int, help=f"override MAX_ROWS (default {one_shot_module.MAX_ROWS}) for this run"
    )
    parser.add_argument(
        "--quant",
        choices=("per_token", "per_group"),
        help="end in dynamic FP8 quantization: time allreduce_add_rms_norm_quant_fp8",
    )
    args = common.parse(parser)
    return distributed.launch_ranks(run, args, parser)


if __name__ == "__main__":
    sys.exit(main())
