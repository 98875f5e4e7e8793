"""fusion_passes: find the unfused subgraphs real LLMs leave in their torch.compile graphs and
rewrite them into fused kernels, each rewrite checked numerically.

    torch.compile(model, backend="fusion_passes")
    torch.compile(model, backend=fusion_passes.backend(fusions=["add_rms_norm"], report=report))
"""

__version__ = "0.1.0"

from fusion_passes import lowering  # noqa: E402,F401  (registers torch.ops.fusion_passes.*)
from fusion_passes.backend import backend  # noqa: E402
from fusion_passes.fusion import Fusion, FusionError, Spelling  # noqa: E402
from fusion_passes.registry import (  # noqa: E402
    list_fusions,
    register_fusion,
    unregister_fusion,
)
from fusion_passes.report import Report  # noqa: E402

__all__ = [
    "Fusion",
    "FusionError",
    "Report",
    "Spelling",
    "backend",
    "list_fusions",
    "register_fusion",
    "unregister_fusion",
]
