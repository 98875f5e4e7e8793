"""A prompt's causal mask, as transformers builds it from the cache position, computed in the
masked attention kernel instead of read.

A prefill on transformers' StaticCache builds its boolean mask with masking_utils' sdpa_mask over
the whole static cache (patterns/causal_masks.py: ``arange(L) <= first + arange(S)``, expanded over
[B, 1, S, L]); SDPA makes it additive per layer (``where(mask, 0, fill)``, fill -inf, or -65504
where it calls cuDNN, which also pads the rows of an odd cache length and slices them back), and
masked_prefill_attention's op reads that:

Unfused: mask = where(expand(arange(L) <= first + arange(S)), 0, fill)      (per layer, [B, 1, S, L])
         out  = fusion_passes.masked_attention(query, key, value, mask, scale)
         the op's kernels summarize the mask's blocks (a pass over the whole mask: 66 us per layer
         at a 4096-token prompt on 4097 slots, its rows at an odd stride, on one H200), then read
         the diagonal's mixed tiles from an aligned copy
Fused:   out  = fusion_passes.masked_attention_causal(query, key, value, first, scale)
         the attention kernel compares each key's position with the row's (first + i) in the
         diagonal's blocks and opens the blocks below it whole: no mask built, read or summarized

Bit-equal to the masked kernel on the mask it replaces (a closed key adds -inf instead of -65504:
either underflows to exactly 0 once a row's max is subtracted, and every row sees position 0).
The mask reaches the op through a chain of views, slices and SDPA's end pad that varies with the
backend and the cache length, and every layer converts the one expanded mask: a rewrite
(``Fusion.rewrite``) follows the op's mask back to the causal mask and checks each node. Not a
site: one query token (a decode step). Not matched: a cache offset (positions from other than 0
on the kv axis), a padding mask combined with the causal one, DeepSeek V3.2's index mask, a
first position that is not a tensor, a closed key's bias above -65504.
"""

from __future__ import annotations

import torch
import torch.fx

from fusion_passes.fake_values import insert_call
from fusion_passes.fusion import Fusion, Rewritten
from fusion_passes.lowering.masked_attention.triton import CLOSED
from fusion_passes.patterns.causal_masks import _arange_plus, _unsqueezed
from fusion_passes.patterns.gqa_decode_attention import mask_source
from fusion_passes.regions import nodes_region
from fusion_passes.report import module_path, source_location

_aten = torch.ops.aten


def _constant(node) -> float | None:
    """The value of a scalar ``full([], value)`` node, or a Python number, else None."""
    if isinstance(node, (int, float)) and not isinstance(node, bool):
        return float(node)
    if isinstance(node, torch.fx.Node) and node.target is _aten.full.default and list(node.args[0]) == []:
        return float(node.args[1])
    return None


def causal_first(mask: torch.fx.Node, s: int, length: int) -> torch.fx.Node | str:
    """The first position node of a causal mask that ``mask`` (the op's argument) is, as the
    module docstring builds it for S query tokens on L keys; else why it is not one."""
    mask = mask_source(mask)
    if not (isinstance(mask, torch.fx.Node) and mask.target is _aten.where.self):
        return "the mask is not SDPA's where() of a boolean one"
    cond, a, b = mask.args
    if isinstance(cond, torch.fx.Node) and cond.target is _aten.logical_not.default:
        cond, a, b = cond.args[0], b, a  # where(~keep, fill, 0)
    zero, fill = _constant(a), _constant(b)
    if zero != 0.0 or fill is None or not fill <= CLOSED:
        return f"the mask's biases are {zero} / {fill}, not 0 and at most {CLOSED}"
    if not (isinstance(cond, torch.fx.Node) and cond.target is _aten.expand.default):
        return "the boolean mask is not expanded over [B, 1, S, L]"
    le = cond.args[0]
    if not (isinstance(le, torch.fx.Node) and le.target is _aten.le.Tensor):
        return "the boolean mask is not a comparison of positions (kv <= query)"
    kv, q = _unsqueezed(le.args[0], (0, 1, 2)), _unsqueezed(le.args[1], (0, 1, 3))
    if not _arange_plus(kv, 0) or kv.args[0].args[0] != length:
        return f"the mask's kv positions are not arange({length}) (a cache offset, or another axis)"
    first = q.args[1] if isinstance(q, torch.fx.Node) and q.target is _aten.add.Tensor else None
    if not _arange_plus(q, first) or q.args[0].args[0] != s:
        return f"the mask's query positions are not arange({s}) + a first position"
    val = first.meta.get("val") if isinstance(first, torch.fx.Node) else None
    if not (isinstance(val, torch.Tensor) and val.numel() == 1 and val.dtype in (torch.int32, torch.int64)):
        return "the first position is not one int tensor"
    return first


def compute_causal_masks(graph: torch.fx.Graph) -> list[Rewritten]:
    """The rewrite (module docstring): each prefill's masked_attention op through the causal mask."""
    op = torch.ops.fusion_passes.masked_attention.default
    done = []
    for node in list(graph.find_nodes(op="call_function", target=op)):
        query, key, value, mask, scale = node.args
        s, length = query.meta["val"].shape[2], key.meta["val"].shape[2]
        if not isinstance(s, int) or s < 2:
            continue  # a decode step's attention (sparse_decode_attention's), or a symbolic prompt
        first = causal_first(mask, s, length)
        if isinstance(first, str):
            continue
        before = nodes_region([node])
        causal = insert_call(graph, torch.ops.fusion_passes.masked_attention_causal.default,
                             (query, key, value, first, scale), node)  # fmt: skip
        node.replace_all_uses_with(causal)
        graph.erase_node(node)
        done.append(Rewritten("sdpa_causal_mask", module_path(causal), source_location(causal), before,
                              nodes_region([causal]), (causal,)))  # fmt: skip
    if done:  # the masks no op reads now (the expanded one goes with the last layer's)
        graph.eliminate_dead_code()
    return done


MASKED_PREFILL_ATTENTION_CAUSAL = Fusion(
    name="masked_prefill_attention_causal",
    summary="masked_attention through a prompt's causal mask (built from the cache position) -> the mask "
    "compared in the attention kernel, no mask read or summarized",
    doc=__doc__.split("\n\n", 1)[1],
    spellings=(),
    example_inputs=lambda: (),
    rewrite=compute_causal_masks,
    requires=("masked_prefill_attention",),
    opt_in="not yet timed on a GPU: the mask summary it removes takes 66 us per layer at a 4096-token prompt "
    "on one H200 (MiniMax-M2's widths)",
    builtin=True,
)

FUSIONS = (MASKED_PREFILL_ATTENTION_CAUSAL,)
