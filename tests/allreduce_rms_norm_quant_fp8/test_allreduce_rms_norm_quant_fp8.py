"""Tests of the tensor-parallel allreduce + (residual add +) RMSNorm + FP8 quantization fusions.

On a gloo group of 2 spawned CPU processes, ONE spawn for every case (a spawn costs ~9 s): match
counts, spelling names, ops before/after and outputs equal to eager on every rank, bit for bit
(the fused op's reference is the model's own math: the same gloo sum, the norm and quantization
references that round as the model does), for every scheme, both ops, every norm form, both slots
of the sum, and the near misses that must stay unfused; on the same spawn, a tiny tensor-parallel
Qwen3 whose linears are FP8 (per token), fused at every allreduce -> norm -> FP8 projection.

In this process: the one-shot symmetric-memory kernel under Triton's interpreter, on a simulated
world of 2 (two workspaces of CPU tensors, the signal and buffer state a peer leaves), against the
single-GPU norm + quantization kernel on the reference sum, bit for bit; and, in a subprocess
without the interpreter, the kernel compiled for an H100/H200 (sm_90): the interpreter cannot run
real cross-GPU traffic, so these two are what a CPU can check of it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import triton

import fusion_passes
import fusion_passes.lowering.allreduce_rms_norm_quant_fp8.op  # noqa: F401  (registers the ops)
from _distributed import bits, compile_case, run_world
from fusion_passes.lowering.common.direct_launch import LAUNCHERS
from _fp8_spellings import (
    FP8_DTYPE,
    FP8_MAX,
    MIN_SCALING_FACTOR,
    QUANT,
    llama_rms_norm,
    per_group_quant,
    per_token_quant,
    qwen3_next_rms_norm,
    torchtitan_rms_norm,
)
from fusion_passes.numerics import fp8_codes_apart

WORLD = 2
EPS = 1e-6
HIDDEN = 256  # two groups of 128 (per_group)
SCHEMES = ("static", "per_token", "per_group")
FUSIONS = [f"allreduce_{prefix}rms_norm_quant_fp8_{s}" for prefix in ("add_", "") for s in SCHEMES]
C10D = ("_c10d_functional.all_reduce.default", "_c10d_functional.wait_tensor.default")
# What the fused op replaces: the norm (model or canonical) and the quantization (model or canonical).
UNFUSED_OPS = (
    "aten.rsqrt.default",
    "aten.amax.default",
    "aten.clamp_max.default",
    "fusion_passes.add_rms_norm.default",
    "fusion_passes.rms_norm.default",
    "fusion_passes.add_rms_norm_quant_fp8.default",
    "fusion_passes.rms_norm_quant_fp8.default",
)
# The pattern's form name -> the model code written in that form; QUANT: each scheme's real
# spelling (tests/_fp8_spellings.py names the code each follows).
NORMS = {"llama": llama_rms_norm, "fp32_weight": torchtitan_rms_norm, "offset": qwen3_next_rms_norm}


# --- the spellings, as TP model code writes them (x: this rank's partial sum) ---


def _add_norm_quant(form: str, scheme: str, sum_first: bool):
    """allreduce, residual add (``residual + s`` or ``s + residual``), norm, quantization."""
    norm, quant = NORMS[form], QUANT[scheme]

    def fn(x, residual, w, scale):
        s = funcol.all_reduce(x, "sum", dist.group.WORLD)
        h = residual + s if sum_first else s + residual
        return (*quant(norm(h, w, EPS), scale), h)

    return fn


def _norm_quant(form: str, scheme: str, sum_reused: bool):
    """allreduce, norm, quantization: no residual add (the first layer after a reduced embedding,
    whose sum is the next residual)."""
    norm, quant = NORMS[form], QUANT[scheme]

    def fn(x, residual, w, scale):
        s = funcol.all_reduce(x, "sum", dist.group.WORLD)
        out = quant(norm(s, w, EPS), scale)
        return (*out, s * 2) if sum_reused else out

    return fn


def add_ue8m0_canonical(x, residual, w, scale):
    """Power-of-two scales: no plain-torch spelling is registered for them, so the canonical op is
    called as a user (or a future fusion) would; the sum in the residual slot."""
    s = funcol.all_reduce(x, "sum", dist.group.WORLD)
    ops = torch.ops.fusion_passes
    return ops.add_rms_norm_quant_fp8(residual, s, w, EPS, 0.0, True, "per_group", None, 128, True)


def last_norm_canonical(x, residual, w, scale):
    """The model's final norm: nothing reads the new residual. The quantization fusion's patterns
    always return the new residual, so only a canonical call has this form today."""
    s = funcol.all_reduce(x, "sum", dist.group.WORLD)
    q, scales, _ = torch.ops.fusion_passes.add_rms_norm_quant_fp8(residual, s, w, EPS, 0.0, True, "per_token")
    return q, scales


def ue8m0_canonical(x, residual, w, scale):
    s = funcol.all_reduce(x, "sum", dist.group.WORLD)
    return torch.ops.fusion_passes.rms_norm_quant_fp8(s, w, EPS, 1.0, False, "per_group", None, 128, True)


def max_not_fused(x, residual, w, scale):
    s = funcol.all_reduce(x, "max", dist.group.WORLD)  # not a sum: the fused op would be wrong
    h = residual + s
    return (*per_token_quant(llama_rms_norm(h, w, EPS)), h)


def sum_read_elsewhere_not_fused(x, residual, w, scale):
    s = funcol.all_reduce(x, "sum", dist.group.WORLD)  # s is read outside the pattern: it must stay
    h = residual + s
    return (*per_group_quant(llama_rms_norm(h, w, EPS)), h, s * 3)


def unclamped_scale_read_not_fused(x, residual, w, scale):
    """The scale before its floor (vLLM's MIN_SCALING_FACTOR) is read too: the quantization fusion
    refuses (its op returns only the floored scale), so the canonical quantization op the allreduce
    fusion starts from never appears and the allreduce stays."""
    s = funcol.all_reduce(x, "sum", dist.group.WORLD)
    h = residual + s
    y32 = llama_rms_norm(h, w, EPS).to(torch.float32)
    unclamped = y32.abs().amax(-1, keepdim=True) / FP8_MAX
    scales = unclamped.clamp(min=MIN_SCALING_FACTOR)
    return (y32 / scales).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scales, h, unclamped


def other_group_size_not_fused(x, residual, w, scale):
    """Group size 64: a canonical call of another group size keeps it as an argument, a form the
    patterns (group size 128, see patterns/allreduce_rms_norm_quant_fp8.GROUP_SIZE) do not take.
    Left as it is: the outputs still equal eager (no rewrite with the wrong group size)."""
    s = funcol.all_reduce(x, "sum", dist.group.WORLD)
    return torch.ops.fusion_passes.add_rms_norm_quant_fp8(
        s, residual, w, EPS, 0.0, True, "per_group", None, 64
    )


_QUANT_FUSION = {True: "add_rms_norm_quant_fp8_{}", False: "rms_norm_quant_fp8_{}"}
_NORM_FUSION = {True: "add_rms_norm", False: "rms_norm"}
_RAISE = {"static": "quant_fp8_static", "per_token": "quant_fp8_dynamic", "per_group": "quant_fp8_dynamic"}


def _fused(with_residual: bool, scheme: str, canonical: bool = False) -> dict[str, int]:
    """The matches of a fused case: the norm and quantization raise to their canonical ops and
    the norm + quant fusion takes them (unless the model calls the fused op itself), then the
    allreduce fusion takes its op."""
    prefix = "add_" if with_residual else ""
    matches = {f"allreduce_{prefix}rms_norm_quant_fp8_{scheme}": 1}
    if not canonical:
        matches |= {_NORM_FUSION[with_residual]: 1, _QUANT_FUSION[with_residual].format(scheme): 1}
        matches |= {_RAISE[scheme]: 1}
    return matches


# name -> (fn, dtype, the fused op or None, its spelling, the matches expected)
CASES = {
    "static_llama_residual_plus_sum_bf16": (
        _add_norm_quant("llama", "static", True), torch.bfloat16,
        "allreduce_add_rms_norm_quant_fp8", "allreduce_residual_plus_sum_add_rms_norm_llama_then_static",
        _fused(True, "static"),
    ),
    "per_token_fp32_weight_sum_plus_residual_bf16": (
        _add_norm_quant("fp32_weight", "per_token", False), torch.bfloat16,
        "allreduce_add_rms_norm_quant_fp8",
        "allreduce_sum_plus_residual_add_rms_norm_fp32_weight_then_per_token",
        _fused(True, "per_token"),
    ),
    "per_group_offset_residual_plus_sum_bf16": (
        _add_norm_quant("offset", "per_group", True), torch.bfloat16,
        "allreduce_add_rms_norm_quant_fp8",
        "allreduce_residual_plus_sum_add_rms_norm_offset_then_per_group",
        _fused(True, "per_group"),
    ),
    "per_token_last_norm_canonical_fp32": (
        last_norm_canonical, torch.float32,
        "allreduce_add_rms_norm_quant_fp8",
        "allreduce_sum_plus_residual_add_rms_norm_llama_then_per_token_last",
        _fused(True, "per_token", canonical=True),
    ),
    "per_group_ue8m0_canonical_bf16": (
        add_ue8m0_canonical, torch.bfloat16,
        "allreduce_add_rms_norm_quant_fp8",
        "allreduce_sum_plus_residual_add_rms_norm_llama_then_per_group_ue8m0",
        _fused(True, "per_group", canonical=True),
    ),
    "no_residual_static_llama_bf16": (
        _norm_quant("llama", "static", False), torch.bfloat16,
        "allreduce_rms_norm_quant_fp8", "allreduce_rms_norm_llama_then_static",
        _fused(False, "static"),
    ),
    "no_residual_per_token_offset_sum_reused_bf16": (
        _norm_quant("offset", "per_token", True), torch.bfloat16,
        "allreduce_rms_norm_quant_fp8", "allreduce_rms_norm_offset_then_per_token",
        _fused(False, "per_token"),
    ),
    "no_residual_per_group_fp32_weight_fp32": (
        _norm_quant("fp32_weight", "per_group", False), torch.float32,
        "allreduce_rms_norm_quant_fp8", "allreduce_rms_norm_fp32_weight_then_per_group",
        _fused(False, "per_group"),
    ),
    "no_residual_per_group_ue8m0_canonical_fp32": (
        ue8m0_canonical, torch.float32,
        "allreduce_rms_norm_quant_fp8", "allreduce_rms_norm_offset_then_per_group_ue8m0",
        _fused(False, "per_group", canonical=True),
    ),
    "max_not_fused": (
        max_not_fused, torch.bfloat16, None, None,
        {"add_rms_norm": 1, "quant_fp8_dynamic": 1, "add_rms_norm_quant_fp8_per_token": 1},
    ),
    "sum_read_elsewhere_not_fused": (
        sum_read_elsewhere_not_fused, torch.bfloat16, None, None,
        {"add_rms_norm": 1, "quant_fp8_dynamic": 1, "add_rms_norm_quant_fp8_per_group": 1},
    ),
    "unclamped_scale_read_not_fused": (
        unclamped_scale_read_not_fused, torch.bfloat16, None, None, {"add_rms_norm": 1},
    ),
    "other_group_size_not_fused": (other_group_size_not_fused, torch.bfloat16, None, None, {}),
}  # fmt: skip
ARG_ERROR = "bad_arguments"  # key of the job's result for the op's argument check
TP_MODEL = "tp_qwen3_fp8"  # key of the job's result for the tensor-parallel FP8 model
TP_SCHEME = "per_token"


def _tp_model_job() -> dict:
    """Tiny Qwen3 (bf16, 2 layers), parallelized, its linears swapped for per-token FP8 ones,
    compiled with the allreduce + norm + quantization fusions."""
    from torch.distributed.device_mesh import init_device_mesh

    from fusion_passes.models import build_model
    from fusion_passes.models.fp8_linear import swap_fp8_linears_sharded
    from fusion_passes.models.tensor_parallel import parallelize
    from fusion_passes.numerics import compare

    built = build_model("qwen3", "tiny", dtype=torch.bfloat16)  # seeded: the same on every rank
    mesh = init_device_mesh("cpu", (WORLD,))
    parallelize(built, mesh)
    swapped = swap_fp8_linears_sharded(built, TP_SCHEME, mesh)
    fusions = [f"allreduce_{prefix}rms_norm_quant_fp8_{TP_SCHEME}" for prefix in ("add_", "")]
    # The non-quantizing fusion too: it must leave the quantized norms to the fusions above (the
    # quantization fusions run first, so it never sees their norms) and take the final norm.
    fusions.append("allreduce_add_rms_norm")
    report = fusion_passes.Report()
    torch._dynamo.reset()
    with torch.no_grad():
        backend = fusion_passes.backend(fusions, report=report, strict=True)
        out = torch.compile(built.module, backend=backend)(*built.example_inputs)
        eager = built.module(*built.example_inputs)
    return {
        "swapped": len(swapped),
        "layers": built.config.num_hidden_layers,
        "matches": {k: v for k, v in report.matches.items() if v},
        "sites": sorted((s.fusion, s.module) for s in report.sites if s.fusion.startswith("allreduce_")),
        "before": report.ops_before(),
        "after": report.ops_after(),
        "vs_eager": compare(out, eager).rel_norm,
        "errors": list(report.errors),
    }


def _job(rank: int, world_size: int) -> dict:
    """Every case compiled on this rank: what the report says, and the outputs against eager."""
    results = {}
    group = dist.group.WORLD.group_name
    for name, (fn, dtype, *_rest) in CASES.items():
        torch.manual_seed(0)  # residual, weight and scale replicated, as in a TP model
        residual = torch.randn(3, 4, HIDDEN).to(dtype)
        w = (1.0 + 0.3 * torch.randn(HIDDEN)).to(dtype)
        scale = torch.tensor(0.02)
        torch.manual_seed(1 + rank)  # each rank's partial sum differs
        x = torch.randn(3, 4, HIDDEN).to(dtype)
        results[name] = {**compile_case(fn, (x, residual, w, scale), FUSIONS), "group": group}
    # The op checks its arguments before any collective: both ranks raise, none is left waiting.
    x = torch.randn(2, HIDDEN)
    try:
        torch.ops.fusion_passes.allreduce_rms_norm_quant_fp8(
            x, torch.ones(HIDDEN), EPS, 0.0, False, "static", None, 128, False, group
        )
        results[ARG_ERROR] = None
    except ValueError as e:
        results[ARG_ERROR] = str(e)
    results[TP_MODEL] = _tp_model_job()  # on this spawn too: a spawn costs ~9 s
    return results


@pytest.fixture(scope="module")
def job():
    return run_world(_job, world_size=WORLD, timeout=180)


@pytest.mark.parametrize("case", CASES)
def test_allreduce_norm_quant_spelling(job, case):
    _fn, _dtype, op, spelling, matches = CASES[case]
    for rank, results in enumerate(job):
        r = results[case]
        assert not r["errors"], (rank, r["errors"])
        assert r["equal"] and all(r["equal"]), (rank, r["equal"])
        before, after = r["before"], r["after"]
        assert all(before.get(o) == 1 for o in C10D), (rank, before)
        assert r["matches"] == matches, (rank, r["matches"])
        if op is None:  # not fused: the collective stays, no collective op was added
            assert all(after.get(o) == 1 for o in C10D), (rank, after)
            assert not r["spellings"] and r["fallbacks"] == {}, (rank, r)
            continue
        assert r["spellings"] == [spelling], (rank, r["spellings"])
        assert set(UNFUSED_OPS) & set(before), (rank, before)
        assert after.get(f"fusion_passes.{op}.default") == 1, (rank, after)
        assert not set(C10D + UNFUSED_OPS) & set(after), (rank, after)
        # The report names the path the op took at run time on this group: on a CPU, the reference.
        expected = {f"fusion_passes.{op}.default": {r["group"]: "x is on cpu: the reference path"}}
        assert r["fallbacks"] == expected, (rank, r["fallbacks"])


def test_every_scheme_form_and_op_is_covered():
    """The cases above exercise every fusion, every scheme and every norm form."""
    spellings = [c[3] for c in CASES.values() if c[3]]
    assert all(any(f"_{form}_then_" in s for s in spellings) for form in NORMS)
    fused = {f for c in CASES.values() if c[2] for f in c[4] if f.startswith("allreduce_")}
    assert fused == set(FUSIONS)


def test_tiny_qwen3_tensor_parallel_fp8_fuses_every_allreduce_norm_quant(job):
    """Every norm whose sum comes from a row-wise projection and whose output feeds FP8
    projections is fused with both: post_attention_layernorm (o_proj's allreduce; gate / up
    quantize) and the next layer's input_layernorm (down_proj's; q / k / v quantize), reported at
    the first projection. The final norm feeds no FP8 projection: allreduce_add_rms_norm takes it.
    So every sum is fused, and no collective is left (each rank quantizes its row-wise
    projections' inputs over its own features). Layer 0's input norm reads the embedding (no
    allreduce)."""
    op = "allreduce_add_rms_norm_quant_fp8"
    for rank, results in enumerate(job):
        r = results[TP_MODEL]
        layers = r["layers"]
        fused = 2 * layers - 1
        expected = [(f"{op}_{TP_SCHEME}", f"model.layers.{i}.mlp.gate_proj") for i in range(layers)]
        expected += [(f"{op}_{TP_SCHEME}", f"model.layers.{i}.self_attn.q_proj") for i in range(1, layers)]
        expected += [("allreduce_add_rms_norm", "model.norm")]
        assert not r["errors"], (rank, r["errors"])
        assert r["swapped"] == 7 * layers, (rank, r["swapped"])
        assert r["sites"] == sorted(expected), (rank, r["sites"])
        assert r["matches"][f"{op}_{TP_SCHEME}"] == fused, (rank, r["matches"])
        assert r["matches"][f"rms_norm_quant_fp8_{TP_SCHEME}"] == 1, (rank, r["matches"])
        before, after = r["before"], r["after"]
        assert after[f"fusion_passes.{op}.default"] == fused, (rank, after)
        assert after["fusion_passes.allreduce_add_rms_norm.default"] == 1, (rank, after)
        assert "fusion_passes.add_rms_norm_quant_fp8.default" not in after, (rank, after)
        # 2 sums per layer (o_proj, down_proj), all fused.
        for c10d in C10D:
            assert before[c10d] == 2 * layers and c10d not in after, (rank, before, after)
        # The fused sites compute eager's math exactly (the spelling cases show it bit for bit);
        # what stays apart from eager is Inductor's own quantization of the row-wise projections'
        # inputs, which flips an fp8 code now and then (stock Inductor: ~5% on the FP8 Qwen3, see
        # test_models_fp8). A lost residual or a wrong sum would be O(1).
        assert r["vs_eager"] < 0.05, (rank, r["vs_eager"])


def test_bad_arguments_raise_on_every_rank(job):
    assert all(r[ARG_ERROR] and "static scheme needs a scale" in r[ARG_ERROR] for r in job), job


def test_fusions_are_opt_in_require_their_quant_fusion_and_launch_no_collective():
    names = [
        f.name for f in fusion_passes.registry.get_fusions(["allreduce_add_rms_norm_quant_fp8_per_group"])
    ]
    assert names == [
        "add_rms_norm",
        "rms_norm",
        "quant_fp8_dynamic",
        "quant_fp8_unfloored",
        "quant_fp8_static",
        "add_rms_norm_quant_fp8_per_group",
        "allreduce_add_rms_norm_quant_fp8_per_group",
    ]
    assert not set(FUSIONS) & {f.name for f in fusion_passes.registry.get_fusions("all")}
    # A collective must stay a dispatcher call, never be inlined as a bare Triton launch.
    ops = torch.ops.fusion_passes
    assert not {ops.allreduce_add_rms_norm_quant_fp8.default, ops.allreduce_rms_norm_quant_fp8.default} & set(
        LAUNCHERS
    )


def test_fake_kernels_give_the_output_shapes():
    """The shapes Inductor plans buffers with: codes like x, scales [..., 1] / [..., N / G] / the
    static scale's, and the sum or new residual like x (no process group needed)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    ops = torch.ops.fusion_passes
    with FakeTensorMode():
        x, w = torch.empty(3, 4, HIDDEN, dtype=torch.bfloat16), torch.empty(HIDDEN, dtype=torch.bfloat16)
        q, s, r = ops.allreduce_add_rms_norm_quant_fp8(
            x, x, w, EPS, 0.0, True, "per_group", None, 128, True, "0"
        )
        assert (q.shape, q.dtype, s.shape, s.dtype) == (x.shape, FP8_DTYPE, (3, 4, 2), torch.float32)
        assert (r.shape, r.dtype) == (x.shape, x.dtype)
        q, s, r = ops.allreduce_rms_norm_quant_fp8(x, w, EPS, 0.0, True, "per_token", None, 128, False, "0")
        assert (q.shape, s.shape, r.shape) == (x.shape, (3, 4, 1), x.shape)
        scale = torch.empty((), dtype=torch.float32)
        q, s, r = ops.allreduce_rms_norm_quant_fp8(x, w, EPS, 0.0, True, "static", scale, 128, False, "0")
        assert s.shape == () and s.dtype == torch.float32


# --- the one-shot kernel, under the interpreter, on a simulated world of 2 ---


@pytest.fixture
def interpreter_range_fix(monkeypatch):
    """Triton 3.6's interpreter turns a runtime loop bound into an int with ``int(array)``, which
    NumPy >= 2.3 refuses for its 1-element arrays (a program id, a scalar argument): the one-shot
    kernel's grid-stride loops then fail under the interpreter. Take the element instead."""
    import triton.runtime.interpreter as interpreter

    original = interpreter._patch_lang_tensor

    def patch(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    monkeypatch.setattr(interpreter, "_patch_lang_tensor", patch)


class _SimulatedWorld:
    """Two ranks' workspaces of CPU tensors in one process, run one after the other: rank 0
    first, with rank 1's copy-in (its rows, in the half its program uses) and its first barrier
    signal put in place beforehand, as if rank 1 had run up to its barrier; then rank 1, which
    finds rank 0's copy-in and signal. Each later call finds the signal the previous rank 1 left,
    as a real peer's would be. max_programs 2 and 64 rows of 256 per block make the grid-stride
    loops and the per-program halves (epochs) do real work."""

    def __init__(self, hidden: int, dtype: torch.dtype, max_rows: int = 64, max_programs: int = 2):
        from fusion_passes.lowering.allreduce_rms_norm.symm_mem import GroupInfo, Workspace
        from fusion_passes.lowering.common.rows import launch_config

        self.launch = launch_config(hidden)
        # NaN-filled: a row the kernel reads but no copy-in wrote would show in every output.
        self.buffers = [torch.full((2, max_rows, hidden), float("nan"), dtype=dtype) for _ in range(WORLD)]
        self.pads = [torch.zeros(max_programs * WORLD, dtype=torch.int32) for _ in range(WORLD)]
        peer_buffers = torch.tensor([b.data_ptr() for b in self.buffers], dtype=torch.int64)
        peer_signals = torch.tensor([p.data_ptr() for p in self.pads], dtype=torch.int64)
        self.workspaces = [
            Workspace(
                buffer=self.buffers[rank],
                handle=None,
                epochs=torch.zeros(max_programs, dtype=torch.int32),
                peer_buffers=peer_buffers,
                peer_signals=peer_signals,
                info=GroupInfo(rank=rank, world_size=WORLD, max_programs=max_programs),
                launch=self.launch,
            )
            for rank in range(WORLD)
        ]
        self.pads[0][1::WORLD] = 1  # rank 1's first signal to every program of rank 0: [pid, 1]

    def call(self, xs, residual, weight, *args):
        from fusion_passes.lowering.allreduce_rms_norm_quant_fp8.symm_mem import launch_on_workspace

        rows = xs[1].reshape(-1, xs[1].shape[-1])
        per_block = self.launch[1]
        programs = self.workspaces[1].info.max_programs
        for block in range(triton.cdiv(rows.shape[0], per_block)):
            half = int(self.workspaces[1].epochs[block % programs]) & 1
            block_rows = slice(block * per_block, min((block + 1) * per_block, rows.shape[0]))
            self.buffers[1][half, block_rows] = rows[block_rows]
        return [launch_on_workspace(self.workspaces[r], xs[r], residual, weight, *args) for r in range(WORLD)]


# The interpreter truncates bf16 casts (DESIGN.md), so bf16 cannot match torch's rounding of the
# sum: fp32 and fp16, whose casts it rounds as torch does, each scheme in one of them.
@pytest.mark.parametrize(
    ("scheme", "group_size", "scale_ue8m0", "dtype"),
    [
        ("static", 128, False, torch.float16),
        ("per_token", 128, False, torch.float32),
        ("per_group", 64, False, torch.float16),
        ("per_group", 48, True, torch.float32),
    ],
    ids=str,
)
def test_one_shot_kernel_interpreted_matches_the_norm_quant_kernel(
    interpreter_range_fix, scheme, group_size, scale_ue8m0, dtype
):
    """Three calls in a row (37, 5, 37 rows: the halves alternate per program, a program handles
    two row blocks), with and without the residual: codes, scales and r of both ranks equal the
    single-GPU kernel's on the sum torch computes, and are within one code of the reference. Group
    size 48 (240 = 5 x 48 columns) pads the quant block to [8, 64] and keeps the row blocks of
    launch_config(240)."""
    from fusion_passes.lowering.common.fp8 import QuantFP8
    from fusion_passes.lowering.rms_norm.reference import RMSNormForm
    from fusion_passes.lowering.rms_norm_quant_fp8.reference import (
        add_rms_norm_quant_fp8_reference,
        rms_norm_quant_fp8_reference,
    )
    from fusion_passes.lowering.rms_norm_quant_fp8.triton import rms_norm_quant_fp8_triton

    hidden = 240 if group_size == 48 else 256
    for with_residual in (True, False):
        world = _SimulatedWorld(hidden, dtype)
        for call, rows in enumerate((37, 5, 37)):
            g = torch.Generator().manual_seed(100 * call + with_residual)
            xs = [torch.randn(rows, hidden, generator=g).to(dtype) for _ in range(WORLD)]
            residual = torch.randn(rows, hidden, generator=g).to(dtype) if with_residual else None
            weight = (1 + 0.3 * torch.randn(hidden, generator=g)).to(dtype)
            scale = torch.tensor(0.02) if scheme == "static" else None
            norm = RMSNormForm(EPS, 0.0, dtype != torch.float32)  # the Llama form (fp32: the other)
            quant = QuantFP8(scheme, scale, group_size, scale_ue8m0)
            outs = world.call(xs, residual, weight, norm, quant)
            s = (xs[0].float() + xs[1].float()).to(dtype)  # one rounding of the exact sum (W = 2)
            q, scales, r = rms_norm_quant_fp8_triton(s, weight, norm, quant, residual)
            r = s if r is None else r
            if with_residual:
                ref_q, *_ = add_rms_norm_quant_fp8_reference(s, residual, weight, norm, quant)
            else:
                ref_q, _ = rms_norm_quant_fp8_reference(s, weight, norm, quant)
            for rank, (q_out, scales_out, r_out) in enumerate(outs):
                where = f"rank {rank} call {call} residual={with_residual}"
                assert q_out.dtype == FP8_DTYPE and torch.equal(bits(q_out), bits(q)), where
                assert torch.equal(scales_out, scales), where
                assert torch.equal(r_out, r), where
                assert fp8_codes_apart(q_out, ref_q) <= 1, where  # the sum of squares' order
        assert world.workspaces[0].epochs.tolist() == [3, 2]  # program 1 had no block at 5 rows


_COMPILE_FOR_SM90 = textwrap.dedent(
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from fusion_passes.lowering.allreduce_rms_norm_quant_fp8.symm_mem import (
        _one_shot_allreduce_add_rms_norm_quant_fp8_kernel as kernel,
    )
    from fusion_passes.lowering.common.rows import launch_config

    names = kernel.arg_names
    pointers = {"x_ptr": "*bf16", "residual_ptr": "*bf16", "weight_ptr": "*bf16", "q_ptr": "*u8",
                "scale_ptr": "*fp32", "sum_out_ptr": "*bf16", "peer_buffers_ptr": "*i64",
                "peer_signals_ptr": "*i64", "epochs_ptr": "*i32"}
    for scheme, ue8m0, world in (("static", False, 2), ("per_group", True, 8)):
        n, group = 7168, 128 if scheme == "per_group" else 7168
        block_n, rows, _ = launch_config(n)
        *_, warps = launch_config(triton.next_power_of_2(n // group) * triton.next_power_of_2(group))
        constants = dict(WORLD=world, HAS_RESIDUAL=True, CAST_BEFORE_WEIGHT=True,
                         STATIC=scheme == "static", SCALE_UE8M0=ue8m0, AMAX_TIMES_RECIPROCAL=True,
                         HW_FP8_CONVERT=True, BLOCK_N=block_n,
                         BLOCK_GROUPS=triton.next_power_of_2(n // group),
                         BLOCK_GROUP=triton.next_power_of_2(group), ROWS_PER_PROGRAM=rows)
        signature = {a: pointers.get(a, "fp32" if a in ("eps", "weight_offset") else "i32") for a in names}
        signature.update({a: "constexpr" for a in constants})
        compiled = triton.compile(ASTSource(kernel, signature, constants),
                                  target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
        ptx = compiled.asm["ptx"]
        assert compiled.asm["cubin"], scheme
        # The barrier's system-scope CAS (sends release, waits acquire: one per rank each, as the
        # rank is a run-time value every branch is emitted) and store_quantized's fp8 conversion.
        assert ptx.count("atom.global.release.sys.cas.b32") == world, scheme
        assert ptx.count("atom.global.acquire.sys.cas.b32") == world, scheme
        assert "cvt.rn.satfinite.e4m3x2.f32" in ptx, scheme
        print("compiled", scheme, world)
    """
)


def test_one_shot_kernel_compiles_for_sm90():
    """Triton compiles the kernel to PTX and a cubin for sm_90 without a GPU (ptxas ships with
    triton); the interpreter above cannot show that the compiled path accepts the code."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", _COMPILE_FOR_SM90], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("\n")[:2] == ["compiled static 2", "compiled per_group 8"], done.stdout
