"""The protections that make replay equal eager, and the diagnostic switch that turns them off."""

from __future__ import annotations

import warnings
from collections.abc import Iterable

from .errors import ReplayError, ReplayWarning

#: Every protection, by the name ``unsafe_disable`` takes.
PROTECTIONS: tuple[str, ...] = ("copy_out", "hold", "live_outputs", "none_pattern")

_WHAT = {
    "copy_out": "live gradients are not copied out before a replay: accumulation reads overwritten buffers",
    "hold": "forwards replay while a backward is pending: it reads the later forward's activations",
    "live_outputs": "outputs the caller still holds are overwritten by the next replay",
    "none_pattern": "parameters behind unread outputs get zero gradients where eager leaves None",
}


def disabled_protections(names: Iterable[str] | str) -> frozenset[str]:
    """Validate ``unsafe_disable`` and warn once per protection switched off."""
    if isinstance(names, str):
        names = (names,)
    chosen = frozenset(names)
    unknown = sorted(chosen - set(PROTECTIONS))
    if unknown:
        raise ReplayError(f"unknown unsafe_disable name(s) {unknown}; choose from {list(PROTECTIONS)}")
    for name in sorted(chosen):
        warnings.warn(
            f"replaykit: protection {name!r} is disabled ({_WHAT[name]}); results may differ from eager",
            ReplayWarning,
            stacklevel=3,
        )
    return chosen
