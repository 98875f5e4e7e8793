"""Where a decode step's new tokens go in a KV cache: the one statement of the ``positions``
argument that the cache-writing ops (``*_cache``, ``*_cache_write``) share.

``positions`` holds a slot per token (an engine's slot mapping, transformers' ``cache_position``),
or one value: the first slot, the tokens at consecutive slots from it (transformers' StaticLayer
writes at ``arange(S) + length``, its write counter). With one token both forms are the same.
The kernels read it on the device (no host sync) and write nothing for a slot outside the cache,
where torch's ``index_copy`` raises.
"""

from __future__ import annotations

import torch


def check_positions(op: str, positions: torch.Tensor, tokens: int) -> None:
    """Raise a one-line ValueError unless ``positions`` is ``tokens`` or one int32 / int64 value(s)."""
    if positions.dtype not in (torch.int64, torch.int32) or positions.numel() not in (1, tokens) or positions.dim() > 1:
        raise ValueError(
            f"{op}: positions must be {tokens} or 1 int64 / int32 values (0-d or 1-d), "
            f"got {tuple(positions.shape)} {positions.dtype}"
        )


def cache_slots(positions: torch.Tensor, tokens: int) -> torch.Tensor:
    """The int64 slots of ``tokens`` new tokens (see the module docstring)."""
    positions = positions.reshape(-1).to(torch.int64)
    if positions.numel() == tokens:
        return positions
    return positions + torch.arange(tokens, device=positions.device)


def slots_mode(positions: torch.Tensor, tokens) -> int:
    """The kernels' SLOTS constexpr: 1 for one first slot of several tokens, else 2 (a slot per token)."""
    return 1 if positions.numel() == 1 and tokens != 1 else 2


def check_kv_caches(op: str, k_cache, v_cache, batch: int, heads: int, k_width: int, v_width: int, dtype,
                    positions: torch.Tensor, tokens: int) -> None:  # fmt: skip
    """Raise a one-line ValueError unless k_cache / v_cache are [batch, heads, T, width] of dtype
    with one T (a StaticCache layer's pair), and positions fit ``tokens`` (check_positions)."""
    for what, cache, width in (("k_cache", k_cache, k_width), ("v_cache", v_cache, v_width)):
        if cache.dim() != 4 or tuple(cache.shape[:2]) != (batch, heads) or cache.shape[3] != width or cache.dtype != dtype:
            raise ValueError(f"{op}: {what} [{batch}, {heads}, T, {width}] {dtype} expected, "
                             f"got {tuple(cache.shape)} {cache.dtype}")  # fmt: skip
    if k_cache.shape[2] != v_cache.shape[2]:
        raise ValueError(f"{op}: the caches hold {k_cache.shape[2]} and {v_cache.shape[2]} slots")
    check_positions(op, positions, tokens)
