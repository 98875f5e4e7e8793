"""The ``diff --html`` page: one self-contained document, a before/after SVG per site, escaped
data; and the layered layout of a region graph."""

from __future__ import annotations

import re
import textwrap

import pytest

from fusion_passes.cli import main
from fusion_passes.html_report import layout, render_html

FACTORY = textwrap.dedent(
    """
    import torch

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = torch.nn.RMSNorm(64, eps=1e-6)
            self.final = torch.nn.RMSNorm(64, eps=1e-6)

        def forward(self, x, residual):
            h = self.norm(x + residual)
            return self.final(h * 2)

    def make():
        return Block(), (torch.randn(2, 5, 64), torch.randn(2, 5, 64))
    """
)

# An RMSNorm region with a long edge (x feeds pow and, four layers down, mul) and a late input.
REGION = {
    "nodes": [
        {"id": "in_x", "label": "x", "kind": "input"},
        {"id": "in_weight", "label": "weight", "kind": "input"},
        {"id": "n0", "label": "aten.pow.Tensor_Scalar : float32", "kind": "op"},
        {"id": "n1", "label": "aten.mean.dim : float32", "kind": "op"},
        {"id": "n2", "label": "aten.add.Tensor : float32", "kind": "op"},
        {"id": "n3", "label": "aten.rsqrt.default : float32", "kind": "op"},
        {"id": "n4", "label": "aten.mul.Tensor : float32", "kind": "op"},
        {"id": "n5", "label": "aten.mul.Tensor : float32", "kind": "op"},
        {"id": "out0", "label": "output 0", "kind": "output"},
    ],
    "edges": [
        ["in_x", "n0"], ["n0", "n1"], ["n1", "n2"], ["n2", "n3"], ["in_x", "n4"], ["n3", "n4"],
        ["n4", "n5"], ["in_weight", "n5"], ["n5", "out0"],
    ],
}


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    """The CLI's HTML report of a two-site model (add_rms_norm and rms_norm), as written."""
    tmp = tmp_path_factory.mktemp("html")
    factory, out = tmp / "block.py", tmp / "report.html"
    factory.write_text(FACTORY)
    assert main(["diff", f"{factory}:make", "--html", str(out)]) == 0
    return out.read_text()


def test_page_is_one_self_contained_document(page):
    assert page.startswith("<!DOCTYPE html>") and page.count("<html") == 1
    assert page.rstrip().endswith("</html>")
    assert "<script" not in page and "<link" not in page and "@import" not in page
    urls = re.findall(r"https?://[^\s\"')]+", page)
    assert set(urls) == {"http://www.w3.org/2000/svg"}  # only the SVG namespace
    assert not re.search(r"(src|href)=\"(?!#)", page)  # links only to anchors in the page


def test_every_site_has_a_before_and_after_graph(page):
    sites = page.count('<section class="site"')
    assert sites == 2
    assert page.count("<svg") == 2 * sites
    assert page.count('class="graph before"') == sites and page.count('class="graph after"') == sites
    assert "fusion_passes.add_rms_norm.default" in page and "fusion_passes.rms_norm.default" in page
    assert 'class="node op replaced"' in page and 'class="node op fused"' in page
    assert "add_rms_norm — norm — " in page.replace('<span class="sep"> — </span>', " — ")
    assert "numerical check" in page and "graph ops that changed" in page


def test_data_strings_are_escaped():
    evil = "<script>alert(1)</script>"
    site = {
        "fusion": "rms_norm", "spelling": "s&p", "graph": 0, "module": evil, "location": "x.py:1 in <f>",
        "ops_removed": [], "ops_added": [], "scalars": {},
        "before": {"nodes": [{"id": "a", "label": f"aten.{evil} : float32", "kind": "op"},
                             {"id": "b", "label": evil, "kind": "output"}], "edges": [["a", "b"]]},
        "after": {"nodes": [{"id": "a", "label": f"fusion_passes.{evil}", "kind": "op"}], "edges": []},
    }
    data = {
        "model": evil, "device": "cpu", "dtype": "fp32", "matches": {"rms_norm": 1}, "sites": [site],
        "rejected": [{"fusion": "rms_norm", "spelling": "s", "graph": 0, "module": "", "location": "",
                      "reason": evil}],
        "near_misses": [], "errors": [evil], "ops_before": {evil: 1}, "ops_after": {},
        "numerics": {evil: {"outputs": [{"max_abs": 0.0, "rel_norm": 0.0, "ok": True}], "ok": True}},
    }
    page = render_html(data)
    assert "<script" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "s&amp;p" in page and "in &lt;f&gt;" in page


def test_layout_places_every_node_in_layers_that_follow_the_edges():
    lay = layout(REGION)
    ids = [n["id"] for n in REGION["nodes"]]
    assert set(lay.pos) == set(ids) == set(lay.layer)
    for src, dst in REGION["edges"]:
        assert lay.layer[src] < lay.layer[dst]
        assert lay.pos[src][1] < lay.pos[dst][1]  # top to bottom
    assert lay.layer["in_weight"] == lay.layer["n5"] - 1  # an input sits just above its consumer
    for (x, y), (w, h) in ((lay.pos[n], lay.size[n]) for n in ids):  # inside the canvas
        assert 0 <= x - w / 2 and x + w / 2 <= lay.width and 0 <= y - h / 2 and y + h / 2 <= lay.height
    for i, a in enumerate(ids):  # no two nodes of a layer overlap
        for b in ids[i + 1 :]:
            if lay.layer[a] == lay.layer[b]:
                assert abs(lay.pos[a][0] - lay.pos[b][0]) >= (lay.size[a][0] + lay.size[b][0]) / 2
    long_edge = next(points for s, d, points in lay.routes if (s, d) == ("in_x", "n4"))
    assert len(long_edge) == 2 + lay.layer["n4"] - lay.layer["in_x"] - 1  # one bend per layer crossed
