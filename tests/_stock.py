"""Shared by the rewrite tests: a site left unfused must give stock Inductor's output."""

from __future__ import annotations

import torch


def assert_as_stock_inductor(fn, args, out) -> None:
    """A site left unfused is lowered back to the model's own ops: the output is stock Inductor's,
    bit for bit (stock Inductor itself is off eager's by its own roundings: up to 1.5 bf16 ulps at
    one element of 192 for some draws, outside the elementwise tolerance)."""
    torch._dynamo.reset()
    with torch.no_grad():
        stock = torch.compile(fn, backend="inductor")(*args)
    for a, s in zip(out, stock, strict=True):
        assert torch.equal(a, s)
