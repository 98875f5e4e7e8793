"""Gated DeltaNet's prefill with grouped values: the chunked rule reading the key heads as they are.

Qwen 3.5 and Qwen3-Next have more value heads than key heads (32 / 16); transformers repeats q and k
before the chunked rule:

    query = query.repeat_interleave(HV // H, dim=2)      # [B, T, H, K] -> [B, T, HV, K], a copy
    key = key.repeat_interleave(HV // H, dim=2)
    out, S = torch_chunk_gated_delta_rule(query, key, value, g, beta, ...)

which chunk_gated_delta_rule turns into its op on the repeated q and k.

Unfused: the repeats, materialized by Inductor ([B, T, HV, K] twice: 32 MB each at a 4096-token
         prompt of Qwen 3.5's widths, bf16), then the op reading them
Fused:   out, S = fusion_passes.chunk_gated_delta_rule(query, key, value, g, beta, S, scale, ...)
         the same op on the key heads (value head h reads key head h // (HV / H), the math of the
         repeat; flash-linear-attention's chunk kernels take grouped values as they are)

Measured on one H200 (the op alone in a CUDA graph, Qwen 3.5's 16 key / 32 value heads of 128, inputs
as views of the conv's output, 3 alternating rounds): 142.8 -> 94.9 us at 1024 tokens (1.50x), 505.5 ->
291.5 us at 4096 (1.73x).
The same math (the op's reference repeats the heads itself: bit-equal on the CPU, tested). Runs
after chunk_gated_delta_rule, on its op: the repeat of q and k (both, by the same factor, along
the heads) is the pattern; heads tiled (repeat), or one of q / k tiled, are not.
"""

from __future__ import annotations

import torch

from fusion_passes.fusion import Fusion, Spelling
from fusion_passes.patterns.chunk_gated_delta_rule import L2NORM_EPS

# The query scale is a pattern argument, traced with this sentinel (exact in fp32).
SCALE_SENTINEL = 2.0**-7


def _op(query, key, value, g, beta, state, scale):
    return torch.ops.fusion_passes.chunk_gated_delta_rule(query, key, value, g, beta, state, scale, True, L2NORM_EPS)


def _repeated(query, key, value):
    groups = value.shape[2] // query.shape[2]
    return query.repeat_interleave(groups, dim=2), key.repeat_interleave(groups, dim=2)


def repeated_chunk_rule_with_state(query, key, value, g, beta, state, scale):
    return _op(*_repeated(query, key, value), value, g, beta, state, scale)


def repeated_chunk_rule(query, key, value, g, beta, state, scale):
    return _op(*_repeated(query, key, value), value, g, beta, state, scale)[0]


def grouped_chunk_rule_with_state(query, key, value, g, beta, state, scale):
    return _op(query, key, value, g, beta, state, scale)


def grouped_chunk_rule(query, key, value, g, beta, state, scale):
    return _op(query, key, value, g, beta, state, scale)[0]


def _examples():
    # 2 key heads read by 4 value heads; 70 tokens, bf16 activations, fp32 decays and state
    def bf16(*shape):
        return torch.randn(*shape, dtype=torch.bfloat16)

    yield (bf16(2, 70, 2, 8), bf16(2, 70, 2, 8), bf16(2, 70, 4, 6), -torch.rand(2, 70, 4), bf16(2, 70, 4),
           torch.randn(2, 4, 8, 6), SCALE_SENTINEL)  # fmt: skip


CHUNK_GATED_DELTA_RULE_GVA = Fusion(
    name="chunk_gated_delta_rule_gva",
    summary="Gated DeltaNet prefill with grouped values: the repeats of q and k before the chunked rule -> the "
    "op on the key heads",
    doc=__doc__.split("\n\n", 1)[1],
    spellings=(
        Spelling("repeated_chunk_rule_with_state", repeated_chunk_rule_with_state, grouped_chunk_rule_with_state),
        Spelling("repeated_chunk_rule", repeated_chunk_rule, grouped_chunk_rule),
    ),
    example_inputs=_examples,
    scalars={"scale": SCALE_SENTINEL},
    requires=("chunk_gated_delta_rule",),
    builtin=True,
)

FUSIONS = (CHUNK_GATED_DELTA_RULE_GVA,)
