"""FP8 linear layers as serving engines write their native (plain torch) fallback, and a helper
that swaps a model's ``nn.Linear`` layers for them.

Weights (quantized once, offline): float8_e4m3fn codes with fp32 scales,
    static     one scale for the whole weight            w = codes * ws          (ws: [])
    per_token  one scale per output channel               w[n] = codes[n] * ws[n] (ws: [N, 1])
    per_group  one scale per 128 x 128 block (DeepSeek V3's block-wise FP8)       (ws: [N/128, K/128])
Activations (quantized in forward; each spelling names the code it follows, see the functions):
    static     q = fp8(clamp(f32(x) / s, -448, 448)), s calibrated: amax of the layer's input / 448
    per_token  s = max(amax(|f32(x)|, -1) / 448, 1 / (448 * 512)) per row; q = fp8(clamp(f32(x) / s))
    per_group  the same per 128 columns (DeepSeek V3's block-wise activations), s: [..., K / 128]
GEMM: ``torch._scaled_mm`` on CUDA for the static (per-tensor) and per-token (row-wise) scales;
elsewhere -- on CPU, and for the block-wise scheme -- the dequantized matmul, in fp32:
    y = ((q * s) @ (codes * ws)^T).to(x.dtype) (+ bias)

This module is model code: it imports nothing from ``fusion_passes.patterns`` or
``fusion_passes.lowering``. Where the engines' own plain-torch code differs (vLLM's
``QuantFP8.forward_native`` takes the amax in the activation dtype with ``max(dim)`` and multiplies
by the scale's reciprocal), the functions below say so; tests/_fp8_spellings.py holds those
spellings too.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448.0
FP8_MIN = torch.finfo(FP8_DTYPE).min  # -448.0
# vLLM (layers/quantization/input_quant_fp8.py): _FP8_MIN_SCALING_FACTOR = 1.0 / (_FP8_MAX * 512.0),
# the floor of its dynamic scales: an all-zero row keeps finite codes.
MIN_SCALING_FACTOR = 1.0 / (FP8_MAX * 512.0)
GROUP_SIZE = 128  # DeepSeek V3 / V3.2 block-wise activation quantization

SCHEMES = ("static", "per_token", "per_group")
# Not quantized: MoE routers (their logits pick experts: FP8 error would move tokens between
# experts) and the LM head.
DEFAULT_SKIP = r"(^|\.)(gate|router|lm_head)$"


# --- activation quantization ---


def quantize_static(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Static per-tensor codes: torchao's ``_quantize_affine_float8``
    (torchao/quantization/quant_primitives.py) as written: upcast, divide, saturate, cast. (vLLM's
    ``QuantFP8.forward_native`` multiplies by ``scale.reciprocal()`` instead: other codes where the
    two roundings differ.)"""
    tensor_fp32 = x.to(torch.float32)
    tensor_scaled = tensor_fp32 / scale
    tensor_clamped = tensor_scaled.clamp(min=-FP8_MAX, max=FP8_MAX)
    return tensor_clamped.to(FP8_DTYPE)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token (codes, scales [..., 1]). vLLM's per-token FP8 math: ``scale = (x_max /
    _FP8_MAX).clamp(min=_FP8_MIN_SCALING_FACTOR)``, then ``x.to(float32) / scale`` saturated to
    +-448 (``QuantFP8PerToken.forward_native`` of vLLM 0.8; tests/kernels/quant_utils.py
    ``ref_dynamic_per_token_quant``, fp8 branch). The amax is that of the fp32 upcast, the order of
    DeepSeek-V3's ``act_quant`` kernel (inference/kernel.py: load as fp32, ``max(abs(x)) / 448``,
    ``x / s``) and of vLLM's and SGLang's per-token-group Triton kernels. vLLM's torch code takes
    ``x.abs().max(dim=-1)`` in the activation dtype: the same value (the max of bf16 numbers is
    exact), written otherwise."""
    x_fp32 = x.to(torch.float32)
    x_max = x_fp32.abs().amax(dim=-1, keepdim=True)
    scale = (x_max / FP8_MAX).clamp(min=MIN_SCALING_FACTOR)
    out = (x_fp32 / scale).clamp(FP8_MIN, FP8_MAX).to(FP8_DTYPE)
    return out, scale


def quantize_per_group(x: torch.Tensor, group_size: int = GROUP_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per token group of ``group_size`` columns: (codes like x, scales [..., K / group]).
    DeepSeek-V3's ``act_quant`` (inference/kernel.py: per block of 128, fp32 upcast, ``s =
    max(abs(x)) / 448``, ``y = x / s``) with vLLM's ``QuantFP8._quantize_group_native`` scale floor
    (``(absmax / _FP8_MAX).clamp(min=_FP8_MIN_SCALING_FACTOR)``), saturation and scale layout.
    vLLM's native code groups with ``x.view(-1, groups, group_size)`` and takes the amax with
    ``max(dim)[0].float()`` in the activation dtype: the same numbers, written otherwise."""
    x_grouped = x.to(torch.float32).unflatten(-1, (-1, group_size))
    absmax = x_grouped.abs().amax(dim=-1, keepdim=True)
    scales = (absmax / FP8_MAX).clamp(min=MIN_SCALING_FACTOR)
    x_quant = (x_grouped / scales).clamp(FP8_MIN, FP8_MAX).to(FP8_DTYPE)
    return x_quant.flatten(-2), scales.squeeze(-1)


# --- the layer ---


def _weight_codes(w: torch.Tensor, scheme: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scales) of a [N, K] weight for the scheme (see the module docstring)."""
    w32 = w.detach().to(torch.float32)
    if scheme == "static":
        scale = (w32.abs().amax() / FP8_MAX).clamp(min=MIN_SCALING_FACTOR)
        return (w32 / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale
    if scheme == "per_token":
        scale = (w32.abs().amax(-1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALING_FACTOR)
        return (w32 / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale
    n, k = w32.shape
    blocks = w32.reshape(n // GROUP_SIZE, GROUP_SIZE, k // GROUP_SIZE, GROUP_SIZE)
    scale = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=MIN_SCALING_FACTOR)
    codes = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return codes.reshape(n, k), scale


class Fp8Linear(nn.Module):
    """``nn.Linear`` with FP8 weights and FP8 activations; see the module docstring for the math."""

    def __init__(
        self,
        linear: nn.Linear,
        scheme: str,
        input_scale: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        if scheme not in SCHEMES:
            raise ValueError(f"Fp8Linear: scheme must be one of {SCHEMES}, got {scheme!r}")
        n, k = linear.weight.shape
        if scheme == "per_group" and (n % GROUP_SIZE or k % GROUP_SIZE):
            raise ValueError(f"Fp8Linear: per_group needs both dims divisible by {GROUP_SIZE}, got {n} x {k}")
        if (scheme == "static") != (input_scale is not None):
            raise ValueError("Fp8Linear: the static scheme, and only it, takes a calibrated input_scale")
        self.scheme, self.in_features, self.out_features = scheme, k, n
        codes, scale = _weight_codes(linear.weight, scheme)
        self.register_buffer("weight", codes)
        self.register_buffer("weight_scale", scale)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())
        self.register_buffer(
            "input_scale", None if input_scale is None else input_scale.detach().to(torch.float32).reshape(())
        )

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, scheme={self.scheme}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.scheme == "static":
            q, s = quantize_static(x, self.input_scale), self.input_scale
        elif self.scheme == "per_token":
            q, s = quantize_per_token(x)
        else:
            q, s = quantize_per_group(x)
        if x.is_cuda and self.scheme != "per_group":
            return self._scaled_mm(q, s, x.dtype)
        return self._dequantized_mm(q, s, x.dtype)

    def _scaled_mm(self, q: torch.Tensor, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """cuBLAS FP8 GEMM: per-tensor scales (static) or row-wise scales (per_token)."""
        rows = q.reshape(-1, self.in_features)
        if self.scheme == "static":
            scale_a, scale_b = s, self.weight_scale
        else:
            scale_a, scale_b = s.reshape(-1, 1), self.weight_scale.reshape(1, -1)
        out = torch._scaled_mm(
            rows, self.weight.t(), scale_a=scale_a, scale_b=scale_b, bias=self.bias, out_dtype=dtype
        )
        return out.reshape(*q.shape[:-1], self.out_features)

    def _dequantized_mm(self, q: torch.Tensor, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The same product from dequantized operands, in fp32 (any device, any scheme)."""
        if self.scheme == "per_group":
            a = (q.to(torch.float32).unflatten(-1, (-1, GROUP_SIZE)) * s.unsqueeze(-1)).flatten(-2)
            ws = self.weight_scale.repeat_interleave(GROUP_SIZE, 0).repeat_interleave(GROUP_SIZE, 1)
        else:
            a, ws = q.to(torch.float32) * s, self.weight_scale
        out = (a @ (self.weight.to(torch.float32) * ws).t()).to(dtype)
        return out if self.bias is None else out + self.bias


@torch.no_grad()
def calibrate_input_scales(module: nn.Module, paths: Iterable[str], example_inputs: tuple) -> dict[str, torch.Tensor]:
    """Static scales: run ``module`` once and take each listed linear's input amax / 448."""
    modules = dict(module.named_modules())
    amax: dict[str, torch.Tensor] = {}
    handles = []
    for path in paths:

        def record(_m, args, _out, path=path):
            value = args[0].detach().abs().amax().to(torch.float32)
            amax[path] = torch.maximum(amax[path], value) if path in amax else value

        handles.append(modules[path].register_forward_hook(record))
    try:
        module(*example_inputs)
    finally:
        for h in handles:
            h.remove()
    return {p: (a / FP8_MAX).clamp(min=MIN_SCALING_FACTOR) for p, a in amax.items()}


def swap_fp8_linears(
    module: nn.Module,
    scheme: str,
    example_inputs: tuple | None = None,
    skip: str = DEFAULT_SKIP,
) -> list[str]:
    """Replace every ``nn.Linear`` of ``module`` (in place) by an ``Fp8Linear`` of ``scheme``;
    returns the paths replaced. Skipped: paths matching the regex ``skip`` (routers, LM head) and,
    for per_group, linears whose dims are not multiples of 128. The static scheme calibrates its
    input scales on ``example_inputs`` (required then)."""
    if scheme not in SCHEMES:
        raise ValueError(f"swap_fp8_linears: scheme must be one of {SCHEMES}, got {scheme!r}")
    paths = [
        path
        for path, m in module.named_modules()
        if isinstance(m, nn.Linear)
        and not re.search(skip, path)
        and (scheme != "per_group" or not (m.in_features % GROUP_SIZE or m.out_features % GROUP_SIZE))
    ]
    scales: dict[str, torch.Tensor] = {}
    if scheme == "static":
        if example_inputs is None:
            raise ValueError("swap_fp8_linears: the static scheme calibrates on example_inputs; none given")
        scales = calibrate_input_scales(module, paths, example_inputs)
    for path in paths:
        parent_path, _, name = path.rpartition(".")
        parent = module.get_submodule(parent_path)
        linear = getattr(parent, name)
        # A linear the calibration run never reached keeps no static scale: leave it unquantized.
        if scheme == "static" and path not in scales:
            continue
        setattr(parent, name, Fp8Linear(linear, scheme, scales.get(path)))
    return [p for p in paths if scheme != "static" or p in scales]


def swap_fp8_linears_sharded(built, scheme: str, mesh) -> list[str]:
    """The tensor-parallel counterpart of ``swap_fp8_linears``, for a model that
    ``tensor_parallel.parallelize`` sharded: replace every sharded ``nn.Linear`` of
    ``built.module`` (its weight a DTensor) by an ``Fp8Linear`` of ``scheme`` built from this
    rank's weight shard and run under the same TP style (``tensor_parallel.replace_sharded_module``);
    returns the paths replaced. Each rank quantizes its own shard, as serving engines do: a
    row-wise projection's activation scales are per token over this rank's input features (no max
    allreduce). Sharding after the swap is not possible: the TP styles take nn.Linear only."""
    from torch.distributed.tensor import DTensor

    from .tensor_parallel import replace_sharded_module

    paths = [
        path
        for path, m in built.module.named_modules()
        if isinstance(m, nn.Linear) and isinstance(m.weight, DTensor)
    ]
    for path in paths:
        replace_sharded_module(built, path, lambda linear: Fp8Linear(linear, scheme), mesh)
    return paths
