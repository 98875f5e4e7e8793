"""Plain-torch reference of ``advance_lengths``: a decode step's cache write counters advanced.

transformers' StaticCache layers count the tokens written into them in a 0-d int64 tensor each
(``cumulative_length``; DeepSeek V3.2's indexer keeps a second one), advanced in place by every
update: ``cumulative_length.add_(S)``. Functionalized, each is ``new = start + S`` copied into the
counter at the step's end (``start`` the counter itself, or the position an engine sets it from).

    new_lengths[i] = starts[i] + steps[i]      (in lengths[i]'s dtype)
"""

from __future__ import annotations

import torch

LENGTH_DTYPES = (torch.int64, torch.int32)


def check_advance_lengths_args(starts: list[torch.Tensor], lengths: list[torch.Tensor], steps: list[int]) -> None:
    """Raise a one-line ValueError for arguments the op does not define."""
    if not (len(starts) == len(lengths) == len(steps)) or not lengths:
        raise ValueError(f"advance_lengths: {len(starts)} starts, {len(lengths)} lengths and {len(steps)} steps")
    for i, (start, length) in enumerate(zip(starts, lengths)):
        if length.numel() != 1 or length.dtype not in LENGTH_DTYPES:
            raise ValueError(f"advance_lengths: length {i} is {length.dtype} {tuple(length.shape)}, not one int")
        if start.numel() != 1 or start.dtype not in LENGTH_DTYPES:
            raise ValueError(f"advance_lengths: start {i} is {start.dtype} {tuple(start.shape)}, not one int")
        if start.device != length.device:
            raise ValueError(f"advance_lengths: start {i} on {start.device}, its length on {length.device}")


def advance_lengths_reference(starts: list[torch.Tensor], lengths: list[torch.Tensor], steps: list[int]) -> list[torch.Tensor]:
    """The new value of each length: its start plus its step, in the length's dtype and shape."""
    return [
        (start.reshape(()) + step).to(length.dtype).reshape(length.shape)
        for start, length, step in zip(starts, lengths, steps, strict=True)
    ]
