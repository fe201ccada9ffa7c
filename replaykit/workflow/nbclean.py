"""Keep committed notebooks free of outputs: strip them on save, check them in ``make nbcheck``.

Jupyter autosaves a notebook opened by hand with its outputs into the tracked file; then the
repository's notebooks no longer match what the tests and the packs expect.
``jupyter_server_config.py`` at the repository root calls ``pre_save_hook`` on every save;

    python -m replaykit.workflow.nbclean --check notebooks/*.ipynb   # exit 1 naming the dirty ones
    python -m replaykit.workflow.nbclean notebooks/*.ipynb           # strip them in place
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

__all__ = ["dirty", "pre_save_hook", "strip"]


def strip(nb: Any) -> bool:
    """Remove outputs and execution counts from a notebook (dict or NotebookNode) in place;
    True when anything changed."""
    changed = False
    for cell in nb.get("cells", []):
        if cell.get("cell_type") != "code":
            continue
        if cell.get("outputs") or cell.get("execution_count") is not None:
            changed = True
        cell["outputs"], cell["execution_count"] = [], None
    return changed


def dirty(path: Path) -> bool:
    """True when the notebook at ``path`` carries outputs or execution counts."""
    return strip(json.loads(Path(path).read_text()))


def pre_save_hook(model: dict[str, Any], **_: Any) -> None:
    """Jupyter's ``ContentsManager.pre_save_hook``: a notebook is saved without its outputs."""
    if model.get("type") == "notebook" and isinstance(model.get("content"), dict):
        strip(model["content"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m replaykit.workflow.nbclean", description=__doc__.splitlines()[0]
    )
    ap.add_argument("notebooks", nargs="+", type=Path)
    ap.add_argument(
        "--check", action="store_true", help="change nothing; exit 1 when a notebook has outputs"
    )
    args = ap.parse_args(argv)
    found = [p for p in args.notebooks if dirty(p)]
    if args.check:
        for path in found:
            print(
                f"{path}: carries outputs; run `make nbstrip` (or save it from Jupyter here)",
                file=sys.stderr,
            )
        return 1 if found else 0
    for path in found:
        import nbformat

        nb = nbformat.read(str(path), as_version=4)
        strip(nb)
        nbformat.write(nb, str(path))
        print(f"stripped {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
