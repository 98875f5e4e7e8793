"""FP8 linear layers as serving engines write their native (plain torch) fallback, and a helper
that swaps a model's ``nn.Linear`` layers for them: the source of the norm -> FP8 quantization
spellings that ``fusion_passes.patterns.rms_norm_quant_fp8`` fuses.

Weights (quantized once, offline): float8_e4m3fn codes with fp32 scales,
    static     one scale for the whole weight            w = codes * ws          (ws: [])
    per_token  one scale per output channel               w[n] = codes[n] * ws[n] (ws: [N, 1])
    per_group  one scale per 128 x 128 block (DeepSeek V3's block-wise FP8)       (ws: [N/128, K/128])
Activations (quantized in forward, the spellings of patterns.rms_norm_quant_fp8):
    static     q = fp8(clamp(x / s, -448, 448)), s calibrated: amax of the layer's input / 448
    per_token  s = max(amax(|x|, -1) / 448, MIN_SCALE) per row
    per_group  the same per 128 columns
GEMM: ``torch._scaled_mm`` on CUDA for the static (per-tensor) and per-token (row-wise) scales;
elsewhere -- on CPU, and for the block-wise scheme -- the dequantized matmul, in fp32:
    y = ((q * s) @ (codes * ws)^T).to(x.dtype) (+ bias)
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from fusion_passes.lowering.rms_norm_quant_fp8.reference import FP8_DTYPE, FP8_MAX, MIN_SCALE
from fusion_passes.patterns.rms_norm_quant_fp8 import (
    GROUP_SIZE,
    quant_per_group,
    quant_per_token,
    quant_static,
)

SCHEMES = ("static", "per_token", "per_group")
# Not quantized: MoE routers (their logits pick experts: FP8 error would move tokens between
# experts) and the LM head.
DEFAULT_SKIP = r"(^|\.)(gate|router|lm_head)$"


def _weight_codes(w: torch.Tensor, scheme: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scales) of a [N, K] weight for the scheme (see the module docstring)."""
    w32 = w.detach().to(torch.float32)
    if scheme == "static":
        scale = (w32.abs().amax() / FP8_MAX).clamp(min=MIN_SCALE)
        return (w32 / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale
    if scheme == "per_token":
        scale = (w32.abs().amax(-1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)
        return (w32 / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale
    n, k = w32.shape
    blocks = w32.reshape(n // GROUP_SIZE, GROUP_SIZE, k // GROUP_SIZE, GROUP_SIZE)
    scale = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=MIN_SCALE)
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
            q, s = quant_static(x, self.input_scale), self.input_scale
        elif self.scheme == "per_token":
            q, s = quant_per_token(x)
        else:
            q, s = quant_per_group(x)
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
    return {p: (a / FP8_MAX).clamp(min=MIN_SCALE) for p, a in amax.items()}


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
