"""Parametrizations whose representative subset runs by default (CI) and the rest in the full
suite (``python -m pytest -m ""``): the others are marked ``slow``, so none stops running."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pytest


def grid(axes: Mapping[str, Mapping[str, Any]], default: Callable[..., bool]) -> list[Any]:
    """One ``pytest.param`` for each combination of the axes' values ({argname: {id: value}}),
    its id the values' ids joined by ``-`` in the order of ``axes`` (as stacked parametrize
    decorators name them: the one nearest the function first). A combination for which
    ``default(**values)`` is false is marked slow."""
    names = list(axes)
    params = []
    for combination in itertools.product(*(axes[name].items() for name in names)):
        values = {name: value for name, (_id, value) in zip(names, combination, strict=True)}
        params.append(
            pytest.param(
                *values.values(),
                id="-".join(str(i) for i, _value in combination),
                marks=() if default(**values) else (pytest.mark.slow,),
            )
        )
    return params


def by_str(values: Sequence[Any]) -> dict[str, Any]:
    """{str(value): value}: the ids pytest gives strings and ints, and ``ids=str`` dtypes."""
    return {str(v): v for v in values}


def models(cases: Sequence[tuple[str, Any]], default: tuple[str, Any]) -> list[Any]:
    """One ``pytest.param(name, dtype)`` per (model name, dtype) case, id ``name-dtype``: the
    ``default`` case runs by default (its compile shared through _compiled_models), the others
    are marked slow."""
    return [
        pytest.param(
            n, d, id=f"{n}-{str(d).removeprefix('torch.')}", marks=() if (n, d) == default else pytest.mark.slow
        )
        for n, d in cases
    ]
