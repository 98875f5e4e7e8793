"""DeepSeek V3.2's indexer scores at decode: both matmuls, the scale and the relu in one kernel.

transformers' DeepseekV32Indexer scores each cached position for each query token (q [B, S, H, D]
from wq_b and RoPE, k [B, T, D] the indexer's key cache, weights [B, S, H] fp32 from
weights_proj, times H^-1/2):

    scores = torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * softmax_scale
    scores = F.relu(scores)
    index_scores = torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)

(DeepSeek's own inference code and vLLM score in FP8 kernels of their own, which no graph traces
into: transformers' is the spelling torch.compile meets.)

Unfused: with stock Inductor the key cache transposed and upcast into an fp32 copy every layer
         (8.8 us per layer at 8192 cached tokens, batch 1, on one H200), an fp32 GEMM of the
         query heads against it, scale and relu, and a second GEMM over the heads
Fused:   index_scores = fusion_passes.sparse_index_scores(q, k, weights, softmax_scale)
         one kernel reading the cache as it is (lowering/sparse_index_scores)

The products of bf16 q and k are exact in fp32 either way: the scores differ from the unfused
ones in the order of fp32 sums (an ulp or so), which can move a top-k's choice where two scores
tie to the last bits.

Not a site: more than MAX_QUERY_TOKENS query tokens (a prefill: sparse_index_scores_prefill's,
the same op through a tiled kernel). Rejected with the reason: keys shared across the batch
(k [1, T, D] broadcast), or arguments the op does not define. Not matched: weights summed over
another dim than the heads.
Around the op (sparse_index_scores_weights, sparse_index_scores_keep, below): the weights'
upcast and H^-1/2 scale before it and the attention mask's masked_fill after it, folded into its
loads and its store, so neither is an elementwise kernel of its own.
On a GPU, Inductor's joint-graph pass has turned a batch-1 bmm (one decode token of one sequence)
into mm(a.squeeze(0), b.squeeze(0)).unsqueeze(0) before the post-grad passes;
``undo_batch_one_mm`` turns the two around the relu back into the bmm the spelling traces to, so
a single-sequence decode step matches as a batch does.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from fusion_passes.fusion import Fusion, NotASite, Spelling
from fusion_passes.patterns.causal_masks import causal_mask_refusal, sdpa_decode_causal_mask
from fusion_passes.lowering.sparse_index_scores.reference import check_sparse_index_scores_args

# Query tokens per sequence up to which sparse_index_scores takes the scores: decode steps (and a
# few speculative tokens), the per-token kernel's; above it sparse_index_scores_prefill's sites,
# the tiled kernel's (the launcher's TILED_ABOVE is the same bound).
MAX_QUERY_TOKENS = 16

# softmax_scale is traced as this sentinel, so the pattern takes every scale.
SCALE_SENTINEL = 2.0**-19


def transformers_index_scores(q, k, weights, softmax_scale):
    scores = torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * softmax_scale
    scores = F.relu(scores)
    return torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)


_aten = torch.ops.aten
_VIEWS = (_aten.reshape.default, _aten.view.default, _aten.expand.default, _aten.unsqueeze.default, _aten.squeeze.dim)


def _batch_one_bmm(node: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node, torch.fx.Node] | None:
    """(mm, a, b) where ``node`` is unsqueeze(mm(squeeze(a, 0), squeeze(b, 0)), 0): bmm(a, b) of
    batch 1 as Inductor's joint-graph pass (bmm_to_mm) leaves it on a GPU."""
    if node.op != "call_function" or node.target is not _aten.unsqueeze.default or node.args[1] != 0:
        return None
    mm = node.args[0]
    if not isinstance(mm, torch.fx.Node) or mm.target is not _aten.mm.default:
        return None
    operands = []
    for x in mm.args[:2]:
        if not isinstance(x, torch.fx.Node) or x.target is not _aten.squeeze.dim or x.args[1] != 0:
            return None
        operands.append(x.args[0])
    return mm, operands[0], operands[1]


def _relu_within(node: torch.fx.Node, hops: int, down: bool) -> bool:
    """A relu within ``hops`` views (and multiplications, the scale) below (``down``) or above node."""
    for _ in range(hops):
        if node.target is _aten.relu.default:
            return True
        if down:
            if len(node.users) != 1:
                return False
            node = next(iter(node.users))
        else:
            if node.target not in _VIEWS or not isinstance(node.args[0], torch.fx.Node):
                return False
            node = node.args[0]
        if node.target not in (*_VIEWS, _aten.mul.Tensor, _aten.relu.default):
            return False
    return node.target is _aten.relu.default


def undo_batch_one_mm(graph: torch.fx.Graph) -> int:
    """Turn the indexer's batch-1 mm forms (the one into the relu, the one reading it) back into
    bmm: the same math and the same extern GEMM, in the form the spelling traces to. Returns how
    many it turned."""
    count = 0
    for node in list(graph.nodes):
        found = _batch_one_bmm(node)
        if found is None:
            continue
        mm, a, b = found
        if not (_relu_within(node, 4, down=True) or _relu_within(b, 4, down=False)):
            continue
        with graph.inserting_before(node):
            bmm = graph.call_function(_aten.bmm.default, (a, b))
        bmm.meta = dict(node.meta)  # [1, M, N] contiguous, as the unsqueeze of mm's output
        node.replace_all_uses_with(bmm)
        for dead in dict.fromkeys((node, mm, *mm.args[:2])):  # a squeeze may feed both operands
            if not dead.users:
                graph.erase_node(dead)
        count += 1
    return count


def _fused(q, k, weights, softmax_scale):
    # every argument written out: the folds below match the op's node by its arguments
    return torch.ops.fusion_passes.sparse_index_scores(q, k, weights, softmax_scale, 1.0, None)


def _check_args(values: dict[str, Any]) -> str | None:
    try:
        check_sparse_index_scores_args(values["q"], values["k"], values["weights"], values.get("keep"))
    except ValueError as e:
        return str(e).removeprefix("sparse_index_scores: ")
    return None


def _check(values: dict[str, Any]) -> str | None:
    q = values["q"]
    if q.dim() == 4 and q.shape[1] > MAX_QUERY_TOKENS:
        return NotASite(f"{q.shape[1]} query tokens: a prefill's scores (sparse_index_scores_prefill)")
    return _check_args(values)


def _examples():
    # A decode step (1 token) and a few tokens: matmul's broadcast traces apart for S = 1.
    # Heads, dims and positions of distinct sizes; bf16 q and k (a bf16 model's) and fp32.
    for s in (1, 3):
        for dtype in (torch.bfloat16, torch.float32):
            yield (torch.randn(2, s, 4, 16, dtype=dtype), torch.randn(2, 24, 16, dtype=dtype),
                   torch.randn(2, s, 4), SCALE_SENTINEL)  # fmt: skip


SPARSE_INDEX_SCORES = Fusion(
    name="sparse_index_scores",
    summary="DeepSeek V3.2 indexer scores (two matmuls, scale, relu) at decode -> one kernel, no copy of the key cache",
    doc=__doc__.split("\n\n", 1)[1],
    spellings=(
        Spelling("transformers_index_scores", transformers_index_scores, _fused),
    ),
    example_inputs=_examples,
    scalars={"softmax_scale": SCALE_SENTINEL},
    check=_check,
    canonicalize=undo_batch_one_mm,
    # Its patterns are traced (4 examples) only for graphs holding a relu: few LLMs' do.
    applies_to=lambda graph: bool(graph.find_nodes(op="call_function", target=torch.ops.aten.relu.default)),
    builtin=True,
)


def _check_prefill(values: dict[str, Any]) -> str | None:
    q = values["q"]
    if q.dim() == 4 and q.shape[1] <= MAX_QUERY_TOKENS:
        return NotASite(f"{q.shape[1]} query tokens: a decode step's scores (sparse_index_scores)")
    return _check_args(values)


def _prefill_examples():
    # Several tokens trace as a prefill's. Batch 1 apart: there matmul views the keys' broadcast
    # over the tokens as a batch (stride 0), where a batch of sequences copies it (a clone).
    for batch in (1, 2):
        for dtype in (torch.bfloat16, torch.float32):
            yield (torch.randn(batch, 3, 4, 16, dtype=dtype), torch.randn(batch, 24, 16, dtype=dtype),
                   torch.randn(batch, 3, 4), SCALE_SENTINEL)  # fmt: skip


SPARSE_INDEX_SCORES_PREFILL = Fusion(
    name="sparse_index_scores_prefill",
    summary="DeepSeek V3.2 indexer scores (two matmuls, scale, relu) at prefill -> one tiled kernel, no [B, S, H, T] "
    "fp32 scores",
    doc=(
        "sparse_index_scores' spelling above MAX_QUERY_TOKENS query tokens (a prefill). Unfused: the fp32 GEMM of "
        "every query head against the upcast key cache writes [B, S, H, T] fp32 scores (4.3 GB at DeepSeek V3.2's "
        "64 indexer heads and a 4096-token prompt), an elementwise kernel scales and relus them (2041 us per layer "
        "on one H200) and a batched GEMM reads them back over the heads. Fused: the same op, whose launcher takes "
        "the tiled kernel at these sizes (lowering/sparse_index_scores: a program per 64 tokens x 128 positions "
        "walks the heads with its key tile loaded once; bf16 q and k dotted as they are, exact products, fp32 sums): "
        "10544 -> 720 us at 4096 tokens in a CUDA graph on one H200 (14.6x), the 4096-token prefill 2.0x."
    ),
    spellings=(Spelling("transformers_index_scores", transformers_index_scores, _fused),),
    example_inputs=_prefill_examples,
    scalars={"softmax_scale": SCALE_SENTINEL},
    check=_check_prefill,
    applies_to=lambda graph: bool(graph.find_nodes(op="call_function", target=torch.ops.aten.relu.default)),
    builtin=True,
)

# The weights' scale is traced as this sentinel (a pattern argument: every H^-1/2 matches).
WEIGHTS_SCALE_SENTINEL = 2.0**-17
# The folds into the op (below) take both scales as pattern arguments, and apply where the op is.
_FOLD_SCALARS = {"softmax_scale": SCALE_SENTINEL, "weights_scale": WEIGHTS_SCALE_SENTINEL}


def _holds_the_op(graph: torch.fx.Graph) -> bool:
    return bool(graph.find_nodes(op="call_function", target=torch.ops.fusion_passes.sparse_index_scores.default))


def scaled_weights_scores(q, k, weights, softmax_scale, weights_scale):
    """The op on transformers' weights: weights_proj's output upcast and scaled before the op."""
    return torch.ops.fusion_passes.sparse_index_scores(q, k, weights.float() * weights_scale, softmax_scale, 1.0, None)


def _weights_folded(q, k, weights, softmax_scale, weights_scale):
    return torch.ops.fusion_passes.sparse_index_scores(q, k, weights, softmax_scale, weights_scale, None)


def _weights_examples():
    # weights_proj's bf16 output (upcast and scaled), and fp32 weights (scaled only: .float() is none)
    for dtype in (torch.bfloat16, torch.float32):
        yield (torch.randn(2, 1, 4, 16, dtype=torch.bfloat16), torch.randn(2, 24, 16, dtype=torch.bfloat16),
               torch.randn(2, 1, 4, dtype=dtype), SCALE_SENTINEL, WEIGHTS_SCALE_SENTINEL)  # fmt: skip


def _check_weights(values: dict[str, Any]) -> str | None:
    if not isinstance(values["weights_scale"], (int, float)):
        return "weights scaled by a tensor, not a number: the op takes a scalar weights_scale"
    return _check_args(values)


SPARSE_INDEX_SCORES_WEIGHTS = Fusion(
    name="sparse_index_scores_weights",
    summary="DeepSeek V3.2 indexer weights' upcast and H^-1/2 scale -> the scores kernel's loads",
    doc=(
        "transformers computes the indexer's per-head weights as weights_proj(x).float() * n_heads ** -0.5 and "
        "hands the fp32 product to the scores. Unfused: an elementwise kernel between weights_proj's GEMM and the "
        "scores kernel (0.8 us per layer in a DeepSeek V3.2 decode step on one H200). Fused: "
        "sparse_index_scores(q, k, weights, scale, weights_scale) loads the GEMM's output as it is and multiplies "
        "in fp32 as the model does: the same products, bit for bit. Runs on sparse_index_scores' op (decode and "
        "prefill)."
    ),
    spellings=(Spelling("scaled_weights_scores", scaled_weights_scores, _weights_folded),),
    example_inputs=_weights_examples,
    scalars=_FOLD_SCALARS,
    check=_check_weights,
    requires=("sparse_index_scores",),
    applies_to=_holds_the_op,
    builtin=True,
)


def masked_scores(q, k, weights, keep, softmax_scale, weights_scale):
    """transformers' DeepseekV32Indexer: index_scores.masked_fill(~attention_mask, -inf) before the top-k."""
    scores = torch.ops.fusion_passes.sparse_index_scores(q, k, weights, softmax_scale, weights_scale, None)
    # masked_fill(~keep, -inf), in the form Inductor's constant folding leaves it (its
    # scalar_tensor(-inf) becomes full([], -inf) before the post-grad passes)
    minus_inf = torch.full([], float("-inf"), dtype=scores.dtype, device=scores.device)
    return torch.where(~keep, minus_inf, scores)


def _keep_folded(q, k, weights, keep, softmax_scale, weights_scale):
    return torch.ops.fusion_passes.sparse_index_scores(q, k, weights, softmax_scale, weights_scale, keep)


def _keep_examples():
    # (the scalars last: the matcher fills in the pattern's scalar arguments itself)
    # the mask as sdpa_mask gives it at decode (broadcast over the batch) and a full one; bf16 / fp32 weights
    keep = torch.rand(1, 2, 24) > 0.3
    for mask in (keep.expand(2, 2, 24), keep.repeat(2, 1, 1)):
        for dtype in (torch.bfloat16, torch.float32):
            yield (torch.randn(2, 2, 4, 16, dtype=torch.bfloat16), torch.randn(2, 24, 16, dtype=torch.bfloat16),
                   torch.randn(2, 2, 4, dtype=dtype), mask, SCALE_SENTINEL, WEIGHTS_SCALE_SENTINEL)  # fmt: skip


SPARSE_INDEX_SCORES_KEEP = Fusion(
    name="sparse_index_scores_keep",
    summary="DeepSeek V3.2 indexer scores' attention mask (masked_fill -inf before the top-k) -> the scores kernel's store",
    doc=(
        "transformers masks the index scores by the attention mask before its top-k: "
        "index_scores.masked_fill(~attention_mask, -inf). Unfused: an elementwise kernel reading the mask and the "
        "fp32 scores and writing them again (1.1 us per layer in a DeepSeek V3.2 decode step at 8192 cached tokens "
        "on one H200). Fused: sparse_index_scores(..., keep) stores -inf where the mask is False as it writes the "
        "scores: bit-equal. Runs on sparse_index_scores' op (decode and prefill), after sparse_index_scores_weights. "
        "Opt-in: the mask it reads is then materialized per layer by Inductor, a kernel as cheap as the one it saves."
    ),
    spellings=(Spelling("masked_scores", masked_scores, _keep_folded),),
    example_inputs=_keep_examples,
    scalars=_FOLD_SCALARS,
    check=_check_args,
    requires=("sparse_index_scores",),
    opt_in="measured no faster: in a DeepSeek V3.2 decode step on one H200 Inductor then writes the mask the op reads "
    "in a kernel of its own each layer (0.96 us), in place of the masked_fill's (1.09 us); 22 other kernels a layer "
    "either way with sparse_index_scores_weights",
    applies_to=_holds_the_op,
    builtin=True,
)

def causal_masked_scores(q, k, weights, first, softmax_scale, weights_scale):
    """The scores masked by the causal mask as transformers builds it at decode (patterns/causal_masks.py),
    which the indexer reads at [:, 0], then the indexer's masked_fill(~mask, -inf)."""
    scores = torch.ops.fusion_passes.sparse_index_scores(q, k, weights, softmax_scale, weights_scale, None)
    b, s, t = scores.shape
    keep = sdpa_decode_causal_mask(b, s, t, first, scores.device).select(1, 0)
    minus_inf = torch.full([], float("-inf"), dtype=scores.dtype, device=scores.device)
    return torch.where(~keep, minus_inf, scores)


def _causal_folded(q, k, weights, first, softmax_scale, weights_scale):
    return torch.ops.fusion_passes.sparse_index_scores(q, k, weights, softmax_scale, weights_scale, None, first)


def _causal_examples():
    # a decode step (1 token) and 2 tokens, from a 0-d first position as the step reads it off
    # cache_position; bf16 / fp32 weights (the scalars last, as for the keep fold)
    for s in (1, 2):
        for dtype in (torch.bfloat16, torch.float32):
            yield (torch.randn(2, s, 4, 16, dtype=torch.bfloat16), torch.randn(2, 24, 16, dtype=torch.bfloat16),
                   torch.randn(2, s, 4, dtype=dtype), torch.tensor(20), SCALE_SENTINEL, WEIGHTS_SCALE_SENTINEL)  # fmt: skip


def _check_causal(values: dict[str, Any]) -> str | None:
    first = values["first"]
    if not isinstance(first, torch.Tensor) or first.numel() != 1 or first.dtype not in (torch.int64, torch.int32):
        return f"the first position is not one int tensor: {getattr(first, 'shape', first)}"
    return _check_args(values)


def causal_mask_check(match) -> str | None:
    """The literals the matcher skipped on this spelling (its expand node is shared), checked on the matched nodes."""
    return causal_mask_refusal(match, head_selected=True)


SPARSE_INDEX_SCORES_CAUSAL = Fusion(
    name="sparse_index_scores_causal",
    summary="DeepSeek V3.2 indexer scores' causal mask (built from the cache position) -> computed in the scores kernel",
    doc=(
        "At decode the indexer masks its scores by the causal mask transformers builds from the cache position "
        "(arange(T) <= first + arange(S), broadcast over the batch): index_scores.masked_fill(~mask, -inf). "
        "Unfused: an elementwise kernel building the mask and rewriting the fp32 scores (0.96 us per layer in a "
        "DeepSeek V3.2 decode step on one H200). Fused: sparse_index_scores(..., causal_first=first) stores -inf "
        "past each token's position itself, reading only the first position (a view of the step's input): "
        "bit-equal, and no mask for Inductor to materialize (which sparse_index_scores_keep left)."
    ),
    spellings=(Spelling("sdpa_causal_mask", causal_masked_scores, _causal_folded),),
    example_inputs=_causal_examples,
    scalars=_FOLD_SCALARS,
    check=_check_causal,
    match_check=causal_mask_check,
    shared_nodes=(torch.ops.aten.expand.default,),
    requires=("sparse_index_scores",),
    applies_to=_holds_the_op,
    builtin=True,
)

# The causal fold before the keep fold: both take the masked_fill; the causal one leaves no mask.
FUSIONS = (SPARSE_INDEX_SCORES, SPARSE_INDEX_SCORES_PREFILL, SPARSE_INDEX_SCORES_WEIGHTS, SPARSE_INDEX_SCORES_CAUSAL,
           SPARSE_INDEX_SCORES_KEEP)  # fmt: skip
