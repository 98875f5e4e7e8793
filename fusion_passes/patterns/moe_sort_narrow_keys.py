"""A prefill's sort of MoE expert ids on 16-bit keys: the radix sort's passes cut from 8 to 2.

transformers' grouped_mm experts sort the flat expert ids (``torch.sort(expert_ids)``, int64: the
router's top-k indices). At decode moe_sort_by_expert takes the sort; a prefill's (more pairs than
its launch table's limit: 32768 at 4096 tokens x top-8) is left to Inductor, which calls torch's
sort: a CUB radix sort over all 64 bits of the keys, 8 passes of 8 bits (51.6 us per MoE layer at
a 4096-token MiniMax-M2 prefill on one H200, beside ~10 memsets and histogram kernels).

Unfused: sorted_ids, perm = sort(expert_ids)                                  (int64 keys)
Fused:   keys, perm = sort(expert_ids.to(int16), stable=True);  sorted_ids = keys.to(int64)
         the same radix sort over 16-bit keys: 2 passes

Exact where every id fits 16 bits, which the graph proves: the ids are a top-k's indices over at
most 32767 experts (transformers' router, or moe_route's ids), through views. The stable order is
one the model's unstable sort may return (moe_sort_by_expert's reference says why the layer does
not depend on it). Not a site: a sort moe_sort_by_expert takes (at decode), ids of unknown
provenance (an expert-parallel remap with sentinels: their values are not bounded by the graph),
a descending sort, a sort over another dim than the only one.
"""

from __future__ import annotations

import operator

import torch
import torch.fx
from torch._guards import detect_fake_mode

from fusion_passes.fusion import Fusion, Rewritten
from fusion_passes.regions import nodes_region
from fusion_passes.report import module_path, source_location

_aten = torch.ops.aten
_VIEWS = (_aten.view.default, _aten.reshape.default, _aten._unsafe_view.default, _aten.clone.default)
KEY_DTYPE = torch.int16
MAX_EXPERTS = torch.iinfo(KEY_DTYPE).max  # ids 0 .. 32766 fit the keys


def _router_ids_bound(ids: torch.fx.Node) -> int | None:
    """The number of experts the ids are a top-k's indices over (so each id is below it), or None."""
    while isinstance(ids, torch.fx.Node) and ids.target in _VIEWS:
        ids = ids.args[0]
    if not (isinstance(ids, torch.fx.Node) and ids.target is operator.getitem and ids.args[1] == 1):
        return None
    source = ids.args[0]
    if source.target is _aten.topk.default:
        scores = source.args[0].meta.get("val")
        dim = source.args[2] if len(source.args) > 2 else source.kwargs.get("dim", -1)
        return scores.shape[dim] if isinstance(scores, torch.Tensor) else None
    route_ops = [getattr(torch.ops.fusion_passes, name).default for name in ("moe_route", "moe_route_grouped")]
    if source.target in route_ops:  # (weights, ids) of logits [T, E]
        logits = source.args[0].meta.get("val")
        return logits.shape[1] if isinstance(logits, torch.Tensor) else None
    return None


def _sort_site(sort: torch.fx.Node) -> torch.fx.Node | None:
    """The ids of an ascending sort of 1-D int64 router ids that moe_sort_by_expert left, or None."""
    from fusion_passes.lowering.launch_tables import moe_sort_refusal

    ids = sort.args[0]
    val = ids.meta.get("val") if isinstance(ids, torch.fx.Node) else None
    if not (isinstance(val, torch.Tensor) and val.dim() == 1 and val.dtype == torch.int64):
        return None
    if sort.target is _aten.sort.default:
        dim, descending = (list(sort.args[1:]) + [-1, False][len(sort.args) - 1 :])[:2]
        dim, descending = sort.kwargs.get("dim", dim), sort.kwargs.get("descending", descending)
    else:  # aten.sort.stable(self, *, stable, dim, descending)
        dim, descending = sort.kwargs.get("dim", -1), sort.kwargs.get("descending", False)
    if descending or dim not in (0, -1) or moe_sort_refusal(val) is None:
        return None  # descending, or a sort moe_sort_by_expert takes
    bound = _router_ids_bound(ids)
    return ids if isinstance(bound, int) and bound <= MAX_EXPERTS else None


def narrow_sort_keys(graph: torch.fx.Graph) -> list[Rewritten]:
    """The rewrite (module docstring)."""
    done = []
    sorts = [*graph.find_nodes(op="call_function", target=_aten.sort.default),
             *graph.find_nodes(op="call_function", target=_aten.sort.stable)]  # fmt: skip
    for sort in sorts:
        ids = _sort_site(sort)
        if ids is None:
            continue
        before = nodes_region([sort])
        with graph.inserting_before(sort):
            keys = graph.call_function(torch.ops.prims.convert_element_type.default, (ids, KEY_DTYPE))
            narrow = graph.call_function(_aten.sort.stable, (keys,), {"stable": True, "dim": 0, "descending": False})
            sorted_keys = graph.call_function(operator.getitem, (narrow, 0))
            perm = graph.call_function(operator.getitem, (narrow, 1))
            sorted_ids = graph.call_function(torch.ops.prims.convert_element_type.default, (sorted_keys, torch.int64))
            with detect_fake_mode([ids.meta["val"]]):
                keys.meta["val"] = ids.meta["val"].to(KEY_DTYPE)
                narrow.meta["val"] = torch.sort(keys.meta["val"], stable=True)
                sorted_keys.meta["val"], perm.meta["val"] = narrow.meta["val"]
                sorted_ids.meta["val"] = sorted_keys.meta["val"].to(torch.int64)
        for user in list(sort.users):
            assert user.target is operator.getitem
            user.replace_all_uses_with(sorted_ids if user.args[1] == 0 else perm)
            graph.erase_node(user)
        graph.erase_node(sort)
        done.append(Rewritten("router_ids_sort", module_path(ids), source_location(ids), before,
                              nodes_region([keys, narrow, sorted_keys, perm, sorted_ids]), (narrow,)))  # fmt: skip
    return done


MOE_SORT_NARROW_KEYS = Fusion(
    name="moe_sort_narrow_keys",
    summary="a prefill's sort of MoE router ids (left to Inductor) on 16-bit keys: the radix sort's 8 passes -> 2",
    doc=__doc__.split("\n\n", 1)[1],
    spellings=(),
    example_inputs=lambda: (),
    rewrite=narrow_sort_keys,
    opt_in="not yet timed on a GPU: the 64-bit sort it narrows takes 51.6 us per MoE layer at a 4096-token "
    "prefill on one H200 (MiniMax-M2)",
    builtin=True,
)

FUSIONS = (MOE_SORT_NARROW_KEYS,)
