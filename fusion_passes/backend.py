"""The torch.compile backend: Inductor with the fusion pass manager as its post-grad custom pass.

    torch.compile(model, backend="fusion_passes")            # every fusion, via the entry point
    torch.compile(model, backend=fusion_passes.backend(fusions=["add_rms_norm"], report=r))
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from fusion_passes import report_cache
from fusion_passes.pass_manager import FusionPassManager
from fusion_passes.registry import FusionError, get_fusions
from fusion_passes.report import Report


def backend(
    fusions: str | Sequence[str] = "all",
    report: Report | None = None,
    verify: bool = False,
    strict: bool = False,
    launch: str = "direct",
    **inductor_options: Any,
) -> Callable[..., Any]:
    """Build a torch.compile backend.

    fusions:  "all" or the names of the fusions to apply (``fusion_passes.list_fusions()``).
    report:   a ``Report`` to fill with the sites rewritten in every graph this backend compiles.
    verify:   check each rewrite on fresh random inputs of the recorded shapes; a rewrite whose
              outputs differ beyond the per-dtype tolerance is rejected (the report says which).
    strict:   re-raise a fusion's failure instead of warning and leaving the graph unchanged.
    launch:   on CUDA, "direct" lets Inductor launch the fused Triton kernels from its generated
              code; "dispatch" calls the fused ops through the PyTorch dispatcher.
    inductor_options: ``torch._inductor.config`` settings for this compile (e.g. max_autotune).
    """
    import torch._inductor.config as inductor_config

    unknown = [k for k in inductor_options if not hasattr(inductor_config, k)]
    if unknown:
        raise FusionError(f"unknown Inductor option {unknown[0]!r}")
    if "post_grad_custom_post_pass" in inductor_options:
        raise FusionError("post_grad_custom_post_pass is the slot fusion_passes runs in")
    manager = FusionPassManager(get_fusions(fusions), report, verify, strict, launch)

    def compile_with_fusions(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        from torch._dynamo.utils import counters
        from torch._inductor.compile_fx import compile_fx

        patches = {**inductor_options, "post_grad_custom_post_pass": manager}
        key = report_cache.graph_key(manager.uuid(), gm, example_inputs)
        first_graph = len(manager.report.graphs)
        hits = counters["inductor"]["fxgraph_cache_hit"]
        compiled = compile_fx(gm, example_inputs, config_patches=patches)
        served = counters["inductor"]["fxgraph_cache_hit"] > hits
        if len(manager.report.graphs) == first_graph and served:
            cached = report_cache.load(key)
            if cached is not None:
                manager.report.replay(cached)
                return compiled
            # Inductor has the code but our records of it are gone (another cache directory, or
            # written before they were kept): compile once more, past the cache.
            patches["fx_graph_cache"] = False
            compiled = compile_fx(gm, example_inputs, config_patches=patches)
        report_cache.save(key, manager.report.graphs_since(first_graph))
        return compiled

    compile_with_fusions.report = manager.report  # type: ignore[attr-defined]
    compile_with_fusions.pass_manager = manager  # type: ignore[attr-defined]
    return compile_with_fusions


def fusion_passes_backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
    """``backend="fusion_passes"`` (the torch_dynamo_backends entry point): every fusion."""
    return backend()(gm, example_inputs)
