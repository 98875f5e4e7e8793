"""A cached decode step (transformers StaticCache, fullgraph): outputs and cache contents equal to
eager over several steps, the QK-norm + RoPE sites a decode step leaves to Inductor, and the
what-is-left ranking of the decode benchmark and the CLI."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from unittest import mock

import pytest
import torch
from _rewrites import defaults_without
from torch._inductor.graph import GraphLowering

import fusion_passes
from fusion_passes.kernels import _BLOCKING, classify_kernel, count_kernels, host_costs, what_is_left
from fusion_passes.models import build_model
from fusion_passes.models.decode import DecodeError, DecodeStep
from fusion_passes.numerics import compare, tolerance

STEPS = 3


@functools.cache
def _step(name: str) -> DecodeStep:
    built = build_model(name, size="tiny", dtype=torch.bfloat16, layers=2)
    return DecodeStep(built.module, batch=2, context=8, steps=STEPS)


@functools.cache
def _compiled(name: str, backend_name: str, fusions: tuple[str, ...] | None = None):
    """(compiled step, report, kernel counts of its code): compiled on the first step's inputs, with
    the default fusions or ``fusions``."""
    import torch._inductor.config as inductor_config

    step = _step(name)
    report = fusion_passes.Report()
    chosen = "all" if fusions is None else list(fusions)
    backend = fusion_passes.backend(chosen, report=report) if backend_name == "fusion_passes" else "inductor"
    compiled = torch.compile(step, backend=backend, fullgraph=True, dynamic=False)
    step.restore()
    codes: list[str] = []
    # run_and_get_code's hook without its torch._dynamo.reset(), which would make the steps
    # compiled before compile again on their next call.
    with torch.no_grad(), inductor_config.patch(fx_graph_cache=False), \
            mock.patch.object(GraphLowering, "save_output_code", codes.append):  # fmt: skip
        compiled(*step.inputs(0))
    return compiled, report, count_kernels(codes)


def _run(step: DecodeStep, fn):
    step.restore()
    with torch.no_grad():
        outs = [fn(*step.inputs(i)) for i in range(STEPS)]
    return outs, [t.clone() for t in step.cache_tensors()]


def test_decode_steps_match_eager_outputs_and_cache():
    step = _step("qwen3")
    compiled, report, _ = _compiled("qwen3", "fusion_passes")
    stock, _, _ = _compiled("qwen3", "inductor")
    expected_outs, expected_cache = _run(step, step)
    again_outs, again_cache = _run(step, step)
    # restore() puts the prefilled cache back: eager repeats itself bit for bit
    assert all(torch.equal(a, b) for a, b in zip(again_outs, expected_outs, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(again_cache, expected_cache, strict=True))
    bound = tolerance(torch.bfloat16).rel_norm
    for fn in (compiled, stock):
        outs, cache = _run(step, fn)
        for a, e in zip(outs, expected_outs, strict=True):
            assert compare(a, e).rel_norm <= bound
        written = 0
        for a, e in zip(cache, expected_cache, strict=True):
            if e.is_floating_point():
                assert compare(a, e).rel_norm <= bound
            else:  # the write counters: the step sets them from the position
                assert torch.equal(a, e)
                written += 1
        assert written == 2  # one counter per layer
    # the decode step's norms are raised (and lowered back): the passes ran on it
    assert report.matches["add_rms_norm"] == 4 and report.matches["rms_norm"] == 5


def test_decode_step_leaves_per_head_qk_norm_rope_to_inductor():
    """At one token per sequence Inductor fuses the RoPE table, both norms, both rotations and the
    k cache write into one kernel: the fused op is refused there, with the reason, and the step
    compiles to as many kernels as stock Inductor's (without cache_lengths, which takes the write
    counters' adds: on the CPU Inductor fuses those into its other kernels)."""
    _, report, ours = _compiled("qwen3", "fusion_passes", tuple(defaults_without("cache_lengths")))
    _, _, stock = _compiled("qwen3", "inductor")
    assert report.final()["qk_norm_rope"] == 0
    refused = [r for r in report.rejected if "goes into the KV cache" in r.reason]
    assert sorted(r.module for r in refused) == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    # one entry per site: the matcher's retry that binds k to q's own nodes is no site
    assert [r for r in report.rejected if r.fusion == "qk_norm_rope"] == refused
    assert ours["fused_ops"] == 0 and ours["generated"] == stock["generated"]
    assert report.ops_after()["fusion_passes.qk_norm_rope.default"] == 0


def test_prefill_through_the_cache_still_fuses_qk_norm_rope():
    step = _step("qwen3")
    report = fusion_passes.Report()
    compiled = torch.compile(step, backend=fusion_passes.backend(report=report), fullgraph=True, dynamic=False)
    step.restore()
    prompt, positions = step.prompt, torch.arange(step.context)
    with torch.no_grad():
        out = compiled(prompt, positions)
        step.restore()
        expected = step(prompt, positions)
    assert report.final()["qk_norm_rope"] == 2
    assert not [r for r in report.rejected if "KV cache" in r.reason]
    before, after = report.ops_before(), report.ops_after()
    assert (before["fusion_passes.qk_norm_rope.default"], after["fusion_passes.qk_norm_rope.default"]) == (0, 2)
    assert before["aten.neg.default"] - after["aten.neg.default"] == 4  # q's and k's rotations, 2 layers
    assert compare(out, expected).rel_norm <= tolerance(torch.bfloat16).rel_norm


@pytest.mark.slow
def test_decode_step_keeps_the_whole_row_qk_norm_rope():
    """MiniMax-M2's norm over all heads is not refused at decode (measured faster there)."""
    built = build_model("minimax-m2", size="tiny", dtype=torch.bfloat16, layers=2)
    step = DecodeStep(built.module, batch=2, context=8, steps=1)
    report = fusion_passes.Report()
    compiled = torch.compile(step, backend=fusion_passes.backend(report=report), fullgraph=True)
    with torch.no_grad():
        out = compiled(*step.inputs(0))
        step.restore()
        expected = step(*step.inputs(0))
    assert report.final()["qk_norm_rope_whole_row"] == 2
    assert compare(out, expected).rel_norm <= tolerance(torch.bfloat16).rel_norm


def test_decode_rejects_what_it_cannot_step():
    with pytest.raises(DecodeError, match="decode needs a transformers model .*got Linear"):
        DecodeStep(torch.nn.Linear(4, 4), batch=1, context=4)
    with pytest.raises(DecodeError, match="must be >= 1"):
        DecodeStep(_step("qwen3").model, batch=0, context=4)
    with pytest.raises(DecodeError, match="outside the cache's room for 3 steps"):
        _step("qwen3").inputs(3)


def test_what_is_left_ranks_other_kernels_by_region():
    kernels = [
        ("triton_red_fused_embedding_rms_norm_0", 2.0),
        ("nvjet_gemm_bf16", 10.0),
        ("triton_poi_fused_rope_1", 1.0),
        ("flash_fwd_kernel", 5.0),
        ("nvjet_gemm_bf16", 10.0),
        ("triton_red_fused_add_rms_norm_2", 3.0),
        ("ncclDevKernel_AllReduce_Sum_bf16", 4.0),
        ("triton_poi_fused_rope_1", 1.5),
        ("fused_moe_grouped_kernel", 6.0),
    ]
    left = what_is_left(kernels, layers=2)
    assert [(r["kernel"], r["region"], r["launches"]) for r in left] == [
        ("triton_red_fused_add_rms_norm_2", "gemm -> collective", 1),
        ("triton_red_fused_embedding_rms_norm_0", "start -> gemm", 1),
        ("triton_poi_fused_rope_1", "collective -> moe", 1),
        ("triton_poi_fused_rope_1", "gemm -> attention", 1),
    ]
    assert left[0]["per_layer_us"] == 1.5


def test_host_costs_name_dispatched_ops_and_blocking_calls():
    """A step's host side: fusion_passes ops reached through the dispatcher are named with their
    CPU time (here the CPU reference, as on a CPU); no launch, nothing blocking on a CPU. The
    blocking names: synchronizes and synchronous copies, not the asynchronous copies or launches."""
    x, w = torch.randn(4, 64), torch.randn(64)
    costs = host_costs(lambda: torch.ops.fusion_passes.rms_norm.default(x, w, 1e-6) + 1)
    assert costs["launches"] == 0 and costs["blocking"] == {}
    assert list(costs["dispatched"]) == ["fusion_passes::rms_norm"] and costs["dispatched"]["fusion_passes::rms_norm"] > 0
    assert host_costs(lambda: (x + 1).sum())["dispatched"] == {}
    blocking = ["cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
                "cuMemcpyDtoH_v2", "cuCtxSynchronize"]  # fmt: skip
    assert all(_BLOCKING.match(n) for n in blocking)
    assert not any(_BLOCKING.match(n) for n in ("cudaMemcpyAsync", "cudaLaunchKernel", "cudaMemcpyPeerAsync"))


def test_inductor_glue_named_after_attention_or_topk_is_other():
    # Inductor names a fused kernel after every op it absorbed: the keys' repeat copy fused with
    # the SDPA call's mask carries the attention op's name, and is a copy.
    assert classify_kernel("triton_poi_fused__scaled_dot_product_cudnn_attention_clone_expand_9") == "other"
    assert classify_kernel("triton_per_fused_topk_sort_3") == "other"
    assert classify_kernel("cudnn_generated_fort_native_sdpa_sm80_flash_fprop_wmma_f16_knob_35") == "attention"
    assert classify_kernel("triton_tem_fused_mm_0") == "gemm"
    assert classify_kernel("_route_topk_kernel") == "moe"


def test_cli_decode_on_a_model_it_cannot_step(tmp_path):
    factory = tmp_path / "plain.py"
    factory.write_text("import torch\ndef make():\n    return torch.nn.Linear(8, 8), (torch.randn(2, 8),)\n")
    cli = [sys.executable, "-m", "fusion_passes.cli"]
    done = subprocess.run([*cli, "diff", f"{factory}:make", "--decode", "--device", "cpu"],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "fusion-passes: error: --decode: decode needs a transformers model (a PreTrainedModel with a "
        "config); got Linear"
    ]
    done = subprocess.run([*cli, "diff", "qwen3", "--batch", "4", "--device", "cpu"],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == "fusion-passes: error: --batch applies to --decode only"


def test_decode_benchmark_smoke(tmp_path):
    """The decode benchmark's CPU path: tiny widths, numerics against eager, no times; a second
    fusion_passes variant (--also) compiled and checked beside the defaults in the same run."""
    out = tmp_path / "decode.json"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_decode", "--smoke", "--models", "qwen3", "--batch", "1",
         "--check-steps", "2", "--also", "cache=qk_norm_rope_cache", "--json", str(out), "--out", str(tmp_path / "decode.md")],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    (point,) = json.loads(out.read_text())["points"]
    assert (point["model"], point["batch"], point["context"]) == ("qwen3", 1, 8)
    assert list(point["variants"]) == ["eager", "inductor", "fusion_passes", "fusion_passes+cache"]
    for label in ("inductor", "fusion_passes", "fusion_passes+cache"):
        assert point["variants"][label]["numerics"]["out_rel_err"] <= tolerance(torch.bfloat16).rel_norm
    extra = point["variants"]["fusion_passes+cache"]
    assert extra["opt_in"] == ["qk_norm_rope_cache"] and extra["final"]["qk_norm_rope_cache"] == 2
    assert "qk_norm_rope_cache" not in point["variants"]["fusion_passes"]["final"]
    assert "| fusion_passes+cache |" in (tmp_path / "decode.md").read_text()


def test_decode_benchmark_also_takes_known_fusions_only():
    from benchmarks import bench_decode

    assert bench_decode.also_variants(["a=router_logits,moe_sort_gather", "b=sparse_decode_attention"]) == {
        "a": ("router_logits", "moe_sort_gather"), "b": ("sparse_decode_attention",)}  # fmt: skip
    for bad, message in (("router_logits", "takes LABEL=FUSION"), ("a=", "takes LABEL=FUSION"),
                         ("a=router_logit", "no fusion named 'router_logit'")):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            bench_decode.also_variants([bad])


FACTORY = """
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM


def make():
    cfg = Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return Qwen3ForCausalLM(cfg).eval(), (torch.randint(0, 128, (1, 8)),)
"""


@pytest.mark.slow  # two whole-model compiles; CI keeps the benchmark's smoke run and the CLI's refusal
def test_cli_decode_on_a_users_causal_lm(tmp_path):
    """A factory's transformers *ForCausalLM: its decode step (logits) compared and reported."""
    factory = tmp_path / "user_model.py"
    factory.write_text(FACTORY)
    out = tmp_path / "report.json"
    done = subprocess.run(
        [sys.executable, "-m", "fusion_passes.cli", "diff", f"{factory}:make", "--decode", "--batch", "2",
         "--context", "16", "--device", "cpu", "--json", str(out)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["decode"] == {"batch": 2, "context": 16}
    assert report["model"].endswith("a decode step at batch 2 after 16 tokens")
    assert all(check["ok"] for check in report["numerics"].values())
    (rejected,) = report["rejected"]
    assert rejected["fusion"] == "qk_norm_rope" and "goes into the KV cache" in rejected["reason"]
    assert report["lowered_back"] == {"fusion_passes.add_rms_norm.default": 2,
                                      "fusion_passes.rms_norm.default": 3, "fusion_passes.rope.default": 2}  # fmt: skip


def test_decode_benchmark_takes_inductor_settings_for_both_variants(monkeypatch, capsys):
    """--inductor KEY=VALUE: Python literals (else the string), checked by name and type with a
    one-line error before anything compiles."""
    from benchmarks import bench_decode

    assert bench_decode.inductor_settings(["combo_kernels=True", "max_fusion_size=32", "cpp.cxx=g++"]) == {
        "combo_kernels": True, "max_fusion_size": 32, "cpp.cxx": "g++"}  # fmt: skip
    for bad, message in ((["combo_kernels"], "takes KEY=VALUE"), (["combo_kernel=True"], "unknown Inductor option"),
                         (["combo_kernels=3"], "must be bool")):  # fmt: skip
        monkeypatch.setattr(sys, "argv", ["bench_decode", "--smoke", "--inductor", *bad])
        with pytest.raises(SystemExit) as exit_:
            bench_decode.main()
        assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_plain_rounds_take_the_variants_in_turn(monkeypatch):
    """Plain-launch timing: every variant once a round, in turn, for the rounds asked; each value
    a wall-clock time per back-to-back step (a sleep stands in for a step's host cost)."""
    import time as time_module

    from benchmarks import bench_decode

    monkeypatch.setattr(bench_decode, "PLAIN_ROUND_US", 20_000)
    calls: list[str] = []

    class Step:
        restored = 0

        def restore(self):
            self.restored += 1

    def variant(label: str, seconds: float):
        def step(*inputs):
            calls.append(label)
            time_module.sleep(seconds)

        return step

    step = Step()
    fns = {"slow": variant("slow", 0.002), "fast": variant("fast", 0.0005)}
    rounds = bench_decode.plain_rounds(step, fns, (), 3, None)
    assert step.restored == 1 and list(rounds) == ["slow", "fast"]
    assert all(len(samples) == 3 for samples in rounds.values())
    assert all(1900 < us < 6000 for us in rounds["slow"]) and all(450 < us < 3000 for us in rounds["fast"])
    # after the first estimate (3 + 2 calls each), the rounds alternate: slow's calls, then fast's
    timed = calls[10:]
    changes = sum(a != b for a, b in zip(timed, timed[1:]))
    assert changes == 2 * 3 - 1, changes


def test_benchmarks_page_shows_the_plain_rounds_range():
    """The decode table's plain speedup carries the lowest and highest round's ratio where the
    result file recorded the rounds."""
    from benchmarks import render

    def variant(graph, plain, rounds=None):
        row = {"graph_us": graph, "plain_us": plain}
        return row | ({"plain_rounds_us": rounds} if rounds else {})

    point = {"model": "m", "layers": 2, "batch": 1, "context": 8,
             "variants": {"inductor": variant(100.0, 200.0, [190.0, 200.0, 240.0]),
                          "fusion_passes": variant(80.0, 210.0, [200.0, 210.0, 200.0])}}  # fmt: skip
    _, table = render.decode([{"points": [point]}])
    row = next(line for line in table if line.startswith("| m (2)"))
    assert "0.95x (0.95x-1.20x)" in row and "1.25x" in row, row


@pytest.mark.slow  # a whole-model compile per model
@pytest.mark.parametrize("name,sites", [("qwen3", 2), ("minimax-m2", 2), ("qwen3.5-moe", 1)])
def test_decode_steps_write_the_kv_cache_from_the_prologue_kernel(name, sites):
    """With the opt-in qk_norm_rope_cache fusions every full-attention layer's q/k norm, RoPE and
    both cache writes are one op (no index_put left for them); outputs and caches stay within
    bf16's tolerance of eager over the steps."""
    step = _step(name)
    report = fusion_passes.Report()
    fusions = ["all", "qk_norm_rope_cache", "qk_norm_rope_whole_row_cache"]
    compiled = torch.compile(step, backend=fusion_passes.backend(fusions, report=report), fullgraph=True, dynamic=False)
    outs, cache = _run(step, compiled)
    expected_outs, expected_cache = _run(step, step)
    final = report.final()
    assert final["qk_norm_rope_cache"] + final["qk_norm_rope_whole_row_cache"] == sites and not report.errors
    after = report.ops_after()
    assert after["fusion_passes.qk_norm_rope_cache.default"] == sites and "aten.index_put.default" not in after
    bound = tolerance(torch.bfloat16).rel_norm
    assert all(compare(a, e).rel_norm <= bound for a, e in zip(outs, expected_outs, strict=True))
    for a, e in zip(cache, expected_cache, strict=True):
        assert compare(a, e).rel_norm <= bound if e.is_floating_point() else torch.equal(a, e)
