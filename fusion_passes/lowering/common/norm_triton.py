"""Device code of the RMSNorm that several kernels share (norm, norm + FP8, QK-norm + RoPE, the
one-shot allreduce): the weight scaling in the two rounding forms of rms_norm/reference.py.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def scale_by_weight(n, w, weight_offset, dtype, CAST_BEFORE_WEIGHT: tl.constexpr):
    """The two rounding forms of the reference, in fp32 (shared by every norm kernel):
    Llama rounds n to x.dtype before scaling; the fp32-weight form scales by w + weight_offset."""
    if CAST_BEFORE_WEIGHT:
        return n.to(dtype).to(tl.float32) * w
    return n * (w + weight_offset)
