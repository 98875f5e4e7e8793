"""Plain-torch reference of Gated DeltaNet's prefill (the chunked gated delta rule): the single
statement of its math.

Qwen3-Next / Qwen 3.5 linear attention over T tokens (transformers' ``torch_chunk_gated_delta_rule``,
flash-linear-attention's ``chunk_gated_delta_rule``), per sequence b and head h, token by token:

    q_t, k_t = l2norm(q_t), l2norm(k_t)        x * rsqrt(sum(x * x) + eps)   (qk_l2norm)
    S   = S * exp(g_t)                         S: the fp32 state [K, V]; g_t <= 0 (log decay)
    S   = S + k_t (beta_t (v_t - k_t^T S))^T   the delta rule
    o_t = scale * q_t^T S

Computed as transformers computes it, in chunks of 64 tokens (the rounding is its): everything in
fp32; within a chunk the pairwise decays exp(G_i - G_j) (G the chunk's cumulative log decay) and a
unit lower-triangular solve (the UT transform) give the chunk's new values and decayed keys; one
sequential pass over the chunks then reads and updates the state. The output is rounded once, to
q's dtype. Inputs are transformers' / flash-linear-attention's: [B, T, H, *], the state [B, HV, K, V]
fp32. Grouped values (HV value heads, a multiple of the H key heads: Qwen 3.5 / Qwen3-Next's 32 / 16):
value head h reads key head h // (HV / H), the math of transformers' repeat_interleave of q and k
(flash-linear-attention's kernels read the key heads as they are).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# transformers' chunk size; flash-linear-attention's kernels use the same.
CHUNK = 64


def check_chunk_gated_delta_rule_args(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> None:
    """Raise a one-line ValueError for arguments the op does not define."""
    grouped = q.dim() == 4 and v.dim() == 4 and q.shape[2] >= 1 and v.shape[2] % q.shape[2] == 0
    if not grouped or q.shape != k.shape or v.shape[:2] != q.shape[:2] or v.shape[2] < q.shape[2]:
        raise ValueError(
            f"chunk_gated_delta_rule: q, k [B, T, H, K] and v [B, T, HV, V] (HV a multiple of H) expected, got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    bsz, _, _, dk = q.shape
    heads, dv = v.shape[2], v.shape[-1]
    if g.shape != v.shape[:3] or beta.shape != v.shape[:3]:
        raise ValueError(
            f"chunk_gated_delta_rule: g {tuple(g.shape)} and beta {tuple(beta.shape)} must be {tuple(v.shape[:3])}"
        )
    if tuple(state.shape) != (bsz, heads, dk, dv) or state.dtype != torch.float32:
        raise ValueError(
            f"chunk_gated_delta_rule: state {tuple(state.shape)} {state.dtype} must be "
            f"[{bsz}, {heads}, {dk}, {dv}] float32"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"chunk_gated_delta_rule: q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    for name, tensor in (("q", q), ("g", g), ("beta", beta)):
        if tensor.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"chunk_gated_delta_rule: {name} is {tensor.dtype}; supported: fp32, bf16, fp16")


def _l2norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def chunk_gated_delta_rule_reference(
    q: torch.Tensor,  # [B, T, H, K]
    k: torch.Tensor,  # [B, T, H, K]
    v: torch.Tensor,  # [B, T, HV, V], HV a multiple of H
    g: torch.Tensor,  # [B, T, HV]: the log decay (<= 0)
    beta: torch.Tensor,  # [B, T, HV]: the write strength
    state: torch.Tensor,  # [B, HV, K, V] float32: the state before the first token (zeros: none)
    scale: float,  # the query scale, multiplied (transformers: K ** -0.5)
    qk_l2norm: bool,  # l2-normalise q and k first (Qwen: use_qk_l2norm_in_kernel=True)
    l2norm_eps: float,  # added to sum(x * x) before the rsqrt
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, T, HV, V] in q.dtype, final state [B, HV, K, V] float32); see the module doc."""
    out_dtype, seq_len = q.dtype, q.shape[1]
    groups = v.shape[2] // q.shape[2]
    if groups > 1:  # grouped values: each key head read by its value heads
        q, k = q.repeat_interleave(groups, dim=2), k.repeat_interleave(groups, dim=2)
    # As transformers casts them: .to() keeps an fp32 input's transposed view (no copy), so the
    # matmuls below see its strides; a contiguous copy gave other last bits on an AMD EPYC's MKL.
    q, k, v, beta, g = (x.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format)
                        for x in (q, k, v, beta, g))  # fmt: skip
    if qk_l2norm:
        q, k = _l2norm(q, l2norm_eps), _l2norm(k, l2norm_eps)
    q = q * scale
    pad = (CHUNK - seq_len % CHUNK) % CHUNK  # zero tokens: no decay, no write
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    beta, g = (F.pad(x, (0, pad)) for x in (beta, g))
    v_beta, k_beta = v * beta.unsqueeze(-1), k * beta.unsqueeze(-1)
    q, k, k_beta, v_beta = (
        x.reshape(x.shape[0], x.shape[1], -1, CHUNK, x.shape[-1]) for x in (q, k, k_beta, v_beta)
    )
    cum = g.reshape(g.shape[0], g.shape[1], -1, CHUNK).cumsum(dim=3)  # G: log decay since the chunk began
    upper = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).triu(1)
    pairwise = (cum.unsqueeze(4) - cum.unsqueeze(3)).masked_fill(upper, float("-inf")).exp()
    ut = (k_beta @ k.transpose(-1, -2)) * pairwise
    intra = (q @ k.transpose(-1, -2)) * pairwise
    decayed_k_beta = k_beta * cum.exp().unsqueeze(-1)
    new_v = torch.linalg.solve_triangular(ut, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(ut, decayed_k_beta, upper=False, unitriangular=True)
    out = torch.zeros_like(new_v)
    q = q * cum.exp().unsqueeze(-1)
    k = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    chunk_decay = cum[..., -1].exp()[..., None, None]
    for i in range(q.shape[2]):
        v_i = new_v[:, :, i] - k_cumdecay[:, :, i] @ state
        out[:, :, i] = q[:, :, i] @ state + intra[:, :, i] @ v_i
        state = state * chunk_decay[:, :, i] + k[:, :, i].transpose(-1, -2) @ v_i
    out = out.reshape(out.shape[0], out.shape[1], -1, out.shape[-1])[:, :, :seq_len]
    return out.transpose(1, 2).to(out_dtype, memory_format=torch.contiguous_format), state


def qkv_prep_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, eps: float):
    """(q and k l2-normalized in fp32 as fla's l2norm_fwd computes them, v), contiguous, x.dtype."""

    def norm(x):
        xf = x.float()
        return (xf * (1 / torch.sqrt((xf * xf).sum(-1, keepdim=True) + eps))).to(x.dtype)

    return norm(q).contiguous(), norm(k).contiguous(), v.contiguous()
