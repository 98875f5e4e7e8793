"""A MoE router's fp32 logits from bf16 / fp16 hidden states and gate weight.

transformers' DeepseekV3TopkRouter and the routers written after it (DeepSeek V2 / V3 / V3.2,
GLM-4.5 / 4.6 MoE, Kimi, dots1, LongCat, Solar Open, ...), and HunYuan's and ERNIE 4.5's with
``.float()``, score in fp32:

    hidden_states = hidden_states.view(-1, self.config.hidden_size)
    router_logits = F.linear(hidden_states.type(torch.float32), self.weight.type(torch.float32))

Unfused: the gate weight upcast in a kernel of its own every step (its bf16 read, a new fp32 copy
         written: 3.7 + 7.3 MB a layer at DeepSeek V3's 256 experts x 7168), then cuBLAS's fp32
         GEMM reading the copy
Fused:   router_logits = fusion_passes.router_logits(hidden_states, self.weight)
         one kernel reading the weight once in its own dtype and summing exact fp32 products
         (lowering/router_logits); SGLang's dsv3_router_gemm is the same idea for DeepSeek V3

The same products (each exact in fp32), summed in another order than cuBLAS: the logits may
differ in their last bits, tested against the fp32 reference. Not a site: more than 64 tokens (a
prefill, where the upcast is a small part of a large GEMM; not measured). Rejected with the
reason: inputs of two dtypes. Not matched: a bf16 GEMM whose output is upcast after (Qwen3-MoE,
MiniMax-M2: their logits are the GEMM's own rounding), an upcast weight without the hidden states'.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from fusion_passes.fusion import Fusion, NotASite, Spelling
from fusion_passes.lowering.router_logits.reference import check_router_logits_args

MAX_TOKENS = 64  # a decode step's tokens; a prefill's GEMM is left to cuBLAS


def transformers_router(hidden_states, weight):
    """transformers' DeepseekV3TopkRouter.forward up to its logits (hidden states already [T, H])."""
    return F.linear(hidden_states.type(torch.float32), weight.type(torch.float32))


def _fused(hidden_states, weight):
    return torch.ops.fusion_passes.router_logits(hidden_states, weight)


def _check(values: dict[str, Any]) -> str | None:
    hidden_states, weight = values["hidden_states"], values["weight"]
    if hidden_states.dim() == 2 and isinstance(hidden_states.shape[0], int) and hidden_states.shape[0] > MAX_TOKENS:
        return NotASite(f"{hidden_states.shape[0]} tokens (a prefill)")
    try:
        check_router_logits_args(hidden_states, weight)
    except ValueError as e:
        return str(e).removeprefix("router_logits: ")
    return None


def _upcast_mm(node) -> bool:
    """An mm whose operands are both upcasts (the weight's through its transpose)."""

    def upcast(arg) -> bool:
        if getattr(arg, "target", None) == torch.ops.aten.permute.default:
            arg = arg.args[0]
        return getattr(arg, "target", None) == torch.ops.prims.convert_element_type.default

    return len(node.args) == 2 and all(upcast(a) for a in node.args)


def _examples():
    # 3 tokens of hidden size 16, 8 experts, in each input dtype (an fp32 example would trace no
    # upcast at all: the pattern would be any fp32 GEMM)
    for dtype in (torch.bfloat16, torch.float16):
        yield torch.randn(3, 16, dtype=dtype), torch.randn(8, 16, dtype=dtype)


ROUTER_LOGITS = Fusion(
    name="router_logits",
    summary="MoE router scoring in fp32 (upcast hidden states and gate weight, fp32 GEMM) -> one router_logits "
    "kernel reading the weight in its own dtype",
    doc=__doc__.split("\n\n", 1)[1],
    spellings=(Spelling("transformers_fp32_router", transformers_router, _fused),),
    example_inputs=_examples,
    check=_check,
    candidate_ops=("aten.mm.default",),
    candidate=_upcast_mm,
    opt_in="not yet timed on a GPU: the weight's upcast kernel it removes takes 1.4 us per MoE layer on one H200 "
    "(DeepSeek V3.2, batch 1)",
    builtin=True,
)

FUSIONS = (ROUTER_LOGITS,)
