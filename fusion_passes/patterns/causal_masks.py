"""The causal mask of a decode step as transformers builds it, for the fusions that compute it
from the first position instead of reading it (sparse_index_scores_causal, sparse_attention_mask_causal).

masking_utils' sdpa_mask over a full static cache (kv offset 0), query token i at cache position
first + i seeing the positions up to it:

    kv_idx = arange(T) + 0;  q_idx = arange(S) + first
    mask   = (kv_idx[None, None, None, :] <= q_idx[None, None, :, None]).expand(B, -1, S, T)

The mask's expand is read by every layer (the attention, and the DSA indexer through [:, 0]), so
the spellings holding it match whatever its users (``Fusion.shared_nodes``). Such patterns skip
the matcher's re-trace on the candidate's values: ``causal_mask_refusal`` checks the literals that
decide the mask on the matched nodes.
"""

from __future__ import annotations

import torch


def sdpa_decode_causal_mask(batch, s, t, first, device) -> torch.Tensor:
    """bool [B, 1, S, T] as sdpa_mask builds it from the cache position (module docstring)."""
    kv_idx = torch.arange(t, device=device) + 0  # kv_arange + kv_offset (0: a full cache)
    q_idx = torch.arange(s, device=device) + first  # the cache positions of the step's tokens
    mask = kv_idx.unsqueeze(0).unsqueeze(1).unsqueeze(2) <= q_idx.unsqueeze(0).unsqueeze(1).unsqueeze(3)
    return mask.expand(batch, -1, s, t)


def _arange_plus(node, offset) -> bool:
    """node is iota(n, start=0, step=1) + offset (an int, or the node it must be)."""
    if not (isinstance(node, torch.fx.Node) and node.target is torch.ops.aten.add.Tensor):
        return False
    iota, added = node.args[0], node.args[1]
    return (isinstance(iota, torch.fx.Node) and iota.target is torch.ops.prims.iota.default
            and iota.kwargs.get("start") == 0 and iota.kwargs.get("step") == 1 and added == offset)  # fmt: skip


def _unsqueezed(node, dims):
    """The node under unsqueezes by ``dims`` (innermost first), or None where they differ."""
    for dim in reversed(dims):
        if not (isinstance(node, torch.fx.Node) and node.target is torch.ops.aten.unsqueeze.default and node.args[1] == dim):
            return None
        node = node.args[0]
    return node


def causal_mask_refusal(match, head_selected: bool) -> str | None:
    """Why the matched mask is not the decode step's causal one (None: it is): positions from 0
    (no cache offset) on the kv axis, the tokens' from the matched ``first`` on the query axis,
    expanded over [B, 1, S, T] (``head_selected``: then read at [:, 0], as the DSA indexer does)."""
    le = next((n for n in match.nodes if n.target is torch.ops.aten.le.Tensor), None)
    expand = next((n for n in match.nodes if n.target is torch.ops.aten.expand.default), None)
    if le is None or expand is None or expand.args[0] is not le:
        return "not a causal mask expanded over [B, 1, S, T]"
    if head_selected:
        select = next((n for n in match.nodes if n.target is torch.ops.aten.select.int), None)
        if select is None or tuple(select.args[1:]) != (1, 0):
            return "not the causal mask's [:, 0] of the expanded [B, 1, S, T] mask"
    kv, q = _unsqueezed(le.args[0], (0, 1, 2)), _unsqueezed(le.args[1], (0, 1, 3))
    if not _arange_plus(kv, 0):
        return "the mask's kv positions are not arange(T) (a cache offset, or another axis)"
    if not _arange_plus(q, match.kwargs.get("first")):
        return "the mask's query positions are not arange(S) + the first position"
    return None
