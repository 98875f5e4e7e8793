"""Tensor-parallel sharding of the built models (``torch.distributed.tensor.parallel``).

    built = build_model("qwen3", "tiny")
    parallelize(built, mesh)          # mesh = init_device_mesh("cpu", (world_size,)), gloo or NCCL

applies ``parallelize_module`` with the model's own HuggingFace TP plan
(``config.base_model_tp_plan``): q/k/v and gate/up projections ``ColwiseParallel`` (each rank
holds a slice of the heads / of the intermediate features), o_proj and down_proj
``RowwiseParallel`` (each rank multiplies its slice and the partial sums are allreduced). The
attention modules need no edit: transformers views the projections as ``(..., -1, head_dim)``, so
a rank's q/k/v hold num_heads / world_size heads (and kv heads / world_size) on their own.

The row-wise projections' allreduces are what the ``allreduce_add_rms_norm`` fusion matches:
under torch.compile each becomes ``_c10d_functional.all_reduce(x, "sum", group) + wait_tensor``,
followed by the residual add and the next RMSNorm.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from .registry import BuiltModel

# HF plan entries -> the parallel styles of torch.distributed.tensor.parallel. Replicated norms
# (q_norm / k_norm: "replicated_with_grad_allreduce") need nothing at inference.
_STYLES = {"colwise", "rowwise"}
_REPLICATED = {"replicated_with_grad_allreduce"}


def tp_plan(built: BuiltModel) -> dict[str, str]:
    """The model's HF TP plan, with paths relative to ``built.module`` (the base model sits at
    ``model``). Raises ValueError for a plan entry this module cannot apply (MoE experts, ...)."""
    plan = dict(getattr(built.config, "base_model_tp_plan", None) or {})
    if not plan:
        raise ValueError(f"{built.name}: the config has no base_model_tp_plan")
    unsupported = {k: v for k, v in plan.items() if v not in _STYLES | _REPLICATED}
    if unsupported:
        key, style = next(iter(unsupported.items()))
        raise ValueError(f"{built.name}: TP style {style!r} ({key}) is not supported here")
    return {f"model.{k}": v for k, v in plan.items() if v in _STYLES}


def parallelize(built: BuiltModel, mesh: Any) -> nn.Module:
    """Shard ``built.module`` in place over the 1-D ``mesh`` (every rank must call this, with the
    same seeded weights: each keeps its slice); returns the module. Head counts must divide."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    world = mesh.size()
    config = built.config
    for attr in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = getattr(config, attr, None)
        if value is not None and value % world:
            raise ValueError(f"{built.name}: {attr}={value} does not divide by world size {world}")
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    plan = {path: styles[style]() for path, style in tp_plan(built).items()}
    return parallelize_module(built.module, mesh, plan)
