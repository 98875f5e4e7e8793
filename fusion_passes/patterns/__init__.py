"""WHAT is detected: one module per fusion family. Each lists the unfused spellings found in real
model code and maps them to ONE canonical op of ``fusion_passes.lowering``. Importing this package
registers the built-in fusions, in the order they are applied."""

from fusion_passes.patterns import rms_norm, rms_norm_quant_fp8  # noqa: F401  (in this order)
from fusion_passes.patterns import mla_rope  # noqa: F401,E402  (after rms_norm: starts from it)
from fusion_passes.patterns import qk_norm_rope  # noqa: E402,F401  (after rms_norm)
