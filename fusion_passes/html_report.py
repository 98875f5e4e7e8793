"""The ``fusion-passes diff --html`` report: one self-contained page (inline CSS and SVG, no script).

    render_html(data) -> str        data: the JSON report (schema "fusion_passes.diff/1", cli._as_json)

The page has the summary tables (sites per fusion, numerical check, graph ops that changed, errors,
rejected candidates, near misses) and, for each rewritten site, its region graph before and after
(regions.py format) drawn side by side. Each graph is laid out top to bottom the layered (Sugiyama)
way, with networkx: longest-path layers from ``nx.topological_generations``, each node then pulled
down to just above its first consumer; edges longer than one layer get virtual bend points; the
order within a layer is the barycenter heuristic (the sweep with the fewest crossings wins); x
positions sweep toward the neighbours above, then below, busy nodes placed before bend points.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from html import escape
from typing import Any

import networkx as nx

CHAR_W = 7.3  # px per character of the 12px monospace labels
LINE_H = 14
PAD_X, PAD_Y = 12, 7
NODE_GAP, LAYER_GAP, MARGIN = 22, 30, 14
VIRTUAL_W = 8
FUSED_PREFIX = "fusion_passes."


# --- layout -------------------------------------------------------------------------------------


@dataclass
class Layout:
    """Node centres and sizes, layers, and each edge's route (a list of points, source to target)."""

    pos: dict[str, tuple[float, float]] = field(default_factory=dict)
    size: dict[str, tuple[float, float]] = field(default_factory=dict)
    layer: dict[str, int] = field(default_factory=dict)
    routes: list[tuple[str, str, list[tuple[float, float]]]] = field(default_factory=list)
    width: float = 0.0
    height: float = 0.0


def node_lines(node: dict[str, Any]) -> list[str]:
    """The text of a node: op name (without aten./prims.) and dtype on a second line."""
    if node["kind"] != "op":
        return [node["label"]]
    op, _, dtype = node["label"].partition(" : ")
    for prefix in ("aten.", "prims."):
        op = op.removeprefix(prefix)
    return [op, dtype] if dtype else [op]


def _layers(g: nx.DiGraph) -> dict[str, int]:
    """Longest-path layers, then every node that feeds something pulled down to just above its
    first consumer (an input sits next to where it is used)."""
    layer = {n: i for i, gen in enumerate(nx.topological_generations(g)) for n in gen}
    for n in reversed(list(nx.topological_sort(g))):
        below = [layer[s] for s in g.successors(n)]
        if below:
            layer[n] = max(layer[n], min(below) - 1)
    return layer


def _crossings(rows: list[list[str]], h: nx.DiGraph) -> int:
    total = 0
    for upper, lower in zip(rows, rows[1:]):
        at = {n: i for i, n in enumerate(lower)}
        ends = [(i, at[s]) for i, n in enumerate(upper) for s in h.successors(n)]
        total += sum(1 for a, b in ends for c, d in ends if a < c and b > d)
    return total


def _order(rows: list[list[str]], h: nx.DiGraph, sweeps: int = 4) -> list[list[str]]:
    """Barycenter ordering within layers, down and up sweeps; keeps the order with fewest crossings."""
    best, best_crossings = [r[:] for r in rows], _crossings(rows, h)
    for sweep in range(2 * sweeps):
        down = sweep % 2 == 0
        indices = range(1, len(rows)) if down else range(len(rows) - 2, -1, -1)
        for i in indices:
            ref = {n: j for j, n in enumerate(rows[i - 1] if down else rows[i + 1])}
            neighbours = h.predecessors if down else h.successors

            def key(item, ref=ref, neighbours=neighbours):
                j, n = item
                near = [ref[m] for m in neighbours(n)]
                return sum(near) / len(near) if near else j

            rows[i] = [n for _, n in sorted(enumerate(rows[i]), key=key)]
        crossings = _crossings(rows, h)
        if crossings < best_crossings:
            best, best_crossings = [r[:] for r in rows], crossings
    return best


def _place(row: list[str], want: dict[str, float], width: dict[str, float], rank: dict[str, float]):
    """x of each node of a row, keeping the row's order and gaps: nodes in decreasing rank take
    their wanted x as far as the nodes already placed (and the room the others need) allow."""
    x: dict[str, float] = {}

    def room(i: int, j: int) -> float:  # least centre-to-centre distance from row[i] to row[j], i < j
        inner = sum(width[n] for n in row[i + 1 : j])
        return inner + (width[row[i]] + width[row[j]]) / 2 + (j - i) * NODE_GAP

    for i in sorted(range(len(row)), key=lambda i: -rank[row[i]]):
        placed = [j for j in range(len(row)) if row[j] in x]
        lo = max((x[row[j]] + room(j, i) for j in placed if j < i), default=float("-inf"))
        hi = min((x[row[j]] - room(i, j) for j in placed if j > i), default=float("inf"))
        x[row[i]] = min(max(want[row[i]], lo), hi)
    return x


def layout(region: dict[str, Any]) -> Layout:
    """Top-to-bottom layered layout of a region graph ({"nodes": [...], "edges": [[src, dst]]})."""
    nodes = {n["id"]: n for n in region["nodes"]}
    first = {n: i for i, n in enumerate(nodes)}
    edges = [(s, d) for s, d in region["edges"] if s in nodes and d in nodes and s != d]
    if not nx.is_directed_acyclic_graph(nx.DiGraph(edges)):  # keep the edges that follow node order
        edges = [(s, d) for s, d in edges if first[s] < first[d]]
    g = nx.DiGraph()
    g.add_nodes_from(nodes)
    g.add_edges_from(edges)
    out = Layout(layer=_layers(g))
    for n, node in nodes.items():
        lines = node_lines(node)
        out.size[n] = (max(map(len, lines)) * CHAR_W + 2 * PAD_X, len(lines) * LINE_H + 2 * PAD_Y)

    # Split edges longer than one layer with virtual nodes, so every edge joins adjacent layers.
    h = nx.DiGraph()
    h.add_nodes_from(nodes)
    chains: dict[tuple[str, str], list] = {}
    layer = dict(out.layer)
    width = {n: s[0] for n, s in out.size.items()}
    for s, d in g.edges:
        chain = [("bend", s, d, k) for k in range(out.layer[s] + 1, out.layer[d])]
        for k, v in enumerate(chain):
            layer[v], width[v] = out.layer[s] + 1 + k, VIRTUAL_W
        nx.add_path(h, [s, *chain, d])
        chains[(s, d)] = chain
    rows: list[list] = [[] for _ in range(max(layer.values(), default=-1) + 1)]
    for n in sorted(h.nodes, key=lambda n: first[n] if n in nodes else first[n[1]] + 0.5):
        rows[layer[n]].append(n)
    rows = _order(rows, h)

    # x: packed rows, then sweeps down (toward the preds) and up (toward the succs); real nodes,
    # busiest first, take their place before the bend points of long edges.
    rank = {n: (10 + h.degree(n) if n in nodes else 0) for n in h.nodes}
    x: dict[str, float] = {}
    for row in rows:
        x.update(_place(row, {n: 0.0 for n in row}, width, rank))
    for sweep in range(6):
        down = sweep % 2 == 0
        for row in rows[1:] if down else rows[-2::-1]:
            want = {}
            for n in row:
                near = list(h.predecessors(n) if down else h.successors(n))
                near = [m for m in near if m in nodes] or near
                want[n] = sum(x[m] for m in near) / len(near) if near else x[n]
            x.update(_place(row, want, width, rank))
    left = min(x[n] - width[n] / 2 for n in x)
    heights = [max((out.size[n][1] for n in row if n in nodes), default=LINE_H) for row in rows]
    y, top = {}, MARGIN
    for row, row_h in zip(rows, heights):
        for n in row:
            y[n] = top + row_h / 2
        top += row_h + LAYER_GAP
    at = {n: (x[n] - left + MARGIN, y[n]) for n in x}
    out.pos = {n: at[n] for n in nodes}
    out.width = max(x[n] + width[n] / 2 for n in x) - left + 2 * MARGIN
    out.height = top - LAYER_GAP + MARGIN
    out.routes = _routes(g, chains, at, out.size)
    return out


def _routes(g: nx.DiGraph, chains: dict, at: dict, size: dict) -> list:
    """Edge routes: from a port on the source's bottom, through the bend points, to a port on the
    target's top (ports spread in the order of the other ends, so arrows do not pile up)."""

    def ports(n, ends):
        ends = sorted(ends, key=lambda e: at[e[1]][0])
        step = min(16.0, (size[n][0] - 16) / max(len(ends) - 1, 1))
        return {e[0]: at[n][0] + (i - (len(ends) - 1) / 2) * step for i, e in enumerate(ends)}

    out_x, in_x = {}, {}
    for n in g.nodes:
        out_x.update(ports(n, [((n, d), (chains[(n, d)] or [d])[0]) for d in g.successors(n)]))
        in_x.update(ports(n, [((s, n), (chains[(s, n)] or [s])[-1]) for s in g.predecessors(n)]))
    routes = []
    for s, d in g.edges:
        start = (out_x[(s, d)], at[s][1] + size[s][1] / 2)
        end = (in_x[(s, d)], at[d][1] - size[d][1] / 2)
        routes.append((s, d, [start, *(at[v] for v in chains[(s, d)]), end]))
    return routes


# --- SVG ----------------------------------------------------------------------------------------


def _node_class(node: dict[str, Any], side: str) -> str:
    if node["kind"] != "op":
        return node["kind"]
    if side == "before":
        return "op replaced"
    return "op fused" if node["label"].startswith(FUSED_PREFIX) else "op"


def _svg_node(node: dict[str, Any], center: tuple[float, float], size: tuple[float, float], side: str):
    (cx, cy), (w, h) = center, size
    if node["kind"] == "op":
        shape = f'<rect x="{cx - w / 2:.1f}" y="{cy - h / 2:.1f}" width="{w:.1f}" height="{h:.1f}" rx="8"/>'
    else:
        shape = f'<ellipse cx="{cx:.1f}" cy="{cy:.1f}" rx="{w / 2:.1f}" ry="{h / 2:.1f}"/>'
    lines = node_lines(node)
    texts = "".join(
        f'<text x="{cx:.1f}" y="{cy + (i - (len(lines) - 1) / 2) * LINE_H:.1f}"'
        f' class="{"dtype" if i else "name"}">{escape(line)}</text>'
        for i, line in enumerate(lines)
    )
    cls = _node_class(node, side)
    return f'<g class="node {cls}"><title>{escape(node["label"])}</title>{shape}{texts}</g>'


def _svg_edge(points: list[tuple[float, float]], marker: str) -> str:
    (x0, y0), d = points[0], [f"M{points[0][0]:.1f},{points[0][1]:.1f}"]
    for x1, y1 in points[1:]:
        ym = (y0 + y1) / 2
        d.append(f"C{x0:.1f},{ym:.1f} {x1:.1f},{ym:.1f} {x1:.1f},{y1:.1f}")
        x0, y0 = x1, y1
    return f'<path class="edge" d="{" ".join(d)}" marker-end="url(#{marker})"/>'


def region_svg(region: dict[str, Any], side: str, uid: str) -> str:
    """One region graph as an inline SVG sized to its content; side: "before" or "after"."""
    if not region or not region.get("nodes"):
        return '<p class="none">(no graph recorded)</p>'
    lay = layout(region)
    marker = f"arrow-{uid}"
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="graph {side}" width="{lay.width:.0f}" '
        f'height="{lay.height:.0f}" viewBox="0 0 {lay.width:.0f} {lay.height:.0f}" role="img">',
        f'<defs><marker id="{marker}" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" '
        f'markerHeight="7" orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" class="arrow"/>'
        f"</marker></defs>",
    ]
    parts += [_svg_edge(points, marker) for _, _, points in lay.routes]
    parts += [_svg_node(n, lay.pos[n["id"]], lay.size[n["id"]], side) for n in region["nodes"]]
    parts.append("</svg>")
    return "".join(parts)


# --- HTML ---------------------------------------------------------------------------------------

CSS = """
body { font: 14px/1.4 system-ui, -apple-system, "Segoe UI", "DejaVu Sans", sans-serif; color: #1f2328;
       margin: 0; padding: 20px 28px; background: #f6f8fa; }
h1 { font-size: 22px; margin: 0 0 4px; }
h2 { font-size: 16px; margin: 0 0 6px; }
h3 { font-size: 13px; margin: 0 0 6px; text-transform: uppercase; letter-spacing: .04em; color: #57606a; }
code, .where { font-family: ui-monospace, "DejaVu Sans Mono", Menlo, Consolas, monospace; font-size: 12px; }
.meta { color: #57606a; margin: 0 0 16px; }
.meta b { color: #1f2328; }
.grid { display: flex; flex-wrap: wrap; gap: 14px; align-items: flex-start; margin-bottom: 18px; }
.card { background: #fff; border: 1px solid #d0d7de; border-radius: 8px; padding: 12px 14px; }
.col { display: flex; flex-direction: column; gap: 14px; max-width: 760px; }
.wide { flex-basis: 100%; }
table { border-collapse: collapse; }
th, td { text-align: left; padding: 3px 10px 3px 0; border-bottom: 1px solid #eaeef2; vertical-align: top; }
th { font-size: 12px; color: #57606a; font-weight: 600; }
td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; }
tr.total td { font-weight: 600; border-bottom: none; }
.ok { color: #1a7f37; font-weight: 600; } .bad { color: #cf222e; font-weight: 600; }
.none { color: #6e7781; margin: 0; }
a { color: #0969da; text-decoration: none; }
.site { background: #fff; border: 1px solid #d0d7de; border-radius: 8px; padding: 14px 16px;
        margin-bottom: 16px; }
.site h2 .sep { color: #8c959f; font-weight: 400; }
.site .sub { color: #57606a; margin: 0 0 10px; font-size: 13px; }
.pair { display: flex; gap: 28px; align-items: flex-start; flex-wrap: wrap; }
figure { margin: 0; }
figcaption { font-size: 12px; font-weight: 600; color: #57606a; margin-bottom: 4px;
             text-transform: uppercase; }
svg.graph { display: block; background: #fbfcfd; border: 1px solid #eaeef2; border-radius: 6px; }
svg.graph text { font: 12px ui-monospace, "DejaVu Sans Mono", Menlo, Consolas, monospace; fill: #1f2328;
                 text-anchor: middle; dominant-baseline: central; }
svg.graph text.dtype { fill: #6e7781; font-size: 11px; }
.node rect { fill: #fff; stroke: #8c959f; stroke-width: 1.2; }
.node.replaced rect { fill: #ffebe9; stroke: #cf222e; }
.node.fused rect { fill: #dafbe1; stroke: #1a7f37; stroke-width: 2; }
.node.fused text { font-weight: 700; }
.node.input ellipse, .node.output ellipse { fill: #eaeef2; stroke: #afb8c1; }
.node.input text, .node.output text { fill: #424a53; font-style: italic; }
.edge { fill: none; stroke: #6e7781; stroke-width: 1.3; }
.arrow { fill: #6e7781; }
.legend span { display: inline-block; width: 12px; height: 12px; border-radius: 3px; vertical-align: -2px;
               margin: 0 4px 0 12px; border: 1px solid; }
"""


NONE = '<p class="none">none</p>'


def _table(headers: list[str], rows: list[list[str]], numeric: tuple[int, ...] = (), total: bool = False):
    """A table of cells that are already HTML (escape data first); ``numeric``: right-aligned
    columns; ``total``: the last row is a total. No rows: "none"."""
    if not rows:
        return NONE

    def cells(tag: str, row: list[str]) -> str:
        return "".join(f'<{tag}{" class=num" if j in numeric else ""}>{c}</{tag}>' for j, c in enumerate(row))

    body = [f'<tr{" class=total" if total and i == len(rows) - 1 else ""}>{cells("td", r)}</tr>'
            for i, r in enumerate(rows)]
    return f"<table><tr>{cells('th', headers)}</tr>{''.join(body)}</table>"


def _card(title: str, body: str, wide: bool = False) -> str:
    return f'<div class="card{" wide" if wide else ""}"><h3>{escape(title)}</h3>{body}</div>'


def _code(*parts: str) -> str:
    return f"<code>{'.'.join(escape(p) for p in parts)}</code>"


def _where(item: dict[str, Any]) -> str:
    module = escape(item.get("module") or "(root)")
    return f'<span class="where">{module}</span><br><small>{escape(item.get("location") or "")}</small>'


def _fusions(data: dict[str, Any]) -> str:
    """Sites per fusion, each site a link to its section."""
    links: dict[str, list[str]] = {}
    for i, s in enumerate(data.get("sites", [])):
        module = escape(s.get("module") or "(root)")
        links.setdefault(s["fusion"], []).append(f'<a href="#site-{i}">{module}</a>')
    matches, final = data.get("matches", {}), data.get("final", {})
    fates: dict[str, dict[str, int]] = {}
    for s in data.get("sites", []):
        if s.get("fate"):
            fates.setdefault(s["fusion"], {}).setdefault(s["fate"], 0)
            fates[s["fusion"]][s["fate"]] += 1
    rows = [
        [
            _code(f),
            str(final.get(f, n)),
            escape(", ".join(f"{k} {fate}" for fate, k in sorted(fates.get(f, {}).items())) or "-"),
            ", ".join(links.get(f, [])) or "-",
        ]
        for f, n in matches.items()
    ]
    out = _table(["fusion", "sites in the compiled graph", "rewrites not left", "where"], rows, numeric=(1,))
    expected = data.get("expected_rms_norm_sites")
    if expected is not None:
        raised = sum(matches.get(f, 0) for f in ("rms_norm", "add_rms_norm"))
        out += f'<p class="none">RMSNorm sites in the model: {int(expected)}; raised: {raised}</p>'
    return out


def _numerics(data: dict[str, Any]) -> str:
    ok = {True: '<span class="ok">yes</span>', False: '<span class="bad">NO</span>'}
    rows = [
        [escape(name), str(i), f"{o['max_abs']:.3g}", f"{o['rel_norm']:.3g}", ok[bool(o["ok"])]]
        for name, check in data.get("numerics", {}).items()
        for i, o in enumerate(check["outputs"])
    ]
    return _table(["compiled", "output", "max abs error", "rel. norm error", "ok"], rows, numeric=(1, 2, 3))


def _ops_changed(data: dict[str, Any]) -> str:
    before, after = data.get("ops_before", {}), data.get("ops_after", {})
    rows = [
        [_code(op), str(before.get(op, 0)), str(after.get(op, 0))]
        for op in sorted(set(before) | set(after))
        if before.get(op, 0) != after.get(op, 0)
    ]
    rows.append(["total", str(sum(before.values())), str(sum(after.values()))])
    return _table(["op", "before", "after"], rows, numeric=(1, 2), total=True)


def _kernels(data: dict[str, Any]) -> str:
    kernels = data.get("kernels", {})
    rows = [
        [escape(name), str(k["generated"]), str(k["fused_ops"]), str(k["extern"])]
        for name, k in kernels.items()
    ]
    out = _table(["compiled", "generated", "fused ops", "extern"], rows, numeric=(1, 2, 3))
    launched = {name: k["launched"] for name, k in kernels.items() if "launched" in k}
    if launched:
        classes = list(next(iter(launched.values())))
        rows = [[escape(n), *(str(c[k]) for k in classes)] for n, c in launched.items()]
        out += _table(["launched (CUDA)", *map(escape, classes)], rows, numeric=tuple(range(1, 1 + len(classes))))
    return out


def _summary(data: dict[str, Any]) -> str:
    errors = "".join(f'<p class="bad">{escape(e)}</p>' for e in data.get("errors", [])) or NONE
    rejected = [
        [_code(r["fusion"], r["spelling"]), _where(r), escape(r["reason"])] for r in data.get("rejected", [])
    ]
    near = [
        [_where(m), _code(m["fusion"], m["spelling"]), f"{int(m['matched'])}/{int(m['total'])}",
         escape(m["reason"])]
        for m in data.get("near_misses", [])
    ]
    left = [
        _card("sites per fusion", _fusions(data)),
        _card("numerical check (per output, against eager)", _numerics(data)),
        _card("errors", errors),
        _card("matched a spelling but not rewritten", _table(["fusion", "where", "reason"], rejected)),
    ]
    right = _card("graph ops that changed (all compiled graphs)", _ops_changed(data))
    if data.get("kernels"):
        right += _card("kernels in the generated code", _kernels(data))
    near_table = _table(["where", "closest spelling", "ops lined up", "first divergence"], near, numeric=(2,))
    return (
        f'<div class="grid"><div class="col">{"".join(left)}</div><div class="col">{right}</div></div>'
        f'<div class="grid">{_card("candidate sites left unfused", near_table, wide=True)}</div>'
    )


def _site(i: int, site: dict[str, Any]) -> str:
    parts = (site["fusion"], site.get("module") or "(root)", site.get("location") or "?")
    title = '<span class="sep"> — </span>'.join(escape(p) for p in parts)
    scalars = "".join(f", {escape(k)}={v:g}" for k, v in site.get("scalars", {}).items())
    removed, added = len(site.get("ops_removed", [])), len(site.get("ops_added", []))
    sub = (
        f"spelling {_code(site['spelling'])}{scalars} · graph {int(site.get('graph', 0))}"
        f" · {removed} ops replaced by {added}"
        + (f" · then {escape(site['fate'])}" if site.get("fate") else "")
    )
    before = region_svg(site.get("before", {}), "before", f"{i}b")
    after = region_svg(site.get("after", {}), "after", f"{i}a")
    return (
        f'<section class="site" id="site-{i}"><h2>{title}</h2><p class="sub">{sub}</p><div class="pair">'
        f"<figure><figcaption>before: the matched region (red: ops removed)</figcaption>{before}</figure>"
        f"<figure><figcaption>after (green: the fused op)</figcaption>{after}</figure></div></section>"
    )


def render_html(data: dict[str, Any]) -> str:
    """The whole report as one HTML page (no scripts, no external resources)."""
    model = escape(str(data.get("model", "?")))
    meta = " · ".join(f"{k} <b>{escape(str(data.get(k, '?')))}</b>" for k in ("model", "device", "dtype"))
    sites = data.get("sites", [])
    body = "".join(_site(i, s) for i, s in enumerate(sites)) or '<p class="none">no site rewritten</p>'
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>fusion-passes diff: {model}</title><style>{CSS}</style></head><body>"
        f'<h1>fusion-passes diff</h1><p class="meta">{meta}</p>{_summary(data)}'
        f"<h2>rewrites ({len(sites)}; {sum(not s.get('fate') for s in sites)} in the compiled graph)</h2>"
        f"{body}</body></html>\n"
    )
