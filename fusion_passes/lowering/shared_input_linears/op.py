"""The canonical op ``fusion_passes::shared_input_linears``: bias-free linears of one input.

Unfused (a model's sibling projections, traced): one GEMM launch per weight, each reading the
same input; a small one (Qwen 3.5's ``in_proj_b`` / ``in_proj_a``: 32 rows) costs a launch's
latency, not its bytes.
Fused:
    y_1, ..., y_n = shared_input_linears(x, [w_1, ..., w_n])        # y_i = x @ w_i.T
one kernel over the weights' rows. The math lives in ``reference``.
"""

from __future__ import annotations

import torch

from fusion_passes.lowering.common.direct_launch import register_launcher
from fusion_passes.lowering.common.ops import op_from_reference
from fusion_passes.lowering.shared_input_linears.reference import (
    check_shared_input_linears_args,
    shared_input_linears_reference,
)

shared_input_linears = op_from_reference(
    "shared_input_linears", shared_input_linears_reference, check=check_shared_input_linears_args
)


@shared_input_linears.register_kernel("cuda")
@register_launcher(torch.ops.fusion_passes.shared_input_linears.default)
def _shared_input_linears_cuda(x, weights, wrap=None):
    from fusion_passes.lowering.shared_input_linears.triton import shared_input_linears_triton

    return shared_input_linears_triton(x, weights, wrap=wrap)


@shared_input_linears.register_fake
def _shared_input_linears_fake(x, weights):
    check_shared_input_linears_args(x, weights)
    return [x.new_empty((x.shape[0], w.shape[0])) for w in weights]
