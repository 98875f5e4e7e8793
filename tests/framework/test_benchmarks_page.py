"""BENCHMARKS.md is what python -m benchmarks.render writes from benchmarks/results/*.json, and every
result file says where, when and how its numbers were measured."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = sorted((ROOT / "benchmarks" / "results").glob("*.json"))
PROVENANCE_KEYS = ("date", "gpu", "gpus", "torch", "triton", "command")  # benchmarks/common.py's


def _load(name: str):
    """benchmarks/NAME.py, loaded from its file (render and common import no other module of the folder)."""
    spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _render_module():
    return _load("render")


def test_the_page_is_what_the_renderer_writes():
    text = _render_module().render(ROOT / "benchmarks" / "results")
    assert (ROOT / "BENCHMARKS.md").read_text() == text, "run: python -m benchmarks.render"
    assert text.count("\n") <= 500  # a screenful per section: whole models, decode, each family (22)
    assert "docs/notes/benchmarks-history.md" in text


def test_every_section_has_its_result_file():
    render = _render_module()
    names = {path.stem for path in RESULTS}
    for section in render.SECTIONS:
        assert set(section.files) <= names, section.title
    assert names == {name for section in render.SECTIONS for name in section.files}


def test_the_writer_stamps_these_provenance_keys():
    assert _load("common").PROVENANCE_KEYS == PROVENANCE_KEYS


@pytest.mark.parametrize("path", RESULTS, ids=[p.stem for p in RESULTS])
def test_result_file_has_its_provenance(path):
    provenance = json.loads(path.read_text())["provenance"]
    for key in PROVENANCE_KEYS:
        assert provenance.get(key) not in (None, "", []), f"{path.name}: provenance has no {key}"
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}(T.*)?", provenance["date"])
    commands = [provenance["command"]] if isinstance(provenance["command"], str) else provenance["command"]
    assert all(isinstance(c, str) and c for c in commands)


@pytest.mark.parametrize("path", RESULTS, ids=[p.stem for p in RESULTS])
def test_a_transcribed_result_names_sections_of_the_history(path):
    source = json.loads(path.read_text())["provenance"].get("source")
    if source is None:
        return  # measured and written by the benchmark itself
    assert source.startswith("transcribed from docs/notes/benchmarks-history.md: section")
    headings = {
        line.lstrip("#").strip()
        for line in (ROOT / "docs" / "notes" / "benchmarks-history.md").read_text().splitlines()
        if line.startswith("#")
    }
    sections = re.findall(r'"([^"]+)"', source)
    assert sections
    for section in sections:
        assert section in headings, f"{path.name}: no section {section!r} in the history"


def test_runs_over_parts_of_the_shapes_merge_into_one_result():
    def run(date, command, tokens, copy_gbps):
        provenance = {"date": date, "gpu": "NVIDIA H200", "gpus": 1, "torch": "2.11.0+cu130"}
        provenance.update(triton="3.6.0", command=command)
        return {"provenance": provenance, "copy_gbps": copy_gbps, "records": [{"tokens": tokens}]}

    merge = _render_module().merge
    merged = merge([run("2026-12-05T10:00:00", "a", 1, 4200.0), run("2026-12-05T10:09:00", "b", 64, 4250.0)])
    assert [r["tokens"] for r in merged["records"]] == [1, 64]
    assert merged["provenance"]["command"] == ["a", "b"]
    assert merged["provenance"]["date"] == "2026-12-05T10:09:00"
    assert merged["copy_gbps"] == 4250.0
    other = run("2026-12-05T10:09:00", "c", 4096, 4250.0)
    other["provenance"]["torch"] = "2.13.0"
    with pytest.raises(SystemExit, match="torch"):
        merge([run("2026-12-05T10:00:00", "a", 1, 4200.0), other])
