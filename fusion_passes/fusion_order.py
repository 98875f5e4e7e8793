"""The built-in fusions and the order they run in: one list, each entry with why it sits there.

The pass manager applies the enabled fusions in this order to each post-grad graph (as Inductor's
own post_grad passes run in the order written in post_grad.py). A fusion whose patterns start from
another's canonical op (``Fusion.requires``) must come after it; ``builtin_fusions`` checks that.
Within a family, its module's ``FUSIONS`` tuple gives the order, with the reasons in that module.

Adding a family: write ``patterns/<family>.py`` exporting ``FUSIONS``, and put one line here.
"""

from __future__ import annotations

from types import ModuleType

from fusion_passes.fusion import Fusion
from fusion_passes.patterns import (
    allreduce_rms_norm,
    allreduce_rms_norm_quant_fp8,
    cache_lengths,
    causal_conv1d,
    causal_conv1d_update,
    chunk_gated_delta_rule,
    chunk_gated_delta_rule_gva,
    gated_delta_step,
    gated_delta_step_norm,
    gqa_decode_attention,
    masked_prefill_attention,
    masked_prefill_attention_causal,
    mla_rope,
    moe_route,
    moe_route_sort,
    moe_sort_by_expert,
    moe_sort_narrow_keys,
    qk_norm_rope,
    qk_norm_rope_cache,
    quant_fp8,
    rms_norm,
    rms_norm_quant_fp8,
    rope,
    router_logits,
    shared_input_linears,
    silu_mul_quant_fp8,
    sparse_index_mask,
    sparse_decode_attention,
    sparse_index_scores,
)

FUSION_ORDER: tuple[tuple[ModuleType, str], ...] = (
    (rms_norm, "first: every later family except SiLU + FP8 starts from the canonical norm ops"),
    (
        causal_conv1d_update,
        "independent of the others (a cat, a convolution and SiLU); before the quantization "
        "fusions' common-subexpression elimination, as gated_delta_step",
    ),
    (causal_conv1d, "independent of the others (a padded depthwise convolution and SiLU), as the decode step's"),
    (
        gated_delta_step,
        "independent of the norms (its l2norms sum, not average, and have no weight); before the "
        "quantization fusions' common-subexpression elimination, which would merge the two "
        "unsqueezes of the normalised k that transformers' recurrent step traces apart",
    ),
    (
        gated_delta_step_norm,
        "after gated_delta_step and the norms, whose ops (the step, the gated norm's rms_norm) it "
        "starts from; before the lower-back stage, which would return the norm to Inductor",
    ),
    (
        chunk_gated_delta_rule,
        "independent of the others (the prefill's chunked rule, whose l2norms have no weight); "
        "before that elimination too, which would merge the rule's two beta.unsqueeze(-1) and "
        "two exp(cumsum) that its traced patterns hold apart",
    ),
    (chunk_gated_delta_rule_gva, "after chunk_gated_delta_rule, whose op (on repeated q and k) it starts from"),
    (
        mla_rope,
        "after the norms (kv_a_layernorm is a canonical rms_norm); before the quantization "
        "fusions' common-subexpression elimination, which merges the per-layer cos / sin views "
        "that the RoPE patterns expect to find apart",
    ),
    (
        rope,
        "after mla_rope (whose patterns start from transformers' RoPE spellings, which this raises) "
        "and before qk_norm_rope, which starts from the canonical rope op",
    ),
    (qk_norm_rope, "after the norms and before that elimination, as mla_rope"),
    (qk_norm_rope_cache, "after qk_norm_rope, whose op it starts from, and before gqa_decode_attention, which reads the caches"),
    (
        quant_fp8,
        "before the FP8 region fusions, which start from the canonical quant_fp8 it raises; "
        "independent of the norms and RoPE (it matches the quantization alone)",
    ),
    (
        rms_norm_quant_fp8,
        "after the norms (it matches a canonical norm followed by a quantization) and after the "
        "RoPE families (its cse_before deduplicates q / k / v's copies of one quantization)",
    ),
    (silu_mul_quant_fp8, "independent of the others (the MLP's activation, no norm); kept beside the other FP8 family"),
    (router_logits, "independent of the others (two upcasts and an fp32 GEMM); before moe_route, which reads its logits"),
    (
        moe_route,
        "independent of the others (a softmax or sigmoid, a top-k and a renormalisation of the "
        "router's scores, no canonical op); before moe_sort_by_expert, whose sort reads its ids",
    ),
    (
        moe_sort_by_expert,
        "independent of the others (a sort, histc, cumsum and a scatter of integer expert ids, no "
        "canonical op)",
    ),
    (
        moe_route_sort,
        "after moe_route and moe_sort_by_expert, whose two ops (the route, the sort of its ids) it folds "
        "into one; after moe_sort_gather, whose sites keep their gather",
    ),
    (
        moe_sort_narrow_keys,
        "after moe_sort_by_expert: it narrows the keys of the sorts that one leaves to Inductor (a prefill's)",
    ),
    (sparse_index_mask, "independent of the others (a top-k and a scatter into a mask, no canonical op)"),
    (
        sparse_index_scores,
        "after sparse_index_mask: where that drops the top-k (every position kept) the scores are "
        "dead code, which no kernel of this one should keep alive",
    ),
    (
        gqa_decode_attention,
        "independent of the others (copies of the keys and values and the SDPA call reading them, "
        "no canonical op); after the RoPE and cache-write regions that produce its query and keys",
    ),
    (
        masked_prefill_attention,
        "the same copies and SDPA call at several query tokens (gqa_decode_attention's sites are "
        "one token: the two never share a site); after the same regions. Its opt-in form without "
        "the repeat (masked_prefill_attention_mha) comes second, so that a repeat site is the "
        "grouped form's, its copies gone",
    ),
    (
        masked_prefill_attention_causal,
        "after masked_prefill_attention, whose masked_attention op it starts from",
    ),
    (
        sparse_decode_attention,
        "after sparse_index_mask, whose sparse_attention_mask op its SDPA call's mask must be; after "
        "masked_prefill_attention (that one takes several query tokens, this one one: no shared site)",
    ),
    (allreduce_rms_norm, "after the norms: it folds the allreduce before a canonical (add_)rms_norm into it"),
    (
        allreduce_rms_norm_quant_fp8,
        "after the norm + FP8 family and allreduce_rms_norm: it folds the allreduce before a "
        "canonical (add_)rms_norm_quant_fp8 into it, which the norm-only allreduce fusion "
        "(needing a bare norm) leaves alone",
    ),
    (
        shared_input_linears,
        "after every family that reads a GEMM's operands or output (router_logits' fp32 GEMM, the "
        "attention and MoE families' projections): it regroups the GEMMs left",
    ),
    (cache_lengths, "last: the writes of the cache counters at the graph's end, which no other fusion reads"),
)


def builtin_fusions() -> list[Fusion]:
    """Every built-in fusion in the order they run; raises if one runs before a fusion it requires."""
    fusions = [fusion for module, _ in FUSION_ORDER for fusion in module.FUSIONS]
    seen: set[str] = set()
    for fusion in fusions:
        late = [name for name in fusion.requires if name not in seen]
        if late:
            raise RuntimeError(f"fusion_order: {fusion.name} requires {late[0]}, which runs after it")
        seen.add(fusion.name)
    return fusions
