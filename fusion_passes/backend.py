"""The torch.compile backend: Inductor with the fusion pass manager as its post-grad custom pass.

    torch.compile(model, backend="fusion_passes")            # every fusion, via the entry point
    torch.compile(model, backend=fusion_passes.backend(fusions=["add_rms_norm"], report=r))
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from fusion_passes.pass_manager import FusionPassManager
from fusion_passes.registry import FusionError, get_fusions
from fusion_passes.report import Report


def backend(
    fusions: str | Sequence[str] = "all",
    report: Report | None = None,
    verify: bool = False,
    strict: bool = False,
    **inductor_options: Any,
) -> Callable[..., Any]:
    """Build a torch.compile backend.

    fusions:  "all" or the names of the fusions to apply (``fusion_passes.list_fusions()``).
    report:   a ``Report`` to fill with the sites rewritten in every graph this backend compiles.
    verify:   check each rewrite on fresh random inputs of the recorded shapes; a rewrite whose
              outputs differ beyond the per-dtype tolerance is rejected (the report says which).
    strict:   re-raise a fusion's failure instead of warning and leaving the graph unchanged.
    inductor_options: ``torch._inductor.config`` settings for this compile (e.g. max_autotune).
    """
    import torch._inductor.config as inductor_config

    unknown = [k for k in inductor_options if not hasattr(inductor_config, k)]
    if unknown:
        raise FusionError(f"unknown Inductor option {unknown[0]!r}")
    if "post_grad_custom_post_pass" in inductor_options:
        raise FusionError("post_grad_custom_post_pass is the slot fusion_passes runs in")
    manager = FusionPassManager(get_fusions(fusions), report, verify, strict)

    def compile_with_fusions(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        from torch._inductor.compile_fx import compile_fx

        patches = {**inductor_options, "post_grad_custom_post_pass": manager}
        return compile_fx(gm, example_inputs, config_patches=patches)

    compile_with_fusions.report = manager.report  # type: ignore[attr-defined]
    compile_with_fusions.pass_manager = manager  # type: ignore[attr-defined]
    return compile_with_fusions


def fusion_passes_backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
    """``backend="fusion_passes"`` (the torch_dynamo_backends entry point): every fusion."""
    return backend()(gm, example_inputs)
