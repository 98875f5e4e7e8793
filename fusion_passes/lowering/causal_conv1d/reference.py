"""Plain-torch reference of a prefill's depthwise causal conv: the single statement of its math.

Gated DeltaNet (Qwen3-Next, Qwen 3.5) and Mamba-style layers run a W-tap depthwise causal conv over
the projected q / k / v channels. Over a prompt (no cached inputs before it) transformers calls its
``causal_conv1d_fn`` (the code of causal-conv1d's reference ``causal_conv1d_ref``):

    out = conv1d(x.to(weight.dtype), weight[:, None], bias, padding=W - 1, groups=C)[..., :T]
        = sum_w weight[c, w] * x[b, c, t - W + 1 + w] (+ bias[c]),  x[.., t < 0] = 0
    out = silu(out) if silu; returned in x.dtype, [B, C, T] contiguous

With ``initial_state`` [B, C, S] (S >= W - 1: the inputs before the prompt, a cached conv state
that the prompt continues; transformers' StaticCache passes cat([conv_state, x]) to its conv),
x[.., t < 0] = initial_state[.., S + t] instead of 0:

    out = conv1d(cat([initial_state, x], -1).to(weight.dtype), weight[:, None], bias, groups=C)[..., -T:]

Rounding: the conv accumulates in fp32 and rounds once to weight.dtype; SiLU reads that rounded
value (fp32 inside) and rounds again to weight.dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_causal_conv1d_args(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, initial_state: torch.Tensor | None = None
) -> None:
    """Raise a one-line ValueError for arguments the op does not define."""
    if x.dim() != 3 or weight.dim() != 2:
        raise ValueError(
            f"causal_conv1d: x [B, C, T] and weight [C, W] expected, got {tuple(x.shape)}, {tuple(weight.shape)}"
        )
    if weight.shape[0] != x.shape[1] or (bias is not None and tuple(bias.shape) != (x.shape[1],)):
        raise ValueError(
            f"causal_conv1d: weight {tuple(weight.shape)} and bias "
            f"{None if bias is None else tuple(bias.shape)} do not match x's {x.shape[1]} channels"
        )
    for name, t in (("x", x), ("weight", weight), ("bias", bias)):
        if t is not None and t.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"causal_conv1d: {name} dtype {t.dtype} is not one of fp32 / bf16 / fp16")
    if bias is not None and bias.dtype != weight.dtype:
        raise ValueError(f"causal_conv1d: bias dtype {bias.dtype} differs from weight's {weight.dtype}")
    if initial_state is not None:
        if initial_state.dim() != 3 or tuple(initial_state.shape[:2]) != tuple(x.shape[:2]):
            raise ValueError(f"causal_conv1d: initial_state {tuple(initial_state.shape)} does not match x {tuple(x.shape)}")
        if initial_state.shape[-1] < weight.shape[-1] - 1:
            raise ValueError(
                f"causal_conv1d: initial_state holds {initial_state.shape[-1]} inputs, {weight.shape[-1] - 1} needed"
            )
        if initial_state.dtype != x.dtype:
            raise ValueError(f"causal_conv1d: initial_state is {initial_state.dtype}, x {x.dtype}")


def causal_conv1d_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    silu: bool,
    initial_state: torch.Tensor | None = None,
) -> torch.Tensor:
    """out [B, C, T] (x.dtype) of the W-tap depthwise causal conv over x [B, C, T] (after
    initial_state's inputs, else zeros), then SiLU."""
    check_causal_conv1d_args(x, weight, bias, initial_state)
    # Padded and cut as transformers does (the unpadded conv's last T outputs are the same sums).
    full = x if initial_state is None else torch.cat([initial_state, x], dim=-1)
    out = F.conv1d(full.to(weight.dtype), weight.unsqueeze(1), bias, padding=weight.shape[-1] - 1, groups=x.shape[1])
    out = out[..., : full.shape[-1]][..., -x.shape[-1] :]
    if silu:
        out = F.silu(out)
    return out.to(x.dtype)
