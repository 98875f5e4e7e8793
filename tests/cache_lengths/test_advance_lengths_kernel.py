"""advance_lengths' Triton kernel (Triton's interpreter on CPU, compiled on CUDA tensors where a GPU
is present) against its reference: several
counters of mixed int dtypes, more than one launch's worth, in place with counters that are their
own starts (or another's), and the one-line errors."""

from __future__ import annotations

import os

import torch  # torch does not import triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    # Chosen before triton is first imported, and only without a GPU: set in a GPU run, it would
    # turn every kernel the same process imports afterwards into an interpreted one.
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

import fusion_passes  # noqa: E402,F401  (registers torch.ops.fusion_passes)
from fusion_passes.lowering.cache_lengths.reference import advance_lengths_reference  # noqa: E402
from fusion_passes.lowering.cache_lengths.triton import PER_LAUNCH, advance_lengths_triton  # noqa: E402


def _counters(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    values = torch.randint(0, 10**6, (n,), generator=g)
    dtypes = [torch.int64 if i % 3 else torch.int32 for i in range(n)]
    return [torch.tensor(int(v), dtype=d, device=DEVICE) for v, d in zip(values, dtypes)]


@pytest.mark.parametrize("n", [1, 2, 5, PER_LAUNCH, PER_LAUNCH + 1, 3 * PER_LAUNCH + 7])
def test_new_tensors_equal_the_reference(n):
    starts, lengths = _counters(n, n), _counters(n, n + 1)
    starts[0] = starts[0].reshape(1)  # a position read off a [1] cache_position
    steps = [1 + i % 5 for i in range(n)]
    out = advance_lengths_triton(starts, lengths, steps)
    expected = advance_lengths_reference(starts, lengths, steps)
    assert all(o.dtype == e.dtype and o.shape == e.shape and torch.equal(o, e) for o, e in zip(out, expected, strict=True))
    assert all(o.data_ptr() != length.data_ptr() for o, length in zip(out, lengths))
    torch.library.opcheck(torch.ops.fusion_passes.advance_lengths.default, (starts, lengths, steps))


@pytest.mark.parametrize("n", [3, PER_LAUNCH + 2])
def test_in_place_each_counter_its_own_start(n):
    """transformers' form: cumulative_length.add_(S), the counter read and written by one launch."""
    counters = _counters(n, 7)
    expected = [c + 2 for c in counters]
    out = advance_lengths_triton(counters, counters, [2] * n, wrap=lambda kernel: kernel)
    assert all(o is c for o, c in zip(out, counters)) and all(torch.equal(c, e) for c, e in zip(counters, expected))


def test_in_place_a_counter_read_as_another_ones_start():
    """Every start is loaded before any counter is stored: a start that is another counter reads its old value."""
    counters = _counters(4, 9)
    old = [c.clone() for c in counters]
    advance_lengths_triton([counters[1], counters[2], counters[3], counters[0]], counters, [1] * 4, wrap=lambda k: k)
    assert [int(c) for c in counters] == [int(old[1]) + 1, int(old[2]) + 1, int(old[3]) + 1, int(old[0]) + 1]


def test_bad_counters_get_a_one_line_error():
    one = torch.tensor(3)
    for starts, lengths, steps, message in (([one], [one, one], [1], "1 starts, 2 lengths"),
                                            ([one], [torch.zeros(2, dtype=torch.int64)], [1], "not one int"),
                                            ([torch.tensor(3.0)], [one], [1], "start 0 is torch.float32"),
                                            ([], [], [], "0 starts")):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            torch.ops.fusion_passes.advance_lengths(starts, lengths, steps)
