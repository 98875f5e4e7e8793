"""Rewrite tests of the tensor-parallel allreduce + (residual add +) RMSNorm fusions, on a gloo
group of 2 spawned CPU processes: match counts, spellings, ops before/after, and outputs equal to
eager on every rank (bit for bit for the spellings: the fused op's reference rounds as the model
does), and the tiny tensor-parallel Qwen3 against the unsharded model."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

import fusion_passes
from _distributed import World, compile_case
from fusion_passes.lowering.common.direct_launch import LAUNCHERS
from fusion_passes.numerics import compare
from fusion_passes.patterns.rms_norm import llama_rms_norm, offset_rms_norm

FUSIONS = ["allreduce_add_rms_norm", "allreduce_rms_norm"]
WORLD = 2
C10D = ("_c10d_functional.all_reduce.default", "_c10d_functional.wait_tensor.default")
SYMM_MEM_REASON = "symm_mem_eligible"  # key of the spellings job's result for the one-shot gate
NORM_OPS = ("aten.rsqrt.default", "fusion_passes.add_rms_norm.default", "fusion_passes.rms_norm.default")


def functional_rms_norm(h, w, eps):
    return F.rms_norm(h, (h.shape[-1],), w, eps)


_SUBGROUP = None  # set by the spellings job for the cases that reduce over a subgroup


def _group():
    """The group a case reduces over: WORLD, or the subgroup the job made (another group name)."""
    return _SUBGROUP or dist.group.WORLD

# --- the spellings, as TP model code writes them (x: this rank's partial sum) ---


def llama_residual_plus_sum(x, residual, w):
    s = funcol.all_reduce(x, "sum", _group())
    h = residual + s
    return llama_rms_norm(h, w, 1e-6), h


def functional_sum_plus_residual_inplace(x, residual, w):
    s = x.clone()
    dist.all_reduce(s)  # in place: traces to the same functional all_reduce + wait_tensor
    h = s + residual
    return functional_rms_norm(h, w, 1e-5), h


def offset_sum_plus_residual(x, residual, w):
    s = funcol.all_reduce(x, "sum", _group())
    h = s + residual
    return offset_rms_norm(h, w, 1e-6), h


def offset_residual_plus_sum(x, residual, w):
    s = funcol.all_reduce(x, "sum", _group())
    h = residual + s
    return offset_rms_norm(h, w, 1e-6), h


def llama_last_norm(x, residual, w):
    """The model's final norm: nothing reads the new residual."""
    s = funcol.all_reduce(x, "sum", _group())
    return llama_rms_norm(residual + s, w, 1e-6)


def functional_no_residual_sum_reused(x, residual, w):
    """The first layer after a reduced (vocabulary-parallel) embedding: the sum is the residual."""
    s = funcol.all_reduce(x, "sum", _group())
    return functional_rms_norm(s, w, 1e-6), s * 2


def llama_no_residual(x, residual, w):
    s = funcol.all_reduce(x, "sum", _group())
    return llama_rms_norm(s, w, 1e-6)


def moe_view_before_add(x, residual, w):
    """A MoE block under TP: the experts' partial sums over (tokens, hidden), reduced, then viewed
    back to (batch, seq, hidden) before the residual add."""
    s = funcol.all_reduce(x.reshape(-1, x.shape[-1]), "sum", _group())
    h = residual + s.view(residual.shape)
    return llama_rms_norm(h, w, 1e-6), h


def moe_view_sum_read_elsewhere_not_fused(x, residual, w):
    """As moe_view_before_add, but the reduced (tokens, hidden) sum is read by other code too: the
    view may not move (the other reader needs the sum's own shape), so nothing fuses."""
    s = funcol.all_reduce(x.reshape(-1, x.shape[-1]), "sum", _group())
    h = residual + s.view(residual.shape)
    return llama_rms_norm(h, w, 1e-6), h, s * 3


def max_not_fused(x, residual, w):
    s = funcol.all_reduce(x, "max", _group())  # not a sum: the fused op would be wrong
    h = residual + s
    return llama_rms_norm(h, w, 1e-6), h


def sum_read_elsewhere_not_fused(x, residual, w):
    s = funcol.all_reduce(x, "sum", _group())  # s is read outside the pattern: it must stay
    h = residual + s
    return llama_rms_norm(h, w, 1e-6), h, s * 3


def vllm_fp32_add_not_fused(x, residual, w):
    """vLLM's native add + norm after the reduction: the add in fp32, its sum normalised before
    rounding. It raises (add_rms_norm with residual_in_fp32), but the allreduce fusions take the
    rounded add only: not fused, a near miss naming the difference."""
    s = funcol.all_reduce(x, "sum", _group())
    orig_dtype = s.dtype
    h = s.to(torch.float32) + residual.to(torch.float32)
    residual = h.to(orig_dtype)
    h = h * torch.rsqrt(h.pow(2).mean(dim=-1, keepdim=True) + 1e-6)
    return h.to(orig_dtype) * w, residual


# name -> (fn, dtype, subgroup, the fused op's fusion or None, its spelling, the norm fusion)
CASES = {
    "llama_residual_plus_sum": (
        llama_residual_plus_sum, torch.float32, False,
        "allreduce_add_rms_norm", "allreduce_residual_plus_sum_add_rms_norm_llama", "add_rms_norm",
    ),
    "llama_residual_plus_sum_bf16": (
        llama_residual_plus_sum, torch.bfloat16, False,
        "allreduce_add_rms_norm", "allreduce_residual_plus_sum_add_rms_norm_llama", "add_rms_norm",
    ),
    "functional_sum_plus_residual_inplace_bf16": (
        functional_sum_plus_residual_inplace, torch.bfloat16, False,
        "allreduce_add_rms_norm", "allreduce_sum_plus_residual_add_rms_norm_fp32_weight", "add_rms_norm",
    ),
    "offset_sum_plus_residual_bf16": (
        offset_sum_plus_residual, torch.bfloat16, False,
        "allreduce_add_rms_norm", "allreduce_sum_plus_residual_add_rms_norm_offset", "add_rms_norm",
    ),
    "offset_residual_plus_sum_subgroup_bf16": (
        offset_residual_plus_sum, torch.bfloat16, True,
        "allreduce_add_rms_norm", "allreduce_residual_plus_sum_add_rms_norm_offset", "add_rms_norm",
    ),
    "llama_last_norm_bf16": (
        llama_last_norm, torch.bfloat16, False,
        "allreduce_add_rms_norm", "allreduce_residual_plus_sum_add_rms_norm_llama_last", "add_rms_norm",
    ),
    "functional_no_residual_sum_reused_bf16": (
        functional_no_residual_sum_reused, torch.bfloat16, False,
        "allreduce_rms_norm", "allreduce_rms_norm_fp32_weight", "rms_norm",
    ),
    "llama_no_residual_bf16": (
        llama_no_residual, torch.bfloat16, False,
        "allreduce_rms_norm", "allreduce_rms_norm_llama", "rms_norm",
    ),
    "moe_view_before_add_bf16": (
        moe_view_before_add, torch.bfloat16, False,
        "allreduce_add_rms_norm", "allreduce_residual_plus_sum_add_rms_norm_llama", "add_rms_norm",
    ),
    "moe_view_sum_read_elsewhere_not_fused": (
        moe_view_sum_read_elsewhere_not_fused, torch.float32, False, None, None, "add_rms_norm",
    ),
    "max_not_fused": (max_not_fused, torch.float32, False, None, None, "add_rms_norm"),
    "sum_read_elsewhere_not_fused": (
        sum_read_elsewhere_not_fused, torch.float32, False, None, None, "add_rms_norm",
    ),
    "vllm_fp32_add_not_fused_bf16": (
        vllm_fp32_add_not_fused, torch.bfloat16, False, None, None, "add_rms_norm",
    ),
}


def _spellings_job(rank: int, world_size: int) -> dict:
    """Every case compiled on this rank: what the report says, and the outputs against eager."""
    global _SUBGROUP
    subgroup = dist.new_group(list(range(world_size)))  # every rank creates it, in order
    results = {}
    for name, (fn, dtype, use_subgroup, *_rest) in CASES.items():
        _SUBGROUP = subgroup if use_subgroup else None
        torch.manual_seed(0)  # residual and weight replicated, as in a TP model
        residual = torch.randn(3, 4, 64).to(dtype)
        w = (1.0 + 0.3 * torch.randn(64)).to(dtype)
        torch.manual_seed(1 + rank)  # each rank's partial sum differs
        x = torch.randn(3, 4, 64).to(dtype)
        results[name] = {
            **compile_case(fn, (x, residual, w), FUSIONS),
            "group": _group().group_name,
        }
    # Piggybacks on this job's spawn (a spawn costs ~9 s): the one-shot gate on a gloo group.
    from fusion_passes.lowering.allreduce_rms_norm.symm_mem import symm_mem_eligible

    results[SYMM_MEM_REASON] = symm_mem_eligible(torch.randn(3, 64), dist.group.WORLD.group_name)
    return results


@pytest.fixture(scope="module")
def world():
    """One spawned group for the module's jobs (a spawn costs ~9 s)."""
    with World(WORLD) as w:
        yield w


@pytest.fixture(scope="module")
def spellings(world):
    return world.run(_spellings_job, timeout=120)


@pytest.mark.parametrize("case", CASES)
def test_allreduce_norm_spelling(spellings, case):
    _fn, _dtype, _sub, fusion, spelling, norm_fusion = CASES[case]
    for rank, results in enumerate(spellings):
        r = results[case]
        assert not r["errors"], (rank, r["errors"])
        assert all(r["equal"]) and r["equal"], (rank, r["equal"])
        before, after = r["before"], r["after"]
        assert all(before.get(op) == 1 for op in C10D) and before.get("aten.rsqrt.default") == 1
        if fusion is None:  # not fused: the norm still canonicalizes, the collective stays
            assert r["matches"] == {norm_fusion: 1}, (rank, r["matches"])
            assert all(after.get(op) == 1 for op in C10D)
            assert r["fallbacks"] == {}, (rank, r["fallbacks"])  # no collective op was added
            # The all_reduce feeding the norm is reported with the closest spelling and why.
            (miss,) = r["near_misses"]
            assert miss[0] in FUSIONS, (rank, miss)
            if case.startswith("vllm_fp32_add"):
                # the norm's residual_in_fp32 (argument 6): the fusion's spellings add in x.dtype
                assert "add_rms_norm" in miss[2] and "argument 6 is True" in miss[2], (rank, miss)
            continue
        assert not r["near_misses"], (rank, r["near_misses"])
        # The report names the path the op took at run time on this group: on a CPU, the reference.
        op = f"fusion_passes.{fusion}.default"
        # (The table is per process: groups of earlier cases stay in it.)
        assert list(r["fallbacks"]) == [op], (rank, r["fallbacks"])
        assert r["fallbacks"][op][r["group"]] == "x is on cpu: the reference path", (rank, r)
        assert f"run time: {op} on group {r['group']!r} took its fallback: x is on cpu" in r["summary"]
        assert r["matches"] == {norm_fusion: 1, fusion: 1}, (rank, r["matches"])
        assert r["spellings"] == [spelling], (rank, r["spellings"])
        assert after.get(f"fusion_passes.{fusion}.default") == 1
        assert not set(C10D + NORM_OPS) & set(after), (rank, after)


def _qwen3_tp_job(rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from fusion_passes.models import build_model
    from fusion_passes.models.tensor_parallel import parallelize

    built = build_model("qwen3", "tiny")  # seeded: every rank builds the same weights
    unsharded = copy.deepcopy(built.module)
    parallelize(built, init_device_mesh("cpu", (world_size,)))
    report = fusion_passes.Report()
    with torch.no_grad():
        compiled = torch.compile(built.module, backend=fusion_passes.backend(FUSIONS, report=report, strict=True))
        out = compiled(*built.example_inputs)
        expected = unsharded(*built.example_inputs)
        eager_tp = built.module(*built.example_inputs)
    return {
        "matches": {k: v for k, v in report.matches.items() if v},
        "sites": [(s.fusion, s.module) for s in report.sites if s.fusion in FUSIONS],
        "before": report.ops_before(),
        "after": report.ops_after(),
        "vs_unsharded": compare(out, expected).ok,
        "vs_eager_tp": compare(out, eager_tp).ok,
        "eager_tp_vs_unsharded": compare(eager_tp, expected).ok,
        "layers": built.config.num_hidden_layers,
        "errors": list(report.errors),
    }


@pytest.mark.slow  # a whole tensor-parallel model compiled on two gloo ranks (about 10 s)
def test_tiny_qwen3_tensor_parallel_fuses_every_allreduce_norm(world):
    """Every norm after a row-wise projection (o_proj: post_attention_layernorm; down_proj: the
    next layer's input_layernorm and the final norm) is fused; the output matches the unsharded
    model on both ranks."""
    for rank, r in enumerate(world.run(_qwen3_tp_job, timeout=120)):
        layers = r["layers"]
        expected_sites = []
        for i in range(layers):
            expected_sites.append(f"model.layers.{i}.post_attention_layernorm")
            expected_sites.append(f"model.layers.{i + 1}.input_layernorm" if i + 1 < layers else "model.norm")
        assert not r["errors"], (rank, r["errors"])
        assert sorted(r["sites"]) == sorted(("allreduce_add_rms_norm", s) for s in expected_sites), (rank, r["sites"])
        assert r["before"][C10D[0]] == 2 * layers and r["before"][C10D[1]] == 2 * layers
        assert not set(C10D) & set(r["after"]), (rank, r["after"])
        assert r["after"]["fusion_passes.allreduce_add_rms_norm.default"] == 2 * layers
        # left to the plain norm fusion: q_norm, k_norm per layer and layer 0's input_layernorm
        assert r["matches"]["rms_norm"] == 2 * layers + 1
        assert r["eager_tp_vs_unsharded"] and r["vs_unsharded"] and r["vs_eager_tp"], (rank, r)


def test_fusions_are_opt_in_require_the_norms_and_launch_no_collective():
    names = [f.name for f in fusion_passes.registry.get_fusions(["allreduce_add_rms_norm"])]
    assert names == ["add_rms_norm", "rms_norm", "allreduce_add_rms_norm"]
    assert not set(FUSIONS) & {f.name for f in fusion_passes.registry.get_fusions("all")}
    # A collective must stay a dispatcher call, never be inlined as a bare Triton launch.
    ops = torch.ops.fusion_passes
    assert not {ops.allreduce_add_rms_norm.default, ops.allreduce_rms_norm.default} & set(LAUNCHERS)



def test_symm_mem_eligible_gives_the_reason_on_cpu_gloo(spellings):
    """The one-shot kernel's gate answers with a one-line reason (here: not CUDA) on every rank,
    so the CUDA dispatch would record it and take the fallback."""
    reasons = [results[SYMM_MEM_REASON] for results in spellings]
    assert all(isinstance(r, str) and "not CUDA" in r and "\n" not in r for r in reasons), reasons
