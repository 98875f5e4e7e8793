"""One Triton kernel for a prefill's depthwise causal conv and its SiLU.

Unfused (stock Inductor on transformers' causal_conv1d_fn): the transposed projection [B, T, C]
is copied to [B, C, T] and left-padded, an extern depthwise convolution runs over it
(at::native's conv_depthwise2d, bf16: 353 us for 4096 tokens x 8192 channels, measured on one
H200 in a Qwen 3.5 prefill, ~11x the 32 us of one read and one write), and a slice + SiLU kernel.
Fused: each program owns BLOCK_T tokens x BLOCK_C channels of one sequence and, all in fp32,
    acc = bias[c] + sum_w weight[c, w] * x[t - W + 1 + w, c]     (before the prompt: the
                                                                  initial state's inputs, or 0)
    out = silu(round(acc)) rounded to weight.dtype, stored [B, C, T] in x.dtype
(the bias first and the taps in order, as at::native's depthwise kernel sums them). The W loads
of a tile overlap in all but W - 1 rows: L1 serves them, x is read from memory once.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from fusion_passes.lowering.causal_conv1d.reference import check_causal_conv1d_args


@triton.jit
def _causal_conv1d_kernel(
    x_ptr,  # *x.dtype [B, C, T] (strides stride_xb, stride_xc, stride_xt)
    weight_ptr,  # *weight.dtype [C, W] (strides stride_wc, stride_ww)
    bias_ptr,  # *weight.dtype [C] (unread without HAS_BIAS)
    state_ptr,  # *x.dtype [B, C, S] (strides stride_sb, stride_sc, stride_ss; unread without HAS_STATE)
    out_ptr,  # *x.dtype [B, C, T] contiguous
    C, T, S,
    stride_xb, stride_xc, stride_xt, stride_wc, stride_ww, stride_sb, stride_sc, stride_ss,
    W: tl.constexpr,  # taps
    HAS_BIAS: tl.constexpr,
    HAS_STATE: tl.constexpr,
    SILU: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    ts = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cs = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    b = tl.program_id(2).to(tl.int64)
    cm = cs < C
    conv_dtype = weight_ptr.dtype.element_ty
    if HAS_BIAS:
        acc = tl.zeros((BLOCK_T, BLOCK_C), tl.float32) + tl.load(bias_ptr + cs, mask=cm, other=0.0).to(tl.float32)[None, :]
    else:
        acc = tl.zeros((BLOCK_T, BLOCK_C), tl.float32)
    x_base = x_ptr + b * stride_xb + cs[None, :] * stride_xc
    for w in tl.static_range(W):
        src = ts - (W - 1) + w
        inside = (src >= 0) & (src < T)
        xv = tl.load(x_base + src[:, None] * stride_xt, mask=inside[:, None] & cm[None, :], other=0.0)
        # The inputs before the prompt: the state's last W - 1, read by the first tile alone. A
        # branch per program, not a masked load per element: the state's loads (strided by S
        # along the channels) in every tile took the kernel from 58 to 140 us at 4096 tokens x
        # 8192 channels on one H200.
        if HAS_STATE and tl.program_id(0) == 0:
            before = (src < 0) & (src >= -S)
            s_ptrs = state_ptr + b * stride_sb + cs[None, :] * stride_sc + (S + src)[:, None] * stride_ss
            xv = tl.where(before[:, None], tl.load(s_ptrs, mask=before[:, None] & cm[None, :], other=0.0), xv)
        wv = tl.load(weight_ptr + cs * stride_wc + w * stride_ww, mask=cm, other=0.0).to(tl.float32)
        acc += xv.to(conv_dtype).to(tl.float32) * wv[None, :]
    y = acc.to(conv_dtype).to(tl.float32)
    if SILU:
        y = (y / (1.0 + tl.exp(-y))).to(conv_dtype).to(tl.float32)
    out_ptrs = out_ptr + (b * C + cs[None, :]) * T + ts[:, None]
    tl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=(ts < T)[:, None] & cm[None, :])


def causal_conv1d_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    silu: bool,
    initial_state: torch.Tensor | None = None,
    *,
    wrap: Callable | None = None,
) -> torch.Tensor:
    """out as ``causal_conv1d_reference``: [B, C, T] contiguous, x.dtype."""
    check_causal_conv1d_args(x, weight, bias, initial_state)
    bsz, c, t = x.shape
    out = torch.empty((bsz, c, t), dtype=x.dtype, device=x.device)
    # 32 tokens x 128 channels a program at 4 warps (32 outputs a thread): 56.6 us for a
    # 4096-token prompt of 8192 channels on one H200, where 64 x 64 took 65.5 and 16 x 256 56.6
    # (two runs each, within 0.5 us); shorter prompts take fewer tokens a program (a symbolic
    # prompt length, under dynamic shapes, takes 32).
    block_t = min(32, max(16, triton.next_power_of_2(t))) if isinstance(t, int) else 32
    block_c = min(128, triton.next_power_of_2(c))
    state = initial_state if initial_state is not None else x  # unread without one
    kernel = wrap(_causal_conv1d_kernel) if wrap is not None else _causal_conv1d_kernel
    kernel[(triton.cdiv(t, block_t), triton.cdiv(c, block_c), bsz)](
        x, weight, bias, state, out, c, t, state.shape[-1],  # bias None: a constant, never read
        *x.stride(), *weight.stride(), *state.stride(),
        W=weight.shape[-1], HAS_BIAS=bias is not None, HAS_STATE=initial_state is not None, SILU=silu,
        BLOCK_T=block_t, BLOCK_C=block_c,
        num_warps=4,
    )  # fmt: skip
    return out
