"""How the norm + FP8 kernel is launched: block shape, warps, chunks and weight-first rows, from a
launch table row (``NormQuantLaunch``) chosen per GPU in ``fusion_passes/lowering/launch_tables.py``.

The rules change the launch only, never the math: warps and chunks reorder the row's sum (the same
rounding up to the order of additions), weight-first rows change no bit at all.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton

from fusion_passes.lowering.common.launch_policy import select
from fusion_passes.lowering.common.rows import launch_config


@dataclass(frozen=True)
class NormQuantLaunch:
    """One GPU's launch rules for the norm + FP8 kernel (the evidence: docs/notes/launch-policy.md)."""

    many_tokens: int | None = None  # from this static token count the residual form takes fewer warps
    norm_only_many_tokens: int | None = None  # the same for norm-only rows, which also take chunks
    many_tokens_warps: int = 4  # the warps there
    chunk_min: int = 1024  # a norm-only chunk's least width (8 bf16 a thread at 4 warps)
    chunks_max: int = 16  # a row's most chunks (each chunk is unrolled code)
    weight_first_residual: bool = False  # rows of the residual form depend on the weight's loads
    weight_first_norm_only: bool = False  # likewise norm-only rows from norm_only_many_tokens
    weight_first_norm_only_below: int | None = None  # ... up to this static token count (None: no end)
    evidence: str = ""  # the heading of docs/notes/launch-policy.md that holds the runs


@functools.lru_cache(maxsize=None)
def _policy_named(name: str) -> NormQuantLaunch:
    from fusion_passes.lowering.launch_tables import RMS_NORM_QUANT_FP8

    return select(RMS_NORM_QUANT_FP8, name)


def launch_policy(device: torch.device | str) -> NormQuantLaunch:
    """The launch table row for ``device`` (or a device name): the GPU's, else the default."""
    from fusion_passes.lowering.common.launch_policy import device_name

    return _policy_named(device if isinstance(device, str) else device_name(device))


def _many(tokens: int | None, threshold: int | None) -> bool:
    return tokens is not None and threshold is not None and tokens >= threshold


def norm_only_chunks(n: int, scheme: str, group_size: int, tokens: int | None, policy: NormQuantLaunch) -> int:
    """Chunks the norm-only kernel holds a row of n columns in at a static token count (None:
    dynamic): 1 (one padded block), or from ``norm_only_many_tokens`` N / CHUNK exact chunks of
    CHUNK = N's largest power-of-two factor (7168 = 7 x 1024) of at least ``chunk_min`` columns;
    per_group only where the padded block wastes >= 1/4 of its groups."""
    if not _many(tokens, policy.norm_only_many_tokens):
        return 1
    chunk = n & -n
    if (
        chunk == n
        or chunk < policy.chunk_min
        or n // chunk > policy.chunks_max
        or chunk_problem(n, scheme, group_size, n // chunk)
    ):
        return 1
    groups = n // group_size
    if scheme == "per_group" and 4 * groups > 3 * triton.next_power_of_2(groups):
        return 1
    return n // chunk


def takes_weight_first(residual: bool, scheme: str, chunks: int, tokens: int | None, policy: NormQuantLaunch) -> bool:
    """Whether the kernel's rows depend on the weight's loads (after_weight): with the residual
    (``weight_first_residual``), or norm-only from ``norm_only_many_tokens`` static tokens up to
    ``weight_first_norm_only_below`` (``weight_first_norm_only``) unless a static or per_token row
    is held in chunks."""
    if residual:
        return policy.weight_first_residual
    if not (policy.weight_first_norm_only and _many(tokens, policy.norm_only_many_tokens)):
        return False
    if _many(tokens, policy.weight_first_norm_only_below):
        return False
    return chunks == 1 or scheme == "per_group"


def launch_shape(
    num_groups: int,
    group: int,
    tokens: int | None = None,
    norm_only: bool = False,
    policy: NormQuantLaunch = NormQuantLaunch(),
) -> tuple[int, int, int, int]:
    """(BLOCK_GROUPS, BLOCK_GROUP, ROWS_PER_PROGRAM, num_warps) for rows quantized in num_groups
    groups of group columns, with the residual or without (norm_only): the padded block's
    launch_config, but at most ``many_tokens_warps`` warps at a static token count >=
    ``many_tokens``, or >= ``norm_only_many_tokens`` for norm_only (None: dynamic)."""
    block_groups, block_group = triton.next_power_of_2(num_groups), triton.next_power_of_2(group)
    _, rows, num_warps = launch_config(block_groups * block_group)
    if _many(tokens, policy.norm_only_many_tokens if norm_only else policy.many_tokens):
        num_warps = min(num_warps, policy.many_tokens_warps)
    return block_groups, block_group, rows, num_warps


def chunk_problem(n: int, scheme: str, group_size: int, chunks: int) -> str | None:
    """Why a norm-only row of n columns cannot be held in `chunks` exact chunks (None: it can)."""
    chunk = n // chunks
    if chunk * chunks != n or chunk & (chunk - 1):
        return f"chunks={chunks}: a row of {n} columns splits only into chunks of a power-of-two width"
    if scheme == "per_group" and (chunk % group_size or chunk == group_size):
        return f"chunks={chunks}: a per_group chunk of {chunk} columns must hold >= 2 groups of {group_size}"
    return None


def check_chunks_override(
    n: int, scheme: str, group_size: int, chunks: int, residual: torch.Tensor | None
) -> None:
    """ValueError where a `chunks=` override asks for a split the kernel cannot hold."""
    if residual is not None:
        raise ValueError(f"chunks={chunks}: only a norm-only row (no residual) is held in chunks")
    problem = chunk_problem(n, scheme, group_size, chunks)
    if problem:
        raise ValueError(problem)
