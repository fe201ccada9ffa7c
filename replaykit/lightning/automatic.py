"""The optimizer step under Lightning's automatic optimization, replayed through the precision plugin.

Lightning runs an automatic step as ``LightningOptimizer.step`` -> ``Strategy.optimizer_step``
-> ``Precision.optimizer_step(optimizer, model, closure)``; the closure runs
``training_step`` (``self.log`` and hooks included), ``zero_grad`` and ``backward``. Its
Python must run every step, so the closure stays eager (network replay makes its forward
and backward graphs). What follows it is kernels only: gradient clipping (norm or value),
the GradScaler's step and update, the optimizer's update. That part is one
:class:`~replaykit.optimizer_step.OptimizerStep` recording.

The plugin is the user's own precision plugin with ``optimizer_step`` overridden: a
subclass of its class, created per class, under the same ``__qualname__`` (the checkpoint
key of the plugin's state: a GradScaler's scale) and sharing its state. Per step it runs,
in Lightning's order: the closure; ``on_before_optimizer_step`` hooks (eagerly, seeing the
gradients Lightning shows them); then clipping and the step, replayed. Routed to Lightning's
own code, with a reason in the step's journal: manual optimization, extra ``step`` kwargs,
another optimizer, a closure that skipped backward, an overridden
``configure_gradient_clipping`` (its Python would be frozen), and a GradScaler with a
non-fused optimizer (``scaler.step`` reads ``found_inf`` on the host and unscales before the
hooks).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import lightning as L
from lightning.pytorch.plugins.precision import Precision

from ..optimizer_step import OptimizerStep

_CLASSES: dict[type, type] = {}


def clip_overridden(model: L.LightningModule) -> bool:
    """Whether the module clips with Python of its own (a replay would freeze its decisions)."""
    return (
        type(model).configure_gradient_clipping is not L.LightningModule.configure_gradient_clipping
    )


class ReplayedOptimizerStep:
    """Mixed into the user's precision class: ``optimizer_step`` replays clipping and the update."""

    replaykit_step: OptimizerStep
    _deferred: list[tuple[tuple, dict]] | None = None

    def optimizer_step(  # type: ignore[override]
        self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        native = super().optimizer_step  # type: ignore[misc]
        step = self.replaykit_step
        if not isinstance(model, L.LightningModule) or not model.automatic_optimization:
            return native(optimizer, model, closure, **kwargs)
        result = closure()
        done = lambda: result  # noqa: E731 - the closure already ran: Lightning's code gets its result
        reason = None
        if kwargs:
            reason = f"optimizer.step kwargs {sorted(kwargs)}"
        elif optimizer is not step.optimizer:
            reason = "another optimizer than the one recorded"
        elif result is None:
            reason = "training_step returned None (backward skipped)"
        elif clip_overridden(model):
            reason = "configure_gradient_clipping is overridden: its Python would be frozen"
        elif step.refusal is not None:
            reason = step.refusal
        if reason is not None:
            out: list = []
            step.run_eager(lambda: out.append(native(optimizer, model, done, **kwargs)), reason)
            return out[0]
        self._deferred = []
        try:  # hooks run now, eagerly; the clipping they precede is deferred into the step
            self._after_closure(model, optimizer)  # type: ignore[attr-defined]
            clips, self._deferred = self._deferred, None
        finally:
            self._deferred = None
        scaler = getattr(self, "scaler", None)
        key = tuple(repr(sorted(kw.items())) + repr(args[2:]) for args, kw in clips)

        def body() -> None:
            for args, kw in clips:
                super(ReplayedOptimizerStep, self)._clip_gradients(*args, **kw)  # type: ignore[misc]
            if scaler is not None:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()

        step(body, key)
        return result

    def _clip_gradients(self, *args: Any, **kwargs: Any) -> None:
        if self._deferred is not None:
            self._deferred.append((args, kwargs))
            return
        super()._clip_gradients(*args, **kwargs)  # type: ignore[misc]


def replayed_precision(inner: Precision, step: OptimizerStep) -> Precision:
    """``inner`` with its optimizer step replayed by ``step``: same class name, same state."""
    base = type(inner)
    cls = _CLASSES.get(base)
    if cls is None:
        cls = type(
            base.__name__, (ReplayedOptimizerStep, base), {"__qualname__": base.__qualname__}
        )
        _CLASSES[base] = cls
    plugin = copy.copy(inner)
    plugin.__class__ = cls
    plugin.replaykit_step = step
    return plugin
