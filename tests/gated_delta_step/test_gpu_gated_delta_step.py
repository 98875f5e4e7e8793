"""CUDA: a Qwen 3.5 decode step (tiny widths, StaticCache, fullgraph) with the Gated DeltaNet
fusions: the conv and the recurrent step each one kernel writing its state in place (Inductor's
reinplacing drops the copies into the cache), fewer kernels than stock Inductor, outputs and
cache contents within stock Inductor's own error against eager over several steps, in both
launch modes, and a CUDA-graph replay. Skipped without a GPU (run on the GPU machine)."""

from __future__ import annotations

import re

import pytest
import torch
from _gpu_decode import assert_graph_replay_matches, compile_step

import fusion_passes
from fusion_passes.kernels import count_kernels
from fusion_passes.models import build_model
from fusion_passes.models.decode import DecodeStep
from fusion_passes.numerics import compare

pytestmark = pytest.mark.gpu
STEPS = 4


def _step(name="qwen3.5"):
    built = build_model(name, size="tiny", dtype=torch.bfloat16, layers=4, device="cuda")
    return DecodeStep(built.module, batch=3, context=8, steps=STEPS)


def _launch_args(code: str, kernel: str) -> list[list[str]]:
    """The arguments of each launch of ``kernel`` in Inductor's generated code, split at the
    top-level commas."""
    launches = []
    for match in re.finditer(rf"{kernel}_\d+\.run\(", code):
        depth, args, current = 1, [], ""
        for ch in code[match.end():]:
            depth += {"(": 1, ")": -1}.get(ch, 0)
            if depth == 0 or (ch == "," and depth == 1):
                args.append(current.strip())
                current = ""
                if depth == 0:
                    break
            else:
                current += ch
        launches.append(args)
    return launches


def _run(step, fn):
    step.restore()
    with torch.no_grad():
        outs = [fn(*step.inputs(i)).clone() for i in range(STEPS)]
    return outs, [t.clone() for t in step.cache_tensors()]


@pytest.mark.parametrize("launch", ["direct", "dispatch"])
def test_decode_step_fuses_gdn_layers_in_place(launch):
    torch._dynamo.reset()
    step = _step()
    report = fusion_passes.Report()
    ours, codes = compile_step(step, fusion_passes.backend(report=report, launch=launch))
    stock, stock_codes = compile_step(step, "inductor")
    assert report.final()["causal_conv1d_update"] == 3 and report.final()["gated_delta_step"] == 3
    before, after = report.ops_before(), report.ops_after()
    assert (before["aten.convolution.default"], after["aten.convolution.default"]) == (3, 0)
    assert (before["aten.log1p.default"], after["aten.log1p.default"]) == (3, 0)
    expected_outs, expected_cache = _run(step, step)

    def errors(fn):
        outs, cache = _run(step, fn)
        out_err = max(compare(a, e).rel_norm for a, e in zip(outs, expected_outs, strict=True))
        cache_err = max(
            compare(a, e).rel_norm for a, e in zip(cache, expected_cache, strict=True) if e.is_floating_point()
        )
        return out_err, cache_err

    # within twice stock Inductor's own error against eager (or bf16's rounding where that is 0)
    (ours_out, ours_cache), (stock_out, stock_cache) = errors(ours), errors(stock)
    assert ours_out <= 2 * max(stock_out, 4e-3) and ours_cache <= 2 * max(stock_cache, 4e-3)
    if launch == "direct":
        (code,) = codes
        # the fused kernels are Inductor's launches, writing the cache's states themselves (the
        # graph's inputs): Inductor reinplaced them, and no copy into the cache is left
        conv = _launch_args(code, "_causal_conv1d_update_kernel")
        step_ = _launch_args(code, "_gated_delta_step_kernel")
        assert len(conv) == 3 and len(step_) == 3
        assert all(re.fullmatch(r"arg\d+_1", args[1]) for args in conv)  # conv_state
        assert all(re.fullmatch(r"arg\d+_1", args[7]) for args in step_)  # the recurrent state
        assert sum(count_kernels(codes).values()) < sum(count_kernels(stock_codes).values())
    assert_graph_replay_matches(step, ours)
