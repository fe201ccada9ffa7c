#!/usr/bin/env python3
"""`make demo`: run notebooks/parity.ipynb on the device present, then print where it was saved, its tables
(the Lightning scenarios, the model zoo) and its Result (every part counted).

    python scripts/demo.py [--runs-dir runs] [-y '{"tasks": ["detection"]}']
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from replaykit.workflow import tables  # noqa: E402
from replaykit.workflow.evidence import result_text  # noqa: E402
from replaykit.workflow.runs import run_notebook, summary_line  # noqa: E402

COLUMNS = [
    "scenario",
    "arm",
    "expected",
    "equal",
    "ok",
    "recordings",
    "replays",
    "eager_reasons",
    "native_step_ms",
    "arm_step_ms",
]
ZOO_COLUMNS = [
    "model",
    "precision",
    "accumulation",
    "verdict",
    "records",
    "replays",
    "eager",
    "replay_vs_eager",
]


def _number(text: str) -> object:
    """A CSV cell as a float where it is one (so tables round it), else the text."""
    try:
        return float(text) if "." in text else text
    except ValueError:
        return text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--runs-dir", type=Path, default=ROOT / "runs")
    ap.add_argument(
        "-y", "--yaml", default="{}", help='parameters as JSON/YAML, e.g. \'{"device": "cuda"}\''
    )
    args = ap.parse_args(argv)
    result = run_notebook(
        ROOT / "notebooks" / "parity.ipynb", json.loads(args.yaml), runs_dir=args.runs_dir, cwd=ROOT
    )
    print(f"\nsaved: {result.run_dir}")
    for name, columns in (
        ("matrix.csv", COLUMNS),
        ("zoo.csv", ZOO_COLUMNS),
    ):  # what the notebook writes
        table = result.run_dir / name
        if table.exists():
            with table.open() as f:
                rows = [{k: _number(v) for k, v in row.items()} for row in csv.DictReader(f)]
            print(tables.text(rows, [c for c in columns if rows and c in rows[0]]))
    print(summary_line(result.summary))
    print((result.summary.get("results") or {}).get("line", ""))
    print(f"result: {result_text(result.summary)}")
    return 0 if result.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
