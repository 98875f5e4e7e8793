"""A prefill's depthwise causal conv and its SiLU (Gated DeltaNet, Mamba-style layers).

Over a prompt, Qwen3-Next / Qwen 3.5 run the projected q / k / v channels through a W-tap
depthwise conv padded by W - 1 on the left and cut back to the prompt: transformers'
``causal_conv1d_fn`` (causal-conv1d's reference ``causal_conv1d_ref`` writes the same), and
``nn.Conv1d(padding=W - 1)`` called as a module (Mamba's and earlier Qwen3-Next code):

    out = silu(conv1d(x.to(weight.dtype), weight.unsqueeze(1), bias, padding=W-1, groups=C)[..., :T])
    out = out.to(x.dtype)                                     x = mixed_qkv.transpose(1, 2)

Where the prompt continues a cached state (transformers' StaticCache once the layer has one: a
chunked prefill, a second turn), the cache's ``update_conv_state`` first returns
``full = cat([conv_state, x], -1)`` and copies its last S inputs into the cache; the conv runs over
``full`` and the prompt's T outputs are kept (``[..., -T:]``).

Unfused: the transposed projection copied to [B, C, T], an extern depthwise convolution
         (at::native's conv_depthwise2d: 353 us for 4096 tokens x 8192 channels in bf16, measured
         on one H200), a slice + SiLU kernel.
Fused:   out = fusion_passes.causal_conv1d(x, weight, bias, silu=True, initial_state=conv_state):
         one kernel reading x where the projection wrote it (the state's inputs for the first
         W - 1 outputs); the cache's new state is the last S inputs of cat([conv_state, x]), which
         Inductor writes as a copy of S columns (the cat of all T is gone).

Not fused: a conv whose padding is not W - 1 or that keeps other than the first T outputs (not
causal), strides or dilations other than 1, a conv that is not depthwise (groups != C), x and
weight of different dtypes. The decode step's conv over [state, x] is causal_conv1d_update's.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx
import torch.nn.functional as F

from fusion_passes.fusion import Fusion, GraphExample, Spelling
from fusion_passes.lowering.causal_conv1d.reference import check_causal_conv1d_args

WIDTH = 4  # the taps of Qwen3-Next's, Qwen 3.5's and Mamba's convs; other widths: graph_examples


def _transformers_conv_fn(x, weight, bias):
    # transformers' causal_conv1d_fn (qwen3_next, qwen3_5, qwen3_5_moe), activation "silu".
    seq_len = x.shape[-1]
    out = F.conv1d(x.to(weight.dtype), weight=weight.unsqueeze(1), bias=bias, padding=weight.shape[-1] - 1,
                   groups=x.shape[1])[:, :, :seq_len]  # fmt: skip
    return F.silu(out).to(x.dtype)


def transformers_causal_conv1d_fn(x, weight):
    # The models' conv1d has bias=False.
    return _transformers_conv_fn(x, weight, None)


def transformers_causal_conv1d_fn_bias(x, weight, bias):
    return _transformers_conv_fn(x, weight, bias)


def transformers_causal_conv1d_fn_after_state(x, conv_state, weight):
    # transformers' StaticCache (LinearAttentionLayer.update_conv_state with a previous state):
    # the cat, its last S inputs copied into the cache (the functional form of copy_); then
    # causal_conv1d_fn over the cat and the prompt's outputs kept (qwen3_5's forward).
    full = torch.cat([conv_state, x], dim=-1)
    new_state = torch.ops.aten.copy.default(conv_state, full[..., -conv_state.shape[-1] :])
    return _transformers_conv_fn(full, weight, None)[:, :, -x.shape[-1] :], new_state


def conv1d_module(x, weight3):
    # nn.Conv1d(C, C, W, groups=C, padding=W - 1, bias=False) called as a module, then the
    # activation: Mamba's `act(conv1d(x)[..., :seqlen])` and earlier Qwen3-Next code.
    out = F.conv1d(x, weight3, None, padding=weight3.shape[-1] - 1, groups=x.shape[1])
    return F.silu(out[..., : x.shape[-1]])


def conv1d_module_bias(x, weight3, bias):
    out = F.conv1d(x, weight3, bias, padding=weight3.shape[-1] - 1, groups=x.shape[1])
    return F.silu(out[..., : x.shape[-1]])


def _fused(x, weight):
    return torch.ops.fusion_passes.causal_conv1d(x, weight, None, True)


def _fused_bias(x, weight, bias):
    return torch.ops.fusion_passes.causal_conv1d(x, weight, bias, True)


def _fused_after_state(x, conv_state, weight):
    out = torch.ops.fusion_passes.causal_conv1d(x, weight, None, True, conv_state)
    # The new state is the last S inputs of cat([conv_state, x]), written without the cat: Inductor
    # lowers a cat read only through a slice as a whole concatenated buffer (4 + T columns: 67 of
    # 141 us at 4096 tokens x 8192 channels on one H200). The replacement is traced at the match's
    # sizes, so the branch is on a concrete T.
    state_len, tokens = conv_state.shape[-1], x.shape[-1]
    if tokens >= state_len:
        new_state = x[..., tokens - state_len :]
    else:
        new_state = torch.cat([conv_state[..., tokens:], x], dim=-1)
    return out, torch.ops.aten.copy.default(conv_state, new_state)


def _fused_module(x, weight3):
    return torch.ops.fusion_passes.causal_conv1d(x, weight3.squeeze(1), None, True)


def _fused_module_bias(x, weight3, bias):
    return torch.ops.fusion_passes.causal_conv1d(x, weight3.squeeze(1), bias, True)


def _check(values: dict[str, Any]) -> str | None:
    x = values["x"]
    weight = values["weight"] if "weight" in values else values["weight3"].squeeze(1)
    if x.dtype != weight.dtype:
        return f"x is {x.dtype}, the conv's weight {weight.dtype}"
    state = values.get("conv_state")
    if state is not None and state.dtype != x.dtype:
        return f"the cached conv state is {state.dtype}, x {x.dtype}"
    try:
        check_causal_conv1d_args(x, weight, values.get("bias"), state)
    except ValueError as e:
        return str(e).removeprefix("causal_conv1d: ")
    return None


def _is_prefill_conv(node) -> bool:
    """A 1-d depthwise convolution padded by W - 1 (a causal conv over a prompt)."""
    # aten.convolution(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups)
    if len(node.args) < 9 or "val" not in getattr(node.args[1], "meta", {}):
        return False
    weight = node.args[1].meta["val"]
    stride, padding, dilation, transposed, groups = (*node.args[3:7], node.args[8])
    return (weight.dim() == 3 and weight.shape[1] == 1 and list(padding) == [weight.shape[-1] - 1]
            and list(stride) == [1] and list(dilation) == [1] and not transposed and groups == weight.shape[0])  # fmt: skip


def _examples(width: int = WIDTH):
    # x is the transpose of the projection's [B, T, C] output, as the model passes it.
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        yield torch.randn(2, 10, 24, dtype=dtype).transpose(1, 2), torch.randn(24, width, dtype=dtype)


def _examples_after_state():
    for x, weight in _examples():
        yield x, torch.randn(x.shape[0], x.shape[1], WIDTH, dtype=x.dtype), weight


def _graph_examples(graph: torch.fx.Graph):
    """The spellings at the widths other than WIDTH that the graph's prefill convs have."""
    for node in graph.find_nodes(op="call_function", target=torch.ops.aten.convolution.default):
        if _is_prefill_conv(node) and node.args[1].meta["val"].shape[-1] != WIDTH:
            x, weight = node.args[0].meta["val"], node.args[1].meta["val"]
            args = (torch.empty_strided(x.shape, x.stride(), dtype=x.dtype).normal_(),
                    torch.randn(weight.shape[0], weight.shape[-1], dtype=weight.dtype))  # fmt: skip
            yield GraphExample(args, frozenset({"transformers_causal_conv1d_fn"}))


def _fusion(name, summary, spelling, examples, graph_examples=None, near_misses=False) -> Fusion:
    return Fusion(
        name=name,
        summary=summary,
        doc=__doc__.split("\n\n", 1)[1],
        spellings=(spelling,),
        example_inputs=examples,
        check=_check,
        # One fusion reports the unmatched prefill convs (every spelling's conv is one).
        candidate_ops=("aten.convolution.default",) if near_misses else (),
        candidate=_is_prefill_conv if near_misses else None,
        graph_examples=graph_examples,
        builtin=True,
    )


def _with_bias(examples):
    def gen():
        for x, weight in examples():
            yield x, weight, torch.randn(weight.shape[0], dtype=weight.dtype)

    return gen


def _module_form(examples):
    def gen():
        for x, weight, *bias in examples():
            yield x, weight.unsqueeze(1), *bias

    return gen


FUSIONS = (
    # First: the plain spelling would take its conv too, as a zero-padded conv over the whole cat
    # (x = the cat), leaving the cat of all T inputs; where the state is shorter than W - 1 that
    # is the site (the conv reads zeros before the state).
    _fusion(
        "causal_conv1d_after_state",
        "the same where the prompt continues a cached conv state (transformers' StaticCache)",
        Spelling("transformers_causal_conv1d_fn_after_state", transformers_causal_conv1d_fn_after_state,
                 _fused_after_state),  # fmt: skip
        _examples_after_state,
    ),
    _fusion(
        "causal_conv1d",
        "prefill causal depthwise conv + SiLU (Gated DeltaNet) -> one kernel",
        Spelling("transformers_causal_conv1d_fn", transformers_causal_conv1d_fn, _fused),
        _examples,
        graph_examples=_graph_examples,
        near_misses=True,
    ),
    _fusion(
        "causal_conv1d_bias",
        "the same with a conv bias",
        Spelling("transformers_causal_conv1d_fn_bias", transformers_causal_conv1d_fn_bias, _fused_bias),
        _with_bias(_examples),
    ),
    _fusion(
        "causal_conv1d_module",
        "the same as an nn.Conv1d module's call (weight [C, 1, W])",
        Spelling("conv1d_module", conv1d_module, _fused_module),
        _module_form(_examples),
    ),
    _fusion(
        "causal_conv1d_module_bias",
        "the same with a conv bias",
        Spelling("conv1d_module_bias", conv1d_module_bias, _fused_module_bias),
        _module_form(_with_bias(_examples)),
    ),
)
