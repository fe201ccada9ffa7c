"""The catalogue: every hazard class's patterns, in one list the runner and the notebook read.

Each hazard module holds one class (``HAZARD``), its realistic ``PATTERNS`` and, where some
are still silent differences, its ``KNOWN_LIMITS``. A new class is a new module listed in
``MODULES``; a new pattern is one more entry in its module's ``PATTERNS``.

The patterns of ``replaykit.lightning.whole_step`` (``api="whole_step"``, across the classes)
live in :mod:`.lightning_whole_step`, the one module that uses Lightning (when a pattern runs):
they join the lists where Lightning is installed; importing the catalogue imports no Lightning.
"""

from __future__ import annotations

import importlib.util

from . import (
    autocast,
    autograd_modes,
    backend_diffs,
    crashes,
    hook_order,
    host_state,
    host_values,
    inputs,
    kept_grads,
    kept_outputs,
    leaving_grads,
    lifecycle,
    lightning_whole_step,
    parameters,
    recording_call,
    recurrent,
    side_effects,
    step_python,
    switches,
    two_backwards,
    under_capture,
)
from .pattern import Pattern

MODULES = (
    two_backwards,
    host_values,
    parameters,
    inputs,
    side_effects,
    lifecycle,
    hook_order,
    autocast,
    step_python,
    host_state,
    autograd_modes,
    leaving_grads,
    crashes,
    backend_diffs,
    under_capture,
    switches,
    recording_call,
    recurrent,
    kept_outputs,
    kept_grads,
)


def _lightning() -> tuple[list[Pattern], list[Pattern]]:
    """The whole_step patterns and known limits, or none where Lightning is not installed
    (looked up, not imported: a pattern imports it when it runs)."""
    try:
        installed = importlib.util.find_spec("lightning") is not None
    except ValueError:  # sys.modules["lightning"] is None: blocked
        installed = False
    if not installed:
        return [], []
    return lightning_whole_step.PATTERNS, lightning_whole_step.KNOWN_LIMITS


_WHOLE_STEP, _WHOLE_STEP_LIMITS = _lightning()

HAZARDS: tuple[str, ...] = tuple(m.HAZARD for m in MODULES)

PATTERNS: list[Pattern] = [p for m in MODULES for p in m.PATTERNS] + _WHOLE_STEP

KNOWN_LIMITS: list[Pattern] = [
    p for m in MODULES for p in getattr(m, "KNOWN_LIMITS", [])
] + _WHOLE_STEP_LIMITS
"""Still silent differences (README, Known limits): kept out of ``PATTERNS``; their tests are
strict xfails, so a fix shows up as a test to update."""


def by_hazard(hazard: str) -> list[Pattern]:
    """The catalogue's patterns of one hazard class."""
    if hazard not in HAZARDS:
        raise KeyError(f"unknown hazard {hazard!r}; choose from {HAZARDS}")
    return [p for p in PATTERNS if p.hazard == hazard]


def pattern(name: str) -> Pattern:
    """The catalogue's pattern of this name."""
    for p in PATTERNS:
        if p.name == name:
            return p
    raise KeyError(f"no hazard pattern named {name!r}")
