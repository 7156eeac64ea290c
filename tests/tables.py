"""The suite's representative subsets of its heavy parametrization tables; the full tables by hand.

`MOEJAX_TESTS_FULL=1 python -m pytest tests/...` runs every table in full (as `MOEJAX_CUDA_COMPILE_ALL=1` does for
tests/test_cuda_compile.py). Without it the suite runs the subsets: each case compiles new programs (suite time),
and each subset keeps every value of every axis of its table (each test says which pairs it keeps and why).
"""

import itertools
import os

FULL = os.environ.get("MOEJAX_TESTS_FULL") == "1"


def table(axes: dict[str, list], suite: list[tuple]) -> list[tuple]:
    """The product of `axes` (their values, in order) under MOEJAX_TESTS_FULL=1, else the `suite` cases.

    Raises:
      ValueError: a suite case that is not in the product, or a value of an axis that no suite case takes.
    """
    full = list(itertools.product(*axes.values()))
    if stray := [case for case in suite if case not in full]:
        raise ValueError(f"suite cases not in the table of {list(axes)}: {stray}")
    for i, (name, values) in enumerate(axes.items()):
        if missing := set(values) - {case[i] for case in suite}:
            raise ValueError(f"axis {name!r}: no suite case takes {sorted(missing, key=str)}")
    return full if FULL else list(suite)
