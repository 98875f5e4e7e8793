"""Register your own fusion: SiLU-and-mul, the gate of every SwiGLU MLP.

Unfused: y = silu(gate) * up            (Inductor: one kernel, but the op is opaque to your serving stack)
Fused:   y = my_project.silu_mul(gate, up)

A fusion is the unfused computation written as plain torch code (the pattern), the fused call
(the replacement), example inputs to trace the pattern with, and optionally a check that rejects
a match the fused op would compute differently. Run: python examples/custom_fusion.py
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import fusion_passes


# 1. The fused op. Here its implementation is the reference; a real project dispatches to its
#    kernel on CUDA (silu_mul.register_kernel("cuda")).
@torch.library.custom_op("my_project::silu_mul", mutates_args=())
def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


@silu_mul.register_fake
def _(gate, up):
    return torch.empty_like(gate)


# 2. The pattern (as model code writes it) and the replacement, with the same arguments.
def silu_times_up(gate, up):
    """SiLU(gate) * up -> my_project.silu_mul"""
    return F.silu(gate) * up


def fused_silu_mul(gate, up):
    return torch.ops.my_project.silu_mul.default(gate, up)


def example_inputs():
    # One tuple is enough: register_fusion traces it at fp32, bf16 and fp16 (their graphs differ:
    # bf16 and fp16 keep F.silu's upcast), or at the dtypes given as dtypes=[...].
    return [(torch.randn(4, 32), torch.randn(4, 32))]


def same_shape_and_dtype(values):
    gate, up = values["gate"], values["up"]
    if gate.shape != up.shape or gate.dtype != up.dtype:
        return "gate and up differ in shape or dtype (the fused op does not broadcast)"
    return None


fusion_passes.register_fusion(
    "silu_mul",
    pattern=silu_times_up,
    replacement=fused_silu_mul,
    example_inputs=example_inputs,
    check=same_shape_and_dtype,
    replace=True,  # re-running this file in one process re-registers
)


class SwiGLU(nn.Module):
    def __init__(self, hidden: int = 64, inner: int = 128) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(hidden, eps=1e-6)
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, x):
        h = self.norm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


def main() -> fusion_passes.Report:
    torch.manual_seed(0)
    model = SwiGLU().eval()
    x = torch.randn(2, 8, 64)
    report = fusion_passes.Report()
    compiled = torch.compile(
        model, backend=fusion_passes.backend(["silu_mul", "rms_norm"], report=report, verify=True)
    )
    with torch.no_grad():
        out, expected = compiled(x), model(x)
    print(report.summary())
    for site in report.sites:
        print(f"  {site.fusion:10s} {site.module:12s} {site.location}")
    print(f"max abs error vs eager: {(out - expected).abs().max().item():.2e}")
    return report


if __name__ == "__main__":
    main()
