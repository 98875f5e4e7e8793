"""The canonical op ``fusion_passes::quant_fp8``: FP8 (float8_e4m3fn) activation quantization,
every spelling of patterns/quant_fp8.py raised to it.

Unfused: an amax reduction, a scale computation and a scale-and-cast pass, as a spelling writes them
Fused:   q, scales = quant_fp8(x, *quant)          quant: common.fp8.QuantFP8 (all twelve fields)

A raise-stage op (``lower_back=True``): where no region fusion (norm + quant, SiLU + quant)
consumed it, the pass manager decomposes it back into ``reference`` and Inductor fuses it with its
neighbours as it did the spelling. It has no kernel of its own: its CUDA path is the reference too.
"""

from __future__ import annotations

from fusion_passes.lowering.common.fp8 import QuantFP8
from fusion_passes.lowering.common.ops import op_from_reference
from fusion_passes.lowering.quant_fp8.reference import quant_fp8_reference

quant_fp8 = op_from_reference("quant_fp8", quant_fp8_reference, lower_back=True)


@quant_fp8.register_fake
def _quant_fp8_fake(x, *quant):
    return QuantFP8(*quant).fake_outputs(x)
