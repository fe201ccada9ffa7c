"""replaykit: replay a network's recorded forward+backward in training, bitwise equal to eager.

    import replaykit as rk
    rec = rk.capture(module)   # module(x) now routes: record | replay | eager(reason)
    ...
    rec.journal, rec.counts, rec.eager_reasons, rec.retired, rec.retire_reason
    rec.release()

    step = rk.TrainStep(model, loss_fn, optimizer, max_norm=1.0, accumulate=2)  # the whole step
    loss = step(x, y)          # forward, loss, backward, clip, optimizer: record | replay | eager(reason)

This package is the core and imports only torch. Beside it: ``replaykit.lightning``
(extra ``lightning``), ``replaykit.testing`` (the parity harness, extra ``testing``) and
``replaykit.workflow`` (notebook verification, extra ``workflow``).
"""

from __future__ import annotations

__version__ = "0.1.0"

from .determinism import enable_determinism
from .errors import ReplayError, ReplayWarning
from .journal import Event, Journal
from .protections import PROTECTIONS
from .recorder import Recorder, capture, recorder_of
from .step import EMA, TrainStep

__all__ = [
    "EMA",
    "PROTECTIONS",
    "Event",
    "Journal",
    "Recorder",
    "ReplayError",
    "ReplayWarning",
    "TrainStep",
    "__version__",
    "capture",
    "enable_determinism",
    "recorder_of",
]
