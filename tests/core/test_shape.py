"""The core's size limits (structure, not timing): no function over 60 lines, no module over 700."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "core_shape.py"
_spec = importlib.util.spec_from_file_location("core_shape", _SCRIPT)
assert _spec is not None and _spec.loader is not None
shape = sys.modules["core_shape"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(shape)


def test_no_core_function_over_60_lines() -> None:
    found = {
        f"{path.name}:{name}": n
        for path in shape.core_modules()
        for name, n in shape.long_functions(path.read_text())
    }
    assert not found, f"core functions over {shape.MAX_FUNCTION_LINES} lines: {found}"


def test_no_core_module_over_700_lines() -> None:
    found = {
        path.name: n
        for path in shape.core_modules()
        if (n := len(path.read_text().splitlines())) > shape.MAX_MODULE_LINES
    }
    assert not found, f"core modules over {shape.MAX_MODULE_LINES} lines: {found}"


def test_the_limits_see_a_long_function() -> None:
    """The counter finds a long method (the test above could not fail if it found none)."""
    body = "\n".join(f"        x = {i}" for i in range(61))
    assert shape.long_functions(f"class A:\n    def f(self):\n{body}\n") == [("A.f", 62)]
