"""The built-in fusions run in fusion_order's one list; a fusion never runs before one it requires."""

from __future__ import annotations

import subprocess
import sys

import pytest

import fusion_passes
from fusion_passes import fusion_order


def test_registry_order_is_fusion_order():
    builtin = [f.name for f in fusion_order.builtin_fusions()]
    assert [f.name for f in fusion_passes.list_fusions()][: len(builtin)] == builtin
    # Every family's module is listed once, with a reason.
    modules = [module for module, _ in fusion_order.FUSION_ORDER]
    assert len(set(modules)) == len(modules)
    assert all(reason for _, reason in fusion_order.FUSION_ORDER)


def test_requirements_run_first():
    position = {f.name: i for i, f in enumerate(fusion_order.builtin_fusions())}
    for fusion in fusion_order.builtin_fusions():
        assert all(position[name] < position[fusion.name] for name in fusion.requires), fusion.name


def test_an_order_that_runs_a_fusion_before_its_requirement_is_refused(monkeypatch):
    monkeypatch.setattr(fusion_order, "FUSION_ORDER", tuple(reversed(fusion_order.FUSION_ORDER)))
    with pytest.raises(RuntimeError, match="requires .* which runs after it"):
        fusion_order.builtin_fusions()


@pytest.mark.parametrize("first", ["fusion_passes.patterns.rms_norm", "fusion_passes.registry"])
def test_no_import_cycle(first):
    """A pattern module and the registry import on their own, in either order."""
    code = f"import {first}; import fusion_passes.fusion_order; import fusion_passes.registry"
    subprocess.run([sys.executable, "-c", code], check=True)
