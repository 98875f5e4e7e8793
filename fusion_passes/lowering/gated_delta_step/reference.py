"""Plain-torch reference of one Gated DeltaNet decode step: the single statement of its math.

Qwen3-Next / Qwen 3.5 linear attention (transformers' Qwen3_5GatedDeltaNet at one new token, its
gating and ``torch_recurrent_gated_delta_rule``), per sequence b and value head h, with key head
hk = h // (HV / Hk) (grouped value heads: transformers repeats q and k, the math does not need to):

    beta  = sigmoid(b)                                    in b.dtype (rounded), then fp32
    g     = -exp(f32(A_log)) * softplus(f32(a) + f32(dt_bias))     softplus: threshold 20
    q, k  = l2norm(f32(q)), l2norm(f32(k))                x * rsqrt(sum(x * x) + l2norm_eps)
    q     = q / scale            (divide_scale: transformers, scale = sqrt(K))   else q * scale
    S     = S * exp(g)                                    S: the fp32 state [K, V] of (b, h)
    delta = (f32(v) - sum_k S[k, :] * k[k]) * beta
    S     = S + k[:, None] * delta[None, :]
    out   = sum_k S[k, :] * q[k]                          returned in v.dtype

Rounding is where transformers rounds: sigmoid in b.dtype, everything after in fp32, the output
once. The state is fp32 in transformers' layout [B, HV, K, V].

``gated_delta_step_norm_reference``: the step followed by the layer's gated RMSNorm over each
value head's V outputs (Qwen3_5RMSNormGated / Qwen3NextRMSNormGated on out.reshape(-1, V)):

    n = rms_norm(out, norm_weight, norm_eps, weight_offset, cast_before_weight)   in v.dtype
    y = (f32(n) * silu(f32(z))).to(v.dtype)          z: the gate rows [B * HV, V], same order
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fusion_passes.lowering.rms_norm.reference import check_rms_norm_args, rms_norm_reference

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_gated_delta_step_args(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
) -> None:
    """Raise a one-line ValueError for arguments the op does not define."""
    if q.dim() != 4 or q.shape != k.shape or v.dim() != 4:
        raise ValueError(
            f"gated_delta_step: q, k [B, 1, Hk, K] and v [B, 1, HV, V] expected, got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    bsz, t, hk, dk = q.shape
    _, _, hv, dv = v.shape
    if t != 1 or v.shape[:2] != q.shape[:2]:
        raise ValueError(f"gated_delta_step: one token per sequence, got q {tuple(q.shape)} and v {tuple(v.shape)}")
    if hv % hk:
        raise ValueError(f"gated_delta_step: {hv} value heads are not a multiple of {hk} key heads")
    if tuple(a.shape) != (bsz, 1, hv) or tuple(b.shape) != (bsz, 1, hv):
        raise ValueError(f"gated_delta_step: a {tuple(a.shape)} and b {tuple(b.shape)} must be [{bsz}, 1, {hv}]")
    if tuple(A_log.shape) != (hv,) or tuple(dt_bias.shape) != (hv,):
        raise ValueError(f"gated_delta_step: A_log {tuple(A_log.shape)} and dt_bias {tuple(dt_bias.shape)} must be [{hv}]")
    if tuple(state.shape) != (bsz, hv, dk, dv) or state.dtype != torch.float32:
        raise ValueError(
            f"gated_delta_step: state {tuple(state.shape)} {state.dtype} must be [{bsz}, {hv}, {dk}, {dv}] float32"
        )
    for name, tensor in (("q", q), ("k", k), ("v", v), ("a", a), ("b", b), ("A_log", A_log), ("dt_bias", dt_bias)):
        if tensor.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"gated_delta_step: {name} is {tensor.dtype}; supported: fp32, bf16, fp16")


def _l2norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def gated_delta_step_reference(
    q: torch.Tensor,  # [B, 1, Hk, K] (any strides)
    k: torch.Tensor,  # [B, 1, Hk, K]
    v: torch.Tensor,  # [B, 1, HV, V]
    a: torch.Tensor,  # [B, 1, HV]: the decay's input (softplus(a + dt_bias))
    b: torch.Tensor,  # [B, 1, HV]: the write strength's input (sigmoid(b))
    A_log: torch.Tensor,  # [HV]
    dt_bias: torch.Tensor,  # [HV]
    state: torch.Tensor,  # [B, HV, K, V] float32: the recurrent state before the step
    scale: float,  # the query scale: sqrt(K) divided by (transformers), or 1/sqrt(K) multiplied
    divide_scale: bool,  # q / scale (transformers) rather than q * scale
    qk_l2norm: bool,  # l2-normalise q and k first (Qwen: use_qk_l2norm_in_kernel=True)
    l2norm_eps: float,  # added to sum(x * x) before the rsqrt
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, 1, HV, V] in v.dtype, new_state [B, HV, K, V] float32); see the module doc."""
    ratio = v.shape[2] // q.shape[2]
    beta = b.sigmoid().float()[:, 0]  # [B, HV]
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
    decay = g.float()[:, 0].exp()[..., None, None]  # [B, HV, 1, 1]
    qf = q.float()[:, 0].repeat_interleave(ratio, dim=1)  # [B, HV, K]
    kf = k.float()[:, 0].repeat_interleave(ratio, dim=1)
    if qk_l2norm:
        qf, kf = _l2norm(qf, l2norm_eps), _l2norm(kf, l2norm_eps)
    qf = qf / scale if divide_scale else qf * scale
    s = state * decay
    kv_mem = (s * kf.unsqueeze(-1)).sum(dim=-2)
    delta = (v.float()[:, 0] - kv_mem) * beta.unsqueeze(-1)
    s = s + kf.unsqueeze(-1) * delta.unsqueeze(-2)
    out = (s * qf.unsqueeze(-1)).sum(dim=-2)
    return out.unsqueeze(1).to(v.dtype), s


def check_gated_delta_step_norm_args(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    z: torch.Tensor,
    norm_weight: torch.Tensor,
    weight_offset: float,
    cast_before_weight: bool,
) -> None:
    """The step's checks, then the gated norm's: z [B * HV, V] in v.dtype, the norm's weight and form."""
    check_gated_delta_step_args(q, k, v, a, b, A_log, dt_bias, state)
    bsz, _, hv, dv = v.shape
    if tuple(z.shape) != (bsz * hv, dv) or z.dtype != v.dtype:
        raise ValueError(
            f"gated_delta_step_norm: z {tuple(z.shape)} {z.dtype} must be [{bsz * hv}, {dv}] {v.dtype} "
            "(a gate row per sequence and value head)"
        )
    try:
        check_rms_norm_args(z, norm_weight, weight_offset, cast_before_weight)
    except ValueError as e:
        raise ValueError(f"gated_delta_step_norm: {str(e).removeprefix('rms_norm: ')}") from None


def gated_delta_step_norm_reference(
    q: torch.Tensor,  # [B, 1, Hk, K]
    k: torch.Tensor,  # [B, 1, Hk, K]
    v: torch.Tensor,  # [B, 1, HV, V]
    a: torch.Tensor,  # [B, 1, HV]
    b: torch.Tensor,  # [B, 1, HV]
    A_log: torch.Tensor,  # [HV]
    dt_bias: torch.Tensor,  # [HV]
    state: torch.Tensor,  # [B, HV, K, V] float32
    z: torch.Tensor,  # [B * HV, V] in v.dtype: the gate of each (sequence, value head) row
    norm_weight: torch.Tensor,  # [V]
    scale: float,
    divide_scale: bool,
    qk_l2norm: bool,
    l2norm_eps: float,
    norm_eps: float,  # the gated norm's epsilon
    weight_offset: float,  # rms_norm's forms (rms_norm/reference.py)
    cast_before_weight: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y [B * HV, V] in v.dtype, new_state [B, HV, K, V] float32); see the module doc."""
    out, new_state = gated_delta_step_reference(
        q, k, v, a, b, A_log, dt_bias, state, scale, divide_scale, qk_l2norm, l2norm_eps
    )
    n = rms_norm_reference(out.reshape(-1, v.shape[-1]), norm_weight, norm_eps, weight_offset, cast_before_weight)
    return (n.float() * F.silu(z.float())).to(v.dtype), new_state
