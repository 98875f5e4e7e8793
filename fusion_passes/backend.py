"""The torch.compile backend: Inductor with the fusion pass manager as its post-grad custom pass.

    torch.compile(model, backend="fusion_passes")            # every fusion, via the entry point
    torch.compile(model, backend=fusion_passes.backend(fusions=["add_rms_norm"], report=r))
"""

from __future__ import annotations

import collections.abc
import types
import typing
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from fusion_passes import report_cache
from fusion_passes.pass_manager import LAUNCH_MODES, FusionPassManager
from fusion_passes.registry import FusionError, get_fusions, unknown_name
from fusion_passes.report import Report


def backend(
    fusions: str | Sequence[str] = "all",
    report: Report | None = None,
    verify: bool = False,
    strict: bool = False,
    launch: str = "direct",
    lower_back: bool = True,
    **inductor_options: Any,
) -> Callable[..., Any]:
    """Build a torch.compile backend.

    fusions:  "all" or the names of the fusions to apply (``fusion_passes.list_fusions()``); "all"
              among the names adds the defaults (``["all", "allreduce_rms_norm"]``).
    report:   a ``Report`` to fill with the sites rewritten in every graph this backend compiles.
    verify:   check each rewrite on fresh random inputs of the recorded shapes; a rewrite whose
              outputs differ beyond the per-dtype tolerance is rejected (the report says which).
    strict:   re-raise a fusion's failure instead of warning and leaving the graph unchanged.
    launch:   on CUDA, "direct" lets Inductor launch the fused Triton kernels from its generated
              code; "dispatch" calls the fused ops through the PyTorch dispatcher.
    lower_back: decompose the canonical ops (a raised norm, RoPE or quantization) that no region
              fusion consumed back into plain torch, so Inductor fuses them with their neighbours
              as it would the model's own code; False keeps them as standalone kernels.
    inductor_options: ``torch._inductor.config`` settings for this compile (e.g. max_autotune).
    """
    _check_options(report, verify, strict, launch, lower_back)
    _check_inductor_options(inductor_options)
    manager = FusionPassManager(get_fusions(fusions), report, verify, strict, launch, lower_back)

    def compile_with_fusions(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        import torch._inductor.config as inductor_config
        from torch._dynamo.utils import counters
        from torch._inductor.compile_fx import compile_fx

        if inductor_options.get("freezing", inductor_config.freezing):
            warnings.warn(FREEZING_WARNING, stacklevel=2)

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


# Inductor's freezing folds the parameters' own math into constants before the post-grad passes:
# Qwen 3.5's -exp(A_log) and its conv weight's view, for one (a tiny Qwen 3.5-MoE decode step
# under freezing matched neither causal_conv1d_update nor gated_delta_step; the near misses say
# "expected aten.neg.default, found the graph input neg_1").
FREEZING_WARNING = (
    "fusion_passes: Inductor's freezing is on; it folds parameter math (e.g. -exp(A_log), weight views) into "
    "constants, so fusions whose patterns hold that math do not match (the report's near misses name them)"
)


def _given(value: Any) -> str:
    return f"{type(value).__name__} {value!r}"[:80]


def _check_options(report: Any, verify: Any, strict: Any, launch: Any, lower_back: Any) -> None:
    """Each option of ``backend`` has the type it says (a wrong one is a one-line TypeError; the
    fusion names are get_fusions' to check)."""
    if report is not None and not isinstance(report, Report):
        raise TypeError(f"backend: report must be a fusion_passes.Report or None, got {_given(report)}")
    for name, value in (("verify", verify), ("strict", strict), ("lower_back", lower_back)):
        if not isinstance(value, bool):
            raise TypeError(f"backend: {name} must be a bool, got {_given(value)}")
    if not isinstance(launch, str):
        modes = " or ".join(map(repr, LAUNCH_MODES))
        raise TypeError(f"backend: launch must be a str ({modes}), got {_given(launch)}")


def _check_inductor_options(options: dict[str, Any]) -> None:
    """Every option is a ``torch._inductor.config`` setting, of the type that config declares."""
    import torch._inductor.config as inductor_config

    known = getattr(inductor_config, "_config", {})
    for name, value in options.items():
        if name == "post_grad_custom_post_pass":
            raise FusionError("post_grad_custom_post_pass is the slot fusion_passes runs in")
        if name not in known and not hasattr(inductor_config, name):
            raise FusionError(unknown_name("Inductor option", name, list(known), listing=None))
        entry = known.get(name)
        expected = getattr(entry, "value_type", None)
        if expected is None and entry is not None and entry.default is not None:
            expected = type(entry.default)
        if expected is not None and not _is_instance(value, expected):
            shown = getattr(expected, "__name__", None) or str(expected).replace("typing.", "")
            raise TypeError(f"backend: Inductor option {name} must be {shown}, got {_given(value)}")


def _is_instance(value: Any, expected: Any) -> bool:
    """``isinstance`` for the annotations ``torch._inductor.config`` declares (unions, Optional,
    Literal, list[...], Callable); an annotation it cannot read accepts the value."""
    if expected is type(None) or expected is None:
        return value is None
    if expected is bool:
        return isinstance(value, bool)
    if expected is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if isinstance(expected, type):
        return isinstance(value, expected)
    origin = typing.get_origin(expected)
    if origin in (typing.Union, types.UnionType):
        return any(_is_instance(value, arg) for arg in typing.get_args(expected))
    if origin is typing.Literal:
        return value in typing.get_args(expected)
    if origin is collections.abc.Callable:
        return callable(value)
    if isinstance(origin, type):
        return isinstance(value, origin)
    return True  # a forward reference or a form not read here


def fusion_passes_backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
    """``backend="fusion_passes"`` (the torch_dynamo_backends entry point): every fusion."""
    return backend()(gm, example_inputs)
