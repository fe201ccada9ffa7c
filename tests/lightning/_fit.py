"""The Lightning tests' quiet ``Trainer`` and their fit of the detection task: each test states
only the Trainer arguments it is about."""

from __future__ import annotations

from typing import Any

import lightning as L

from replaykit.testing.tasks import make_datamodule

#: One epoch on the CPU without logs, checkpoints, progress bar or model summary.
QUIET: dict[str, Any] = {
    "accelerator": "cpu",
    "max_epochs": 1,
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
}


def trainer(**kw: Any) -> L.Trainer:
    """A quiet ``Trainer``; ``kw`` adds to or overrides :data:`QUIET`."""
    return L.Trainer(**{**QUIET, **kw})


def fit_detection(task: L.LightningModule, **kw: Any) -> L.Trainer:
    """``task`` fitted on the detection datamodule by ``trainer(num_sanity_val_steps=0, **kw)``."""
    fitted = trainer(num_sanity_val_steps=0, **kw)
    fitted.fit(task, datamodule=make_datamodule("detection"))
    return fitted
