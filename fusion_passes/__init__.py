"""fusion_passes: find the unfused subgraphs real LLMs leave in their torch.compile graphs and
rewrite them into fused kernels, each rewrite checked numerically.

    torch.compile(model, backend="fusion_passes")
    torch.compile(model, backend=fusion_passes.backend(fusions=["add_rms_norm"], report=report))

Importing the package registers its ops (``torch.ops.fusion_passes.*``); the framework (backend,
registry, pass manager: Inductor's pattern matcher, ~2 s to import) loads on first use of one of
its names, so ``import fusion_passes`` and the CLI's first line come fast.
"""

import importlib

__version__ = "0.1.0"

from fusion_passes import lowering  # noqa: E402,F401  (registers torch.ops.fusion_passes.*)

# name -> the module that defines it, imported on first access (PEP 562).
_LAZY = {
    "backend": "fusion_passes.backend",
    "Fusion": "fusion_passes.fusion",
    "FusionError": "fusion_passes.fusion",
    "Spelling": "fusion_passes.fusion",
    "list_fusions": "fusion_passes.registry",
    "register_fusion": "fusion_passes.registry",
    "unregister_fusion": "fusion_passes.registry",
    "Report": "fusion_passes.report",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # later accesses skip this hook
        return value
    try:  # a submodule (fusion_passes.registry ...), as an eager import would have bound it
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as e:
        if e.name != f"{__name__}.{name}":
            raise  # the submodule exists; something it imports does not
        raise AttributeError(f"module 'fusion_passes' has no attribute {name!r}") from None


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
