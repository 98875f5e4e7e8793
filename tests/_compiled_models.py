"""Whole tiny models compiled once with every default fusion, shared by the model tests.

Compiling a tiny model takes 5-50 s on 2 cores (Qwen3 bf16 16 s as a process's first compile,
DeepSeek V3.2 fp32 27 s); the RMSNorm, QK-norm + RoPE and MLA model tests check different fusions
of the same compiles, so each (model, dtype, variant) compiles once per process. Under
pytest-xdist the three files are one xdist_group (tests/conftest.py), so one worker compiles them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

import fusion_passes
from fusion_passes.models import BuiltModel, build_model


@dataclass(frozen=True)
class CompiledModel:
    built: BuiltModel
    report: fusion_passes.Report  # of the fusion_passes compile
    fused: torch.Tensor  # the compiled model's output
    expected: torch.Tensor  # eager's output


def compiled_model(
    name: str,
    dtype: torch.dtype,
    rope_interleave: bool | None = None,
    opt_in: tuple[str, ...] = (),
    opt_out: tuple[str, ...] = (),
) -> CompiledModel:
    """``name`` (tiny) compiled with fusion_passes' default fusions (and the opt-in ones named, less
    the opt-out ones), run once on its inputs. rope_interleave: overrides the config's (DeepSeek
    V3 MLA); None keeps it."""
    # One cache key however the arguments are spelled (functools.cache keys f(a, b) and
    # f(a, b, None) apart, which compiled a model twice).
    return _compiled_model(name, dtype, rope_interleave, tuple(opt_in), tuple(opt_out))


@functools.cache
def _compiled_model(
    name: str,
    dtype: torch.dtype,
    rope_interleave: bool | None,
    opt_in: tuple[str, ...],
    opt_out: tuple[str, ...],
) -> CompiledModel:
    built = build_model(name, size="tiny", dtype=dtype)
    if rope_interleave is not None:
        built.config.rope_interleave = rope_interleave  # read by the attention at every forward
    module, inputs = built.module.eval(), built.example_inputs
    report = fusion_passes.Report()
    with torch.no_grad():
        expected = module(*inputs)
        torch._dynamo.reset()
        fusions = [f.name for f in fusion_passes.registry.get_fusions("all") if f.name not in opt_out]
        fusions += list(opt_in)
        backend = fusion_passes.backend(fusions, report=report)
        fused = torch.compile(module, backend=backend, fullgraph=True)(*inputs)
    return CompiledModel(built, report, fused, expected)
