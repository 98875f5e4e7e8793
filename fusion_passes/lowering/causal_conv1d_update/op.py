"""The canonical op ``fusion_passes::causal_conv1d_update``: a decode step's depthwise causal conv
with its conv-state shift (and SiLU).

Unfused (transformers' causal_conv1d_update, traced): cat(state, x) -> slice + copy back into the
state, an extern depthwise convolution, a slice, SiLU: 3 kernels and a copy per layer.
Fused:
    out, new_state = causal_conv1d_update(x, conv_state, weight, bias, silu)
one kernel that reads the state once, writes the shifted state and the activated output.

The op is functional (new_state is an output); on CUDA the launch writes the state in place and
Inductor's reinplacing drops the copy back into the cache (``direct_launch``: inputs written in
place). The math lives in ``reference``.
"""

from __future__ import annotations

import torch

from fusion_passes.lowering.causal_conv1d_update.reference import (
    causal_conv1d_update_reference,
    check_causal_conv1d_update_args,
)
from fusion_passes.lowering.common.direct_launch import register_launcher
from fusion_passes.lowering.common.ops import op_from_reference

causal_conv1d_update = op_from_reference(
    "causal_conv1d_update", causal_conv1d_update_reference, check=check_causal_conv1d_update_args
)


# The CUDA kernel doubles as the direct launcher; the state is written in place only when the
# launch is inlined (wrap given: functionalized, reinplaced by Inductor), else into a copy.
@causal_conv1d_update.register_kernel("cuda")
@register_launcher(torch.ops.fusion_passes.causal_conv1d_update.default, writes_inputs=(1,))
def _causal_conv1d_update_cuda(x, conv_state, weight, bias, silu, wrap=None):
    from fusion_passes.lowering.causal_conv1d_update.triton import causal_conv1d_update_triton

    return causal_conv1d_update_triton(x, conv_state, weight, bias, silu, wrap=wrap)


@causal_conv1d_update.register_fake
def _causal_conv1d_update_fake(x, conv_state, weight, bias, silu):
    check_causal_conv1d_update_args(x, conv_state, weight, bias)
    return torch.empty(x.shape, dtype=x.dtype, device=x.device), torch.empty_like(
        conv_state, memory_format=torch.contiguous_format
    )
