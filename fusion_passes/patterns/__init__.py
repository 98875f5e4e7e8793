"""WHAT is detected: one module per fusion family. Each lists the unfused spellings found in real
model code and maps them to ONE canonical op of ``fusion_passes.lowering``. Importing this package
registers the built-in fusions, in the order they are applied."""

# In this order: the norms first (the later fusions start from their canonical ops); the RoPE
# fusions before the quantization ones, which deduplicate the graph first (Fusion.cse_before).
from fusion_passes.patterns import rms_norm  # noqa: F401
from fusion_passes.patterns import mla_rope  # noqa: F401
from fusion_passes.patterns import qk_norm_rope  # noqa: F401
from fusion_passes.patterns import rms_norm_quant_fp8  # noqa: F401
from fusion_passes.patterns import silu_mul_quant_fp8  # noqa: F401  (independent of the others)
from fusion_passes.patterns import allreduce_rms_norm  # noqa: F401  (after the norms)
from fusion_passes.patterns import allreduce_rms_norm_quant_fp8  # noqa: F401  (after the quant fusions)
