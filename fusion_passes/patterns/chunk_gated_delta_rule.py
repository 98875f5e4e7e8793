"""Gated DeltaNet's prefill (Qwen3-Next, Qwen 3.5): the chunked gated delta rule as one op.

transformers' Qwen3_5GatedDeltaNet / Qwen3NextGatedDeltaNet over a prompt (more than one token, or
no cache) calls ``torch_chunk_gated_delta_rule(q, k, v, g, beta, initial_state=S or None,
output_final_state=cache is not None, use_qk_l2norm_in_kernel=True)``; traced, its loop over the
64-token chunks is unrolled, so the graph of a T-token prompt holds ceil(T / 64) copies of the
chunk step. The patterns are therefore traced from the graph being compiled
(``Fusion.graph_examples``), at its exact sizes: the chunk count, batch, heads and head dims of
each ``linalg_solve_triangular`` (the UT transform, two per layer), the activations' dtype and the
pad to whole chunks. A prompt length torch.compile made dynamic (symbolic sizes) is left alone.

Unfused: with stock Inductor, per layer, the prep (casts, l2norms, pairwise decays, two batched
         triangular solves) then per chunk four small batched GEMMs and their elementwise glue,
         one chunk after the other: 64 sequential steps for 4096 tokens.
Fused:   out, S = fusion_passes.chunk_gated_delta_rule(q, k, v, g, beta, S or zeros,
                                                      K ** -0.5, qk_l2norm=True, 1e-6)
         flash-linear-attention's chunk kernels on CUDA (the extra ``fla``); sites it cannot run
         (fla-core missing, fp32 activations) are left to Inductor with the reason.

Opt-in: not yet timed on a GPU.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch
import torch.nn.functional as F

from fusion_passes.fusion import Fusion, Spelling
from fusion_passes.lowering.chunk_gated_delta_rule.op import fla_chunk_kernel_refusal
from fusion_passes.lowering.chunk_gated_delta_rule.reference import CHUNK, check_chunk_gated_delta_rule_args
from fusion_passes.patterns.gated_delta_step import transformers_rule_inputs

# transformers' l2norm default, fixed in its chunked rule.
L2NORM_EPS = 1e-6

aten, prims = torch.ops.aten, torch.ops.prims


def _transformers_chunk_rule(query, key, value, g, beta, initial_state, output_final_state):
    # torch_chunk_gated_delta_rule(..., chunk_size=64, use_qk_l2norm_in_kernel=True) as
    # transformers 5.17 writes it (qwen3_5 / qwen3_5_moe / qwen3_next), outside export.
    chunk_size = 64
    initial_dtype = query.dtype
    batch_size, sequence_length, _, k_head_dim = key.shape
    num_v_heads, v_head_dim = value.shape[-2:]
    padded_output_shape = (batch_size, num_v_heads, -1, v_head_dim)
    query, key, value, beta, decay = transformers_rule_inputs(query, key, value, beta, g)
    scaling = query.shape[-1] ** -0.5
    query = query * scaling
    pad_size = (chunk_size - sequence_length % chunk_size) % chunk_size
    query, key, value = (F.pad(x, (0, 0, 0, pad_size)) for x in (query, key, value))
    beta, decay = (F.pad(x, (0, pad_size)) for x in (beta, decay))
    total_sequence_length = sequence_length + pad_size
    num_chunks = total_sequence_length // chunk_size
    v_beta = value * beta.unsqueeze(-1)
    k_beta = key * beta.unsqueeze(-1)
    query, key, k_beta, v_beta = [
        x.reshape(x.shape[0], x.shape[1], -1, chunk_size, x.shape[-1]) for x in (query, key, k_beta, v_beta)
    ]
    decay = decay.reshape(decay.shape[0], decay.shape[1], -1, chunk_size)
    strictly_upper_mask = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=query.device).triu(1)
    cum_decay = decay.cumsum(dim=3)
    pairwise_decay = cum_decay.unsqueeze(4) - cum_decay.unsqueeze(3)
    # masked_fill(strictly_upper_mask, float("-inf")), as Inductor's constant folding leaves it
    # (its scalar_tensor(-inf) becomes full([], -inf) before the post-grad passes)
    minus_inf = torch.full([], float("-inf"), dtype=pairwise_decay.dtype, device=pairwise_decay.device)
    pairwise_decay = torch.where(strictly_upper_mask, minus_inf, pairwise_decay)
    pairwise_decay = pairwise_decay.exp()
    ut_system = (k_beta @ key.transpose(-1, -2)) * pairwise_decay
    intra_chunk_attn = (query @ key.transpose(-1, -2)) * pairwise_decay
    decayed_k_beta = k_beta * cum_decay.exp().unsqueeze(-1)
    new_values = torch.linalg.solve_triangular(ut_system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(ut_system, decayed_k_beta, upper=False, unitriangular=True)
    # initial_state=None is torch.zeros(...): a graph input here like a cached state.
    last_recurrent_state = initial_state.to(new_values)
    core_attn_out = torch.zeros_like(new_values)
    query = query * cum_decay.exp().unsqueeze(-1)
    key = key * (cum_decay[..., -1:] - cum_decay).exp().unsqueeze(-1)
    chunk_decay = cum_decay[..., -1].exp()[..., None, None]
    for i in range(num_chunks):
        v_new = new_values[:, :, i] - k_cumdecay[:, :, i] @ last_recurrent_state
        inter_chunk_attn = query[:, :, i] @ last_recurrent_state
        core_attn_out[:, :, i] = inter_chunk_attn + intra_chunk_attn[:, :, i] @ v_new
        last_recurrent_state = (
            last_recurrent_state * chunk_decay[:, :, i] + key[:, :, i].transpose(-1, -2) @ v_new
        )
    last_recurrent_state = None if not output_final_state else last_recurrent_state
    core_attn_out = core_attn_out.reshape(padded_output_shape)
    core_attn_out = core_attn_out[:, :, :sequence_length]
    core_attn_out = core_attn_out.transpose(1, 2).to(initial_dtype, memory_format=torch.contiguous_format)
    return core_attn_out, last_recurrent_state


def transformers_chunk_rule_with_state(query, key, value, g, beta, initial_state):
    # A prefill through a cache: the final state is copied into it.
    return _transformers_chunk_rule(query, key, value, g, beta, initial_state, output_final_state=True)


def transformers_chunk_rule(query, key, value, g, beta, initial_state):
    # A forward without a cache: the final state is dropped (its last update is dead code).
    return _transformers_chunk_rule(query, key, value, g, beta, initial_state, output_final_state=False)[0]


def _fused_with_state(query, key, value, g, beta, initial_state):
    return torch.ops.fusion_passes.chunk_gated_delta_rule(
        query, key, value, g, beta, initial_state, query.shape[-1] ** -0.5, True, L2NORM_EPS
    )


def _fused(query, key, value, g, beta, initial_state):
    return _fused_with_state(query, key, value, g, beta, initial_state)[0]


def _check(values: dict[str, Any]) -> str | None:
    q, v = values["query"], values["value"]
    try:
        check_chunk_gated_delta_rule_args(
            q, values["key"], v, values["g"], values["beta"], values["initial_state"]
        )
    except ValueError as e:
        return str(e).removeprefix("chunk_gated_delta_rule: ")
    if q.device.type == "cuda":
        return fla_chunk_kernel_refusal(q, v, L2NORM_EPS)
    return None


def _static_size(t: Any) -> tuple[int, ...] | None:
    if not isinstance(t, torch.Tensor) or not all(isinstance(s, int) for s in t.shape):
        return None  # symbolic sizes: no example to trace
    return tuple(t.shape)


def _activation_dtype_and_padding(ut: torch.fx.Node) -> tuple[torch.dtype, int]:
    """The dtype of q / k before the rule's fp32 cast, and the tokens the prompt was padded by to
    whole chunks (a constant_pad_nd's last pad; 0: none), read off the UT system's producers: the
    cast of k is about 10 nodes above it (mul, reshape, bmm, reshape, expand, reshape, mul, pad,
    mul, clone)."""
    dtype, pad = torch.float32, None
    seen, todo = {ut}, deque([(ut, 0)])
    while todo:
        node, depth = todo.popleft()
        # the nearest pad (breadth first): the rule's own, not one further up (a conv state's)
        if pad is None and node.target is aten.constant_pad_nd.default and isinstance(node.args[1][-1], int):
            pad = node.args[1][-1]
        if node.target is prims.convert_element_type.default and node.args[1] == torch.float32:
            source = node.args[0].meta.get("val") if isinstance(node.args[0], torch.fx.Node) else None
            if isinstance(source, torch.Tensor) and source.dtype in (torch.bfloat16, torch.float16):
                dtype = source.dtype
            continue
        if depth < 16:
            for parent in node.all_input_nodes:
                if parent not in seen:
                    seen.add(parent)
                    todo.append((parent, depth + 1))
    return dtype, pad or 0


def _graph_examples(graph: torch.fx.Graph):
    """Meta-device arguments with each chunked rule's sizes in ``graph`` (its exact prompt length:
    whole chunks less the pad): the pair of triangular solves of a layer shares its UT system
    [B, H, N, 64, 64] and gives V (new values: a reshaped v * beta) and K (decayed keys:
    k * beta * exp(G))."""
    solves: dict[torch.fx.Node, dict[str, int]] = {}
    for node in graph.nodes:
        if node.op != "call_function" or node.target is not aten.linalg_solve_triangular.default:
            continue
        ut, rhs = node.args[0], node.args[1]
        ut_size, rhs_size = _static_size(ut.meta.get("val")), _static_size(rhs.meta.get("val"))
        if ut_size is None or rhs_size is None or len(ut_size) != 5 or ut_size[-1] != CHUNK:
            continue
        dims = solves.setdefault(ut, {})
        dims["k" if rhs.target is aten.mul.Tensor else "v"] = rhs_size[-1]
    for ut, dims in solves.items():
        if len(dims) != 2:
            continue
        batch, heads, chunks = ut.meta["val"].shape[:3]
        dtype, pad = _activation_dtype_and_padding(ut)
        tokens = chunks * CHUNK - pad

        def meta(*shape, dtype=dtype):
            return torch.empty(shape, dtype=dtype, device="meta")

        yield (
            meta(batch, tokens, heads, dims["k"]),
            meta(batch, tokens, heads, dims["k"]),
            meta(batch, tokens, heads, dims["v"]),
            meta(batch, tokens, heads, dtype=torch.float32),  # g: transformers' gating is fp32
            meta(batch, tokens, heads),
            meta(batch, heads, dims["k"], dims["v"], dtype=torch.float32),
        )


def _examples():
    # 70 tokens: two chunks, the second padded (the replacement's region and near-miss traces).
    yield (
        torch.randn(2, 70, 2, 8, dtype=torch.bfloat16),
        torch.randn(2, 70, 2, 8, dtype=torch.bfloat16),
        torch.randn(2, 70, 2, 6, dtype=torch.bfloat16),
        -torch.rand(2, 70, 2),
        torch.rand(2, 70, 2, dtype=torch.bfloat16),
        torch.randn(2, 2, 8, 6),
    )


CHUNK_GATED_DELTA_RULE = Fusion(
    name="chunk_gated_delta_rule",
    summary="Gated DeltaNet prefill (transformers' chunked delta rule, its loop unrolled per chunk) -> one op",
    doc=__doc__.split("\n\n", 1)[1],
    spellings=(
        Spelling("transformers_chunk_rule_with_state", transformers_chunk_rule_with_state, _fused_with_state),
        Spelling("transformers_chunk_rule", transformers_chunk_rule, _fused),
    ),
    example_inputs=_examples,
    graph_examples=_graph_examples,
    check=_check,
    candidate_ops=("aten.linalg_solve_triangular.default",),
    opt_in="not yet timed on a GPU (flash-linear-attention's chunk kernels on CUDA)",
    builtin=True,
)

FUSIONS = (CHUNK_GATED_DELTA_RULE,)
