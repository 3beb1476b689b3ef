"""Which cases of a long parametrized test run in the quick suite (`make test`).

The quick suite keeps one or a few cases of each test that covers many; the rest are marked
slow, so `make test-slow` and CI still run every case."""

from collections.abc import Callable, Collection, Iterable
from typing import Any

import pytest


def quick(cases: Iterable[Any], keep: Collection[Any] | Callable[[Any], bool]) -> list:
    """`cases` as pytest params, those not kept marked slow. `keep`: the cases to keep quick,
    or a predicate on a case; a tuple case spreads over the test's argument names."""
    kept = keep if callable(keep) else keep.__contains__
    return [
        pytest.param(
            *(c if isinstance(c, tuple) else (c,)), marks=() if kept(c) else pytest.mark.slow
        )  # fmt: skip
        for c in cases
    ]
