"""replaykit: replay a network's recorded forward+backward in training, bitwise equal to eager.

    import replaykit as rk
    rec = rk.capture(module)   # module(x) now routes: record | replay | eager(reason)
    ...
    rec.journal, rec.counts, rec.eager_reasons, rec.retired, rec.retire_reason
    rec.release()

    step = rk.TrainStep(model, loss_fn, optimizer, max_norm=1.0, accumulate=2)  # the whole step
    loss = step(x, y)          # forward, loss, backward, clip, optimizer: record | replay | eager(reason)

    opt_step = rk.OptimizerStep(optimizer, scaler=scaler)  # the optimizer step alone, after your backward
    opt_step(lambda: (scaler.step(optimizer), scaler.update()))

This package is the core and imports only torch. Beside it: ``replaykit.lightning``
(extra ``lightning``), ``replaykit.testing`` (the parity harness, extra ``testing``) and
``replaykit.workflow`` (notebook verification, extra ``workflow``).
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# what type checkers and IDEs see; at run time ``__getattr__`` imports on first use
if TYPE_CHECKING:
    from .capturing import capture, recorder_of
    from .errors import ReplayError, ReplayWarning
    from .journal import Event, Journal
    from .memory.pool import MemoryPool
    from .optimizer_step import OptimizerStep
    from .protections import PROTECTIONS
    from .recorder import Recorder
    from .step import EMA, TrainStep
    from .verify.determinism import enable_determinism

__all__ = [
    "EMA",
    "PROTECTIONS",
    "Event",
    "Journal",
    "MemoryPool",
    "OptimizerStep",
    "Recorder",
    "ReplayError",
    "ReplayWarning",
    "TrainStep",
    "__version__",
    "capture",
    "enable_determinism",
    "recorder_of",
]

# The package root is lazy so that ``replaykit.workflow`` (no torch) loads
# without the core: a name below is imported from its module the first time it is asked for.
_HOMES = {
    "EMA": "step",
    "PROTECTIONS": "protections",
    "Event": "journal",
    "Journal": "journal",
    "MemoryPool": "memory.pool",
    "OptimizerStep": "optimizer_step",
    "Recorder": "recorder",
    "ReplayError": "errors",
    "ReplayWarning": "errors",
    "TrainStep": "step",
    "capture": "capturing",
    "enable_determinism": "verify.determinism",
    "recorder_of": "capturing",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f".{home}", __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
