"""A decode step's depthwise causal conv with its conv-state shift (Gated DeltaNet, Mamba-style).

Qwen3-Next / Qwen 3.5 run the projected q / k / v channels through a W-tap depthwise causal conv;
in a cached decode step transformers calls its ``causal_conv1d_update`` (the same code as
causal-conv1d's reference ``causal_conv1d_update_ref``), which torch.compile traces as:

    full = cat([conv_state, x], -1).to(weight.dtype)           x = mixed_qkv.transpose(1, 2)
    conv_state.copy_(full[:, :, -S:])                          functionalized: copy + copy_ back
    out  = silu(conv1d(full, weight.unsqueeze(1), groups=C)[:, :, -T:]).to(x.dtype)

Unfused: a cat kernel, the state copy, an extern depthwise convolution and a slice + SiLU kernel
         (4 launches per GDN layer with stock Inductor).
Fused:   out, new_state = fusion_passes.causal_conv1d_update(x, conv_state, weight, bias, silu)
         one kernel; on CUDA the state is shifted in place (the copy back into the cache goes).

Also causal-conv1d's reference on x [B, C] (one token per sequence: unsqueezed, the output
squeezed before SiLU): the ``_token`` fusions. Not fused: a conv whose state is shorter than
W - 1 (not a causal update), x and state of different dtypes, a prefill's padded conv.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx
import torch.nn.functional as F

from fusion_passes.fusion import Fusion, Spelling
from fusion_passes.lowering.causal_conv1d_update.reference import check_causal_conv1d_update_args


def _transformers_update(x, conv_state, weight, bias):
    # transformers' causal_conv1d_update (Qwen3-Next, Qwen 3.5, Qwen 3.5-MoE), activation "silu";
    # conv_state.copy_ written as its functional form.
    state_len = conv_state.shape[-1]
    full = torch.cat([conv_state, x], dim=-1).to(weight.dtype)
    new_state = torch.ops.aten.copy.default(conv_state, full[:, :, -state_len:])
    out = F.conv1d(full, weight.unsqueeze(1), bias, padding=0, groups=x.shape[1])
    out = F.silu(out[:, :, -x.shape[-1] :])
    return out.to(x.dtype), new_state


def transformers_causal_conv1d_update(x, conv_state, weight):
    # The models' conv1d has bias=False.
    return _transformers_update(x, conv_state, weight, None)


def transformers_causal_conv1d_update_bias(x, conv_state, weight, bias):
    # With a conv bias (causal-conv1d's reference takes one).
    return _transformers_update(x, conv_state, weight, bias)


def _causal_conv1d_ref_2d(x, conv_state, weight, bias):
    # causal-conv1d's causal_conv1d_update_ref on one token per sequence (x [B, C]): unsqueezed,
    # and the conv's output squeezed before the activation.
    state_len = conv_state.shape[-1]
    full = torch.cat([conv_state, x.unsqueeze(-1)], dim=-1).to(weight.dtype)
    new_state = torch.ops.aten.copy.default(conv_state, full[:, :, -state_len:])
    out = F.conv1d(full, weight.unsqueeze(1), bias, padding=0, groups=x.shape[1])[:, :, -1:]
    return F.silu(out.squeeze(-1)).to(dtype=x.dtype), new_state


def causal_conv1d_ref_2d(x, conv_state, weight):
    return _causal_conv1d_ref_2d(x, conv_state, weight, None)


def causal_conv1d_ref_2d_bias(x, conv_state, weight, bias):
    return _causal_conv1d_ref_2d(x, conv_state, weight, bias)


def _fused_bias(x, conv_state, weight, bias):
    return torch.ops.fusion_passes.causal_conv1d_update(x, conv_state, weight, bias, True)


def _fused(x, conv_state, weight):
    return _fused_bias(x, conv_state, weight, None)


def _fused_2d_bias(x, conv_state, weight, bias):
    out, state = _fused_bias(x.unsqueeze(-1), conv_state, weight, bias)
    return out.squeeze(-1), state


def _fused_2d(x, conv_state, weight):
    return _fused_2d_bias(x, conv_state, weight, None)


def _check(values: dict[str, Any]) -> str | None:
    x = values["x"]
    x = x.unsqueeze(-1) if x.dim() == 2 else x  # the 2-D spelling's one token per sequence
    try:
        check_causal_conv1d_update_args(x, values["conv_state"], values["weight"], values.get("bias"))
    except ValueError as e:
        return str(e).removeprefix("causal_conv1d_update: ")
    return None


def _is_update(node) -> bool:
    """An unpadded convolution over a cat of a graph input (the cached state) with the new inputs:
    a decode step's update, not a prefill's padded conv (transformers' causal_conv1d_fn, which
    also reads the cached state where a prompt continues one) or a vision tower's."""
    source, padding = node.args[0], node.args[4]
    if getattr(source, "target", None) is not torch.ops.aten.cat.default or any(padding):
        return False
    first = source.args[0][0]
    return isinstance(first, torch.fx.Node) and first.op == "placeholder"


def _examples():
    # x is the transpose of the projection's [B, T, C] output, as the model passes it.
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        x = torch.randn(2, 1, 24, dtype=dtype).transpose(1, 2)
        yield x, torch.randn(2, 24, 4, dtype=dtype), torch.randn(24, 4, dtype=dtype)


def _examples_bias():
    for x, state, weight in _examples():
        yield x, state, weight, torch.randn(24, dtype=weight.dtype)


def _examples_2d():
    for x, state, weight in _examples():
        yield x[:, :, 0], state, weight


def _examples_2d_bias():
    for x, state, weight, bias in _examples_bias():
        yield x[:, :, 0], state, weight, bias


def _fusion(name: str, summary: str, spelling: Spelling, examples, near_misses: bool = False) -> Fusion:
    return Fusion(
        name=name,
        summary=summary,
        doc=__doc__.split("\n\n", 1)[1],
        spellings=(spelling,),
        example_inputs=examples,
        check=_check,
        # One family reports the unmatched decode-step convs (every spelling's conv is one).
        candidate_ops=("aten.convolution.default",) if near_misses else (),
        candidate=_is_update if near_misses else None,
        builtin=True,
    )


FUSIONS = (
    _fusion(
        "causal_conv1d_update",
        "decode-step causal depthwise conv + state shift + SiLU (Gated DeltaNet) -> one kernel",
        Spelling("transformers_causal_conv1d_update", transformers_causal_conv1d_update, _fused),
        _examples,
        near_misses=True,
    ),
    _fusion(
        "causal_conv1d_update_bias",
        "the same with a conv bias",
        Spelling("transformers_causal_conv1d_update_bias", transformers_causal_conv1d_update_bias, _fused_bias),
        _examples_bias,
    ),
    _fusion(
        "causal_conv1d_update_token",
        "the same on x [B, C] (causal-conv1d's reference at one token)",
        Spelling("causal_conv1d_ref_2d", causal_conv1d_ref_2d, _fused_2d),
        _examples_2d,
    ),
    _fusion(
        "causal_conv1d_update_token_bias",
        "the same with a conv bias",
        Spelling("causal_conv1d_ref_2d_bias", causal_conv1d_ref_2d_bias, _fused_2d_bias),
        _examples_2d_bias,
    ),
)
