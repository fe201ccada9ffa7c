"""The core's shape: how many lines and of what kind, and what outgrows the size limits.

The core is every module under replaykit/ except the extras (testing, workflow, integrations,
lightning). `python scripts/core_shape.py` prints it and exits 0; tests/core/test_shape.py holds
the limits.
"""

from __future__ import annotations

import ast
import io
import sys
import tokenize
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "replaykit"
EXTRAS = ("testing", "workflow", "integrations", "lightning")
MAX_MODULE_LINES = 700
MAX_FUNCTION_LINES = 60


@dataclass
class Lines:
    total: int = 0
    docstring: int = 0
    comment: int = 0
    blank: int = 0

    @property
    def code(self) -> int:
        return self.total - self.docstring - self.comment - self.blank

    def __iadd__(self, other: Lines) -> Lines:
        self.total += other.total
        self.docstring += other.docstring
        self.comment += other.comment
        self.blank += other.blank
        return self


def core_modules(root: Path = ROOT) -> list[Path]:
    return sorted(
        path for path in root.rglob("*.py") if path.relative_to(root).parts[0] not in EXTRAS
    )


def _docstring_lines(tree: ast.Module) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if (
                body
                and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)
            ):
                lines.update(range(body[0].lineno, body[0].end_lineno + 1))
    return lines


def count_lines(source: str) -> Lines:
    text = source.splitlines()
    docstrings = _docstring_lines(ast.parse(source))
    comments = {
        token.start[0]
        for token in tokenize.generate_tokens(io.StringIO(source).readline)
        if token.type == tokenize.COMMENT and text[token.start[0] - 1].lstrip().startswith("#")
    }
    counted = Lines(total=len(text))
    for number, line in enumerate(text, 1):
        if number in docstrings:
            counted.docstring += 1
        elif number in comments:
            counted.comment += 1
        elif not line.strip():
            counted.blank += 1
    return counted


def long_functions(source: str, limit: int = MAX_FUNCTION_LINES) -> list[tuple[str, int]]:
    """(qualified name, lines) of every function longer than `limit`, decorators excluded."""
    found: list[tuple[str, int]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    length = child.end_lineno - child.lineno + 1
                    if length > limit:
                        found.append((name, length))
                visit(child, name + ".")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return found


def main() -> int:
    total = Lines()
    per_folder: Counter[str] = Counter()
    big_modules: list[tuple[str, int]] = []
    big_functions: list[tuple[str, int]] = []
    disabled_tests = 0
    for path in core_modules():
        source = path.read_text()
        name = path.relative_to(ROOT.parent).as_posix()
        counted = count_lines(source)
        total += counted
        per_folder[path.parent.relative_to(ROOT.parent).as_posix()] += 1
        if counted.total > MAX_MODULE_LINES:
            big_modules.append((name, counted.total))
        big_functions += [(f"{name}:{f}", n) for f, n in long_functions(source)]
        disabled_tests += source.count("in self.disabled")
    print(
        f"core lines: total {total.total}, docstring {total.docstring}, comment {total.comment}, "
        f"blank {total.blank}, code {total.code}"
    )
    print("modules per folder: " + ", ".join(f"{k} {v}" for k, v in sorted(per_folder.items())))
    print(f"modules over {MAX_MODULE_LINES} lines: {big_modules or 'none'}")
    print(f"functions over {MAX_FUNCTION_LINES} lines: {big_functions or 'none'}")
    print(f"`in self.disabled` tests: {disabled_tests}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
