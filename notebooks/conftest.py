"""nbval (`make test`) runs each notebook with its CPU-quick parameters, the Colab simulation's.

nbval cannot inject parameters, so the cell tagged ``parameters`` is edited here, as a user edits it
(``replaykit.workflow.colab.edit_parameters``), before it runs: every cell still runs, on the
smallest selection that reaches it (the committed defaults run the whole hazard catalogue, which
tests/core/hazards already runs pattern by pattern). ``REPLAYKIT_NBVAL_DEFAULTS=1`` runs the
committed defaults instead.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("REPLAYKIT_NBVAL_DEFAULTS") == "1":
        return
    from replaykit.workflow.colab import QUICK, edit_parameters

    for item in items:
        cell = getattr(item, "cell", None)
        if cell is None or "parameters" not in cell.get("metadata", {}).get("tags", []):
            continue
        edit_parameters(SimpleNamespace(cells=[cell]), QUICK[Path(str(item.path)).stem])
