"""A layer's small bias-free projections of one input, at decode, as one GEMM launch.

Models project one hidden state through several weights, each an ``nn.Linear`` of its own:

    Qwen 3.5 / Qwen3-Next Gated DeltaNet    b = self.in_proj_b(h); a = self.in_proj_a(h)        (32 rows each)
    Qwen 3.5-MoE's MoE block                self.gate (router), shared_expert.gate_proj / up_proj,
                                            self.shared_expert_gate                           (256 / 512 / 512 / 1)
    attention with few KV heads             k = self.k_proj(h); v = self.v_proj(h)             (Qwen3: 512 each)

Traced, each is ``mm(view(h, [T, K]), permute(weight, [1, 0]))`` (every linear makes its own view
of ``h``): one cuBLAS launch per weight, and at decode a small weight's launch is its latency
(~1.5 us inside a CUDA graph on one H200 for 128 KB that stream in 0.03 us).

Unfused: y_i = mm(view(h, [T, K]), permute(w_i, [1, 0]))     for each small weight w_i
Fused:   y_1, ..., y_n = fusion_passes.shared_input_linears(view(h, [T, K]), [w_1, ..., w_n])
         one launch over all the weights' rows (lowering/shared_input_linears), up to 4 weights
         a launch (more siblings: groups of 4, in graph order)

A pattern cannot state "every GEMM of this input", so this fusion is a rewrite (Fusion.rewrite).
A site: bf16 / fp16 input and weights of one dtype, at most MAX_TOKENS tokens (a decode step; a
prefill's GEMMs are compute, left to cuBLAS), weights read as they are stored (contiguous rows,
the linear's transpose a view) of at most SMALL_WEIGHT_BYTES each (a large weight's GEMM is its
bytes: cuBLAS streams those at full bandwidth, and the launch saved is a small part of it). Not a
site: a linear with a bias (addmm), an fp32 GEMM (a router's upcast logits: router_logits), one
small linear alone. The outputs are the GEMMs' up to the order of the fp32 sums (reference).
"""

from __future__ import annotations

import operator
from collections import defaultdict

import torch
import torch.fx

from fusion_passes.fake_values import insert_call
from fusion_passes.fusion import Fusion, Rewritten
from fusion_passes.lowering.shared_input_linears.reference import INPUT_DTYPES, MAX_WEIGHTS
from fusion_passes.regions import nodes_region
from fusion_passes.report import module_path, source_location

_aten = torch.ops.aten
_VIEWS = (_aten.view.default, _aten.reshape.default, _aten._unsafe_view.default)

MAX_TOKENS = 16  # a decode step's tokens (more: each program's weight rows are re-read per 4 tokens)
# The largest weight a launch takes: 8 MiB streams in ~2 us at an H200's 4.3 TB/s, about a launch's
# latency; a larger one is mostly its bytes (Qwen 3.5's in_proj_qkv: 32 MiB).
SMALL_WEIGHT_BYTES = 8 << 20


def _small_linear(mm: torch.fx.Node, max_bytes: int | None) -> tuple[torch.fx.Node, torch.fx.Node] | None:
    """(input, weight) of an mm that is a bias-free linear at decode with a weight of at most
    ``max_bytes`` (None: any size) (module docstring), or None."""
    if len(mm.args) != 2 or mm.kwargs:
        return None
    x, wt = mm.args
    if not isinstance(wt, torch.fx.Node) or wt.target is not _aten.permute.default or list(wt.args[1]) != [1, 0]:
        return None
    w = wt.args[0]
    xv, wv = x.meta.get("val"), w.meta.get("val")
    if not (isinstance(xv, torch.Tensor) and isinstance(wv, torch.Tensor)) or xv.dim() != 2 or wv.dim() != 2:
        return None
    tokens = xv.shape[0]
    if not isinstance(tokens, int) or not 1 <= tokens <= MAX_TOKENS or not isinstance(xv.shape[1], int):
        return None
    if xv.dtype not in INPUT_DTYPES or wv.dtype != xv.dtype or wv.device != xv.device or xv.stride(1) != 1:
        return None
    if not wv.is_contiguous() or (max_bytes is not None and wv.numel() * wv.element_size() > max_bytes):
        return None
    return x, w


def _source(x: torch.fx.Node) -> tuple[torch.fx.Node, tuple]:
    """What makes two GEMM inputs one: the node viewed (each linear makes its own view) and the shape."""
    base = x.args[0] if x.target in _VIEWS and isinstance(x.args[0], torch.fx.Node) else x
    return base, tuple(x.meta["val"].shape)


def _common_module(nodes: list[torch.fx.Node]) -> str:
    """The innermost module path that holds all of ``nodes`` (their layer, say)."""
    paths = [module_path(n).split(".") for n in nodes]
    common = []
    for parts in zip(*paths):
        if len(set(parts)) != 1:
            break
        common.append(parts[0])
    return ".".join(common)


def group_shared_input_linears(graph: torch.fx.Graph, max_bytes: int | None = SMALL_WEIGHT_BYTES) -> list[Rewritten]:
    """The rewrite (module docstring): each group of small linears of one input, one op."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    groups: dict[tuple, list[tuple[torch.fx.Node, torch.fx.Node]]] = defaultdict(list)
    for mm in graph.find_nodes(op="call_function", target=_aten.mm.default):
        found = _small_linear(mm, max_bytes)
        if found is not None:
            groups[_source(found[0])].append((mm, found[1]))
    done = []
    for members in groups.values():
        for start in range(0, len(members), MAX_WEIGHTS):
            chunk = members[start : start + MAX_WEIGHTS]
            first = chunk[0][0]
            # the op goes where the first GEMM was: each weight must be there by then (a parameter
            # is a graph input; a weight computed in the graph may come later)
            chunk = [(mm, w) for mm, w in chunk if mm is first or order[w] < order[first]]
            if len(chunk) >= 2:
                done.append(_rewrite(graph, chunk, order))
    return done


def _rewrite(graph: torch.fx.Graph, chunk: list[tuple[torch.fx.Node, torch.fx.Node]], order: dict) -> Rewritten:
    mms = [mm for mm, _ in chunk]
    transposes = [mm.args[1] for mm in mms]
    before = nodes_region(sorted({*transposes, *mms}, key=order.__getitem__))
    module, location = _common_module(mms), source_location(mms[0])
    x, weights = mms[0].args[0], [w for _, w in chunk]
    op = insert_call(graph, torch.ops.fusion_passes.shared_input_linears.default, (x, weights), mms[0])
    with graph.inserting_before(mms[0]):
        outs = [graph.call_function(operator.getitem, (op, i)) for i in range(len(mms))]
    # erased after the inserts: nodes inserted before an erased node fall out of the graph
    for i, (mm, out) in enumerate(zip(mms, outs)):
        out.meta["val"] = op.meta["val"][i]
        mm.replace_all_uses_with(out)
        graph.erase_node(mm)
    for t in transposes:
        if not t.users:
            graph.erase_node(t)
    return Rewritten("sibling_linears", module, location, before, nodes_region([op]), (op,))


SHARED_INPUT_LINEARS = Fusion(
    name="shared_input_linears",
    summary="a layer's small bias-free linears of one input at decode (Gated DeltaNet's b / a, the MoE "
    "block's router and shared expert, k / v) -> one GEMM launch",
    doc=__doc__.split("\n\n", 1)[1],
    spellings=(),
    example_inputs=lambda: (),
    rewrite=group_shared_input_linears,
    opt_in="not yet timed on a GPU: each GEMM launch it saves is ~1.5 us inside a CUDA graph on one H200 "
    "(Qwen 3.5-MoE at batch 1), against its kernel's time on the merged weights",
    builtin=True,
)

SHARED_INPUT_LINEARS_ANY_SIZE = Fusion(
    name="shared_input_linears_any_size",
    summary="shared_input_linears with no weight size limit (Qwen 3.5 Gated DeltaNet's four input projections "
    "as one launch): for measuring the kernel against cuBLAS on large weights",
    doc="The rewrite of shared_input_linears with every bias-free linear of one input at decode taken, large "
    "weights too (Qwen 3.5's in_proj_qkv, 32 MiB, with z, b and a): one launch, the kernel streaming every weight "
    "instead of cuBLAS streaming the large ones. Faster only where the kernel streams a large weight at cuBLAS's "
    "rate; the default form leaves weights above SMALL_WEIGHT_BYTES to cuBLAS.",
    spellings=(),
    example_inputs=lambda: (),
    rewrite=lambda graph: group_shared_input_linears(graph, None),
    opt_in="not yet timed on a GPU (the A/B of the kernel against cuBLAS on large weights decides it)",
    builtin=True,
)

FUSIONS = (SHARED_INPUT_LINEARS, SHARED_INPUT_LINEARS_ANY_SIZE)
