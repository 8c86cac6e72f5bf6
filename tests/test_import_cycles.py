"""No import cycles among flotilla's modules, counting every import: at module level, inside
functions and under ``TYPE_CHECKING`` (an import moved into a function to dodge a cycle is
still a cycle). The graph is built from the source with ``ast``; nothing is imported. A
package's ``__init__`` importing its own submodules (re-exporting them) is not an edge."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("resolution", "kernels", "cluster", "serve", "deploy")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(["flotilla", *parts])


def import_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports (the longest module prefix of each name)."""
    files = {module_name(p): p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))}

    def known(name: str) -> str | None:
        parts = name.split(".")
        for end in range(len(parts), 1, -1):
            if ".".join(parts[:end]) in files:
                return ".".join(parts[:end])
        return None

    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([base] if base else []))
                names = [base] + [f"{base}.{alias.name}" for alias in node.names]
            for name in names:
                target = known(name)
                # NOTE: a package's __init__ importing its own submodules is how it re-exports,
                # not a cycle (the before-stop hook counts the same way).
                own_child = path.name == "__init__.py" and target is not None and target.startswith(module + ".")
                if target is not None and target != module and not own_child:
                    edges.add(target)
        graph[module] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_graph_sees_every_kind_of_import():
    graph = import_graph()
    # NOTE: a function-level import (app.py's of the engine replica) and a plain one both count.
    assert "flotilla.serve.engine_replica" in graph["flotilla.serve.app"]
    assert "flotilla.resolution.fields" in graph["flotilla.resolution.args"]
    assert len(graph) > 200


def test_no_import_cycles():
    found = cycles(import_graph())
    assert not found, "import cycles (move the shared names to a small module both sides import):\n" + "\n".join(
        " <-> ".join(c) for c in found
    )
