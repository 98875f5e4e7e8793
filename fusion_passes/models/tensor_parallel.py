"""Tensor-parallel sharding of the built models, by transformers' own TP implementation.

    built = build_model("qwen3-moe", "tiny")
    parallelize(built, mesh)          # mesh = init_device_mesh("cpu", (world_size,)), gloo or NCCL

applies the model's own HuggingFace TP plan (``config.base_model_tp_plan``, wildcard paths under
the base model) with ``transformers.distributed.tensor_parallel.apply_tensor_parallelism``, the
function ``from_pretrained(tp_plan="auto")`` runs. There it shards the parameters of a model not
yet loaded; here they are real and every rank built the same seeded weights, so each style's
``distribute_tensor(..., src_data_rank=None)`` just keeps this rank's slice (no collective). Every
style installs its input / output transforms by replacing the module's ``forward``. At inference
(no grad) the ``nn.Linear`` and MoE-experts styles run the module on plain local tensors (the
DTensor parameters are swapped for their local shards around the call), and the collectives are
plain ``torch.distributed`` or DTensor calls, which torch.compile traces into functional ones.

What each style of the target models' plans does (transformers 5.17, no grad; the collective as it
appears in the post-grad graph):

  colwise                  Linear weight (and bias) Shard(0): the rank holds num_heads / world
                           heads (q/k/v, MLA's q_b_proj / kv_b_proj; transformers views them as
                           ``(..., -1, head_dim)``) or intermediate / world features (gate/up,
                           shared experts). Output stays sharded. No collective.
  rowwise                  Linear weight Shard(1) (bias replicated, added after the sum): the
                           rank multiplies its slice of the input features, then an in-place
                           ``dist.all_reduce``: ``_c10d_functional.all_reduce(x, "sum") +
                           wait_tensor`` (o_proj, down_proj, shared_expert(s).down_proj).
                           On MoE experts' 3-D ``down_proj`` [E, H, I]: Shard(-1), the slice of
                           every expert's intermediate; the experts' style below runs it.
  packed_colwise           MoE experts' fused ``gate_up_proj`` [E, 2I, H]: _StridedShard(1,
                           split_factor=2), this rank's slice of the gate half and of the up
                           half, so the experts' ``chunk(2)`` still separates gate from up.
  moe_tp_experts           the experts module: tokens and routing replicated, every rank runs
                           every routed token through its slice of each expert's intermediate,
                           then all-reduces the partial sums (``dist.all_reduce`` inside an
                           autograd.Function): ``all_reduce + wait_tensor``. The MoE block then
                           reshapes the sum to (batch, seq, hidden) and, where it has shared
                           experts, adds their (separately all-reduced) output.
  colwise_gather_output    Linear Shard(0), then the output gathered back to full width (DTensor
                           Shard(-1) -> Replicate: ``all_gather_into_tensor + wait_tensor``,
                           then a split and a cat along the last dim); what follows is replicated.
                           Qwen3-Next / Qwen3.5 linear attention (in_proj_*, out_proj: its output
                           is gathered, not summed) and MiniMax-M2's q/k/v (its q_norm / k_norm
                           normalize over all heads).
  rowwise_split_input      Linear Shard(1); the replicated input is sliced locally (no
                           collective), the output all-reduced as ``rowwise`` (MiniMax-M2 o_proj).
  mla_kv_a_proj            MLA's kv_a_proj_with_mqa stays replicated; the style only routes the
                           gradient of its rope part through an allreduce (identity forward).
  replicated_with_grad_allreduce   (q_norm / k_norm) left out: the style's only effect is a
                           module backward hook summing the weight gradients, and a module
                           backward hook graph-breaks torch.compile (the graph would split at
                           every such norm, and with it the allreduce + norm fusion sites).

Paths without an entry stay whole on every rank: embeddings, norms, MoE routers,
DeepSeek-V3's entire MLA attention (its plan shards only the MLP and experts) and
DeepSeek-V3.2's indexer.

The row-wise reductions are what the ``allreduce_add_rms_norm`` fusion matches: ``all_reduce +
wait_tensor`` followed by the residual add and the next RMSNorm. A gathered output
(``colwise_gather_output``) is no sum, and a MoE block's reduction reaches the residual add only
through the block's reshape (and, with shared experts, the add of the two reduced sums).

``replace_sharded_module(built, path, make, mesh)`` swaps a sharded module for another (an FP8
linear) built from this rank's shards, under the same style.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from torch import nn

from .registry import BuiltModel

# Styles whose only effect is in the backward pass, and that break the graph under torch.compile.
BACKWARD_ONLY = {"replicated_with_grad_allreduce"}
# Config counts a sharded plan splits over the ranks: heads where attention is sharded column-wise
# (q/k/v, MLA's q_b/kv_b), intermediate sizes where the MLP / experts are.
_HEAD_COUNTS = ("num_attention_heads", "num_key_value_heads")
_INTERMEDIATE_SIZES = ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size")


def tp_plan(built: BuiltModel) -> dict[str, str]:
    """The model's HF TP plan as ``parallelize`` applies it: wildcard paths relative to
    ``built.module`` (the base model sits at ``model``), the backward-only styles left out.
    Raises a one-line ValueError naming the first style transformers does not implement."""
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES

    plan = dict(getattr(built.config, "base_model_tp_plan", None) or {})
    if not plan:
        raise ValueError(f"{built.name}: the config has no base_model_tp_plan")
    for key, style in plan.items():
        if style not in ALL_PARALLEL_STYLES:
            raise ValueError(f"{built.name}: TP style {style!r} ({key}) is not implemented by transformers")
    return {f"model.{k}": v for k, v in plan.items() if v not in BACKWARD_ONLY}


def _check_world_size(built: BuiltModel, plan: dict[str, str], world: int) -> None:
    """The counts the plan splits must divide by the world size (a rank holds whole heads)."""
    config = built.config
    attrs = list(_INTERMEDIATE_SIZES)
    if any(".self_attn." in k and v == "colwise" for k, v in plan.items()):
        attrs += _HEAD_COUNTS
    for attr in attrs:
        value = getattr(config, attr, None)
        if isinstance(value, int) and value % world:
            raise ValueError(f"{built.name}: {attr}={value} does not divide by world size {world}")


def parallelize(built: BuiltModel, mesh: Any) -> nn.Module:
    """Shard ``built.module`` in place over the 1-D ``mesh`` with the model's HF TP plan (every
    rank must call this, with the same seeded weights: each keeps its slice); returns the module.
    Raises ValueError for a style transformers lacks, a count that does not divide by the world
    size, or a module already sharded."""
    from torch.distributed.tensor import DTensor
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    plan = tp_plan(built)
    _check_world_size(built, plan, mesh.size())
    if any(isinstance(p, DTensor) for p in built.module.parameters()):
        raise ValueError(f"{built.name}: the module is already sharded")
    base = built.module.model
    with warnings.catch_warnings():
        # The setter warns about rules matching no parameter (e.g. the dense-MLP rules of a model
        # whose layers are all MoE): harmless, the plan is the model's own.
        warnings.simplefilter("ignore", UserWarning)
        base.tp_plan = {k.removeprefix("model."): v for k, v in plan.items()}
    apply_tensor_parallelism(base, mesh)
    return built.module


def replace_sharded_module(
    built: BuiltModel, path: str, make: Callable[[nn.Module], nn.Module], mesh: Any
) -> nn.Module:
    """Replace the module at ``path`` of a model ``parallelize`` sharded by ``make(module)``,
    keeping its TP style (e.g. an ``nn.Linear`` by an FP8 linear); returns the new module.

    ``make`` sees the module with this rank's local shards as plain tensors (the new module is
    built from them: its buffers hold no DTensor); the new module is marked
    ``_hf_quantized_needs_local_tp`` (transformers' flag for a quantized linear that runs on local
    tensors) and wrapped by the same style's forward, so it takes and gives what the old one did:
    a column-wise one its output shard, a row-wise one the sum (DTensor Partial -> Replicate:
    ``all_reduce + wait_tensor``). A row-wise module with a bias is refused: the style adds only a
    bias *parameter* once after the sum, a new module's own bias would be summed world-size times."""
    from torch.distributed.tensor import DTensor
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES, replace_layer_number_by_wildcard

    plan = tp_plan(built)
    style = plan.get(replace_layer_number_by_wildcard(path))
    if style is None:
        raise ValueError(f"{built.name}: {path} is not sharded (no TP plan entry)")
    old = built.module.get_submodule(path)
    if style.startswith("rowwise") and getattr(old, "bias", None) is not None:
        raise ValueError(f"{built.name}: {path} is row-wise with a bias: not supported")
    originals = dict(old._parameters)
    old._parameters.update({n: p.to_local() for n, p in originals.items() if isinstance(p, DTensor)})
    try:
        new = make(old)
    finally:
        old._parameters.update(originals)
    new._hf_quantized_needs_local_tp = True
    ALL_PARALLEL_STYLES[style].install_forward(new, mesh)
    parent_path, _, name = path.rpartition(".")
    setattr(built.module.get_submodule(parent_path), name, new)
    return new
