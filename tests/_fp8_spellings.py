"""FP8 activation quantization and RMSNorm as real code bases write them, for the FP8 tests. Each
function names the code it follows. Written here, never imported from ``fusion_passes.patterns``
or ``fusion_passes.lowering``: a fusion is tested against the code it must accept, not against the
spelling it was traced from (the lowering references stay what they are for: the oracle).

e4m3: FP8_MAX = 448; vLLM floors its dynamic scales at MIN_SCALING_FACTOR = 1 / (448 * 512).

Fused today (the ``(add_)rms_norm_quant_fp8_*`` and ``silu_mul_quant_fp8_*`` patterns match them):
    torchao_quantize_affine_float8  static: torchao's ``_quantize_affine_float8``, as written
    per_token_quant                 vLLM's per-token math in DeepSeek-V3 act_quant's order (below)
    per_group_quant                 the same per group of 128 (DeepSeek V3's block-wise activations)

Not fused today (known gaps; the first op of the post-grad graph where each parts from the
patterns, which upcast to fp32, take ``aten.amax`` of |y32|, divide, floor the scale after the
divide at MIN_SCALING_FACTOR and have no power-of-two rounding):
    vllm_quant_fp8_native            static: ``aten.reciprocal`` of the scale (the patterns divide);
                                     per token: ``aten.abs`` of the input in its own dtype (bf16),
                                     ``aten.max.dim`` in fp32, then the reciprocal multiply
    vllm_quant_fp8_group_native      ``aten.abs`` of the bf16 input, ``aten.max.dim`` in fp32; with
                                     use_ue8m0 also ``aten.log2`` / ``ceil`` / ``exp2`` on the scale
    sglang_per_token_group_quant_fp8 ``aten.max.dim``, then the amax floored at 1e-10 before the
                                     divide (other scales than the patterns' for amax < 1/512)
    vllm_ref_dynamic_per_token_quant ``aten.abs`` of the bf16 input / ``aten.max.dim``: numerically
                                     per_token_quant bit for bit (the max of bf16 values is exact)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448.0
FP8_MIN = torch.finfo(FP8_DTYPE).min  # -448.0
# vLLM (input_quant_fp8.py): _FP8_MIN_SCALING_FACTOR = 1.0 / (_FP8_MAX * 512.0)
MIN_SCALING_FACTOR = 1.0 / (FP8_MAX * 512.0)
GROUP_SIZE = 128


# --- RMSNorm (each with the decoder layer's ``hidden_states = residual + hidden_states`` before it
#     where a test adds the residual) ---


def llama_rms_norm(hidden_states, weight, eps):
    """transformers ``LlamaRMSNorm.forward`` (models/llama/modeling_llama.py); Qwen3RMSNorm,
    DeepseekV3RMSNorm and MiniMaxM2RMSNorm are copies of it."""
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + eps)
    return weight * hidden_states.to(input_dtype)


def torchtitan_rms_norm(x, weight, eps):
    """torchtitan's ``nn.RMSNorm`` (torchtitan/models/llama3/model.py), i.e. ``F.rms_norm``: the
    weight multiplied in fp32, one rounding at the end."""
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def qwen3_next_rms_norm(x, weight, eps):
    """transformers ``Qwen3NextRMSNorm.forward`` (models/qwen3_next/modeling_qwen3_next.py): the
    zero-centred weight, ``(1 + w)`` in fp32, ``type_as`` last."""
    output = x.float()
    output = output * torch.rsqrt(output.pow(2).mean(-1, keepdim=True) + eps)
    output = output * (1.0 + weight.float())
    return output.type_as(x)


# --- FP8 activation quantization that the patterns fuse ---


def torchao_quantize_affine_float8(tensor, scale, float8_dtype=FP8_DTYPE):
    """Static per-tensor: torchao ``_quantize_affine_float8`` (torchao/quantization/
    quant_primitives.py), the quantization of torchao's Float8Tensor (its round-to-float8 is the
    plain cast in forward)."""
    tensor_fp32 = tensor.to(torch.float32)
    tensor_scaled = tensor_fp32 / scale
    max_value = torch.finfo(float8_dtype).max
    tensor_clamped = tensor_scaled.clamp(min=-max_value, max=max_value)
    return tensor_clamped.to(float8_dtype)


def per_token_quant(x):
    """Dynamic per token, returns (codes, scales [..., 1]). vLLM's per-token FP8 math: scale =
    amax / 448 floored at 1 / (448 * 512) after the divide, ``x.float() / scale``, saturated at
    +-448 (QuantFP8PerToken.forward_native of vLLM 0.8, layers/quantization/input_quant_fp8.py;
    tests/kernels/quant_utils.py ``ref_dynamic_per_token_quant``, fp8 branch). The amax is taken
    over the fp32 upcast, in the order of DeepSeek-V3's ``act_quant`` kernel (inference/kernel.py:
    ``x = load(x).to(float32); s = max(abs(x)) / 448; y = x / s``) and of vLLM's and SGLang's
    per-token-group Triton kernels; vLLM's torch code reduces in the activation dtype instead
    (``vllm_ref_dynamic_per_token_quant``: the same numbers, not fused today)."""
    x_fp32 = x.to(torch.float32)
    x_max = x_fp32.abs().amax(dim=-1, keepdim=True)
    scale = (x_max / FP8_MAX).clamp(min=MIN_SCALING_FACTOR)
    out = (x_fp32 / scale).clamp(FP8_MIN, FP8_MAX).to(FP8_DTYPE)
    return out, scale


def per_group_quant(x, group_size=GROUP_SIZE):
    """Dynamic per token group (DeepSeek V3's block-wise activations, 128 columns a scale);
    returns (codes like x, scales [..., N / group_size]). DeepSeek-V3 ``act_quant`` (fp32 upcast,
    amax of each block, divide) with vLLM's ``QuantFP8._quantize_group_native`` scale floor
    (``(absmax / _FP8_MAX).clamp(min=_FP8_MIN_SCALING_FACTOR)``), saturation and scale layout."""
    x_grouped = x.to(torch.float32).unflatten(-1, (-1, group_size))
    absmax = x_grouped.abs().amax(dim=-1, keepdim=True)
    scales = (absmax / FP8_MAX).clamp(min=MIN_SCALING_FACTOR)
    x_quant = (x_grouped / scales).clamp(FP8_MIN, FP8_MAX).to(FP8_DTYPE)
    return x_quant.flatten(-2), scales.squeeze(-1)


# Each scheme's fused spelling with one signature: (y, static scale or None) -> outputs tuple.
QUANT = {
    "static": lambda y, scale: (torchao_quantize_affine_float8(y, scale),),
    "per_token": lambda y, scale: per_token_quant(y),
    "per_group": lambda y, scale: per_group_quant(y),
}


# --- FP8 activation quantization that the patterns do not fuse today (known gaps) ---


def vllm_quant_fp8_native(x, scale=None, per_token=True):
    """vLLM ``QuantFP8.forward_native`` (layers/quantization/input_quant_fp8.py), the static
    (``scale`` given) and dynamic per-token branches: the amax in the activation dtype, the input
    multiplied by the reciprocal of the scale ("reciprocal performs slightly better than
    division"). Returns (codes, scale)."""
    if scale is None:
        if per_token:
            x_max, _ = x.abs().max(dim=-1)
            x_max = x_max.unsqueeze(-1).to(torch.float32)
        else:
            x_max = x.abs().max().unsqueeze(-1).to(torch.float32)
        scale = (x_max / FP8_MAX).clamp(min=MIN_SCALING_FACTOR)
    out = x.to(torch.float32) * scale.to(torch.float32).reciprocal()
    out = out.clamp(FP8_MIN, FP8_MAX).to(FP8_DTYPE)
    return out, scale


def vllm_quant_fp8_group_native(x, group_size=GROUP_SIZE, use_ue8m0=False):
    """vLLM ``QuantFP8._quantize_group_native`` (layers/quantization/input_quant_fp8.py), for
    hidden sizes the group size divides (no padding): the amax in the activation dtype, optional
    power-of-two (UE8M0) scales before the floor, the bf16 input divided by the fp32 scales."""
    orig_shape = x.shape
    hidden_dim = x.shape[-1]
    num_groups = hidden_dim // group_size
    x_grouped = x.view(-1, num_groups, group_size)
    absmax = x_grouped.abs().max(dim=-1, keepdim=True)[0].float()
    scales_raw = absmax / FP8_MAX
    if use_ue8m0:
        scales_raw = torch.exp2(torch.ceil(torch.log2(scales_raw)))
    scales = scales_raw.clamp(min=MIN_SCALING_FACTOR)
    x_scaled = x_grouped / scales
    x_quant = x_scaled.clamp(FP8_MIN, FP8_MAX).to(FP8_DTYPE)
    x_quant = x_quant.view(-1, hidden_dim).view(orig_shape)
    scales = scales.squeeze(-1).reshape(orig_shape[:-1] + (num_groups,))
    return x_quant, scales


def sglang_per_token_group_quant_fp8(x, group_size=GROUP_SIZE, eps=1e-10, dtype=FP8_DTYPE):
    """SGLang's ``native_per_token_group_quant_fp8`` (test/srt/test_block_fp8.py; vLLM's
    tests/kernels/quant_utils.py has the same): the amax in the activation dtype floored at eps
    BEFORE the divide, no floor on the scale."""
    finfo = torch.finfo(dtype)
    x_ = x.reshape(x.numel() // group_size, group_size)
    amax = x_.abs().max(dim=-1, keepdim=True)[0].clamp(min=eps).to(torch.float32)
    x_s = amax / finfo.max
    x_q = (x_ / x_s).clamp(min=finfo.min, max=finfo.max).to(dtype)
    x_q = x_q.reshape(x.shape)
    x_s = x_s.reshape(x.shape[:-1] + (x.shape[-1] // group_size,))
    return x_q, x_s


def vllm_ref_dynamic_per_token_quant(x):
    """vLLM tests/kernels/quant_utils.py ``ref_dynamic_per_token_quant`` for float8_e4m3fn (its
    ``as_float32_tensor`` on x's device instead of 'cuda'): per-token amax in the activation dtype,
    scale floored after the divide, divide. Returns (codes, scales [..., 1]) for x of any rank."""

    def as_float32_tensor(t):
        return torch.as_tensor(t, dtype=torch.float32, device=x.device)

    qtype_max = as_float32_tensor(FP8_MAX)
    s_1, s_512 = as_float32_tensor(1.0), as_float32_tensor(512.0)
    x_token_max, _ = x.abs().max(dim=-1)
    x_token_max = as_float32_tensor(x_token_max)
    scales = (x_token_max / qtype_max)[..., None]
    min_scaling_factor = s_1 / (qtype_max * s_512)
    scales = scales.clamp(min=min_scaling_factor)
    torch_out = as_float32_tensor(x) / scales
    torch_out = torch_out.clamp(FP8_MIN, FP8_MAX).to(FP8_DTYPE)
    return torch_out, scales


def bits(t):
    """A tensor's bits where it is fp8 (uint8 view: torch.equal on fp8 NaNs), else the tensor."""
    return t.view(torch.uint8) if t.dtype == FP8_DTYPE else t
