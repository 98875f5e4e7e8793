"""Per-GPU launch tables: for each kernel family, the launch rules its launcher applies on each GPU
(``common/launch_policy.select``), and a "default" row for GPUs no one has measured and for the
CPU's interpreter.

Every rule a GPU's row takes over the default was measured on that GPU; the runs and their numbers
are in docs/notes/launch-policy.md, under the heading each row's ``evidence`` names. A rule is
adopted only where the gain beat the run-to-run spread measured in the same runs
(tools/ab_launch_rule.py: the rule on against off in interleaved rounds, each variant's slowest
round over its fastest as the spread).
"""

from __future__ import annotations

from typing import NamedTuple

from fusion_passes.lowering.rms_norm_quant_fp8.launch import NormQuantLaunch

RMS_NORM_QUANT_FP8: dict[str, NormQuantLaunch] = {
    # The padded block of rms_norm's launch_config at every token count: no rule of one GPU.
    "default": NormQuantLaunch(),
    "NVIDIA H200": NormQuantLaunch(
        # 4 warps from 4096 tokens with the residual: 1.01-1.12x at hidden 5120 / 7168; from 512
        # norm-only: 1.11-1.20x at 4096-16384 tokens (two runs, 2026-12-02).
        many_tokens=4096,
        norm_only_many_tokens=512,
        many_tokens_warps=4,
        # Norm-only rows in exact chunks from 512 tokens, A/B in 3 interleaved rounds at 4 warps:
        # 1.04-1.66x at 4096-16384 tokens, 1.03-1.13x at 512 (hidden 7168 there 0.98-1.00x).
        chunk_min=1024,
        chunks_max=16,
        # Rows made to depend on the weight's loads (no bit of the output changes), A/B in 3
        # interleaved rounds: with the residual 1.05-1.13x at 512-4096 tokens, 1.09-1.12x at
        # 5120 x 16384 (spread <= 1.02x); norm-only 1.02-1.08x at 4096 tokens (spread 1.005x) but
        # 0.97-1.01x at 16384, within its 1.03-1.07x spread: not taken from there.
        weight_first_residual=True,
        weight_first_norm_only=True,
        weight_first_norm_only_below=16384,
        evidence="rms_norm_quant_fp8 on one H200 (2026-12-02, 2026-12-03)",
    ),
}


class FP8RegionRule(NamedTuple):
    """Where an FP8 region fusion (norm + quant, SiLU-and-mul + quant) leaves a site to stock
    Inductor: the shapes measured slower fused, on one GPU. The region's check reads it at compile
    time (static shapes), so the site is not rewritten and its quantization is lowered back."""

    # Rows (tokens) lo <= rows < hi of a static-scale quantization left unfused; (0, 0): none.
    static_unfused_rows: tuple[int, int] = (0, 0)
    evidence: str = ""


RMS_NORM_QUANT_FP8_REGION: dict[str, FP8RegionRule] = {
    "default": FP8RegionRule(),
    # Static scale at 4-16 tokens 0.95-0.98x stock Inductor in a CUDA graph at hidden 7168 / 4096 /
    # 3072 (1 token 1.14-1.48x, 64 and up 1.02-1.75x); BENCHMARKS.md, norm + FP8.
    "NVIDIA H200": FP8RegionRule((2, 32), evidence="bench_rms_norm_quant_fp8 on one H200 (2026-12-02)"),
}

SILU_MUL_QUANT_FP8_REGION: dict[str, FP8RegionRule] = {
    "default": FP8RegionRule(),
    # Static scale at 1-16 tokens 0.91-0.96x stock Inductor in a CUDA graph at intermediate 18432 /
    # 12288 / 2048 (64 tokens and up 1.05-1.56x but 0.92x at 2048 x 64); BENCHMARKS.md, SiLU + FP8.
    "NVIDIA H200": FP8RegionRule((1, 32), evidence="bench_silu_mul_quant_fp8 on one H200 (2026-12-02)"),
}


def fp8_region_refusal(table: dict[str, FP8RegionRule], scheme: str, x) -> str | None:
    """The one-line reason a site of ``scheme`` on ``x`` (fake tensor: the site's shape and device)
    stays unfused under ``table``'s row for x's device, or None to fuse."""
    from fusion_passes.lowering.common.launch_policy import device_name, select

    lo, hi = select(table, x.device).static_unfused_rows
    rows = x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0
    if scheme != "static" or not isinstance(rows, int) or not lo <= rows < hi:
        return None
    return (
        f"static FP8 at {rows} rows on {device_name(x.device)}: measured slower fused than stock "
        f"Inductor at {lo}-{hi - 1} rows (lowering/launch_tables.py); left to Inductor"
    )


class GatedDeltaLaunch(NamedTuple):
    """The Gated DeltaNet step's launch by the number of (sequence, value head) pairs it updates:
    the first rule whose bound the pairs stay under (None: no bound) gives the state columns per
    program and the warps. Narrow blocks at few pairs spread the state's traffic over more SMs."""

    rules: tuple[tuple[int | None, int, int], ...]
    evidence: str = ""


GATED_DELTA_STEP: dict[str, GatedDeltaLaunch] = {
    # Halve the block from the whole row until there are 512 programs, down to 32 columns; 4 warps.
    "default": GatedDeltaLaunch(rules=((None, 0, 4),)),
    # Swept over 5 block widths x 4 warp counts, K = V = 128, 32 value heads, in a CUDA graph:
    # 32 pairs (batch 1) 16 cols x 1 warp 3.6 us vs the default's 4.3; 256 pairs 32 x 1 12.6 vs 14.2;
    # 1024 pairs 64 x 4 42.0 vs 45.7; 4096 pairs 64 x 4 148.6 vs 150.7 (docs/notes/launch-policy.md).
    "NVIDIA H200": GatedDeltaLaunch(
        rules=((128, 16, 1), (1024, 32, 1), (None, 64, 4)),
        evidence="bench_gated_delta_step --sweep on one H200 (2026-12-03)",
    ),
}


class GatedDeltaNormLaunch(NamedTuple):
    """gated_delta_step_norm's launch by the (sequence, value head) pairs it updates: from
    ``epilogue_from`` pairs one program per pair holds the whole value row and normalises it after
    the step (one launch, ``warps`` warps); under it the step runs on GATED_DELTA_STEP's narrower
    tiles (more programs for few pairs) and the gated norm is a second, small launch."""

    epilogue_from: int = 0
    warps: int = 4
    evidence: str = ""


GATED_DELTA_STEP_NORM: dict[str, GatedDeltaNormLaunch] = {
    # One launch at every size: the op's point. Unmeasured on every GPU (an opt-in fusion): the
    # whole row at K = V = 128 and 4 warps was within 1.4-9% of the best step tile at 256-4096
    # pairs on one H200 (bench_gated_delta_step --sweep's "128 x 4"), never timed at 32 pairs.
    "default": GatedDeltaNormLaunch(),
}


class MoeSortRule(NamedTuple):
    """The most (token, expert) pairs moe_sort_by_expert's one-kernel sort takes on one GPU; more
    (a prefill's) are left to Inductor's sort. 0: no limit."""

    max_pairs: int = 0
    evidence: str = ""


MOE_SORT_BY_EXPERT: dict[str, MoeSortRule] = {
    # The kernel's work grows as pairs^2 on any GPU: the H200's limit stands for GPUs no one has
    # measured (a prefill's sort left to Inductor costs little beside its GEMMs; a fused one there
    # costs up to 14x Inductor's).
    "default": MoeSortRule(4096, evidence="bench_moe_sort_by_expert on one H200 (2026-12-03)"),
    # 256 experts, top-8, in a CUDA graph: 3.3x / 2.5x / 1.2x stock Inductor at 8 / 512 / 4096
    # pairs, 0.79x at 8192, 0.07x at 32768 (a 4096-token prefill).
    "NVIDIA H200": MoeSortRule(4096, evidence="bench_moe_sort_by_expert on one H200 (2026-12-03)"),
}


def moe_sort_refusal(expert_ids) -> str | None:
    """The one-line reason moe_sort_by_expert leaves the sort of ``expert_ids`` (a fake tensor: the
    site's size and device) to Inductor on its device, or None to fuse."""
    from fusion_passes.lowering.common.launch_policy import device_name, select

    limit = select(MOE_SORT_BY_EXPERT, expert_ids.device).max_pairs
    pairs = expert_ids.numel()
    if not limit or not isinstance(pairs, int) or pairs <= limit:
        return None
    return (
        f"{pairs} pairs on {device_name(expert_ids.device)}: the one-kernel sort was measured slower "
        f"than Inductor's beyond {limit} (lowering/launch_tables.py); left to Inductor"
    )
