"""Gated DeltaNet's prefill (Qwen3-Next, Qwen 3.5): the chunked gated delta rule as one op.

transformers' Qwen3_5GatedDeltaNet / Qwen3NextGatedDeltaNet over a prompt (more than one token, or
no cache) calls ``torch_chunk_gated_delta_rule(q, k, v, g, beta, initial_state=S or None,
output_final_state=cache is not None, use_qk_l2norm_in_kernel=True)``; traced, its loop over the
64-token chunks is unrolled, so the graph of a T-token prompt holds ceil(T / 64) copies of the
chunk step. The patterns are therefore traced from the graph being compiled
(``Fusion.graph_examples``), at its exact sizes, read around each layer's chunk cumsum: the chunk
count, batch, heads and head dims, the activations' dtype and the pad to whole chunks. A prompt
length torch.compile made dynamic (symbolic sizes) is left alone.

Unfused: with stock Inductor, per layer, the prep (casts, l2norms, pairwise decays, two batched
         triangular solves, or under torch <= 2.11 the export form's forward substitution: 63
         row updates) then per chunk four small batched GEMMs and their elementwise glue, one
         chunk after the other: 64 sequential steps for 4096 tokens.
Fused:   out, S = fusion_passes.chunk_gated_delta_rule(q, k, v, g, beta, S or zeros,
                                                      K ** -0.5, qk_l2norm=True, 1e-6)
         flash-linear-attention's chunk kernels on CUDA (the extra ``fla``); sites it cannot run
         (fla-core missing, fp32 activations) are left to Inductor with the reason.

Measured on one H200 (32 heads of 128, bf16, batch 1, inside a CUDA graph, torch 2.11): 5.7x stock
Inductor at 64 tokens, 9.6x at 512, 11.3x at 4096 (4042 -> 357 us; 494 kernels -> 10).
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable

import torch
import torch.nn.functional as F

from fusion_passes.fusion import Fusion, GraphExample, Spelling
from fusion_passes.lowering.chunk_gated_delta_rule.op import fla_chunk_kernel_refusal
from fusion_passes.lowering.chunk_gated_delta_rule.reference import CHUNK, check_chunk_gated_delta_rule_args
from fusion_passes.patterns.gated_delta_step import transformers_rule_inputs

# transformers' l2norm default, fixed in its chunked rule.
L2NORM_EPS = 1e-6

aten, prims = torch.ops.aten, torch.ops.prims


def _transformers_chunk_rule(query, key, value, g, beta, initial_state, output_final_state, solve=True):
    # torch_chunk_gated_delta_rule(..., chunk_size=64, use_qk_l2norm_in_kernel=True) as
    # transformers 5.17 writes it (qwen3_5 / qwen3_5_moe / qwen3_next). solve=False: its export
    # path, the UT system inverted by forward substitution, which torch.compile also takes under
    # torch <= 2.11 (Dynamo read torch.compiler.is_exporting() as True inside any compile).
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
    if solve:
        new_values = torch.linalg.solve_triangular(ut_system, v_beta, upper=False, unitriangular=True)
        k_cumdecay = torch.linalg.solve_triangular(ut_system, decayed_k_beta, upper=False, unitriangular=True)
    else:
        ut_system = -ut_system.tril(-1)
        for i in range(1, chunk_size):
            row = ut_system[..., i, :i].clone()
            sub = ut_system[..., :i, :i].clone()
            ut_system[..., i, :i] = row + (row.unsqueeze(-1) * sub).sum(-2)
        ut_system = ut_system + torch.eye(chunk_size, dtype=ut_system.dtype, device=ut_system.device)
        new_values, k_cumdecay = ut_system @ v_beta, ut_system @ decayed_k_beta
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


def transformers_chunk_rule_by_substitution_with_state(query, key, value, g, beta, initial_state):
    return _transformers_chunk_rule(query, key, value, g, beta, initial_state, output_final_state=True, solve=False)


def transformers_chunk_rule_by_substitution(query, key, value, g, beta, initial_state):
    return _transformers_chunk_rule(query, key, value, g, beta, initial_state, output_final_state=False, solve=False)[0]


# The spellings a graph can hold: with triangular solves (torch >= 2.12), or by forward substitution.
SOLVE_SPELLINGS = frozenset({"transformers_chunk_rule_with_state", "transformers_chunk_rule"})
SUBSTITUTION_SPELLINGS = frozenset(
    {"transformers_chunk_rule_by_substitution_with_state", "transformers_chunk_rule_by_substitution"}
)


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


def _is_chunk_cumsum(node: torch.fx.Node) -> bool:
    """The rule's cumulative log decay within each chunk, in either spelling: a cumsum over dim 3
    of a 4-d [B, H, N, C] tensor, two unsqueezes of which are subtracted (the pairwise decays)."""
    if node.op != "call_function" or node.target is not aten.cumsum.default or node.args[1] not in (3, -1):
        return False
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dim() != 4:
        return False
    unsqueezes = [u for u in node.users if u.target is aten.unsqueeze.default]
    return any(w.target is aten.sub.Tensor for u in unsqueezes for w in u.users)


def _holds_a_chunk_cumsum(graph: torch.fx.Graph) -> bool:
    return any(map(_is_chunk_cumsum, graph.find_nodes(op="call_function", target=aten.cumsum.default)))


def _nearest(start: torch.fx.Node, found: Callable[[torch.fx.Node], Any], way: str, depth: int) -> Any:
    """The first non-None ``found(node)`` breadth first from ``start``, through inputs ("up"),
    users ("down") or both, at most ``depth`` steps away."""
    seen, todo = {start}, deque([(start, 0)])
    while todo:
        node, d = todo.popleft()
        hit = found(node)
        if hit is not None:
            return hit
        if d < depth:
            near = (list(node.all_input_nodes) if way != "down" else []) + (
                list(node.users) if way != "up" else []
            )
            for nxt in near:
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append((nxt, d + 1))
    return None


def _graph_examples(graph: torch.fx.Graph):
    """Meta-device arguments with each chunked rule's sizes in ``graph``, at its exact prompt
    length (whole chunks less the pad), read around its chunk cumsum G [B, H, N, 64]: K from the
    first 5-d mul below it with an exp(G)[..., None] factor (q, k or k * beta scaled), V from the
    zeros the output is written into ([B, H, N, 64, V]), the pad from the log decays' own pad right
    above G (none: whole chunks), the activations' dtype from the cast to fp32 above the scaled
    keys. Both forms (triangular solve, forward substitution) hold all of these; the graph's
    triangular solves, if any, say which form's spellings to trace."""
    solves = bool(graph.find_nodes(op="call_function", target=aten.linalg_solve_triangular.default))
    for cumsum in graph.nodes:
        lead = _static_size(cumsum.meta.get("val")) if _is_chunk_cumsum(cumsum) else None
        if lead is None or lead[-1] != CHUNK:
            continue

        def five_d(node, last=None):
            val = _static_size(node.meta.get("val"))
            return val is not None and len(val) == 5 and val[:4] == lead and last in (None, val[4])

        scaled = _nearest(cumsum, lambda n: n if n.target is aten.mul.Tensor and five_d(n)
                          and any(five_d(a, 1) for a in n.all_input_nodes) else None, "down", 3)  # fmt: skip
        zeros = _nearest(cumsum, lambda n: _output_head_dim(n, lead), "both", 24)
        pad = _nearest(
            cumsum, lambda n: n.args[1][-1] if n.target is aten.constant_pad_nd.default else None, "up", 3
        )
        if scaled is None or zeros is None or not isinstance(pad or 0, int) or not 0 <= (pad or 0) < CHUNK:
            continue
        k, v = scaled.meta["val"].shape[-1], zeros
        dtype = _nearest(scaled, _cast_from_half, "up", 16) or torch.float32
        batch, heads, chunks = lead[:3]
        tokens = chunks * CHUNK - (pad or 0)

        def meta(*shape, dtype=dtype):
            return torch.empty(shape, dtype=dtype, device="meta")

        args = (
            meta(batch, tokens, heads, k),
            meta(batch, tokens, heads, k),
            meta(batch, tokens, heads, v),
            meta(batch, tokens, heads, dtype=torch.float32),  # g: transformers' gating is fp32
            meta(batch, tokens, heads),
            meta(batch, heads, k, v, dtype=torch.float32),
        )
        yield GraphExample(args, SOLVE_SPELLINGS if solves else SUBSTITUTION_SPELLINGS)


def _output_head_dim(node: torch.fx.Node, lead: tuple[int, ...]) -> int | None:
    """V, if ``node`` is the zeros the rule writes its output into: [B, H, N, 64, V], or
    [B, H, N, V, 64] where they copy the layout of the triangular solve's (column-major) result."""
    val = _static_size(node.meta.get("val"))
    if node.target is not aten.full.default or node.args[1] != 0 or val is None or len(val) != 5:
        return None
    if val[:4] == lead:
        return val[4]
    return val[3] if val[:3] == lead[:3] and val[4] == lead[3] else None


def _cast_from_half(node: torch.fx.Node) -> torch.dtype | None:
    """The half dtype a cast to fp32 reads (the rule's upcast of q / k / v / beta), else None."""
    if node.target is not prims.convert_element_type.default or node.args[1] != torch.float32:
        return None
    source = node.args[0].meta.get("val") if isinstance(node.args[0], torch.fx.Node) else None
    return (
        source.dtype
        if isinstance(source, torch.Tensor) and source.dtype in (torch.bfloat16, torch.float16)
        else None
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
        Spelling(
            "transformers_chunk_rule_by_substitution_with_state",
            transformers_chunk_rule_by_substitution_with_state,
            _fused_with_state,
        ),  # fmt: skip
        Spelling("transformers_chunk_rule_by_substitution", transformers_chunk_rule_by_substitution, _fused),
    ),
    example_inputs=_examples,
    graph_examples=_graph_examples,
    check=_check,
    candidate_ops=("aten.cumsum.default",),
    candidate=_is_chunk_cumsum,
    applies_to=_holds_a_chunk_cumsum,
    builtin=True,
)

FUSIONS = (CHUNK_GATED_DELTA_RULE,)
