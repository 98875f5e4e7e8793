"""WHAT a fusion becomes: the canonical fused ops (torch.library), each with a plain-torch
reference that runs on any device and a Triton kernel that runs on CUDA."""

from fusion_passes.lowering.rms_norm.op import add_rms_norm, rms_norm
from fusion_passes.lowering.rms_norm_quant_fp8.op import add_rms_norm_quant_fp8, rms_norm_quant_fp8
from fusion_passes.lowering.qk_norm_rope.op import qk_norm_rope
from fusion_passes.lowering.mla_rope.op import mla_indexer_k_norm_rope, mla_kv_norm_rope, mla_q_rope
from fusion_passes.lowering.silu_mul_quant_fp8.op import silu_mul_quant_fp8
from fusion_passes.lowering.allreduce_rms_norm.op import allreduce_add_rms_norm, allreduce_rms_norm
from fusion_passes.lowering.allreduce_rms_norm_quant_fp8.op import (
    allreduce_add_rms_norm_quant_fp8,
    allreduce_rms_norm_quant_fp8,
)

__all__ = [
    "add_rms_norm",
    "add_rms_norm_quant_fp8",
    "allreduce_add_rms_norm",
    "allreduce_add_rms_norm_quant_fp8",
    "allreduce_rms_norm",
    "allreduce_rms_norm_quant_fp8",
    "mla_indexer_k_norm_rope",
    "mla_kv_norm_rope",
    "mla_q_rope",
    "qk_norm_rope",
    "rms_norm",
    "rms_norm_quant_fp8",
    "silu_mul_quant_fp8",
]
