"""Launch policy as data: the launchers read per-GPU tables (``fusion_passes/lowering/launch_tables.py``)
through ``select``, keyed by the device's name, with a ``"default"`` row for every other GPU and
for the CPU (where the kernels run under Triton's interpreter).

A rule in a GPU's row was adopted where repeated runs on that GPU beat the run-to-run spread; the
evidence (the runs, with their numbers) is in docs/notes/launch-policy.md, which each row names.
"""

from __future__ import annotations

import functools
from typing import Any

import torch


@functools.lru_cache(maxsize=None)
def _cuda_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def device_name(device: torch.device) -> str:
    """The name a launch table is keyed by: the CUDA device's (e.g. "NVIDIA H200"), else its type.
    Cached per device: it is asked on every launch."""
    if device.type != "cuda":
        return device.type
    return _cuda_name(device.index if device.index is not None else torch.cuda.current_device())


def select(table: dict[str, Any], device: torch.device | str) -> Any:
    """The row of ``table`` for ``device`` (a torch.device, or a device name such as
    "NVIDIA H200"): the row whose key the name starts with ("NVIDIA H200" serves "NVIDIA H200
    NVL"), else ``table["default"]``."""
    name = device if isinstance(device, str) else device_name(device)
    for key, row in table.items():
        if key != "default" and name.startswith(key):
            return row
    return table["default"]
