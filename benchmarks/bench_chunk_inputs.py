"""Time the forms in which the chunked delta rule's op can take its inputs on one GPU: the op alone
(``fusion_passes::chunk_gated_delta_rule`` on flash-linear-attention's chunk kernels), Qwen 3.5
widths (16 key / 32 value heads of 128), batch 1, q / k / v as views of the causal conv's
[B, C, T] output as the model gives them.

Two A/Bs, each variant pair timed in alternating rounds inside a CUDA graph (median per round):

- prep: fla's own input path (its input guard's transposing copies of the strided views, then two
  l2norm launches) against QKV_PREP_KERNEL (one kernel of ours: l2norms and copies in one pass);
- heads: q / k repeated to the value heads (``repeat_interleave`` + the op: what
  chunk_gated_delta_rule leaves) against the op on the key heads as they are
  (chunk_gated_delta_rule_gva's form), both with the default prep.

    python -m benchmarks.bench_chunk_inputs [--tokens 1024 4096 16384] [--rounds 3]
"""

from __future__ import annotations

import sys

import torch

from benchmarks import common
from benchmarks.timing import time_graph_us
from fusion_passes.lowering.chunk_gated_delta_rule import op
from fusion_passes.numerics import compare

KEY_HEADS, VALUE_HEADS, HEAD_DIM = 16, 32, 128
TOKENS = (1024, 4096, 16384)


def inputs(tokens: int, g: torch.Generator):
    kh, hv, d = KEY_HEADS, VALUE_HEADS, HEAD_DIM
    # the conv writes [B, C, T]; the model transposes it and splits q / k / v off the channels
    mixed = torch.randn(1, 2 * kh * d + hv * d, tokens, device="cuda", generator=g).bfloat16().transpose(1, 2)
    q, k, v = torch.split(mixed, [kh * d, kh * d, hv * d], dim=-1)
    q, k, v = q.reshape(1, tokens, kh, d), k.reshape(1, tokens, kh, d), v.reshape(1, tokens, hv, d)
    decay = -torch.nn.functional.softplus(torch.randn(1, tokens, hv, device="cuda", generator=g)) * 0.5
    beta = torch.sigmoid(torch.randn(1, tokens, hv, device="cuda", generator=g)).bfloat16()
    state = torch.randn(1, hv, d, d, device="cuda", generator=g) * 0.1
    return q, k, v, decay, beta, state


def variants(q, k, v, decay, beta, state):
    """{A/B: {variant: (QKV_PREP_KERNEL, call)}}."""
    rule = torch.ops.fusion_passes.chunk_gated_delta_rule
    form = (HEAD_DIM**-0.5, True, op.FLA_L2NORM_EPS)
    ratio = VALUE_HEADS // KEY_HEADS

    def repeated():
        return rule(q.repeat_interleave(ratio, dim=2), k.repeat_interleave(ratio, dim=2), v, decay, beta, state, *form)

    def grouped():
        return rule(q, k, v, decay, beta, state, *form)

    return {"prep": {"fla": (False, grouped), "ours": (True, grouped)},
            "heads": {"repeated": (True, repeated), "grouped": (True, grouped)}}  # fmt: skip


def bench(tokens: int, rounds: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(tokens)
    record = {"tokens": tokens, "key_heads": KEY_HEADS, "value_heads": VALUE_HEADS, "head_dim": HEAD_DIM}
    default = op.QKV_PREP_KERNEL
    try:
        for ab, pair in variants(*inputs(tokens, g)).items():
            times, outs = {name: [] for name in pair}, {}
            for _ in range(rounds):
                for name, (prep, call) in pair.items():
                    op.QKV_PREP_KERNEL = prep
                    outs[name] = call()
                    times[name].append(time_graph_us([call]))
            (a, out_a), (b, out_b) = outs.items()
            record[ab] = {"graph_us_rounds": times, "graph_us": {n: sorted(t)[len(t) // 2] for n, t in times.items()},
                          "out_rel_diff": compare(out_b[0], out_a[0]).rel_norm,
                          "state_rel_diff": compare(out_b[1], out_a[1]).rel_norm}  # fmt: skip
    finally:
        op.QKV_PREP_KERNEL = default
    return record


def report_text(records, device_name) -> str:
    lines = [f"# The chunked delta rule's input forms, {device_name}", "",
             "us per call inside a CUDA graph (median of the rounds' medians); diff: the second form's "
             "output / final state against the first's (relative norm)", "",
             "| tokens | fla prep | our prep | speedup | diff | q / k repeated | grouped | speedup | diff |",
             "|---|---:|---:|---:|---|---:|---:|---:|---|"]  # fmt: skip
    for r in records:
        cells = [str(r["tokens"])]
        for ab in ("prep", "heads"):
            (a, ta), (b, tb) = r[ab]["graph_us"].items()
            cells += [common.us(ta), common.us(tb), common.ratio(ta, tb),
                      f"{r[ab]['out_rel_diff']:.1e} / {r[ab]['state_rel_diff']:.1e}"]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines + [""])


def main() -> int:
    parser = common.parser(__doc__, "bench_chunk_inputs")
    common.add_sizes(parser, "--tokens", TOKENS, what="prompt tokens (batch 1)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per A/B (default 3)")
    args = common.parse(parser)
    common.require_cuda(parser, "the op's CUDA path (flash-linear-attention's chunk kernels)")
    refusal = op.fla_chunk_kernel_refusal(torch.empty(1, dtype=torch.bfloat16), torch.empty(1), op.FLA_L2NORM_EPS)
    if refusal is not None:
        parser.error(refusal)
    records = []
    with torch.no_grad():
        for tokens in args.tokens:
            records.append(bench(tokens, args.rounds))
            print(f"{tokens} tokens: " + "; ".join(f"{ab} {records[-1][ab]['graph_us']}" for ab in ("prep", "heads")),
                  flush=True)  # fmt: skip
    common.finish(args, report_text(records, common.device_name("cuda")),
                  {"device": common.device_name("cuda"), "records": records})  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
