"""Shared by the GPU decode-step tests: compile a DecodeStep keeping Inductor's generated code, and
replay one step from a CUDA graph."""

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
