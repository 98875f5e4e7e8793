"""Shared by the GPU decode-step tests: compile a DecodeStep keeping Inductor's generated code, a
tiny model's prefill compiled with two fusion lists side by side, and replay one step from a CUDA
graph."""

from __future__ import annotations

from unittest import mock

import torch
from torch._inductor.graph import GraphLowering


def compile_step(step, backend, inputs=None):
    """(compiled step, Inductor's generated code per graph), compiled on ``inputs`` (default: the
    first decode step's; a prompt and its positions compile the prefill)."""
    import torch._inductor.config as inductor_config

    codes: list[str] = []
    compiled = torch.compile(step, backend=backend, fullgraph=True, dynamic=False)
    step.restore()
    with torch.no_grad(), inductor_config.patch(fx_graph_cache=False), \
            mock.patch.object(GraphLowering, "save_output_code", codes.append):  # fmt: skip
        compiled(*(step.inputs(0) if inputs is None else inputs))
    return compiled, codes


def prefill_side_by_side(model: str, fusion: str, tokens: int = 40):
    """A tiny ``model`` (2 layers, bf16) prefilling ``tokens`` into a StaticCache, compiled with the
    default fusions and ``fusion`` (an opt-in one added) and with the same set less ``fusion``:
    (the fused run's report, its generated code, its output, the output without ``fusion``)."""
    import fusion_passes
    from fusion_passes.models import build_model
    from fusion_passes.models.decode import DecodeStep

    torch._dynamo.reset()
    built = build_model(model, size="tiny", dtype=torch.bfloat16, layers=2, device="cuda")
    step = DecodeStep(built.module, batch=1, context=tokens, steps=1)
    prompt = (step.prompt, torch.arange(tokens, device="cuda"))
    defaults = [f.name for f in fusion_passes.registry.get_fusions("all")]
    fused = defaults if fusion in defaults else [*defaults, fusion]
    report = fusion_passes.Report()
    with_fused, codes = compile_step(step, fusion_passes.backend(fused, report=report), inputs=prompt)
    without, _ = compile_step(step, fusion_passes.backend([n for n in fused if n != fusion]), inputs=prompt)
    with torch.no_grad():
        step.restore()
        got = with_fused(*prompt).clone()
        step.restore()
        want = without(*prompt).clone()
    (code,) = codes
    return report, code, got, want


def assert_graph_replay_matches(step, compiled) -> None:
    """A CUDA graph of one compiled step, replayed from the restored cache, gives the output a
    direct call gives."""
    step.restore()
    with torch.no_grad():
        inputs = [t.clone() for t in step.inputs(0)]
        compiled(*inputs)
        step.restore()
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            compiled(*inputs)
        torch.cuda.current_stream().wait_stream(stream)
        step.restore()
        with torch.cuda.graph(graph):
            out = compiled(*inputs)
        step.restore()
        graph.replay()
        replayed = out.clone()
        step.restore()
        direct = compiled(*inputs)
    assert torch.equal(replayed, direct)
