"""Real HuggingFace transformers model graphs (tiny / published-width configs, random weights) and the
norm sites a fusion pass should find in them.

    from fusion_passes.models import MODEL_NAMES, build_model
    built = build_model("qwen3", size="tiny", dtype=torch.bfloat16)
    out = torch.compile(built.module, fullgraph=True)(*built.example_inputs)
"""

from .registry import (
    MODEL_NAMES,
    BuiltModel,
    LastHiddenState,
    ModelSites,
    build_model,
    executed_norms,
    norm_kind,
)

__all__ = [
    "MODEL_NAMES",
    "BuiltModel",
    "LastHiddenState",
    "ModelSites",
    "build_model",
    "executed_norms",
    "norm_kind",
]
