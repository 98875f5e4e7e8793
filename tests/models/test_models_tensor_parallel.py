"""Every target model sharded with its own HF TP plan (``models.tensor_parallel.parallelize``,
transformers' styles) on a gloo group of 2 spawned CPU processes, compiled with the TP allreduce +
(residual add +) RMSNorm fusions: which norms fuse, the collectives before/after, and the output
against eager (sharded) and the unsharded model on every rank.

The models run in ONE spawn (a spawn costs ~9 s), tiny configs, 8 tokens, the fewest layers that
hold every kind of layer a model has: 1 for qwen3 / qwen3-moe / minimax-m2, 2 for DeepSeek (a dense
layer, then MoE) and the hybrids (linear attention, then full attention). By default a set that
covers every style of the eight plans (COVERED):
  deepseek-v3.2  MLA (colwise q_b / kv_b, mla_kv_a_proj, rowwise o_proj), a dense MLP, a MoE block
                 with shared experts (packed_colwise, moe_tp_experts, 3-D rowwise down_proj)
  qwen3-moe      attention and a MoE block without shared experts
  qwen3.5        the linear-attention hybrid (colwise_gather_output) with dense MLPs
  minimax-m2     q/k/v colwise_gather_output, o_proj rowwise_split_input, MoE
and, with FUSION_PASSES_TP_ALL_MODELS=1, the other four too: deepseek-v3 (v3.2's plan without
attention entries), qwen3 (dense; also in test_allreduce_rms_norm), qwen3-next and qwen3.5-moe
(hybrid linear attention with shared-expert MoE blocks). On 2 cores with a cold Inductor cache the
file takes ~65 s (all eight: ~95 s); warm ~35 s (~65 s).

Which norms fuse: a decoder layer adds ``mixer(input_layernorm(h))`` and then
``mlp(post_attention_layernorm(h))`` to the residual, each sum read by the next norm
(post_attention_layernorm, the next layer's input_layernorm, model.norm). The fusion takes a norm
whose added term is an all_reduce's output: a row-wise projection's (o_proj, a dense MLP's
down_proj), and a MoE block's without shared experts (its experts' all_reduce is followed by the
block's ``reshape(batch, seq, hidden)``; the fusion's canonicalization moves that view before the
allreduce, with which it commutes). The others, and why (MIXERS / MLPS below):
  - after linear attention (``colwise_gather_output`` out_proj): an all_gather, no sum;
  - after DeepSeek-V3's attention: its plan leaves MLA whole, there is no collective;
  - after a MoE block with shared experts: the block adds the two all-reduced sums (experts',
    shared experts' down_proj) before the residual add; fusing it would take one reduction of
    their sum (as vLLM's MoE does), which the HF plan does not express.
"""

from __future__ import annotations

import copy
import os
import traceback

import pytest
import torch

import fusion_passes
from _distributed import run_world
from fusion_passes.models import MODEL_NAMES, build_model
from fusion_passes.models.tensor_parallel import parallelize, replace_sharded_module, tp_plan

FUSIONS = ["allreduce_add_rms_norm", "allreduce_rms_norm"]
WORLD = 2
ALL_REDUCE = "_c10d_functional.all_reduce.default"
ALL_GATHER = "_c10d_functional.all_gather_into_tensor.default"
WAIT = "_c10d_functional.wait_tensor.default"
FUSED = "fusion_passes.allreduce_add_rms_norm.default"

# Token mixers: kind -> (its module under the layer, all_reduces, all_gathers, whether its sum
# feeds post_attention_layernorm's residual add).
MIXERS = {
    "attention": ("self_attn", 1, 0, True),  # q/k/v (MLA: q_b/kv_b) colwise, o_proj rowwise
    "mla_replicated": ("self_attn", 0, 0, False),  # DeepSeek-V3: no attention entry in the plan
    "attention_gathered_qkv": ("self_attn", 1, 3, True),  # MiniMax-M2: q/k/v gathered, o_proj split
    "linear_attention_3": ("linear_attn", 0, 3, False),  # Qwen3-Next: in_proj_qkvz / _ba, out_proj
    "linear_attention_5": ("linear_attn", 0, 5, False),  # Qwen3.5: in_proj_qkv / _z / _b / _a, out_proj
}
# MLPs: kind -> (all_reduces, whether the sum feeds the next norm's residual add).
MLPS = {
    "dense": (1, True),  # gate/up colwise, down_proj rowwise
    "moe": (1, True),  # experts' all_reduce, then the block's reshape (moved before it)
    "moe_shared": (2, False),  # experts' + shared experts' sums added, then reshaped
}
# name -> (layers, (mixer, mlp) per layer)
MODELS = {
    "deepseek-v3": (2, (("mla_replicated", "dense"), ("mla_replicated", "moe_shared"))),
    "deepseek-v3.2": (2, (("attention", "dense"), ("attention", "moe_shared"))),
    "qwen3": (1, (("attention", "dense"),)),
    "qwen3-moe": (1, (("attention", "moe"),)),
    "qwen3-next": (2, (("linear_attention_3", "moe_shared"), ("attention", "moe_shared"))),
    "qwen3.5": (2, (("linear_attention_5", "dense"), ("attention", "dense"))),
    "qwen3.5-moe": (2, (("linear_attention_5", "moe_shared"), ("attention", "moe_shared"))),
    "minimax-m2": (1, (("attention_gathered_qkv", "moe"),)),
}

COVERED = ("deepseek-v3.2", "qwen3-moe", "qwen3.5", "minimax-m2")
RUN = tuple(MODELS) if os.environ.get("FUSION_PASSES_TP_ALL_MODELS") == "1" else COVERED


def expected_sites(layers) -> list[str]:
    """The norms whose input sum comes straight from an all_reduce."""
    sites = []
    for i, (mixer, mlp) in enumerate(layers):
        if MIXERS[mixer][3]:
            sites.append(f"model.layers.{i}.post_attention_layernorm")
        if MLPS[mlp][1]:
            sites.append(f"model.layers.{i + 1}.input_layernorm" if i + 1 < len(layers) else "model.norm")
    return sites


def _structure(module) -> list[tuple[str, str]]:
    """(mixer module, MLP kind) per layer, read off the module tree (checks the table above)."""
    out = []
    for layer in module.model.layers:
        mixer = "linear_attn" if hasattr(layer, "linear_attn") else "self_attn"
        mlp = layer.mlp
        shared = hasattr(mlp, "shared_expert") or hasattr(mlp, "shared_experts")
        out.append((mixer, ("moe_shared" if shared else "moe") if hasattr(mlp, "experts") else "dense"))
    return out


def _model(name: str, layers: int, mesh) -> dict:
    from fusion_passes.numerics import compare

    built = build_model(name, "tiny", layers=layers)  # seeded: every rank builds the same weights
    structure = _structure(built.module)
    unsharded = copy.deepcopy(built.module)
    parallelize(built, mesh)
    report = fusion_passes.Report()
    torch._dynamo.reset()
    with torch.no_grad():
        compiled = torch.compile(
            built.module, backend=fusion_passes.backend(FUSIONS, report=report, strict=True)
        )
        out = compiled(*built.example_inputs)
        eager_tp = built.module(*built.example_inputs)
        expected = unsharded(*built.example_inputs)
    return {
        "structure": structure,
        "graphs": len(report.graphs),
        "sites": [(s.fusion, s.module) for s in report.sites if s.fusion in FUSIONS],
        "before": dict(report.ops_before()),
        "after": dict(report.ops_after()),
        "errors": list(report.errors),
        "vs_unsharded": compare(out, expected).ok,
        "vs_eager_tp": compare(out, eager_tp).ok,
        "eager_tp_vs_unsharded": compare(eager_tp, expected).ok,
        "out": out,
    }


class BufferLinear(torch.nn.Module):
    """A linear that is no ``nn.Linear`` (its weight a buffer), as a quantized linear is."""

    def __init__(self, linear: torch.nn.Module):
        super().__init__()
        self.register_buffer("weight", linear.weight.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.t()


REPLACED = (
    "model.layers.0.self_attn.q_proj",
    "model.layers.0.self_attn.o_proj",
    "model.layers.0.mlp.down_proj",
)
REPLACE = "replace_sharded_module"  # key of the job's result for the module-swap check


def _replaced(mesh) -> dict:
    """Column- and row-wise linears of a sharded qwen3 swapped for BufferLinear (eager)."""
    from fusion_passes.numerics import compare

    built = build_model("qwen3", "tiny", layers=1)
    unsharded = copy.deepcopy(built.module)
    parallelize(built, mesh)
    for path in REPLACED:
        replace_sharded_module(built, path, BufferLinear, mesh)
    try:
        replace_sharded_module(built, "model.layers.0.mlp.act_fn", BufferLinear, mesh)
        refused = None
    except ValueError as e:
        refused = str(e)
    with torch.no_grad():
        out = built.module(*built.example_inputs)
        expected = unsharded(*built.example_inputs)
    modules = [built.module.get_submodule(p) for p in REPLACED]
    return {
        "types": [type(m).__name__ for m in modules],
        "shapes": [tuple(m.weight.shape) for m in modules],
        "plain": [type(m.weight) is torch.Tensor for m in modules],
        "refused": refused,
        "vs_unsharded": compare(out, expected).ok,
    }


def _job(rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    results = {}
    for name in RUN:
        layers, _kinds = MODELS[name]
        try:  # one model's failure must not hide the others'
            results[name] = _model(name, layers, mesh)
        except Exception:
            results[name] = {"exception": traceback.format_exc()}
    results[REPLACE] = _replaced(mesh)
    return results


@pytest.fixture(scope="module")
def ranks():
    return run_world(_job, world_size=WORLD, timeout=300)  # a hang guard


def test_every_model_has_its_expectations_and_every_style_is_covered():
    assert set(MODELS) == set(MODEL_NAMES)
    plans = {name: set(tp_plan(build_model(name, "tiny", layers=1)).values()) for name in MODEL_NAMES}
    every = set().union(*plans.values())
    assert set().union(*(plans[name] for name in COVERED)) == every, every


@pytest.mark.slow
@pytest.mark.parametrize("name", RUN)
def test_sharded_model_fuses_every_allreduce_that_reaches_a_norm(ranks, name):
    _layers, kinds = MODELS[name]
    sites = expected_sites(kinds)
    all_reduces = sum(MIXERS[m][1] + MLPS[p][0] for m, p in kinds)
    all_gathers = sum(MIXERS[m][2] for m, _p in kinds)
    for rank, results in enumerate(ranks):
        r = results[name]
        assert "exception" not in r, (rank, r.get("exception"))
        assert r["structure"] == [(MIXERS[m][0], p) for m, p in kinds], (rank, r["structure"])
        assert not r["errors"] and r["graphs"] == 1, (rank, r["errors"], r["graphs"])
        assert sorted(r["sites"]) == sorted(("allreduce_add_rms_norm", s) for s in sites), (rank, r["sites"])
        before, after = r["before"], r["after"]
        collectives = {op: before.get(op, 0) for op in (ALL_REDUCE, ALL_GATHER, WAIT)}
        assert collectives == {
            ALL_REDUCE: all_reduces,
            ALL_GATHER: all_gathers,
            WAIT: all_reduces + all_gathers,
        }
        fused = len(sites)
        left = {op: after.get(op, 0) for op in (ALL_REDUCE, ALL_GATHER, WAIT, FUSED)}
        assert left == {
            ALL_REDUCE: all_reduces - fused,
            ALL_GATHER: all_gathers,
            WAIT: all_reduces + all_gathers - fused,
            FUSED: fused,
        }, (rank, left)
        assert r["eager_tp_vs_unsharded"] and r["vs_unsharded"] and r["vs_eager_tp"], (rank, r)
    assert torch.equal(ranks[0][name]["out"], ranks[1][name]["out"])  # the ranks agree bit for bit


@pytest.mark.slow
def test_replaced_modules_keep_their_tp_style(ranks):
    """A module swapped into a sharded model (as an FP8 linear is) is built from this rank's
    shards and runs under the same style: q_proj and down_proj's inputs / o_proj's outputs as
    before, so the model's output is still the unsharded one."""
    for rank, results in enumerate(ranks):
        r = results[REPLACE]
        assert r["types"] == ["BufferLinear"] * 3 and all(r["plain"]), (rank, r)
        # tiny qwen3: q_proj [4 heads * 32, 128] column-wise; o_proj [128, 128] and
        # down_proj [128, 256] row-wise (their input features split)
        assert r["shapes"] == [(64, 128), (128, 64), (128, 128)], (rank, r["shapes"])
        assert r["refused"] == "qwen3: model.layers.0.mlp.act_fn is not sharded (no TP plan entry)", (rank, r)
        assert r["vs_unsharded"], (rank, r)


class _Mesh:
    """What parallelize asks of a mesh before any collective: its size."""

    def __init__(self, size: int):
        self._size = size

    def size(self) -> int:
        return self._size


def test_a_style_transformers_lacks_is_a_one_line_value_error():
    built = build_model("qwen3", "tiny", layers=1)
    built.config.base_model_tp_plan = {
        **built.config.base_model_tp_plan,
        "layers.*.mlp.down_proj": "rowwise_x",
    }
    with pytest.raises(ValueError) as error:
        parallelize(built, _Mesh(WORLD))
    assert (
        str(error.value)
        == "qwen3: TP style 'rowwise_x' (layers.*.mlp.down_proj) is not implemented by transformers"
    )


def test_counts_that_do_not_divide_by_the_world_size_are_refused():
    built = build_model("qwen3", "tiny", layers=1)
    with pytest.raises(ValueError, match=r"^qwen3: intermediate_size=256 does not divide by world size 3$"):
        parallelize(built, _Mesh(3))


def test_the_plan_leaves_out_only_the_backward_only_styles():
    built = build_model("qwen3", "tiny", layers=1)
    plan = tp_plan(built)
    assert plan["model.layers.*.self_attn.o_proj"] == "rowwise"
    assert "model.layers.*.self_attn.q_norm" not in plan  # replicated_with_grad_allreduce
