"""Plain-torch reference of the decode step's causal depthwise conv: the single statement of its math.

Gated DeltaNet (Qwen3-Next, Qwen 3.5) and Mamba-style layers run a W-tap depthwise causal conv
over the projected q / k / v channels; in a cached decode step the last S inputs of each channel
are kept as the conv state. transformers' ``causal_conv1d_update`` (the fallback every model
traces under torch.compile):

    full      = cat([conv_state, x], dim=-1).to(weight.dtype)       [B, C, S + T]
    new_state = full[..., -S:]                                      written back into conv_state
    out       = conv1d(full, weight[:, None], bias, groups=C)[..., -T:]
              = sum_w weight[c, w] * full[c, S - W + 1 + t + w] (+ bias[c]), in weight.dtype
    out       = silu(out) if silu; returned in x.dtype

Rounding: the conv accumulates in fp32 and rounds once to weight.dtype; silu reads that rounded
value (fp32 inside) and rounds again; the state holds the inputs unchanged (state.dtype).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_causal_conv1d_update_args(
    x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> None:
    """Raise a one-line ValueError for arguments the op does not define."""
    if x.dim() != 3 or conv_state.dim() != 3 or weight.dim() != 2:
        raise ValueError(
            f"causal_conv1d_update: x [B, C, T], conv_state [B, C, S] and weight [C, W] expected, got "
            f"{tuple(x.shape)}, {tuple(conv_state.shape)}, {tuple(weight.shape)}"
        )
    (b, c, t), (s, w) = x.shape, (conv_state.shape[-1], weight.shape[-1])
    if tuple(conv_state.shape[:2]) != (b, c) or weight.shape[0] != c:
        raise ValueError(
            f"causal_conv1d_update: conv_state {tuple(conv_state.shape)} and weight {tuple(weight.shape)} "
            f"do not match x {tuple(x.shape)}"
        )
    if t < 1 or s < w - 1:
        raise ValueError(f"causal_conv1d_update: {t} new tokens and a {s}-entry state for {w} taps")
    if bias is not None and tuple(bias.shape) != (c,):
        raise ValueError(f"causal_conv1d_update: bias {tuple(bias.shape)} for {c} channels")
    if x.dtype != conv_state.dtype:
        raise ValueError(f"causal_conv1d_update: x is {x.dtype} but conv_state is {conv_state.dtype}")
    for name, tensor in (("x", x), ("conv_state", conv_state), ("weight", weight)):
        if tensor.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"causal_conv1d_update: {name} is {tensor.dtype}; supported: fp32, bf16, fp16")


def causal_conv1d_update_reference(
    x: torch.Tensor,  # [B, C, T]: the new tokens' channels (any strides)
    conv_state: torch.Tensor,  # [B, C, S]: the last S inputs of each channel, S >= W - 1
    weight: torch.Tensor,  # [C, W]: one W-tap filter per channel
    bias: torch.Tensor | None,  # [C] or None
    silu: bool,  # apply SiLU to the conv output (Qwen3-Next / Qwen 3.5: hidden_act "silu")
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, C, T] in x.dtype, new_state [B, C, S] in conv_state.dtype); see the module doc."""
    t, s = x.shape[-1], conv_state.shape[-1]
    full = torch.cat([conv_state, x], dim=-1).to(weight.dtype)
    new_state = full[..., -s:].to(conv_state.dtype)
    out = F.conv1d(full, weight.unsqueeze(1), bias, padding=0, groups=x.shape[1])[..., -t:]
    if silu:
        out = F.silu(out)
    return out.to(x.dtype), new_state
