"""The canonical op ``fusion_passes::advance_lengths``: every cache write counter of a step, advanced.

Unfused (a StaticCache decode step, traced): each layer's ``cumulative_length.add_(S)`` (and
DeepSeek V3.2's indexer's) is an add copied into its counter at the step's end, which Inductor
writes in a kernel of its own per counter (4 launches for 2 DeepSeek V3.2 layers in its sm_90
code; a 61-layer model: 122 one-thread kernels a step).
Fused:
    new_lengths = advance_lengths(starts, lengths, steps)
one kernel for them all, writing the counters in place where Inductor launches it. The math lives
in ``reference``.
"""

from __future__ import annotations

import torch

from fusion_passes.lowering.cache_lengths.reference import advance_lengths_reference, check_advance_lengths_args
from fusion_passes.lowering.common.direct_launch import register_launcher
from fusion_passes.lowering.common.ops import op_from_reference

advance_lengths = op_from_reference(
    "advance_lengths", advance_lengths_reference, check=check_advance_lengths_args, contiguous=False
)


# writes_inputs: the lengths (argument 1, a list), overwritten in place when Inductor launches it
@advance_lengths.register_kernel("cuda")
@register_launcher(torch.ops.fusion_passes.advance_lengths.default, writes_inputs=(1,))
def _advance_lengths_cuda(starts, lengths, steps, wrap=None):
    from fusion_passes.lowering.cache_lengths.triton import advance_lengths_triton

    return advance_lengths_triton(starts, lengths, steps, wrap=wrap)


@advance_lengths.register_fake
def _advance_lengths_fake(starts, lengths, steps):
    check_advance_lengths_args(starts, lengths, steps)
    return [torch.empty_like(length) for length in lengths]
