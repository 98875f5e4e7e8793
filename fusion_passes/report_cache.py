"""Report records of graphs compiled before, kept beside Inductor's FX graph cache.

A graph that Inductor serves from its FX graph cache runs no post-grad pass, so the pass manager
never sees it. Its records (sites, rejections, ops before/after) are written here when the graph
is compiled, keyed by the pass manager's uuid and the Dynamo graph with its input metadata, and
replayed into the report on a cache hit.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import torch


def _directory() -> str:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return os.path.join(cache_dir(), "fusion_passes_reports")


def graph_key(uuid: str, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> str:
    h = hashlib.sha256(uuid.encode())
    h.update(gm.code.encode())
    # The records name source lines: the same graph written in another file is another key.
    for node in gm.graph.nodes:
        h.update((node.meta.get("stack_trace") or "").encode())
    for x in example_inputs:
        if isinstance(x, torch.Tensor):
            h.update(repr((tuple(x.shape), x.stride(), x.dtype, x.device.type)).encode())
        else:
            h.update(repr(type(x)).encode())
    return h.hexdigest()


def save(key: str, graphs: list[dict[str, Any]]) -> None:
    path = os.path.join(_directory(), f"{key}.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(graphs, f)
    os.replace(tmp, path)  # atomic: a reader never sees half a file


def load(key: str) -> list[dict[str, Any]] | None:
    try:
        with open(os.path.join(_directory(), f"{key}.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
