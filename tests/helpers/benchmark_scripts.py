"""Importing the scripts of ``benchmarks/`` in tests. They are scripts, not a package, and
import each other by file name as ``python benchmarks/X.py`` would (the script's own folder
first on the path), so a test imports them the same way. The scenario benchmarks sit in
``benchmarks/``, the profilers in ``benchmarks/dev/``; a script's name is unique across both."""

import importlib
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
FOLDERS = (BENCHMARKS, BENCHMARKS / "dev")


def import_benchmark(name: str) -> ModuleType:
    """The module ``benchmarks/<name>.py`` or ``benchmarks/dev/<name>.py`` (and whatever
    benchmark modules it imports), with its folder on ``sys.path`` only while importing."""
    found = [folder for folder in FOLDERS if (folder / f"{name}.py").is_file()]
    if len(found) != 1:
        where = " and ".join(str(f) for f in found) or " or ".join(str(f) for f in FOLDERS)
        raise ImportError(f"benchmark script {name}.py: expected exactly one in {where}, found {len(found)}")
    sys.path.insert(0, str(found[0]))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(found[0]))
