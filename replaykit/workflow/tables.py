"""Plain-text and Markdown tables from rows of dicts (no tabulate needed)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any


def _cell(value: Any) -> str:
    if isinstance(value, float):
        # NaN: not measured here (memory off CUDA)
        return "n/a" if math.isnan(value) else f"{value:.3f}"
    if isinstance(value, dict):
        return ", ".join(f"{k}: {v}" for k, v in value.items()) or "-"
    return "" if value is None else str(value)


def markdown(rows: Sequence[dict[str, Any]], cols: Sequence[str]) -> str:
    """A Markdown table of ``cols`` (missing values left blank)."""
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += [
        "| " + " | ".join(_cell(row.get(c)).replace("|", "\\|") for c in cols) + " |"
        for row in rows
    ]
    return "\n".join(lines)


def text(rows: Sequence[dict[str, Any]], cols: Sequence[str]) -> str:
    """An aligned plain-text table of ``cols``."""
    cells = [[_cell(row.get(c)) for c in cols] for row in rows]
    widths = [max([len(c), *(len(r[i]) for r in cells)]) for i, c in enumerate(cols)]
    head = "  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True))
    body = ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)) for r in cells]
    return "\n".join([head, "-" * len(head), *body])
