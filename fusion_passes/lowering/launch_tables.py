"""Per-GPU launch tables: for each kernel family, the launch rules its launcher applies on each GPU
(``common/launch_policy.select``), and a "default" row for GPUs no one has measured and for the
CPU's interpreter.

Every rule a GPU's row takes over the default was measured on that GPU; the runs and their numbers
are in docs/notes/launch-policy.md, under the heading each row's ``evidence`` names. A rule is
adopted only where the gain beat the run-to-run spread measured in the same runs; the note beside a
rule says where it is within the spread (kept, because it changes no bit of the output, until a
repeated run decides it).
"""

from __future__ import annotations

from fusion_passes.lowering.rms_norm_quant_fp8.launch import NormQuantLaunch

RMS_NORM_QUANT_FP8: dict[str, NormQuantLaunch] = {
    # The padded block of rms_norm's launch_config at every token count: no rule of one GPU.
    "default": NormQuantLaunch(),
    "NVIDIA H200": NormQuantLaunch(
        # 4 warps from 4096 tokens with the residual: 1.01-1.12x at hidden 5120 / 7168; from 512
        # norm-only: 1.11-1.20x at 4096-16384 tokens (beyond the spread).
        many_tokens=4096,
        norm_only_many_tokens=512,
        many_tokens_warps=4,
        # Norm-only rows in exact chunks from 512 tokens: 1.07-1.52x at 4096-16384 tokens.
        chunk_min=1024,
        chunks_max=16,
        # Rows made to depend on the weight's loads: 1.02-1.12x, partly within the 5% spread of
        # two runs at 16384 tokens; no bit of the output changes.
        weight_first_residual=True,
        weight_first_norm_only=True,
        evidence="rms_norm_quant_fp8 on one H200 (2026-12-02)",
    ),
}
