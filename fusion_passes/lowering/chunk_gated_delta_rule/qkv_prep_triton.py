"""One Triton kernel for the chunked rule's inputs on CUDA: q and k l2-normalized, v copied, each
written contiguous [B, T, heads, dim], from views laid out however the model left them.

Unfused (the op's CUDA path as flash-linear-attention runs it): its input guard copies every
non-contiguous argument (q, k and v are views of the causal conv's output, split into heads:
[B, C, T] in memory, so each copy is a transpose; v's alone 108 us per Gated DeltaNet layer of a
4096-token Qwen 3.5 prefill on one H200), then its l2norm kernel reads q and writes it
normalized, and again for k (32 us for both).
Fused: per BLOCK_T tokens of one head of q, k or v, the tile read through the view's strides and
    q, k:  y = x * (1 / sqrt(sum(x * x) + eps))     (fp32, over the head's dim; fla's l2norm_fwd)
    v:     y = x
stored in x.dtype, contiguous; the chunk kernels then take q and k as normalized
(``use_qk_l2norm_in_kernel=False``), as fla passes its own l2norm's output to them. One launch
and one read and one write of each instead of five launches and up to two of each.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl


@triton.jit
def _prep_tile(src, dst, b, h, t0, T, heads, stride_b, stride_t, stride_h, stride_d, eps,
               D: tl.constexpr, BD: tl.constexpr, BLOCK_T: tl.constexpr, NORM: tl.constexpr):  # fmt: skip
    ts = t0 + tl.arange(0, BLOCK_T)
    ds = tl.arange(0, BD)
    inside = (ts[:, None] < T) & (ds[None, :] < D)
    x = tl.load(src + b.to(tl.int64) * stride_b + ts[:, None].to(tl.int64) * stride_t + h.to(tl.int64) * stride_h
                + ds[None, :].to(tl.int64) * stride_d, mask=inside, other=0.0)  # fmt: skip
    if NORM:
        xf = x.to(tl.float32)
        rstd = 1 / tl.sqrt(tl.sum(xf * xf, 1) + eps)
        y = (xf * rstd[:, None]).to(dst.dtype.element_ty)
    else:
        y = x
    out = dst + ((b.to(tl.int64) * T + ts[:, None]) * heads + h) * D + ds[None, :]
    tl.store(out, y, mask=inside)


@triton.jit
def _qkv_prep_kernel(
    q_ptr, k_ptr, v_ptr, qo_ptr, ko_ptr, vo_ptr,
    T, H, HV, eps,
    sqb, sqt, sqh, sqd, skb, skt, skh, skd, svb, svt, svh, svd,
    K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BLOCK_T: tl.constexpr,
):  # fmt: skip
    t0 = tl.program_id(0) * BLOCK_T
    b = tl.program_id(1)
    j = tl.program_id(2)  # q heads, then k heads, then v heads
    if j < H:
        _prep_tile(q_ptr, qo_ptr, b, j, t0, T, H, sqb, sqt, sqh, sqd, eps, K, BK, BLOCK_T, True)
    elif j < 2 * H:
        _prep_tile(k_ptr, ko_ptr, b, j - H, t0, T, H, skb, skt, skh, skd, eps, K, BK, BLOCK_T, True)
    else:
        _prep_tile(v_ptr, vo_ptr, b, j - 2 * H, t0, T, HV, svb, svt, svh, svd, eps, V, BV, BLOCK_T, False)


def qkv_prep_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, eps: float, *,
                    block_t: int | None = None, wrap: Callable | None = None):  # fmt: skip
    """As ``reference.qkv_prep_reference``: q, k [B, T, H, K] and v [B, T, HV, V], any strides."""
    if q.shape != k.shape or q.dim() != 4 or v.dim() != 4 or v.shape[:2] != q.shape[:2]:
        raise ValueError(f"qkv_prep: q, k [B, T, H, K] and v [B, T, HV, V] expected, got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")  # fmt: skip
    bsz, t, h, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    qo, ko = (torch.empty(q.shape, dtype=q.dtype, device=q.device) for _ in range(2))
    vo = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if t == 0 or bsz == 0:
        return qo, ko, vo
    # 64 tokens x one head of 128 a program (8192 programs at 4096 tokens of 16 + 16 + 32 heads):
    # the tile's loads follow the view (a [B, C, T] conv output: tokens contiguous), its stores the
    # output's rows; fewer tokens for wider heads keep a tile at 8K elements.
    block_t = block_t or max(16, min(64, 8192 // triton.next_power_of_2(max(dk, dv))))
    kernel = wrap(_qkv_prep_kernel) if wrap is not None else _qkv_prep_kernel
    kernel[(triton.cdiv(t, block_t), bsz, 2 * h + hv)](
        q, k, v, qo, ko, vo, t, h, hv, eps,
        *q.stride(), *k.stride(), *v.stride(),
        K=dk, V=dv, BK=triton.next_power_of_2(dk), BV=triton.next_power_of_2(dv), BLOCK_T=block_t,
        num_warps=4,
    )  # fmt: skip
    return qo, ko, vo
