"""docs/structure.md stays true: every module it names exists, and every module is named.

The doc has one ``## <package>/`` section per package, whose tables name modules relative to
that package (``engine/scheduler.py`` in ``cluster/``); a path that starts with a top-level
folder (``tests/helpers/nodes.py``) is relative to the repository root, wherever it appears.
A folder named with a trailing slash (``rules/``) covers every module under it.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("resolution", "kernels", "cluster", "serve", "deploy")
TOP_LEVEL = PACKAGES + ("tests", "benchmarks", "docs", "shared")
# Backticked names: module paths, folders, globs.
NAME = re.compile(r"`([\w./*-]+)`")


def _sections() -> dict[str, str]:
    """Heading -> body of each ``## `` section of structure.md (the intro under ``""``)."""
    text = (ROOT / "docs" / "structure.md").read_text()
    parts = re.split(r"^## ", text, flags=re.M)
    sections = {"": parts[0]}
    for part in parts[1:]:
        heading, _, body = part.partition("\n")
        sections[heading.strip()] = body
    return sections


def _package_of(heading: str) -> str | None:
    first = heading.split()[0] if heading else ""
    name = first.rstrip("/")
    return name if first.endswith("/") and name in PACKAGES else None


def _resolve(name: str, package: str | None) -> Path | None:
    """The path a backticked module name points at, or None when it is not a module path."""
    if not name.endswith(".py") or "*" in name:
        return None
    if name.split("/")[0] in TOP_LEVEL:
        return ROOT / name
    if package is None:
        return None  # a bare module name in prose outside a package section
    return ROOT / package / name


def test_every_module_structure_md_names_exists():
    stale = []
    for heading, body in _sections().items():
        package = _package_of(heading)
        for name in NAME.findall(body):
            path = _resolve(name, package)
            if path is not None and not path.exists():
                stale.append(f"{heading or 'intro'}: {name}")
    assert not stale, "docs/structure.md names modules that do not exist:\n" + "\n".join(stale)


def test_every_module_is_in_structure_md():
    sections = _sections()
    undocumented = []
    for package in PACKAGES:
        body = next(b for h, b in sections.items() if _package_of(h) == package)
        names = set(NAME.findall(body))
        for path in sorted((ROOT / package).rglob("*.py")):
            if path.name == "__init__.py" or "__pycache__" in path.parts:
                continue
            parts = path.relative_to(ROOT / package).parts
            rel = "/".join(parts)
            folders = {"/".join(parts[:i]) + "/" for i in range(1, len(parts))}
            if rel not in names and not folders & names:
                undocumented.append(f"{package}/{rel}")
    assert not undocumented, (
        "modules missing from docs/structure.md (add a row to their package's table):\n"
        + "\n".join(undocumented)
    )
