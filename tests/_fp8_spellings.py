"""FP8 activation quantization and RMSNorm as real code bases write them, for the FP8 tests. Each
function names the code it follows. Written here, never imported from ``fusion_passes.patterns``
or ``fusion_passes.lowering``: a fusion is tested against the code it must accept, not against the
spelling it was traced from (the lowering references stay what they are for: the oracle).

e4m3: FP8_MAX = 448; vLLM floors its dynamic scales at MIN_SCALING_FACTOR = 1 / (448 * 512).

Every quantization below raises to the canonical ``quant_fp8`` (patterns/quant_fp8.py), and the
norm / SiLU region fusions take it where their kernels compute it (see tests/quant_fp8):
    torchao_quantize_affine_float8  static: torchao's ``_quantize_affine_float8``, as written
    per_token_quant / per_group_quant  vLLM's per-token math in DeepSeek-V3 act_quant's order
    vllm_quant_fp8_native            vLLM QuantFP8.forward_native: static, per token, per tensor;
                                     ``x * scale.reciprocal()``, the floor after the divide
    vllm_quant_fp8_group_native      vLLM's group quant; with use_ue8m0 ``exp2(ceil(log2(s)))``
                                     scales (raised, not fused: the kernels round exactly)
    sglang_per_token_group_quant_fp8 SGLang's native group quant: amax floored at 1e-10 in x's dtype
    sglang_per_token_group_quant_fp8_reciprocal  SGLang's Triton group kernel in torch: fp32 amax
                                     floored at eps, ``y * (1 / s)``
    deepgemm_per_token_cast_to_fp8   DeepGEMM's per-token-group cast: amax clamped at 1e-4,
                                     ``x * (1 / s)``, no saturation
    deepseek_v3_act_quant            DeepSeek-V3's act_quant kernel in torch: no floor, no clamp
    torchao_float8_per_row / torchao_float8_per_tensor  torchao's inference Float8 (bf16 amax and
                                     scale, no floor): raised, not fused (scale in bf16)
    torchao_training_tensorwise      torchao's training float8: fp64 amax, ``448 / amax``
                                     multiplier, optional power-of-two floor: raised, not fused
    te_current_scaling               a Transformer-Engine-style multiplier ``448 / max(amax, eps)``
                                     per tensor: raised, not fused (per tensor)
    vllm_ref_dynamic_per_token_quant vLLM's test reference (constants built as tensors): not raised
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


def sglang_per_token_group_quant_fp8_reciprocal(x, group_size=GROUP_SIZE, eps=1e-10):
    """SGLang's ``_per_token_group_quant_fp8`` Triton kernel (srt/layers/quantization/
    fp8_kernel.py), written in torch: each group loaded as fp32, ``_absmax = max(max(|y|), eps)``,
    ``y_s = _absmax / fp8_max``, ``y_s_inv = 1.0 / y_s``, ``clamp(y * y_s_inv)``."""
    y = x.reshape(-1, group_size).to(torch.float32)
    absmax = torch.clamp(y.abs().amax(dim=-1, keepdim=True), min=eps)
    y_s = absmax / FP8_MAX
    y_s_inv = 1.0 / y_s
    y_q = torch.clamp(y * y_s_inv, FP8_MIN, FP8_MAX).to(FP8_DTYPE)
    return y_q.reshape(x.shape), y_s.reshape(*x.shape[:-1], -1)


def deepgemm_per_token_cast_to_fp8(x):
    """DeepGEMM ``per_token_cast_to_fp8`` (deep_gemm/utils, tests): 2D x, groups of 128, the
    amax clamped at 1e-4, ``x * (1 / sf)``, no saturating clamp. Returns (codes, sf [m, n / 128])."""
    assert x.dim() == 2
    m, n = x.shape
    pad_size = (128 - (n % 128)) % 128
    x = torch.nn.functional.pad(x, (0, pad_size), value=0) if pad_size > 0 else x
    x_view = x.view(m, -1, 128)
    x_amax = x_view.abs().float().amax(dim=2).view(m, -1).clamp(1e-4)
    sf = x_amax / 448.0
    return (x_view * (1.0 / sf.unsqueeze(2))).to(torch.float8_e4m3fn).view(m, n + pad_size)[:, :n].contiguous(), sf


def deepseek_v3_act_quant(x, block_size=128):
    """DeepSeek-V3 ``act_quant`` (inference/kernel.py) in torch: per block of 128, ``x`` loaded as
    fp32, ``s = max(|x|) / 448.``, ``y = x / s``, cast; no floor, no clamp. Returns (y, s)."""
    x32 = x.to(torch.float32).view(*x.shape[:-1], x.shape[-1] // block_size, block_size)
    s = torch.amax(torch.abs(x32), dim=-1, keepdim=True) / 448.0
    y = (x32 / s).to(torch.float8_e4m3fn)
    return y.view(x.shape), s.squeeze(-1)


def _torchao_choose_scale_float8(tensor, block_size):
    """torchao ``_choose_scale_float8`` (quantization/quant_primitives.py), no lower / upper bound:
    the amax and its division by 448 in the tensor's dtype, then fp32."""
    shape_for_reduction, reduction_dims = [], []
    for i, (dim, block) in enumerate(zip(tensor.shape, block_size)):
        if block != dim and block > 1:
            shape_for_reduction += [dim // block, block]
            reduction_dims.append(len(shape_for_reduction) - 1)
        else:
            shape_for_reduction.append(dim)
            if block > 1:
                reduction_dims.append(i if not reduction_dims else len(shape_for_reduction) - 1)
    output_shape = [dim // block for dim, block in zip(tensor.shape, block_size)]
    tensor_reshaped = tensor.view(shape_for_reduction)
    max_abs = tensor_reshaped.abs().amax(dim=reduction_dims, keepdim=True)
    scale = max_abs / torch.finfo(FP8_DTYPE).max
    scale = scale.reshape(output_shape)
    return scale.to(dtype=torch.float32)


def torchao_float8_per_row(x):
    """torchao Float8Tensor with PerRow granularity (the activation of Float8DynamicActivation
    Float8WeightConfig): block (1, ..., N); returns (codes, scale [..., 1])."""
    scale = _torchao_choose_scale_float8(x, [1] * (x.dim() - 1) + [x.shape[-1]])
    return torchao_quantize_affine_float8(x, scale), scale


def torchao_float8_per_tensor(x):
    """torchao Float8Tensor with PerTensor granularity: block = x.shape; scale [1, ..., 1]."""
    scale = _torchao_choose_scale_float8(x, list(x.shape))
    return torchao_quantize_affine_float8(x, scale), scale


def torchao_training_tensorwise(x, round_scales_to_power_of_2=False):
    """torchao training float8 (float8/float8_utils.py ``tensor_to_amax``, ``amax_to_scale``,
    ``to_fp8_saturated``): the amax in fp64, ``448 / clamp(amax, EPS)`` as a multiplier, fp32,
    optionally ``exp2(floor(log2(scale)))``; returns (codes, scale)."""
    EPS = 1e-12
    amax = torch.max(torch.abs(x))
    amax = amax.to(torch.float64)
    res = torch.finfo(FP8_DTYPE).max / torch.clamp(amax, min=EPS)
    res = res.to(torch.float32)
    if round_scales_to_power_of_2:
        res = torch.exp2(torch.floor(torch.log2(res)))
    x_scaled = x.to(torch.float32) * res
    return x_scaled.clamp(min=-FP8_MAX, max=FP8_MAX).to(FP8_DTYPE), res


def te_current_scaling(x, amax_epsilon=1e-6):
    """Transformer-Engine-style current scaling in torch: the tensor's amax floored at epsilon,
    scale = 448 / amax a multiplier (TE computes it in its kernel; torch evaluates ``448 / t`` as
    ``448 * t.reciprocal()``), saturated. Returns (codes, scale)."""
    amax = torch.max(torch.abs(x.float()))
    amax = torch.clamp(amax, min=amax_epsilon)
    scale = FP8_MAX / amax
    return torch.clamp(x.float() * scale, -FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def bits(t):
    """A tensor's bits where it is fp8 (uint8 view: torch.equal on fp8 NaNs), else the tensor."""
    return t.view(torch.uint8) if t.dtype == FP8_DTYPE else t
