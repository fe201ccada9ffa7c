"""Four tiny training tasks with deterministic synthetic data, for replay-vs-native parity.

>>> model = make_task("detection", optimizer="adamw", ema=0.9)
>>> data = make_datamodule("detection", "partial_between", batch_size=4, seed=0)
"""

from __future__ import annotations

from typing import Any

from replaykit.testing.tasks.base import TaskModule
from replaykit.testing.tasks.data import LAYOUTS, TASK_NAMES, SyntheticDataModule
from replaykit.testing.tasks.detection import DetectionTask
from replaykit.testing.tasks.oriented import OrientedTask
from replaykit.testing.tasks.pose import PoseTask
from replaykit.testing.tasks.segmentation import SegmentationTask

TASKS: dict[str, type[TaskModule]] = {
    "detection": DetectionTask,
    "pose": PoseTask,
    "oriented": OrientedTask,
    "segmentation": SegmentationTask,
}
assert tuple(TASKS) == TASK_NAMES


def make_task(name: str, **kw: Any) -> TaskModule:
    """A fresh task module; ``kw`` go to its constructor (see :class:`TaskModule`)."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; expected one of {', '.join(TASKS)}")
    return TASKS[name](**kw)


def make_datamodule(name: str, layout: str = "contiguous", **kw: Any) -> SyntheticDataModule:
    """The synthetic datamodule of task ``name`` in ``layout`` (one of ``LAYOUTS``)."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; expected one of {', '.join(TASKS)}")
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; expected one of {', '.join(LAYOUTS)}")
    return SyntheticDataModule(name, layout=layout, **kw)


__all__ = [
    "LAYOUTS",
    "TASKS",
    "DetectionTask",
    "OrientedTask",
    "PoseTask",
    "SegmentationTask",
    "SyntheticDataModule",
    "TaskModule",
    "make_datamodule",
    "make_task",
]
