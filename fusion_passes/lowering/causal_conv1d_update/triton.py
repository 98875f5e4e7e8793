"""One Triton kernel for a decode step's depthwise causal conv, its state shift and SiLU.

Unfused (stock Inductor on transformers' causal_conv1d_update): a cat kernel building
[state, x], a copy of its tail back into the state, an extern depthwise convolution (cuDNN) and
a kernel for slice + SiLU: 4 launches (7.7 us at batch 1 inside a CUDA graph on one H200, at
8192 channels; this kernel 3.9 us).
Fused: each program takes BLOCK_C channels of one sequence, loads the S state entries and the T
new inputs once, and writes
    out[c, t]     = act(sum_w weight[c, w] * full[c, S - W + 1 + t + w] + bias[c])
    state[c, i]   = full[c, T + i]                  (in place: every load precedes the stores)
with full = [state, x]; the sum in fp32, rounded to weight.dtype as the conv does, SiLU on the
rounded value (fp32 inside), rounded to x.dtype.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from fusion_passes.lowering.causal_conv1d_update.reference import check_causal_conv1d_update_args


@triton.jit
def _causal_conv1d_update_kernel(
    x_ptr,  # *x.dtype [B, C, T]: the new inputs (strides stride_xb, stride_xc, stride_xt)
    state_ptr,  # *state.dtype [B, C, S]: read, then overwritten with the last S inputs
    weight_ptr,  # *weight.dtype [C, W]: the filters (strides stride_wc, stride_ww)
    bias_ptr,  # *bias.dtype [C] (read only when HAS_BIAS)
    out_ptr,  # *x.dtype [B, C, T] contiguous: the conv output, activated
    C,  # channels
    stride_xb, stride_xc, stride_xt,
    stride_sb, stride_sc, stride_ss,
    stride_wc, stride_ww,
    S: tl.constexpr,  # state entries per channel (>= W - 1)
    T: tl.constexpr,  # new tokens (1 in a decode step; a constexpr: the outputs unroll)
    W: tl.constexpr,  # taps
    BLOCK_L: tl.constexpr,  # next_power_of_2(S + T): the window [state, x]
    BLOCK_S: tl.constexpr,  # next_power_of_2(S)
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    BLOCK_C: tl.constexpr,  # channels per program
):
    b = tl.program_id(0).to(tl.int64)
    c = (tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C))[:, None]
    cm = c < C
    conv_dtype = weight_ptr.dtype.element_ty
    x_base = x_ptr + b * stride_xb + c * stride_xc
    s_base = state_ptr + b * stride_sb + c * stride_sc
    # full[c, j] for j in [0, S + T): the state, then x; and the new state full[c, T + i]. Both
    # loaded before any store: the shift is in place.
    j = tl.arange(0, BLOCK_L)[None, :]
    full = tl.load(s_base + j * stride_ss, mask=cm & (j < S), other=0.0).to(conv_dtype)
    full += tl.load(x_base + (j - S) * stride_xt, mask=cm & (j >= S) & (j < S + T), other=0.0).to(conv_dtype)
    i = tl.arange(0, BLOCK_S)[None, :]
    shifted = tl.load(s_base + (T + i) * stride_ss, mask=cm & (T + i < S), other=0.0)
    shifted += tl.load(x_base + (T + i - S) * stride_xt, mask=cm & (i < S) & (T + i >= S), other=0.0)
    # The reference keeps [state, x] in weight.dtype: exact unless the filters are narrower.
    shifted = shifted.to(conv_dtype).to(state_ptr.dtype.element_ty)
    bias = tl.load(bias_ptr + c, mask=cm, other=0.0).to(tl.float32) if HAS_BIAS else 0.0
    full = full.to(tl.float32)
    for t in tl.static_range(T):
        # output t reads full[S - W + 1 + t + w], w in [0, W): the filter placed at that offset.
        tap = j - (S - W + 1 + t)
        wt = tl.load(weight_ptr + c * stride_wc + tap * stride_ww, mask=cm & (tap >= 0) & (tap < W), other=0.0)
        y = tl.sum(wt.to(tl.float32) * full, axis=1)[:, None] + bias
        y = y.to(conv_dtype).to(tl.float32)
        if SILU:
            y = y / (1.0 + tl.exp(-y))
        tl.store(out_ptr + (b * C + c) * T + t, y.to(out_ptr.dtype.element_ty), mask=cm)
    tl.store(s_base + i * stride_ss, shifted, mask=cm & (i < S))


def causal_conv1d_update_triton(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    silu: bool,
    *,
    wrap: Callable | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, new_state) as ``causal_conv1d_update_reference``. With ``wrap`` (an inlined launch)
    the state is written in place and returned; without, a copy is (the op is functional)."""
    check_causal_conv1d_update_args(x, conv_state, weight, bias)
    b, c, t = x.shape
    state = conv_state if wrap is not None else conv_state.clone()
    out = torch.empty((b, c, t), dtype=x.dtype, device=x.device)
    # 256 channels per program: one load per thread and tap at 4 warps; 8192 channels x batch 1
    # is 32 programs (a decode step's conv is latency-bound: one wave).
    block_c = min(256, triton.next_power_of_2(c))
    kernel = wrap(_causal_conv1d_update_kernel) if wrap is not None else _causal_conv1d_update_kernel
    kernel[(b, triton.cdiv(c, block_c))](
        x, state, weight, bias, out, c,  # bias None: a constant (no launch argument), never read
        *x.stride(), *state.stride(), *weight.stride(),
        S=state.shape[-1], T=t, W=weight.shape[-1],
        BLOCK_L=triton.next_power_of_2(state.shape[-1] + t), BLOCK_S=triton.next_power_of_2(state.shape[-1]), HAS_BIAS=bias is not None, SILU=silu,
        BLOCK_C=block_c, num_warps=4,
    )
    return out, state
