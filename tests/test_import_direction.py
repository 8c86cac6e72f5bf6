"""Imports flow one way: deploy -> serve -> cluster -> kernels; everything may
import resolution; resolution imports no other project package, no torch, no ray."""

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("resolution", "kernels", "cluster", "serve", "deploy")
# Which project packages each package may import.
ALLOWED = {
    "resolution": {"resolution"},
    "kernels": {"kernels", "resolution"},
    "cluster": {"cluster", "kernels", "resolution"},
    "serve": {"serve", "cluster", "kernels", "resolution"},
    "deploy": {"deploy", "serve", "cluster", "kernels", "resolution"},
}
FORBIDDEN_IN_RESOLUTION = {"torch", "ray", "numpy", "transformers", "fastapi", "nixl"}


def _imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
        elif isinstance(node, ast.ImportFrom) and node.level > 0:
            pytest.fail(f"{path}: relative import; use absolute flotilla.* imports")
    return names


def _files(package: str) -> list[Path]:
    return sorted((REPO / package).rglob("*.py"))


@pytest.mark.parametrize("package", PACKAGES)
def test_project_imports_follow_the_layering(package):
    bad = []
    for path in _files(package):
        for name in _imports(path):
            parts = name.split(".")
            if parts[0] in PACKAGES:
                bad.append(f"{path.relative_to(REPO)} imports bare {name}; use flotilla.{name}")
            elif parts[0] == "flotilla" and len(parts) > 1 and parts[1] in PACKAGES:
                if parts[1] not in ALLOWED[package]:
                    bad.append(f"{path.relative_to(REPO)} imports {name}")
    assert not bad, "\n".join(bad)


def test_resolution_imports_no_torch_ray_or_heavy_libraries():
    bad = []
    for path in _files("resolution"):
        for name in _imports(path):
            if name.split(".")[0] in FORBIDDEN_IN_RESOLUTION:
                bad.append(f"{path.relative_to(REPO)} imports {name}")
    assert not bad, "\n".join(bad)


def test_the_checker_sees_the_resolution_sources():
    # Guards the test above against silently scanning nothing.
    assert len(_files("resolution")) > 10
