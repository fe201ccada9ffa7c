"""replaykit: replay a network's recorded forward+backward in training, bitwise equal to eager.

    import replaykit as rk
    rec = rk.capture(module)   # module(x) now routes: record | replay | eager(reason)
    ...
    rec.journal, rec.counts, rec.eager_reasons, rec.retired, rec.retire_reason
    rec.release()

The names below load on first use, so the workflow tools (``replaykit.runs``,
``replaykit.pack``, ``replaykit.verify`` ...) start without importing torch.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "PROTECTIONS": "protections",
    "Event": "journal",
    "Journal": "journal",
    "Recorder": "recorder",
    "ReplayError": "errors",
    "ReplayWarning": "errors",
    "capture": "recorder",
    "recorder_of": "recorder",
}

__all__ = [  # noqa: RUF022 - the public names, then the version
    "PROTECTIONS", "Event", "Journal", "Recorder", "ReplayError", "ReplayWarning", "capture", "recorder_of",
    "__version__",
]

if TYPE_CHECKING:
    from .errors import ReplayError, ReplayWarning
    from .journal import Event, Journal
    from .protections import PROTECTIONS
    from .recorder import Recorder, capture, recorder_of


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'replaykit' has no attribute {name!r}")
    value = getattr(import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value
