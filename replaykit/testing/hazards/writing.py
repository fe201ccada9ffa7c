"""How a hazard module writes its patterns: one call per pattern, or per capture pattern and its
whole-step twin, stating only what differs (the class, the common loops and the model's
device are filled in), so the catalogue reads as a table of what each pattern is about.

    HC = HazardClass(HAZARD)
    PATTERNS = [
        *HC.twins("numpy_noise_in_forward", "a noise scale drawn from np.random in forward",
                  built(NumpyNoise), looped(steps=5), stepped(steps=6), guard="host_rng"),
    ]

Imports only torch and the hazard catalogue's :mod:`.pattern`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .pattern import Arm, Extras, Pattern, loop, step_loop


def built(cls: Callable[..., nn.Module], *args: Any, **kw: Any) -> Callable[[str], nn.Module]:
    """A pattern's ``make``: ``cls(*args, **kw)`` on the arm's device."""
    return lambda device: cls(*args, **kw).to(device)


Train = Callable[[nn.Module, Arm], Extras]


@dataclass(frozen=True)
class HazardClass:
    """A hazard module's pattern maker: its patterns state only their name, what they do, their
    model, their training and what differs from the defaults; the class is filled in."""

    name: str

    def pattern(
        self, name: str, what: str, make: Callable[[str], nn.Module], train: Train, **kw: Any
    ) -> Pattern:
        return Pattern(name, self.name, what, make, train, **kw)

    def twins(
        self,
        name: str,
        what: str,
        make: Callable[[str], nn.Module],
        train: Train,
        step_train: Train,
        step_what: str | None = None,
        step: dict[str, Any] | None = None,
        **kw: Any,
    ) -> list[Pattern]:
        """A capture pattern and its whole-step twin: ``step_<name>``, ``api="step"``, trained by
        ``step_train``, described as ``step_what`` (default: ``what``, whole step); both share
        ``make`` and ``kw`` (the guard, the notes), ``step`` overrides what only the twin says."""
        return [
            self.pattern(name, what, make, train, **kw),
            self.pattern(
                f"step_{name}",
                step_what or f"{what}, whole step",
                make,
                step_train,
                **{**kw, "api": "step", **(step or {})},
            ),
        ]


def looped(**kw: Any) -> Train:
    """A pattern's ``train``: :func:`loop` with these arguments."""
    return lambda model, arm: loop(model, arm, **kw)


def stepped(**kw: Any) -> Train:
    """A step pattern's ``train``: :func:`step_loop` with these arguments."""
    return lambda model, arm: step_loop(model, arm, **kw)


def each_step(
    before: Callable[[nn.Module, int], None],
) -> Callable[[nn.Module, torch.optim.Optimizer, int], None]:
    """A :func:`loop` ``before(model, step)`` as a :func:`step_loop` one (which also gets the optimizer)."""
    return lambda model, opt, step: before(model, step)
