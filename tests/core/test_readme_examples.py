"""The README's Python examples run as written and print what their comments say."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


@pytest.mark.parametrize("name", ["rk.capture", "rk.TrainStep"])
def test_example_runs_and_prints_its_comment(name):
    code = next(b for b in BLOCKS if f"{name}(" in b)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, f"README:{name}", "exec"), {})
    said = re.search(r"print\(.*\)\s+# (\{.*)", code).group(1)
    expected = [p.strip() for p in re.split(r"\.\.\.[,}]?", said) if p.strip()]
    for part in expected:
        part = part.rstrip(",} ").lstrip("{")
        assert part in out.getvalue(), (part, out.getvalue())
