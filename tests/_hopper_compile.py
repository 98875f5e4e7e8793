"""Compile Triton launches for Hopper (sm_90) on a machine without a GPU, and trace them as the
pass manager inlines them.

The CPU tests run kernels in Triton's interpreter, which accepts code that the compiler rejects
(a constexpr assigned twice in an unrolled loop, say). ``python -m tests._hopper_compile`` runs
each case below through its launcher with a ``wrap`` that, instead of launching, compiles the
kernel with the launch's arguments to a cubin for sm_90: the whole pipeline down to ptxas, no GPU.
Then it traces the same launch on fake CUDA tensors as ``launch="direct"`` does
(``direct_launch.trace_launch``): a launch that writes an input its op does not return, or that
calls an op Inductor cannot lower after its post-grad passes, would stay a dispatcher call on the
GPU (Python at every step), which the CPU tests never see.
It must run without TRITON_INTERPRET (the tests' conftest sets it), hence a process of its own.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import types

import torch

_DTYPES = {
    torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.bool: "i1",
    torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8",
    torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5",
}  # fmt: skip


_CUDA_CONSTEXPRS = ("HW_FP8_CONVERT", "HW_CONVERT", "AMAX_TIMES_RECIPROCAL")


def _arg_type(value) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + _DTYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for {type(value).__name__}")


class _CompileForHopper:
    """``wrap`` for a launcher: ``wrap(kernel)[grid](*args, **kwargs)`` compiles, launches nothing."""

    compiled: list[str] = []

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        return self.compile

    def compile(self, *args, **kwargs):
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler.compiler import ASTSource

        options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
        # The launchers pick these from the tensors' device (CPU tensors here: False); compiled for
        # the GPU, the kernels take the forms a CUDA tensor gets (the hardware FP8 conversion, a
        # multiply by the reciprocal).
        kwargs |= {k: True for k in _CUDA_CONSTEXPRS if k in kwargs}
        names = [p.name for p in self.kernel.params]
        values = dict(zip(names, args)) | kwargs
        signature, constexprs = {}, {}
        for p in self.kernel.params:
            value = values.get(p.name, p.default)
            if p.is_constexpr or value is None:
                signature[p.name], constexprs[p.name] = "constexpr", value
            else:
                signature[p.name] = _arg_type(value)
        source = ASTSource(fn=self.kernel, signature=signature, constexprs=constexprs)
        triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
        self.compiled.append(self.kernel.__name__)


def _cases():
    """(name, launcher, args): one launch of each kernel checked here, with small CPU tensors."""
    from fusion_passes.lowering.cache_lengths.triton import advance_lengths_triton
    from fusion_passes.lowering.causal_conv1d.triton import causal_conv1d_triton
    from fusion_passes.lowering.causal_conv1d_update.triton import causal_conv1d_update_triton
    from fusion_passes.lowering.common.fp8 import QuantFP8
    from fusion_passes.lowering.rms_norm.reference import RMSNormForm
    from fusion_passes.lowering.gated_delta_step.norm_triton import gated_delta_step_norm_triton
    from fusion_passes.lowering.gated_delta_step.triton import gated_delta_step_triton
    from fusion_passes.lowering.masked_attention.decode import masked_decode_attention_triton
    from fusion_passes.lowering.masked_attention.op import _masked_attention_causal_cuda as causal_launch
    from fusion_passes.lowering.masked_attention.triton import masked_attention_triton
    from fusion_passes.lowering.mla_rope import triton as mla
    from fusion_passes.lowering.moe_route.triton import moe_route_grouped_triton, moe_route_triton
    from fusion_passes.lowering.moe_route_sort.triton import moe_route_sort_triton
    from fusion_passes.lowering.moe_sort_by_expert.triton import moe_sort_by_expert_triton, moe_sort_gather_triton
    from fusion_passes.lowering.qk_norm_rope.triton import qk_norm_rope_cache_triton, qk_norm_rope_triton
    from fusion_passes.lowering.rms_norm.triton import rms_norm_triton
    from fusion_passes.lowering.router_logits.triton import router_logits_triton
    from fusion_passes.lowering.shared_input_linears.triton import shared_input_linears_triton
    from fusion_passes.lowering.rms_norm_quant_fp8.triton import rms_norm_quant_fp8_triton
    from fusion_passes.lowering.silu_mul_quant_fp8.triton import silu_mul_quant_fp8_triton
    from fusion_passes.lowering.sparse_index_mask.triton import sparse_index_mask_triton
    from fusion_passes.lowering.sparse_index_scores.triton import sparse_index_scores_triton

    bf16 = torch.bfloat16
    x = torch.randn(2, 70, 96, dtype=bf16).transpose(1, 2)
    weight, bias = torch.randn(96, 4, dtype=bf16), torch.randn(96, dtype=bf16)
    yield "causal_conv1d", causal_conv1d_triton, (x, weight, bias, True)
    yield "causal_conv1d (no bias)", causal_conv1d_triton, (x, weight, None, True)
    state = torch.randn(2, 96, 4, dtype=bf16)
    yield "causal_conv1d (initial state)", causal_conv1d_triton, (x, weight, None, True, state)
    state = torch.randn(2, 96, 3, dtype=bf16)
    yield "causal_conv1d_update", causal_conv1d_update_triton, (x[:, :, :1], state, weight, None, True)
    yield "sparse_index_mask", sparse_index_mask_triton, (torch.randn(2, 3000), 2048)
    split = functools.partial(sparse_index_mask_triton, split=6)  # a row's programs summing histograms
    yield "sparse_index_mask (split rows)", split, (torch.randn(2, 3000), 2048)
    causal = torch.ones(1, 1, 1, 3000, dtype=torch.bool).expand(2, 1, 1, 3000)
    yield "sparse_attention_mask (split rows)", split, (torch.randn(2, 1, 3000), 2048, causal, bf16, -65504.0)
    def causal_first(scores, k, mask, dtype, fill, first, wrap=None):  # the op's argument order
        return sparse_index_mask_triton(scores, k, mask, dtype, fill, causal_first=first, split=6, wrap=wrap)

    yield ("sparse_attention_mask (causal first)", causal_first,
           (torch.randn(2, 1, 3000), 2048, None, bf16, -65504.0, torch.tensor(2990)))  # fmt: skip
    for s in (1, 40):  # the per-token kernel and the tiled one, with bf16 weights and a broadcast mask
        iq, icache = torch.randn(2, s, 64, 128, dtype=bf16), torch.randn(2, 300, 128, dtype=bf16)
        keep = torch.ones(1, s, 300, dtype=torch.bool).expand(2, s, 300)
        iargs = (iq, icache, torch.randn(2, s, 64, dtype=bf16), 128**-0.5, 0.125, keep)
        yield f"sparse_index_scores ({s} tokens, weights scale, keep mask)", sparse_index_scores_triton, iargs
        cargs = (iq, icache, torch.randn(2, s, 64, dtype=bf16), 128**-0.5, 0.125, None, torch.tensor(250))
        yield f"sparse_index_scores ({s} tokens, causal from the first position)", sparse_index_scores_triton, cargs
    yield "moe_sort_by_expert", moe_sort_by_expert_triton, (torch.randint(0, 64, (64,)), 64)
    # the same with the gather of DeepSeek V3's hidden states (7168) for the first grouped GEMM, a sentinel id among them
    gather_args = (torch.randint(0, 257, (16,)), 256, torch.randn(2, 7168, dtype=bf16), 8)
    yield "moe_sort_gather", moe_sort_gather_triton, gather_args
    logits = torch.randn(3, 256)
    # the route and the dispatch prep in one launch: Qwen's softmax (512 experts, top-10), MiniMax-M2's
    # sigmoid + bias, DeepSeek V3's groups; past the token bound, the two kernels
    route_sorts = (("softmax", (torch.randn(1, 512, dtype=bf16), None, 10, True, True, 0, 0, 1.0, 512)),
                   ("sigmoid + bias", (torch.randn(5, 256, dtype=bf16), torch.randn(256), 8, False, True, 0, 0, 1.0, 256)),
                   ("grouped", (torch.randn(16, 256), torch.randn(256), 8, False, True, 8, 4, 2.5, 256)),
                   ("two launches", (torch.randn(17, 256), torch.randn(256), 8, False, True, 8, 4, 2.5, 256)))  # fmt: skip
    for form, route_args in route_sorts:
        yield f"moe_route_sort ({form})", moe_route_sort_triton, route_args
    # with the gather of DeepSeek V3's 7168-wide hidden states (one launch, and past the token bound)
    for form, route_args in route_sorts[2:]:
        hidden_rows = torch.randn(route_args[0].shape[0], 7168, dtype=bf16)
        yield f"moe_route_sort_gather ({form})", moe_route_sort_triton, (*route_args, hidden_rows)
    yield "moe_route", moe_route_triton, (logits, None, 8, True, True)
    yield "moe_route_grouped", moe_route_grouped_triton, (logits, torch.randn(256), 8, 8, 4, True, 2.5)
    h = torch.randn(3, 1, 2048, dtype=bf16)
    yield "rms_norm", rms_norm_triton, (h, torch.randn(2048, dtype=bf16), 1e-6)
    yield "add_rms_norm", rms_norm_triton, (h, torch.randn(2048, dtype=bf16), 1e-6, 0.0, False, False, h.clone())
    q, v = torch.randn(2, 1, 4, 128, dtype=bf16), torch.randn(2, 1, 8, 128, dtype=bf16)
    a, b, per_head = torch.randn(2, 1, 8, dtype=bf16), torch.randn(2, 1, 8, dtype=bf16), torch.randn(8)
    step = (q, q.clone(), v, a, b, per_head, per_head.clone(), torch.randn(2, 8, 128, 128), 128**0.5, True, True, 1e-6)
    yield "gated_delta_step", gated_delta_step_triton, step
    persistent = functools.partial(gated_delta_step_triton, block_v=32, num_warps=1, programs=3, stages=2)
    yield "gated_delta_step (persistent)", persistent, step
    # with the gated norm: a program per whole value row, and the step's tiles + a norm launch
    norm_step = (*step[:8], torch.randn(16, 128, dtype=bf16), torch.randn(128, dtype=bf16), *step[8:], 1e-6, 0.0, True)
    for epilogue, form in ((True, "epilogue"), (False, "step + norm")):
        yield f"gated_delta_step_norm ({form})", functools.partial(gated_delta_step_norm_triton, epilogue=epilogue), norm_step
    # every layer's cache write counters (DeepSeek V3.2's two a layer), over two launches
    counters = [torch.tensor(7, dtype=torch.int64) for _ in range(20)]
    yield "advance_lengths", advance_lengths_triton, ([torch.tensor(40)] * 20, counters, [1] * 20)
    # a prefill's grouped attention through a causal mask: 8 / 2 heads of 128, and of 256
    for d in (128, 256):
        q, kv = torch.randn(1, 8, 300, d, dtype=bf16), torch.randn(1, 2, 316, d, dtype=bf16)
        keep = (torch.arange(316)[None, :] <= torch.arange(300)[:, None])[None, None]
        causal = torch.zeros(keep.shape, dtype=bf16).masked_fill(~keep, float("-inf"))
        yield f"masked_attention (head dim {d})", masked_attention_triton, (q, kv, kv.clone(), causal, d**-0.5)
        yield f"masked_attention_causal (head dim {d})", causal_launch, (q, kv, kv.clone(), torch.tensor(16), d**-0.5)
    # at one query token: DeepSeek V3.2's 192 / 128 head dims through a -65504 index mask
    q1, k1, v1 = torch.randn(1, 4, 1, 192, dtype=bf16), torch.randn(1, 4, 300, 192, dtype=bf16), torch.randn(1, 4, 300, 128, dtype=bf16)
    index = torch.zeros(1, 1, 1, 300, dtype=bf16).masked_fill(torch.rand(1, 1, 1, 300) > 0.25, -65504.0)
    yield "masked_attention (one token, 192 / 128)", masked_decode_attention_triton, (q1, k1, v1, index, 0.07)
    # a router's fp32 logits from bf16: DeepSeek V3's 256 experts at one token, and 5 tokens of 72
    yield "router_logits (1 token)", router_logits_triton, (torch.randn(1, 7168, dtype=bf16), torch.randn(256, 7168, dtype=bf16))
    yield "router_logits (5 tokens)", router_logits_triton, (torch.randn(5, 300, dtype=bf16), torch.randn(72, 300, dtype=bf16))
    # sibling linears of one input: Qwen 3.5's in_proj_b / in_proj_a at one token; its MoE block's
    # router, shared expert gate / up and shared_expert_gate at 5 tokens
    x1, x5 = torch.randn(1, 2048, dtype=bf16), torch.randn(5, 2048, dtype=bf16)
    ba = [torch.randn(32, 2048, dtype=bf16), torch.randn(32, 2048, dtype=bf16)]
    yield "shared_input_linears (2 weights)", shared_input_linears_triton, (x1, ba)
    moe = [torch.randn(n, 2048, dtype=bf16) for n in (256, 512, 512, 1)]
    yield "shared_input_linears (4 weights)", shared_input_linears_triton, (x5, moe)
    split = functools.partial(masked_decode_attention_triton, splits=3)
    yield "masked_attention (one token, 3 splits and their combine)", split, (q1, k1, v1, index, 0.07)
    # Qwen3-style per-head QK-norm + full RoPE, and MiniMax-M2's whole-row norm + partial RoPE
    q, k, head_w = torch.randn(2, 3, 4, 64, dtype=bf16), torch.randn(2, 3, 2, 64, dtype=bf16), torch.randn(64, dtype=bf16)
    cos, sin = torch.randn(1, 3, 64, dtype=bf16), torch.randn(1, 3, 64, dtype=bf16)
    yield "qk_norm_rope", qk_norm_rope_triton, (q, k, head_w, head_w, cos, sin, 1e-6)
    row_q, row_k = torch.randn(256, dtype=bf16), torch.randn(128, dtype=bf16)
    partial = (q, k, row_q, row_k, cos[..., :32], sin[..., :32], 1e-6, 0.0, True, False)
    yield "qk_norm_rope (whole row, partial)", qk_norm_rope_triton, partial
    # the same, k and v into the KV cache [B, H, 40, D]: per head from a first slot, whole row at a
    # slot per token
    v, caches = torch.randn(2, 3, 2, 64, dtype=bf16), (torch.randn(2, 2, 40, 64, dtype=bf16), torch.randn(2, 2, 40, 64, dtype=bf16))
    cache_args = (q, k, v, head_w, head_w, cos, sin, *caches, torch.tensor(5), 1e-6)
    yield "qk_norm_rope_cache (per head, first slot)", qk_norm_rope_cache_triton, cache_args
    cache_args = (q, k, v, row_q, row_k, cos[..., :32], sin[..., :32], *caches, torch.tensor([7, 0, 9]), 1e-6, 0.0,
                  True, False)  # fmt: skip
    yield "qk_norm_rope_cache (whole row, slot per token)", qk_norm_rope_cache_triton, cache_args
    # DeepSeek V3 MLA: 512 latent + 64 RoPE dims, 4 heads of 128 + 64; the V3.2 indexer's keys
    mq, kv = torch.randn(2, 3, 4, 192, dtype=bf16), torch.randn(2, 3, 576, dtype=bf16)
    latent_w, c32, s32 = torch.randn(512, dtype=bf16), torch.randn(2, 3, 32, dtype=bf16), torch.randn(2, 3, 32, dtype=bf16)
    yield "mla_kv_norm_rope", mla.mla_kv_norm_rope_triton, (kv, latent_w, c32, s32, 1e-6)
    yield "mla_q_rope", mla.mla_q_rope_triton, (mq, c32, s32)
    yield "mla_q_kv_rope", mla.mla_q_kv_rope_triton, (mq, kv, latent_w, c32, s32, 1e-6)
    ik, iw = torch.randn(2, 3, 128, dtype=bf16), torch.randn(128, dtype=bf16)
    c64, s64 = torch.randn(2, 3, 64, dtype=bf16), torch.randn(2, 3, 64, dtype=bf16)
    yield "mla_indexer_k_norm_rope", mla.mla_indexer_k_norm_rope_triton, (ik, iw, iw.clone(), c64, s64, 1e-6)
    icache = torch.randn(2, 40, 128, dtype=bf16)
    for form, slots in (("first slot", torch.tensor(5)), ("slot per token", torch.tensor([7, 0, 9]))):
        cache_args = (ik, iw, iw.clone(), c64, s64, icache, slots, 1e-6)
        yield f"mla_indexer_k_norm_rope_cache ({form})", mla.mla_indexer_k_norm_rope_cache_triton, cache_args
    # the indexer's query (4 heads of 128) and key in one launch, the key as such or into its cache
    iq4 = torch.randn(2, 3, 4, 128, dtype=bf16)
    yield "mla_indexer_qk_rope", mla.mla_indexer_qk_rope_triton, (iq4, ik, iw, iw.clone(), c64, s64, None, None, 1e-6)
    qk_cache_args = (iq4, ik, iw, iw.clone(), c64, s64, icache, torch.tensor(5), 1e-6)
    yield "mla_indexer_qk_rope (into the cache)", mla.mla_indexer_qk_rope_triton, qk_cache_args
    # DeepSeek V3.2's key (128 + 64) and value (128) of 4 heads into the KV cache: k_nope and value
    # strided splits of kv_b_proj's output
    kv = torch.randn(2, 3, 4, 256, dtype=bf16).transpose(1, 2)
    kv_caches = (torch.randn(2, 4, 40, 192, dtype=bf16), torch.randn(2, 4, 40, 128, dtype=bf16))
    for form, slots in (("first slot", torch.tensor(5)), ("slot per token", torch.tensor([7, 0, 9]))):
        write_args = (kv[..., :128], torch.randn(2, 1, 3, 64, dtype=bf16), kv[..., 128:], *kv_caches, slots)
        yield f"mla_kv_cache_write ({form})", mla.mla_kv_cache_write_triton, write_args
    # the indexer's launch into its cache and the KV write in one, each cache at its own positions
    merged_args = (*qk_cache_args[:8], *write_args[:5], torch.tensor(6), 1e-6)
    yield "mla_indexer_qk_rope_kv_cache", mla.mla_indexer_qk_rope_kv_cache_triton, merged_args
    # regrouped: q_a_layernorm (1536) with MLA's kv branch, and MLA's query with the merged launch above
    q_a = (torch.randn(2, 3, 1536, dtype=bf16), torch.randn(1536, dtype=bf16), 1e-6, 0.0, True)
    yield "mla_q_a_kv_norm_rope", mla.mla_q_a_kv_norm_rope_triton, (*q_a, torch.randn(2, 3, 576, dtype=bf16),
                                                                   latent_w, c32, s32, 1e-6)  # fmt: skip
    yield "mla_q_indexer_kv_cache", mla.mla_q_indexer_kv_cache_triton, (mq, c32, s32, True, *merged_args)
    # FP8: per-token, DeepSeek's 128-column groups with power-of-two (UE8M0) scales, a static scale
    norm = RMSNormForm(1e-6, 0.0, False)
    schemes = {"per_token": QuantFP8("per_token"), "per_group": QuantFP8("per_group", None, 128, True),
               "static": QuantFP8("static", torch.tensor(0.05))}  # fmt: skip
    for name, quant in schemes.items():
        yield f"rms_norm_quant_fp8 ({name})", rms_norm_quant_fp8_triton, (h, torch.randn(2048, dtype=bf16), norm, quant)
    add = (h, torch.randn(2048, dtype=bf16), norm, schemes["per_group"], h.clone())
    yield "add_rms_norm_quant_fp8 (per_group)", rms_norm_quant_fp8_triton, add
    gate_up = torch.randn(3, 2 * 1536, dtype=bf16)
    for name, quant in schemes.items():
        yield f"silu_mul_quant_fp8 ({name})", silu_mul_quant_fp8_triton, (gate_up[:, :1536], gate_up[:, 1536:], quant)
    mufu = (gate_up[:, :1536], gate_up[:, 1536:], schemes["per_group"])
    yield "silu_mul_quant_fp8 (bf16 MUFU silu)", lambda *a, wrap: silu_mul_quant_fp8_triton(*a, wrap=wrap, form="bf16_mufu"), mufu


# The cases whose launches update a state in place (positions of the launcher's arguments), as
# their ops' register_launcher(writes_inputs=...) declares: the trace may write those back.
_WRITES_INPUTS = {"advance_lengths": (1,), "causal_conv1d_update": (1,), "gated_delta_step": (7,), "gated_delta_step (persistent)": (7,),
                  "gated_delta_step_norm (epilogue)": (7,), "gated_delta_step_norm (step + norm)": (7,), "mla_indexer_k_norm_rope_cache (first slot)": (5,),
                  "mla_indexer_k_norm_rope_cache (slot per token)": (5,), "mla_kv_cache_write (first slot)": (3, 4),
                  "mla_kv_cache_write (slot per token)": (3, 4), "qk_norm_rope_cache (per head, first slot)": (7, 8),
                  "qk_norm_rope_cache (whole row, slot per token)": (7, 8), "mla_indexer_qk_rope (into the cache)": (6,),
                  "mla_indexer_qk_rope_kv_cache": (6, 11, 12), "mla_q_indexer_kv_cache": (10, 15, 16)}  # fmt: skip


@contextlib.contextmanager
def _as_one_h200():
    """The launchers' device queries and Triton's target, answered as on one H200 (132 SMs):
    the trace runs where no GPU (and no Triton driver) is."""
    import triton
    from triton.backends.compiler import GPUTarget

    class _Hopper:
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

    props = types.SimpleNamespace(multi_processor_count=132, major=9, minor=0, name="NVIDIA H200")
    answers = {
        "get_device_properties": lambda *a, **k: props,
        "get_device_capability": lambda *a, **k: (9, 0),
        "get_device_name": lambda *a, **k: props.name,
        "current_device": lambda: 0,
    }
    saved = {name: getattr(torch.cuda, name) for name in answers}
    for name, answer in answers.items():
        setattr(torch.cuda, name, answer)
    triton.runtime.driver.set_active(_Hopper())
    try:
        yield
    finally:
        for name, original in saved.items():
            setattr(torch.cuda, name, original)
        triton.runtime.driver._active = None


def _trace_on_fake_cuda(name, launcher, args) -> torch.fx.Graph:
    """The launch traced as the pass manager inlines it, on fake CUDA tensors of the args' shapes,
    strides and dtypes (a static FP8 scale, a tensor inside the quant tuple, too)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fusion_passes.lowering.common.direct_launch import tensor_positions, trace_launch
    from fusion_passes.lowering.common.fp8 import QuantFP8

    mode = FakeTensorMode()

    def fake(value):
        if isinstance(value, QuantFP8) and value.scale is not None:
            return value._replace(scale=fake(value.scale))
        if isinstance(value, list):  # a Tensor[] argument
            return [fake(v) for v in value]
        if not isinstance(value, torch.Tensor):
            return value
        with mode:
            return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="cuda")

    fakes = [fake(a) for a in args]
    positions = tensor_positions(fakes)
    graph = trace_launch(launcher, fakes, positions, _WRITES_INPUTS.get(name, ())).graph
    if not any(n.target is torch.ops.higher_order.triton_kernel_wrapper_functional for n in graph.nodes):
        raise RuntimeError("the trace holds no Triton launch")
    return graph


def _report(failed: list[str], check: str, name: str, run) -> None:
    try:
        print(f"ok      {check} {name}: {run()}")
    except Exception as e:  # every case is reported, then the run fails
        first = str(e).strip().splitlines()[-1] if str(e).strip() else ""
        failed.append(f"{check} {name}")
        print(f"FAILED  {check} {name}: {type(e).__name__}: {first}")


def main() -> int:
    failed: list[str] = []

    def compile_case(launcher, args):
        before = len(_CompileForHopper.compiled)
        launcher(*args, wrap=_CompileForHopper)
        if len(_CompileForHopper.compiled) == before:
            raise RuntimeError("the launcher compiled no kernel")
        return ", ".join(_CompileForHopper.compiled[before:])

    def trace_case(name, launcher, args):
        graph = _trace_on_fake_cuda(name, launcher, args)
        return f"{sum(n.op == 'call_function' for n in graph.nodes)} nodes"

    cases = list(_cases())
    for name, launcher, args in cases:
        _report(failed, "compiled", name, lambda: compile_case(launcher, args))
    with _as_one_h200():
        for name, launcher, args in cases:
            _report(failed, "traced", name, lambda: trace_case(name, launcher, args))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
