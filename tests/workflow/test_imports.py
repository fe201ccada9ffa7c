"""The workflow package's modules import one another without a cycle, imports inside functions
included (evidence and seal both read the verdict's words from ``verdict``, not from each other)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "replaykit" / "workflow"
MODULES = {p.stem for p in PACKAGE.glob("*.py")}


def _imported(node: ast.AST) -> set[str]:
    """The workflow modules one import statement (or ``import_module("...")`` call) names."""
    names: set[str] = set()
    if isinstance(node, ast.ImportFrom):
        module = node.module or ""
        if node.level == 1:
            names = {module.split(".")[0]} if module else {a.name for a in node.names}
        elif module.startswith("replaykit.workflow"):
            rest = module.split(".")[2:]
            names = {rest[0]} if rest else {a.name for a in node.names}
    elif isinstance(node, ast.Import):
        names = {
            a.name.split(".")[2] for a in node.names if a.name.startswith("replaykit.workflow.")
        }
    elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "import_module":
        arg = node.args[0] if node.args else None
        if isinstance(arg, ast.Constant) and str(arg.value).startswith("replaykit.workflow."):
            names = {str(arg.value).split(".")[2]}
    return names & MODULES


def graph() -> dict[str, set[str]]:
    out = {}
    for path in PACKAGE.glob("*.py"):
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            found |= _imported(node)
        out[path.stem] = found - {path.stem}
    return out


def cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (``[a, b, a]``), or None."""
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], node, nxt] if nxt in path else [node, nxt]
            if not state.get(nxt) and (found := visit(nxt, [*path, node])):
                return found
        state[node] = 2
        return None

    for start in sorted(edges):
        if not state.get(start) and (found := visit(start, [])):
            return found
    return None


def test_the_workflow_modules_import_without_a_cycle() -> None:
    edges = graph()
    assert "verdict" in edges["seal"] and "verdict" in edges["evidence"]
    assert "evidence" not in edges["seal"]  # the cycle this replaced: seal <-> evidence
    assert cycle(edges) is None, cycle(edges)


def test_the_cycle_finder_finds_one() -> None:
    assert cycle({"evidence": {"seal"}, "seal": {"evidence"}}) is not None
