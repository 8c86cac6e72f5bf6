"""Importing the scripts of ``benchmarks/`` in tests. They are scripts, not a package, and
import each other by file name as ``python benchmarks/X.py`` would (``benchmarks/`` first on
the path), so a test imports them the same way."""

import importlib
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def import_benchmark(name: str) -> ModuleType:
    """The module ``benchmarks/<name>.py`` (and whatever benchmark modules it imports), with
    ``benchmarks/`` on ``sys.path`` only while importing."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCHMARKS))
