"""The canonical op ``fusion_passes::causal_conv1d``: a prefill's depthwise causal conv (and SiLU).

Unfused (transformers' causal_conv1d_fn, traced): an extern depthwise convolution over a
left-padded copy of the transposed projection (after a cat with the cached conv state where the
prompt continues one), then a slice + SiLU kernel.
Fused:
    out = causal_conv1d(x, weight, bias, silu, initial_state=None)
one kernel that reads x in the layout the projection wrote it (channels contiguous) and writes the
activated output, [B, C, T] contiguous as the unfused graph's. The math lives in ``reference``.
"""

from __future__ import annotations

import torch

from fusion_passes.lowering.causal_conv1d.reference import causal_conv1d_reference, check_causal_conv1d_args
from fusion_passes.lowering.common.direct_launch import register_launcher
from fusion_passes.lowering.common.ops import op_from_reference

causal_conv1d = op_from_reference("causal_conv1d", causal_conv1d_reference, check=check_causal_conv1d_args)


@causal_conv1d.register_kernel("cuda")
@register_launcher(torch.ops.fusion_passes.causal_conv1d.default)
def _causal_conv1d_cuda(x, weight, bias, silu, initial_state=None, wrap=None):
    from fusion_passes.lowering.causal_conv1d.triton import causal_conv1d_triton

    return causal_conv1d_triton(x, weight, bias, silu, initial_state, wrap=wrap)


@causal_conv1d.register_fake
def _causal_conv1d_fake(x, weight, bias, silu, initial_state=None):
    check_causal_conv1d_args(x, weight, bias, initial_state)
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)
