"""How a decode step's KV cache writes are spelled: the part the cache-write fusions share
(qk_norm_rope_cache, mla_indexer_k_norm_rope_cache, mla_kv_cache_write).

A write goes to slots that are, by ``SLOT_FORMS``:
    "first"                transformers' StaticLayer: ``cache.index_copy_(dim, arange(S) + length, x)``
    "per_token"            a slot per token: ``index_copy_`` at given slots, or ``cache[..., slots] = x``
    "per_token_batch_one"  that indexed store at a batch of one, which torch.compile traces with the
                           value reshaped to drop the batch dim (at other batches the same as
                           "per_token", so the matcher registers it once)
Functionalized, each is an ``index_put`` (Inductor's decomposition of ``index_copy``).
"""

from __future__ import annotations

import torch

SLOT_FORMS = {"first": "from_first_slot", "per_token": "slot_per_token", "per_token_batch_one": "slot_per_token_batch_one"}


def slot_index(positions, tokens: int, device, slots: str):
    """The index the writes of one step share: arange(S) + the first slot for "first" (one node,
    as the model computes it once for all of its writes), else ``positions`` as they are."""
    if slots == "first":
        return torch.arange(tokens, device=device) + positions
    return positions


def cache_write(cache, dim: int, index, value, slots: str):
    """``value`` written into ``cache`` along ``dim`` at ``index`` (from slot_index), as the
    spelling ``slots`` traces it."""
    if slots == "per_token_batch_one" and value.shape[0] == 1:
        return torch.ops.aten.index_put.default(cache, [None] * dim + [index], value.reshape(value.shape[1:]))
    return torch.index_copy(cache, dim, index, value)


def slots_refusal(slots: str, positions) -> str | None:
    """Why a "first" spelling's match is no site: its slots are arange(S) + more than one value."""
    if slots == "first" and positions.numel() != 1:
        return f"the slots are arange(S) + a {tuple(positions.shape)} tensor, not one first slot"
    return None


def valid_slots(cache: str, dim: int):
    """verify=True's input for a write's ``positions`` (Fusion.verify_inputs): slots inside the
    argument ``cache`` along ``dim``, none repeated (random integers would write past the cache, or
    twice to a slot, whose last write no order fixes): a first slot of 0 (room for every token the
    step writes, as the graph's own sizes fit them) or a distinct slot per token."""

    def make(value, values):
        shape = tuple(int(n) for n in value.shape)
        if not shape:
            return torch.zeros((), dtype=value.dtype, device=value.device)
        length = int(values[cache].shape[dim])
        return torch.randperm(length)[: shape[0]].to(value.device, value.dtype)

    return make
