"""Modules of benchmarks/ for the tests: a folder of scripts that import their siblings by name, not a package."""

import importlib
import pathlib
import sys
from types import ModuleType

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


def load(name: str) -> ModuleType:
    """`benchmarks/<name>.py`, imported with benchmarks/ on sys.path (after the rest: it shadows nothing)."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.append(str(BENCHMARKS))
    return importlib.import_module(name)
