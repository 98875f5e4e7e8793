"""One Gated DeltaNet decode step (Qwen3-Next, Qwen 3.5): gating, q/k l2norm and the delta rule.

transformers' Qwen3_5GatedDeltaNet / Qwen3NextGatedDeltaNet at one cached token (q, k, v from the
conv's output, split and viewed per head; a, b from their projections):

    beta = b.sigmoid();  g = -A_log.float().exp() * softplus(a.float() + dt_bias)
    q, k = repeat_interleave(q, k, HV // Hk, dim=2)                      where HV > Hk
    out, S = torch_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=S,
                                              output_final_state=True, use_qk_l2norm_in_kernel=True)
    cache.update_recurrent_state(S)                                      copy_ into the cache

Unfused: with stock Inductor 4 kernels (gating, repeats + l2norms, two reductions over the
         fp32 state, the output's transpose and cast, and the new state's copy into the cache):
         1.9x the state-traffic floor at batch 128 (measured on one H200).
Fused:   out, S = fusion_passes.gated_delta_step(q, k, v, a, b, A_log, dt_bias, S,
                                                sqrt(K), divide_scale=True, qk_l2norm=True, 1e-6)
         one kernel reading and writing the state once; in place on CUDA (the copy goes).

The prefill path (torch_chunk_gated_delta_rule) is not this pattern but chunk_gated_delta_rule's;
nor is a step whose state is not fp32 or whose value heads are not a multiple of its key heads.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from fusion_passes.fusion import Fusion, Spelling
from fusion_passes.lowering.gated_delta_step.reference import check_gated_delta_step_args

# transformers' l2norm default, fixed in its recurrent step.
L2NORM_EPS = 1e-6


def _transformers_l2norm(x, dim=-1, eps=1e-6):
    inv_norm = torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)
    return x * inv_norm


def transformers_rule_inputs(query, key, value, beta, decay):
    # The head of both of transformers' delta rules (recurrent and chunked, qwen3_5 / qwen3_next,
    # use_qk_l2norm_in_kernel=True): [B, H, T, ...] in fp32, q and k l2-normalised.
    query, key, value, beta, decay = [
        x.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format)
        for x in (query, key, value, beta, decay)
    ]
    query = _transformers_l2norm(query, dim=-1, eps=1e-6)
    key = _transformers_l2norm(key, dim=-1, eps=1e-6)
    return query, key, value, beta, decay


def _transformers_recurrent_rule(query, key, value, g, beta, initial_state):
    # torch_recurrent_gated_delta_rule(..., output_final_state=True, use_qk_l2norm_in_kernel=True)
    # as transformers writes it (its loop runs once per token; one here).
    initial_dtype = query.dtype
    batch_size, sequence_length, _, k_head_dim = key.shape
    query, key, value, beta, decay = transformers_rule_inputs(query, key, value, beta, g)
    query = query / (query.shape[-1] ** 0.5)
    last_recurrent_state = initial_state.to(value)
    # transformers writes torch.zeros_like(value). The graph holds a contiguous fill either way: in
    # bf16 / fp16 value is a new fp32 tensor; in fp32 it is a view whose size-1 token dim the
    # model's tensors stride contiguously, where the site's fake values, re-traced by the matcher,
    # may not (zeros_like would trace a permuted fill there, and no fp32 step matched).
    core_attn_out = value.new_zeros(value.shape)
    for i in range(sequence_length):
        q_t, k_t, v_t = query[:, :, i], key[:, :, i], value[:, :, i]
        decay_t = decay[:, :, i].exp()[..., None, None]
        last_recurrent_state = last_recurrent_state * decay_t
        beta_t = beta[:, :, i].unsqueeze(-1)
        kv_mem = (last_recurrent_state * k_t.unsqueeze(-1)).sum(dim=-2)
        delta = (v_t - kv_mem) * beta_t
        last_recurrent_state = last_recurrent_state + k_t.unsqueeze(-1) * delta.unsqueeze(-2)
        core_attn_out[:, :, i] = (last_recurrent_state * q_t.unsqueeze(-1)).sum(dim=-2)
    core_attn_out = core_attn_out.transpose(1, 2).contiguous().to(initial_dtype)
    return core_attn_out, last_recurrent_state


def transformers_gated_delta_step(query, key, value, a, b, A_log, dt_bias, recurrent_state):
    # Qwen3_5GatedDeltaNet.forward's gating and recurrent step (Qwen3-Next's is the same code).
    beta = b.sigmoid()
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
    ratio = value.shape[2] // query.shape[2]
    if ratio > 1:
        query = query.repeat_interleave(ratio, dim=2)
        key = key.repeat_interleave(ratio, dim=2)
    return _transformers_recurrent_rule(query, key, value, g, beta, recurrent_state)


def _fused(query, key, value, a, b, A_log, dt_bias, recurrent_state):
    return torch.ops.fusion_passes.gated_delta_step(
        query, key, value, a, b, A_log, dt_bias, recurrent_state,
        query.shape[-1] ** 0.5, True, True, L2NORM_EPS,
    )


def _check(values: dict[str, Any]) -> str | None:
    names = ("query", "key", "value", "a", "b", "A_log", "dt_bias", "recurrent_state")
    try:
        check_gated_delta_step_args(*(values[n] for n in names))
    except ValueError as e:
        return str(e).removeprefix("gated_delta_step: ")
    return None


def _is_step_gating(node) -> bool:
    """A softplus (its log1p) of one token per sequence ([B, 1, HV]) in a graph that reads and
    writes back a 4-D fp32 input (a recurrent state updated in the cache): a decode step's gating.
    A prefill's chunked rule (several tokens) and a forward without a cache are not candidates."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dim() != 3 or val.shape[1] != 1:
        return False  # the gate of more than one token per sequence: a prefill's
    graph = node.graph
    written = {
        n.args[0] for n in graph.nodes
        if n.op == "call_function" and n.target is torch.ops.aten.copy_.default and n.args[0].op == "placeholder"
    }  # fmt: skip
    for state in written:
        val = state.meta.get("val")
        if isinstance(val, torch.Tensor) and val.dim() == 4 and val.dtype == torch.float32:
            if any(user.target is torch.ops.aten.mul.Tensor for user in state.users):
                return True
    return False


def _examples():
    # (Hk, HV): grouped value heads (repeated by transformers) and one value head per key head.
    for hk, hv in ((2, 4), (4, 4)):
        # fp32 graphs too (see the fill in _transformers_recurrent_rule): their pattern ends in a
        # bare permute, tried only in graphs that hold a softplus (applies_to).
        for dtype, param_dtype in (
            (torch.bfloat16, torch.bfloat16),
            (torch.float16, torch.float16),
            (torch.bfloat16, torch.float32),  # A_log / dt_bias kept in fp32
            (torch.float32, torch.float32),
        ):
            yield (
                torch.randn(2, 1, hk, 16, dtype=dtype),
                torch.randn(2, 1, hk, 16, dtype=dtype),
                torch.randn(2, 1, hv, 8, dtype=dtype),
                torch.randn(2, 1, hv, dtype=dtype),
                torch.randn(2, 1, hv, dtype=dtype),
                torch.randn(hv, dtype=param_dtype),
                torch.randn(hv, dtype=param_dtype),
                torch.randn(2, hv, 16, 8),
            )


GATED_DELTA_STEP = Fusion(
    name="gated_delta_step",
    summary="Gated DeltaNet decode step (gating, q/k l2norm, delta rule, state update) -> one kernel",
    doc=__doc__.split("\n\n", 1)[1],
    spellings=(Spelling("transformers_gated_delta_step", transformers_gated_delta_step, _fused),),
    example_inputs=_examples,
    check=_check,
    candidate_ops=("aten.log1p.default",),
    candidate=_is_step_gating,
    applies_to=lambda graph: bool(graph.find_nodes(op="call_function", target=torch.ops.aten.log1p.default)),
    builtin=True,
)

FUSIONS = (GATED_DELTA_STEP,)
