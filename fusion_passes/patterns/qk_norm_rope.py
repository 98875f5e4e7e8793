"""QK-norm + RoPE spellings found in real model code, mapped to ``qk_norm_rope``.

Canonicalize, then fuse: the RMSNorm fusion has already turned q_norm / k_norm into
``fusion_passes.rms_norm`` calls; these patterns take both norms and the RoPE after them (q and k
together: one kernel launch serves both). Spellings, as transformers writes them:

- Qwen3 / Qwen3-MoE: per-head norm, rotate_half RoPE over the whole head
      q = q_norm(q_proj(h).view(B, S, -1, D)).transpose(1, 2)     (k alike)
      q * cos + rotate_half(q) * sin                                cos = cos.unsqueeze(1)
- Qwen3-Next / Qwen 3.5 / Qwen 3.5-MoE: per-head ``(1 + w)`` norm of q (a chunk of the q+gate
  projection) and k, partial RoPE on the first R = cos.shape[-1] dims, the rest concatenated back
      cat([q[..., :R] * cos + rotate_half(q[..., :R]) * sin, q[..., R:]], -1)
- MiniMax-M2: the norm spans all heads of a token (weight [H * D]), then per-head partial RoPE
      q = q_norm(q_proj(h)).view(B, S, -1, D).transpose(1, 2)
- (whole-row norm with full RoPE completes the set: OLMo-2-style q/k norms.)
Each in the three norm forms of rms_norm (Llama, fp32 weight, Qwen's (1 + w)).

Unfused: 2 norm kernels (or 4 for the whole-row norm's reduction + scale) and the RoPE pointwise
         kernels, q and k written and read back between them.
Fused:   q, k = fusion_passes.qk_norm_rope(q, k, q_w, k_w, cos, sin, eps, weight_offset, cast,
                                           norm_per_head)            (one kernel on CUDA)

eps and the head dim of the whole-row spellings are pattern arguments (scalars); head counts,
the head dim of the per-head spellings and the rotary dim are read from the matched shapes.
"""

from __future__ import annotations

from typing import Any

import torch

from fusion_passes.lowering.qk_norm_rope.reference import check_qk_norm_rope_args
from fusion_passes.fusion import DEFAULT_SCALAR_SENTINEL, Fusion, Spelling

# The whole-row spellings' head dim is traced with this sentinel: no other int of their traced
# graphs (example sizes, slice bounds) may equal it, or the matcher would take it for the head dim.
HEAD_DIM_SENTINEL = 24
# k_norm's eps is its own pattern argument: the check rejects a site whose two eps differ (one
# shared pattern argument was not enough: the matcher let the k norm's differ).
K_EPS_SENTINEL = 2 * DEFAULT_SCALAR_SENTINEL
_FORMS = {"llama": (0.0, True), "fp32_weight": (0.0, False), "offset": (1.0, False)}

# --- the RoPE spellings (transformers' apply_rotary_pos_emb, unsqueeze_dim=1) ---


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def rope_full(q, k, cos, sin):
    """Qwen3 / Qwen3-MoE (Llama's apply_rotary_pos_emb)."""
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed


def rope_partial(q, k, cos, sin):
    """Qwen3-Next / Qwen 3.5 / MiniMax-M2: rotary on the first cos.shape[-1] dims."""
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    rotary_dim = cos.shape[-1]
    q_rot, q_pass = q[..., :rotary_dim], q[..., rotary_dim:]
    k_rot, k_pass = k[..., :rotary_dim], k[..., rotary_dim:]
    q_embed = (q_rot * cos) + (rotate_half(q_rot) * sin)
    k_embed = (k_rot * cos) + (rotate_half(k_rot) * sin)
    q_embed = torch.cat([q_embed, q_pass], dim=-1)
    k_embed = torch.cat([k_embed, k_pass], dim=-1)
    return q_embed, k_embed


_ROPES = {"rope": rope_full, "partial_rope": rope_partial}

# --- spellings: canonical norm op(s) -> reshape / transpose -> RoPE ---


def _per_head(rope, offset: float, cast: bool):
    norm = torch.ops.fusion_passes.rms_norm.default

    def pattern(q, k, q_weight, k_weight, cos, sin, eps, k_eps):
        q = norm(q, q_weight, eps, offset, cast).transpose(1, 2)
        k = norm(k, k_weight, k_eps, offset, cast).transpose(1, 2)
        return rope(q, k, cos, sin)

    return pattern


def _whole_row(rope, offset: float, cast: bool):
    norm = torch.ops.fusion_passes.rms_norm.default

    def pattern(q, k, q_weight, k_weight, cos, sin, eps, k_eps, head_dim):
        hidden_shape = (*q.shape[:-1], -1, head_dim)
        q = norm(q, q_weight, eps, offset, cast).view(hidden_shape).transpose(1, 2)
        k = norm(k, k_weight, k_eps, offset, cast).view(hidden_shape).transpose(1, 2)
        return rope(q, k, cos, sin)

    return pattern


def _fused_per_head(offset: float, cast: bool):
    def replacement(q, k, q_weight, k_weight, cos, sin, eps, k_eps):
        q_out, k_out = torch.ops.fusion_passes.qk_norm_rope.default(
            q, k, q_weight, k_weight, cos, sin, eps, offset, cast, True
        )
        return q_out, k_out

    return replacement


def _fused_whole_row(offset: float, cast: bool):
    def replacement(q, k, q_weight, k_weight, cos, sin, eps, k_eps, head_dim):
        hidden_shape = (*q.shape[:-1], -1, head_dim)
        q_out, k_out = torch.ops.fusion_passes.qk_norm_rope.default(
            q.view(hidden_shape), k.view(hidden_shape), q_weight, k_weight, cos, sin, eps,
            offset, cast, False,
        )  # fmt: skip
        return q_out, k_out

    return replacement


def _check(offset: float, cast: bool, per_head: bool, full_rope: bool):
    """Reject what the canonical op would compute differently: dtypes, cos/sin shapes, weights of
    another width (a norm over another axis), a full-RoPE site whose cos does not span the head."""

    def check(values: dict[str, Any]) -> str | None:
        q, k = values["q"], values["k"]
        if q is k:
            # The matcher finds k's branch from the nodes q's branch shares with it (cos / sin)
            # and may bind it to q's own branch when k's does not match (e.g. another eps).
            return "the k branch matched q's own nodes: no separate k norm + RoPE"
        if values["eps"] != values["k_eps"]:
            return f"q_norm eps {values['eps']} != k_norm eps {values['k_eps']} (the op has one)"
        if per_head:
            if q.dim() != 4 or k.dim() != 4:
                return f"per-head norm of a rank-{q.dim()} tensor (expected [B, S, H, D])"
        else:
            head_dim = values["head_dim"]
            if q.dim() != 3 or k.dim() != 3:
                return f"whole-row norm of a rank-{q.dim()} tensor (expected [B, S, H * D])"
            if q.shape[-1] % head_dim or k.shape[-1] % head_dim:
                return f"projection widths {q.shape[-1]}, {k.shape[-1]} not heads of {head_dim}"
            q = q.unflatten(-1, (-1, head_dim))
            k = k.unflatten(-1, (-1, head_dim))
        cos = values["cos"]
        if full_rope and cos.dim() >= 1 and cos.shape[-1] != q.shape[-1]:
            return f"cos/sin span {cos.shape[-1]} dims, the head {q.shape[-1]}"
        try:
            check_qk_norm_rope_args(
                q, k, values["q_weight"], values["k_weight"], cos, values["sin"], offset, cast,
                per_head,
            )  # fmt: skip
        except ValueError as e:
            return str(e)
        return None

    return check


def _examples(per_head: bool, full_rope: bool):
    """fp32 and bf16 traces (the RoPE has no casts, but keep both as the other fusions do).
    Sizes avoid HEAD_DIM_SENTINEL everywhere but the whole-row spellings' head dim."""

    def example_inputs():
        b, s, hq, hk = 2, 3, 4, 2
        d = 16 if per_head else HEAD_DIM_SENTINEL
        r = d if full_rope else 8
        for dtype in (torch.float32, torch.bfloat16):
            q, k = torch.randn(b, s, hq, d, dtype=dtype), torch.randn(b, s, hk, d, dtype=dtype)
            w_q, w_k = torch.randn(d, dtype=dtype), torch.randn(d, dtype=dtype)
            if not per_head:
                q, k = q.flatten(-2), k.flatten(-2)
                w_q, w_k = torch.randn(hq * d, dtype=dtype), torch.randn(hk * d, dtype=dtype)
            cos, sin = torch.randn(b, s, r, dtype=dtype), torch.randn(b, s, r, dtype=dtype)
            scalars = (DEFAULT_SCALAR_SENTINEL, K_EPS_SENTINEL)
            scalars += () if per_head else (HEAD_DIM_SENTINEL,)
            yield (q, k, w_q, w_k, cos, sin, *scalars)

    return example_inputs


def _spellings(per_head: bool, rope: str):
    out = []
    for form, (offset, cast) in _FORMS.items():
        scope = "per_head" if per_head else "whole_row"
        out.append(
            Spelling(
                f"{scope}_{form}_norm_{rope}",
                (_per_head if per_head else _whole_row)(_ROPES[rope], offset, cast),
                (_fused_per_head if per_head else _fused_whole_row)(offset, cast),
                _check(offset, cast, per_head, rope == "rope"),
            )
        )
    return out


# One fusion per structural variant: the registry traces every spelling of a fusion with each of
# its example inputs, and the variants need different ones (q of rank 4 or 3; cos spanning the
# head or not, since a pattern traced with an empty pass-through part loses its cat).
FAMILY = ("qk_norm_rope", "qk_norm_rope_partial", "qk_norm_rope_whole_row")
_VARIANTS = {  # name: (per_head, rope), in application order
    "qk_norm_rope_partial": (True, "partial_rope"),
    "qk_norm_rope_whole_row": (False, "partial_rope"),
    "qk_norm_rope": (True, "rope"),
}


def _fusion(name: str) -> Fusion:
    per_head, rope = _VARIANTS[name]
    scalars: dict[str, float] = {"eps": DEFAULT_SCALAR_SENTINEL, "k_eps": K_EPS_SENTINEL}
    if not per_head:
        scalars["head_dim"] = HEAD_DIM_SENTINEL
    where = {
        "qk_norm_rope": "per-head norm, RoPE over the whole head (Qwen3, Qwen3-MoE)",
        "qk_norm_rope_partial": "per-head norm, partial RoPE (Qwen3-Next, Qwen 3.5, Qwen 3.5-MoE)",
        "qk_norm_rope_whole_row": "norm over all heads, partial RoPE (MiniMax-M2)",
    }[name]
    return Fusion(
        name=name,
        summary=f"q/k RMSNorm + RoPE, {where} -> one qk_norm_rope kernel",
        doc=__doc__.split("\n\n", 1)[1],
        spellings=tuple(_spellings(per_head, rope)),
        example_inputs=_examples(per_head, full_rope=rope == "rope"),
        scalars=scalars,
        # Enabling qk_norm_rope by name enables the whole family (and the norms it starts from).
        requires=("rms_norm",) + (FAMILY[1:] if name == "qk_norm_rope" else ()),
        builtin=True,
    )


FUSIONS = tuple(_fusion(name) for name in _VARIANTS)
