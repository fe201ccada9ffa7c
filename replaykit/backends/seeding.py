"""Seeding torch's generator inside recorded code is refused, on every backend.

A CUDA capture refuses to reseed the generator it draws from (``set_current_seed`` while
capturing), except to the seed it already has: that reseed is a no-op there, while eager's
resets the generator's offset at every call, so a replay would draw other numbers, silently. A
replay runs no Python either way. :class:`SeedingRefused` makes every such seed a capture failure
(the entry point retires, saying where the code seeded); the emulated tape also refuses a
generator moved past these names (:class:`~replaykit.backends.tape._GeneratorEvents`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any, NoReturn

import torch
import torch.cuda.random
import torch.random

from ..errors import ReplayError

#: seeding by name; ``torch.manual_seed`` and ``torch.seed``, however bound (``from torch import
#: manual_seed``, a library's ``set_seed``), call ``torch.cuda.manual_seed_all`` (a no-op on a CPU)
_SEEDERS = [
    (module, name)
    for module in (torch, torch.random, torch.cuda, torch.cuda.random)
    for name in ("manual_seed", "seed", "manual_seed_all", "seed_all")
    if hasattr(module, name)
]
#: why a seed inside recorded code fails the recording (here, and the tape's generator watch)
WHY_REFUSED = (
    ": a CUDA capture refuses to reseed the generator it draws from, and a replay runs no Python, "
    "so it would not reseed where eager does at every call; seed before the call, or make fixed "
    "noise once outside it"
)
_SEEDING_FILES = ("torch/random.py", "torch/cuda/random.py", "replaykit/backends/seeding.py")


def _seeded_at() -> str:
    """Where the code that seeded is: the innermost frame outside torch's seeding functions."""
    frame = sys._getframe(1)
    while frame and frame.f_code.co_filename.replace(os.sep, "/").endswith(_SEEDING_FILES):
        frame = frame.f_back
    if frame is None:
        return ""
    code = frame.f_code
    return f" at {os.path.basename(code.co_filename)}:{frame.f_lineno} in {code.co_name}"


class SeedingRefused:
    """While a recording runs, seeding torch's generators by name raises, as a CUDA capture does
    (``set_current_seed`` while capturing): a replay runs no Python, so it would not reseed where
    eager does at every call. A same-seed reseed too, which leaves no trace on the generator (CUDA
    lets it through as a no-op). A refusal the code swallowed fails the recording at its end. (The
    tape refuses a generator moved past these names: :class:`.tape._GeneratorEvents`.)"""

    def __init__(self) -> None:
        self.why: str | None = None
        self._saved: list[tuple[Any, str, Any]] = []

    def __enter__(self) -> None:
        self._saved = [(m, n, getattr(m, n)) for m, n in _SEEDERS]
        for module, name in _SEEDERS:
            setattr(module, name, self._refusing(f"{module.__name__}.{name}"))

    def __exit__(self, *exc: object) -> None:
        for module, name, original in reversed(self._saved):
            setattr(module, name, original)
        self._saved = []
        if self.why is not None and (not exc or exc[0] is None):
            raise ReplayError(self.why)

    def _refusing(self, label: str) -> Callable[..., NoReturn]:
        def seeding(*args: Any, **kwargs: Any) -> NoReturn:
            shown = ", ".join([*map(repr, args), *(f"{k}={v!r}" for k, v in kwargs.items())])
            self.why = self.why or (
                f"{label}({shown}) seeds torch's generator inside the recorded code"
                f"{_seeded_at()}{WHY_REFUSED}"
            )
            raise ReplayError(self.why)

        return seeding
