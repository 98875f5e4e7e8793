"""Shared by the rewrite tests: a function compiled with named fusions and its report, and the op
counts the rewrite changed."""

from __future__ import annotations

import torch

import fusion_passes


def compile_with(fusions, fn, args):
    """(fn compiled with ``fusions`` and run on args, the report)."""
    report = fusion_passes.Report()
    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(fn, backend=fusion_passes.backend(fusions, report=report), fullgraph=True)(*args)
    return out, report


def op_changes(report):
    """The op counts a rewrite changed: op -> (before, after)."""
    before, after = report.ops_before(), report.ops_after()
    return {op: (before[op], after[op]) for op in set(before) | set(after) if before[op] != after[op]}


def decode_steps(step, fusions, steps: int = 2):
    """A DecodeStep compiled with ``fusions`` and run ``steps`` steps from its prefill: (each
    step's output, then every cache tensor and write counter after them; the report)."""
    report = fusion_passes.Report()
    torch._dynamo.reset()
    compiled = torch.compile(step, backend=fusion_passes.backend(fusions, report=report), fullgraph=True)
    with torch.no_grad():
        step.restore()
        outs = [compiled(*step.inputs(i)).clone() for i in range(steps)]
    return outs + [t.clone() for t in step.cache_tensors()] + [t.clone() for t in step._lengths], report


def prefill(step, fusions):
    """The prefill of the step's prompt compiled with ``fusions``, written into a zeroed cache: (the
    output, then every cache tensor after it; the report)."""
    report = fusion_passes.Report()
    torch._dynamo.reset()
    compiled = torch.compile(step, backend=fusion_passes.backend(fusions, report=report), fullgraph=True)
    with torch.no_grad():
        for t in step.cache_tensors():
            t.zero_()
        out = compiled(step.prompt, torch.arange(step.context, device=step.prompt.device)).clone()
        after = [t.clone() for t in step.cache_tensors()]
        step.restore()
    return [out, *after], report


def defaults_without(*names: str) -> list[str]:
    """The default fusions less ``names`` and less every default that requires one of them (its
    ``requires`` would enable it again): the defaults as they were before ``names`` joined them."""
    from fusion_passes.registry import get_fusions

    dropped = set(names)
    defaults = get_fusions("all")
    changed = True
    while changed:
        changed = False
        for f in defaults:
            if f.name not in dropped and dropped & set(f.requires):
                dropped.add(f.name)
                changed = True
    return [f.name for f in defaults if f.name not in dropped]
