"""The canonical op ``fusion_passes::rope``: rotary position embedding of one tensor, every
spelling's numerics stated by two flags (see ``rope_reference``).

Unfused: q * cos + rotate_half(q) * sin, or GPT-J's even/odd pairs, in x.dtype or in fp32
Fused:   fusion_passes.rope(x, cos, sin, interleaved, compute_fp32)

A raise-stage op (``lower_back=True``): the region fusions (qk_norm_rope) consume it; one left
standalone is decomposed back into ``rope_reference``, so Inductor fuses it with its neighbours as
it did the model's own spelling. No kernel of its own: it runs its reference on every device.
"""

from __future__ import annotations

import torch

from fusion_passes.lowering.common.ops import op_from_reference
from fusion_passes.lowering.rope.reference import check_rope_args, rope_reference

rope = op_from_reference("rope", rope_reference, check=check_rope_args, lower_back=True)


# Unchecked: the region patterns are re-traced on candidates' shapes before their checks run, and
# a candidate that does not fit (a norm over pairs of heads) must be rejected with a reason by the
# check, not raise here. The op itself checks its arguments.
@rope.register_fake
def _rope_fake(x, cos, sin, interleaved=False, compute_fp32=False):
    return torch.empty_like(x, memory_format=torch.contiguous_format)
