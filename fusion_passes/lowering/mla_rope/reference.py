"""Plain-torch references of the DeepSeek V3 / V3.2 pre-attention ops: the single statement of
their math, rounding where transformers' eager code rounds.

RoPE, as ``apply_rotary_pos_emb`` / ``apply_rotary_pos_emb_interleave`` compute it: every op in
x.dtype (cos and sin already cast to x.dtype by the rotary embedding), each product and sum rounded:

    interleave=False (rotate_half; cos, sin per element, C = P):
        out[j]     = x[j] * cos[j]         - x[j + P/2] * sin[j]            j < P/2
        out[j+P/2] = x[j + P/2] * cos[j+P/2] + x[j] * sin[j+P/2]
    interleave=True (DeepSeek's even/odd pairs; cos, sin per pair, C = P/2 = cos[..., :P/2] of HF):
        out[j]     = x[2j] * cos[j] - x[2j+1] * sin[j]
        out[j+P/2] = x[2j+1] * cos[j] + x[2j] * sin[j]        (output de-interleaved, as HF's)

The ops (their arguments are canonical: cos and sin are [*lead, C], one row per token):

    mla_kv_norm_rope(kv[*lead, R+P], w[R], cos, sin, eps, weight_offset, cast_before_weight,
                     interleave) -> (rms_norm(kv[..., :R], w), rope(kv[..., R:]))
        kv_a_proj_with_mqa's output: the compressed latent normalised (kv_a_layernorm) and k_pe
        rotated, both from one read of the row.
    mla_q_rope(q[*lead, H, D], cos, sin, rope_first, interleave, heads_first) -> [.., D]
        q with RoPE on its rope slice (the last P dims: MLA's q_pe; the first P: the V3.2 indexer's
        q) and the other slice passed through: the split + RoPE + cat, written once, transposed
        to [B, H, S, D] (heads_first, the layout MLA's attention reads) or kept [B, S, H, D].
    mla_indexer_k_norm_rope(k[*lead, D], w[D], b[D], cos, sin, eps, interleave) -> [*lead, D]
        the V3.2 indexer key: LayerNorm (rounded to k.dtype), then RoPE on its first P dims.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fusion_passes.lowering.common.cache_slots import cache_slots, check_kv_caches, check_positions
from fusion_passes.lowering.rms_norm.reference import SUPPORTED_DTYPES, rms_norm_reference


def rope_dim(cos: torch.Tensor, interleave: bool) -> int:
    """The rotated width P: cos holds one value per element (P) or per even/odd pair (P / 2)."""
    return cos.shape[-1] * 2 if interleave else cos.shape[-1]


def check_rope_args(
    name: str, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lead: tuple, interleave: bool
) -> int:
    """Raise ValueError (one line) unless cos/sin fit x; returns P."""
    if x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{name}: x must be float32/bfloat16/float16, got {x.dtype}")
    if cos.shape != sin.shape:
        raise ValueError(f"{name}: cos {tuple(cos.shape)} and sin {tuple(sin.shape)} differ")
    if cos.dtype != x.dtype or sin.dtype != x.dtype:
        # HF casts cos/sin to x.dtype; another dtype would promote the products: another op.
        raise ValueError(f"{name}: cos/sin must be {x.dtype}, got {cos.dtype}/{sin.dtype}")
    if cos.dim() != len(lead) + 1:
        raise ValueError(f"{name}: cos must have {len(lead) + 1} dims, got {cos.dim()}")
    for c, n in zip(cos.shape[:-1], lead):
        if c not in (1, n):
            raise ValueError(f"{name}: cos {tuple(cos.shape)} does not broadcast to {tuple(lead)}")
    p = rope_dim(cos, interleave)
    if p % 2 or p == 0:
        raise ValueError(f"{name}: the rotary dim must be even and positive, got {p}")
    return p


def check_mla_kv_args(kv, weight, cos, sin, interleave) -> int:
    """Raise ValueError for inputs mla_kv_norm_rope does not define; returns R."""
    p = check_rope_args("mla_kv_norm_rope", kv, cos, sin, tuple(kv.shape[:-1]), interleave)
    r = kv.shape[-1] - p
    if r <= 0 or weight.dim() != 1 or weight.shape[0] != r:
        raise ValueError(
            f"mla_kv_norm_rope: weight must have shape ({r},) = kv width {kv.shape[-1]} - rope {p},"
            f" got {tuple(weight.shape)}"
        )
    return r


def check_mla_q_args(q, cos, sin, interleave) -> int:
    """Raise ValueError for inputs mla_q_rope does not define; returns P."""
    if q.dim() < 3:
        raise ValueError(f"mla_q_rope: q must be [*lead, heads, head_dim], got {tuple(q.shape)}")
    p = check_rope_args("mla_q_rope", q, cos, sin, tuple(q.shape[:-2]), interleave)
    if p > q.shape[-1]:
        raise ValueError(f"mla_q_rope: rope dim {p} exceeds head dim {q.shape[-1]}")
    return p


def check_mla_q_kv_pair(q, kv) -> None:
    """Raise ValueError unless q [*lead, H, D] and kv [*lead, R + P] are of the same tokens and
    dtype (the two branches of mla_q_kv_rope share cos and sin)."""
    if q.dim() < 3 or tuple(q.shape[:-2]) != tuple(kv.shape[:-1]) or q.dtype != kv.dtype:
        raise ValueError(
            f"mla_q_kv_rope: q {tuple(q.shape)} {q.dtype} and kv {tuple(kv.shape)} {kv.dtype} "
            "must be of the same tokens and dtype"
        )


def check_mla_q_kv_args(q, kv, weight, cos, sin, interleave) -> int:
    """Raise ValueError for inputs mla_q_kv_rope does not define (those of its two branches, and
    check_mla_q_kv_pair's); returns R."""
    check_mla_q_kv_pair(q, kv)
    r = check_mla_kv_args(kv, weight, cos, sin, interleave)
    check_mla_q_args(q, cos, sin, interleave)
    return r


def check_indexer_k_args(k, weight, bias, cos, sin, interleave) -> int:
    """Raise ValueError for inputs mla_indexer_k_norm_rope does not define; returns P."""
    p = check_rope_args("mla_indexer_k_norm_rope", k, cos, sin, tuple(k.shape[:-1]), interleave)
    d = k.shape[-1]
    if p > d:
        raise ValueError(f"mla_indexer_k_norm_rope: rope dim {p} exceeds head dim {d}")
    for what, t in (("weight", weight), ("bias", bias)):
        if t.shape != (d,) or t.dtype != k.dtype:
            raise ValueError(
                f"mla_indexer_k_norm_rope: {what} must be ({d},) {k.dtype}, "
                f"got {tuple(t.shape)} {t.dtype}"
            )
    return p


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool):
    """RoPE over x's last dim, in x.dtype (see the module docstring); cos/sin broadcast to x."""
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos) + (rotated * sin)


def mla_kv_norm_rope_reference(
    kv: torch.Tensor,
    weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    weight_offset: float = 0.0,
    cast_before_weight: bool = True,
    interleave: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(kv[..., :R], weight), rope(kv[..., R:])), R = kv width - P."""
    r = check_mla_kv_args(kv, weight, cos, sin, interleave)
    normed = rms_norm_reference(kv[..., :r], weight, eps, weight_offset, cast_before_weight)
    return normed, rope_reference(kv[..., r:], cos, sin, interleave)


def mla_q_rope_reference(
    q: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    rope_first: bool = False,
    interleave: bool = True,
    heads_first: bool = True,
) -> torch.Tensor:
    """cat(pass, rope(q_rope)) (or cat(rope(q_rope), pass) when rope_first) over each head,
    transposed to [..., H, S, D] when heads_first."""
    p = check_mla_q_args(q, cos, sin, interleave)
    d = q.shape[-1]
    c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)  # one row per token, shared by the heads
    if rope_first:
        out = torch.cat([rope_reference(q[..., :p], c, s, interleave), q[..., p:]], dim=-1)
    else:
        out = torch.cat([q[..., : d - p], rope_reference(q[..., d - p :], c, s, interleave)], dim=-1)
    return out.transpose(-3, -2) if heads_first else out


def mla_q_kv_rope_reference(
    q: torch.Tensor,
    kv: torch.Tensor,
    weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    weight_offset: float = 0.0,
    cast_before_weight: bool = True,
    interleave: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(query, normed, k_pe): MLA's two branches side by side, sharing cos and sin; query is
    mla_q_rope_reference in MLA's form (rope last, heads first), (normed, k_pe) are
    mla_kv_norm_rope_reference's."""
    check_mla_q_kv_pair(q, kv)  # each branch checks its own arguments
    query = mla_q_rope_reference(q, cos, sin, False, interleave, True)
    normed, k_pe = mla_kv_norm_rope_reference(
        kv, weight, cos, sin, eps, weight_offset, cast_before_weight, interleave
    )
    return query, normed, k_pe


def mla_indexer_k_norm_rope_reference(
    k: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    interleave: bool = False,
) -> torch.Tensor:
    """cat(rope(y[..., :P]), y[..., P:]) with y = layer_norm(k, weight, bias, eps) in k.dtype."""
    p = check_indexer_k_args(k, weight, bias, cos, sin, interleave)
    y = F.layer_norm(k, (k.shape[-1],), weight, bias, eps)
    return torch.cat([rope_reference(y[..., :p], cos, sin, interleave), y[..., p:]], dim=-1)


def check_indexer_k_cache_args(k, weight, bias, cos, sin, cache, positions, interleave) -> int:
    """Raise ValueError for inputs mla_indexer_k_norm_rope_cache does not define; returns P."""
    p = check_indexer_k_args(k, weight, bias, cos, sin, interleave)
    if k.dim() != 3:
        raise ValueError(f"mla_indexer_k_norm_rope_cache: k [B, S, D] expected, got {tuple(k.shape)}")
    b, s, d = k.shape
    if cache.dim() != 3 or cache.shape[0] != b or cache.shape[2] != d or cache.dtype != k.dtype:
        raise ValueError(
            f"mla_indexer_k_norm_rope_cache: cache [{b}, T, {d}] {k.dtype} expected, "
            f"got {tuple(cache.shape)} {cache.dtype}"
        )
    check_positions("mla_indexer_k_norm_rope_cache", positions, s)
    return p


def mla_indexer_k_norm_rope_cache_reference(
    k: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cache: torch.Tensor,
    positions: torch.Tensor,
    eps: float,
    interleave: bool = False,
) -> torch.Tensor:
    """The indexer key cache [B, T, D] with mla_indexer_k_norm_rope(k, ...) [B, S, D] written at
    the slots ``cache_slots(positions, S)`` of dim 1 (transformers' DeepseekV32 cache layer:
    ``indexer_keys.index_copy_(1, arange(S) + length, key)``), as a new tensor."""
    check_indexer_k_cache_args(k, weight, bias, cos, sin, cache, positions, interleave)
    key = mla_indexer_k_norm_rope_reference(k, weight, bias, cos, sin, eps, interleave)
    return cache.index_copy(1, cache_slots(positions, k.shape[1]), key)


def check_mla_kv_cache_write_args(k_nope, k_pe, value, k_cache, v_cache, positions) -> None:
    """Raise ValueError for inputs mla_kv_cache_write does not define."""
    name = "mla_kv_cache_write"
    if k_nope.dim() != 4 or value.dim() != 4 or k_pe.dim() != 4:
        raise ValueError(f"{name}: k_nope, value [B, H, S, *] and k_pe [B, 1, S, R] expected, got "
                         f"{tuple(k_nope.shape)}, {tuple(value.shape)}, {tuple(k_pe.shape)}")  # fmt: skip
    b, h, s, nope = k_nope.shape
    r, v = k_pe.shape[-1], value.shape[-1]
    if tuple(value.shape[:3]) != (b, h, s) or tuple(k_pe.shape[:3]) not in ((b, 1, s), (b, h, s)):
        raise ValueError(f"{name}: value {tuple(value.shape)} and k_pe {tuple(k_pe.shape)} do not go with "
                         f"k_nope {tuple(k_nope.shape)}")  # fmt: skip
    for what, t in (("k_pe", k_pe), ("value", value)):
        if t.dtype != k_nope.dtype:
            raise ValueError(f"{name}: {what} is {t.dtype}, k_nope {k_nope.dtype}: one dtype expected")
    check_kv_caches(name, k_cache, v_cache, b, h, nope + r, v, k_nope.dtype, positions, s)


def mla_kv_cache_write_reference(
    k_nope: torch.Tensor,
    k_pe: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    positions: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(k_cache, v_cache) [B, H, T, *] with key = cat(k_nope, k_pe over every head) and value
    [B, H, S, *] written at the slots ``cache_slots(positions, S)`` of dim 2, as new tensors
    (transformers' DeepSeek V3.2 attention: expand_kv's key, then the StaticLayer's index_copy_)."""
    check_mla_kv_cache_write_args(k_nope, k_pe, value, k_cache, v_cache, positions)
    key = torch.cat([k_nope, k_pe.expand(-1, k_nope.shape[1], -1, -1)], dim=-1)
    slots = cache_slots(positions, k_nope.shape[2])
    return k_cache.index_copy(2, slots, key), v_cache.index_copy(2, slots, value)


def check_mla_indexer_qk_args(q, k, weight, bias, cos, sin, cache, positions, interleave) -> None:
    """Raise ValueError for inputs mla_indexer_qk_rope does not define."""
    check_mla_q_args(q, cos, sin, interleave)
    if cache is None:
        check_indexer_k_args(k, weight, bias, cos, sin, interleave)
        if positions is not None:
            raise ValueError("mla_indexer_qk_rope: positions without a cache")
    else:
        if positions is None:
            raise ValueError("mla_indexer_qk_rope: a cache without positions")
        check_indexer_k_cache_args(k, weight, bias, cos, sin, cache, positions, interleave)
    if q.dim() != 4 or tuple(q.shape[:2]) != tuple(k.shape[:2]) or q.shape[-1] != k.shape[-1] or q.dtype != k.dtype:
        raise ValueError(f"mla_indexer_qk_rope: q [B, S, H, D] and k [B, S, D] of one dtype expected, got "
                         f"{tuple(q.shape)} {q.dtype} and {tuple(k.shape)} {k.dtype}")  # fmt: skip


def mla_indexer_qk_rope_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cache: torch.Tensor | None,
    positions: torch.Tensor | None,
    eps: float,
    interleave: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The DSA indexer's query and key in one op: (mla_q_rope(q, cos, sin, rope first, [B, S, H, D]),
    mla_indexer_k_norm_rope(k, ...)), or, given the indexer's key cache, the cache with the key
    written at its slots (mla_indexer_k_norm_rope_cache) in place of the key."""
    check_mla_indexer_qk_args(q, k, weight, bias, cos, sin, cache, positions, interleave)
    query = mla_q_rope_reference(q, cos, sin, True, interleave, False)
    if cache is None:
        return query, mla_indexer_k_norm_rope_reference(k, weight, bias, cos, sin, eps, interleave)
    return query, mla_indexer_k_norm_rope_cache_reference(k, weight, bias, cos, sin, cache, positions, eps, interleave)


def mla_indexer_qk_rope_kv_cache_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cache: torch.Tensor,
    positions: torch.Tensor,
    k_nope: torch.Tensor,
    k_pe: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_positions: torch.Tensor,
    eps: float,
    interleave: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A decode step's DSA indexer and MLA cache writes in one op: (query, the indexer's cache with
    its key written) as mla_indexer_qk_rope with a cache, then (k_cache, v_cache) as
    mla_kv_cache_write at ``kv_positions`` (the KV cache counts its own slots)."""
    query, keys = mla_indexer_qk_rope_reference(q, k, weight, bias, cos, sin, cache, positions, eps, interleave)
    return (query, keys, *mla_kv_cache_write_reference(k_nope, k_pe, value, k_cache, v_cache, kv_positions))


def mla_q_a_kv_norm_rope_reference(
    x: torch.Tensor,
    x_weight: torch.Tensor,
    x_eps: float,
    x_weight_offset: float,
    x_cast_before_weight: bool,
    kv: torch.Tensor,
    weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    weight_offset: float = 0.0,
    cast_before_weight: bool = True,
    interleave: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """MLA's two norms before its up-projections in one op: (rms_norm(x) as the canonical rms_norm
    op computes it (q_a_layernorm of q_a_proj's output), *mla_kv_norm_rope(kv, ...))."""
    normed = rms_norm_reference(x, x_weight, x_eps, x_weight_offset, x_cast_before_weight)
    return (normed, *mla_kv_norm_rope_reference(kv, weight, cos, sin, eps, weight_offset, cast_before_weight, interleave))


def mla_q_indexer_kv_cache_reference(
    mq: torch.Tensor,
    mq_cos: torch.Tensor,
    mq_sin: torch.Tensor,
    mq_interleave: bool,
    q: torch.Tensor,
    k: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cache: torch.Tensor,
    positions: torch.Tensor,
    k_nope: torch.Tensor,
    k_pe: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_positions: torch.Tensor,
    eps: float,
    interleave: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A decode step's launch after MLA's and the indexer's up-projections in one op: (MLA's query
    as mla_q_rope(mq, mq_cos, mq_sin) in MLA's form (rope last, heads first), *the
    mla_indexer_qk_rope_kv_cache outputs)."""
    mla_query = mla_q_rope_reference(mq, mq_cos, mq_sin, False, mq_interleave, True)
    return (mla_query, *mla_indexer_qk_rope_kv_cache_reference(
        q, k, weight, bias, cos, sin, cache, positions, k_nope, k_pe, value, k_cache, v_cache, kv_positions, eps,
        interleave,
    ))  # fmt: skip
