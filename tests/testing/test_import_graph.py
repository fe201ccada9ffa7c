"""replaykit has no import cycle: its modules import one another in one direction only.

A cycle works only while its modules are imported in one order (the hazard catalogue once
closed its patterns with imports at the bottom of its largest file, which broke whenever a
module of the cycle was imported first). The graph is read from the source, every import
counted (inside functions too), so it cannot depend on what a test imported before.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "replaykit"
TESTING = PACKAGE / "testing"

#: Pairs of modules whose cycle is known and being removed (each pair's edges are left out).
KNOWN_CYCLES: set[frozenset[str]] = set()


def module_name(path: Path, package: Path) -> str:
    """The dotted name of ``path``, counted from the top package above ``package``."""
    top = package
    while (top.parent / "__init__.py").is_file():
        top = top.parent
    parts = list(path.relative_to(top.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(package: Path) -> dict[str, set[str]]:
    """Each module of ``package`` -> the modules of ``package`` it imports."""
    files = {module_name(p, package): p for p in sorted(package.rglob("*.py"))}
    prefix = module_name(package / "__init__.py", package)
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        is_package = path.name == "__init__.py"
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = name.split(".") if is_package else name.split(".")[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    source = ".".join([*base, *([node.module] if node.module else [])])
                else:
                    source = node.module or ""
                targets = [
                    f"{source}.{a.name}" if f"{source}.{a.name}" in files else source
                    for a in node.names
                ]
            else:
                continue
            edges |= {
                t
                for t in targets
                if t in files and t != name and (t == prefix or t.startswith(prefix + "."))
            }
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (its modules in order, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def test_the_testing_package_has_no_import_cycle() -> None:
    graph = import_graph(TESTING)
    assert "replaykit.testing.hazards.runner" in graph["replaykit.testing.hazards"]
    assert "replaykit.testing.hazards.pattern" in graph["replaykit.testing.hazards.inputs"]
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


def test_the_whole_package_has_no_import_cycle() -> None:
    """The core, its rooms, the harness, the extras and the workflow: imports inside functions count."""
    graph = import_graph(PACKAGE)
    assert "replaykit.route" in graph["replaykit.recorder"]
    assert "replaykit.capturing" in graph["replaykit"]  # the root's TYPE_CHECKING imports count
    for pair in KNOWN_CYCLES:
        a, b = sorted(pair)
        graph[a].discard(b)
        graph[b].discard(a)
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


def test_the_check_sees_a_cycle_closed_by_an_import_at_the_bottom(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "patterns.py").write_text(
        "import torch\nPATTERNS = []\n\nfrom .limits import LIMITS  # noqa: E402\n"
    )
    (package / "limits.py").write_text("from .patterns import PATTERNS\nLIMITS = list(PATTERNS)\n")
    assert find_cycle(import_graph(package)) == ["pkg.limits", "pkg.patterns", "pkg.limits"]
    (package / "patterns.py").write_text("PATTERNS = []\n")
    assert find_cycle(import_graph(package)) is None
