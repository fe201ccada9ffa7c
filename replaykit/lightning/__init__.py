"""``ReplayCallback``: replay submodules of a LightningModule inside ordinary ``Trainer.fit``.

    cb = ReplayCallback("net", backend="auto", optimizer_step=True, **capture_kwargs)
    trainer = L.Trainer(callbacks=[cb], accumulate_grad_batches=2, precision="16-mixed")
    trainer.fit(model, datamodule)
    cb.recorders["net"].journal

The recorders are made when a fit starts (after the strategy has moved the model to
its device) and released when it ends, so the modules' ``forward`` is restored and
graphs and pools are freed; ``cb.recorders`` keeps the last fit's recorders for their
journals. Everything Lightning does around the network stays native: the loss, AMP's
autocast and GradScaler (a skipped overflow step included), gradient clipping,
accumulation (also changed between or during fits), schedulers, validation (eval mode
routes eager), checkpoints.

``optimizer_step=True`` (automatic optimization) replays the optimizer step too: gradient
clipping, the GradScaler's step and update and the optimizer's update become one more
recording (:mod:`replaykit.lightning.automatic`); ``cb.optimizer_step`` is its
:class:`~replaykit.optimizer_step.OptimizerStep` with its journal. A dict instead of True
passes arguments to it (``{"unsafe_disable": [...]}``).
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from torch import nn

from ..capturing import capture
from ..errors import ReplayError
from ..guards.distributed import is_ddp
from ..optimizer_step import OptimizerStep
from ..recorder import Recorder


def resolve(root: nn.Module, path: str) -> nn.Module:
    """The submodule at a dotted attribute path (``"net"``, ``"model.backbone"``)."""
    module: Any = root
    for part in path.split("."):
        if not hasattr(module, part):
            raise ReplayError(
                f"{type(root).__name__} has no attribute path {path!r} (stopped at {part!r})"
            )
        module = getattr(module, part)
    if not isinstance(module, nn.Module):
        raise ReplayError(f"{path!r} is a {type(module).__name__}, not an nn.Module")
    return module


def callable_module(path: str, module: nn.Module) -> nn.Module:
    """``module`` if it has a forward of its own; a container without one (``nn.ModuleDict``,
    ``nn.ModuleList``) is never called itself (its children are), so capturing it would replay
    nothing and say nothing: raise, naming the children to capture instead.

    Not its children captured silently in its place: which of them run, how often per step and
    with which arguments is the user's model, and each becomes a recorder with its own journal.
    """
    if type(module).forward is not nn.Module.forward:
        return module
    children = [f"{path}.{name}" for name, _ in module.named_children()]
    example = ", ".join(repr(c) for c in children[:3]) or f"'{path}.<child>'"
    raise ReplayError(
        f"{path!r} is a {type(module).__name__} without a forward of its own: its children are "
        f"called, never it, so nothing would be recorded. Name the children: ReplayCallback({example})"
    )


#: Strategies under which replay keeps parity: one device, and DDP (gradients reach the
#: parameters' AccumulateGrad nodes as in eager, so DDP's hooks all-reduce them unchanged).
SUPPORTED_STRATEGIES = ("SingleDeviceStrategy", "DDPStrategy")


def unsupported(trainer: L.Trainer) -> str | None:
    """Why replay must not run under this trainer's configuration, or None."""
    strategy = type(trainer.strategy).__name__
    if strategy not in SUPPORTED_STRATEGIES:
        return (
            f"strategy {strategy} is not supported (supported: {', '.join(SUPPORTED_STRATEGIES)})"
        )
    if (
        "bf16" in str(trainer.precision)
        and trainer.strategy.root_device.type == "cuda"
        and not torch.cuda.is_bf16_supported()
    ):
        return "bf16-mixed: this GPU has no bf16 support"
    return None


class ReplayCallback(L.Callback):
    """Record and replay the named submodules during every ``fit``."""

    def __init__(
        self,
        *paths: str,
        backend: str = "auto",
        optimizer_step: bool | dict[str, Any] = False,
        **capture_kwargs: Any,
    ) -> None:
        if not paths:
            raise ReplayError(
                "ReplayCallback needs at least one attribute path, e.g. ReplayCallback('net')"
            )
        if len(set(paths)) != len(paths):
            raise ReplayError(f"duplicate paths in {paths}")
        self.paths = paths
        self.capture_kwargs = {"backend": backend, **capture_kwargs}
        self.recorders: dict[str, Recorder] = {}
        self.fits = 0
        self.step_kwargs: dict[str, Any] | None = (
            None
            if optimizer_step is False
            else {
                "backend": backend,
                **(optimizer_step if isinstance(optimizer_step, dict) else {}),
            }
        )
        #: the last fit's replayed optimizer step (``optimizer_step=True``); None when it could not be set up
        self.optimizer_step: OptimizerStep | None = None
        #: why the optimizer step is not replayed in the last fit, or None
        self.optimizer_step_refusal: str | None = None
        self._native_precision: Any = None
        self._trainer: Any = None

    @property
    def state_key(self) -> str:
        return f"ReplayCallback{self.paths}"

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._release()
        modules = {path: callable_module(path, resolve(pl_module, path)) for path in self.paths}
        self.recorders = {
            path: capture(module, **self.capture_kwargs) for path, module in modules.items()
        }
        self.fits += 1
        reason = unsupported(trainer)
        if reason is not None:  # the same on every rank: no rank replays while another runs eager
            for rec in self.recorders.values():
                rec.retire(reason)
        if self.step_kwargs is not None:
            self._install_step(trainer, pl_module, reason)

    def _install_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, unsupported_reason: str | None
    ) -> None:
        """Put the replaying precision plugin in place of the trainer's for this fit."""
        from .automatic import replayed_precision

        self.optimizer_step, self.optimizer_step_refusal = None, None
        optimizers = trainer.optimizers
        if not pl_module.automatic_optimization:
            why = "manual optimization: use whole_step for the whole step"
        elif len(optimizers) != 1:
            why = f"{len(optimizers)} optimizers: the replayed optimizer step takes one"
        else:
            why = unsupported_reason
        if why is not None:
            self.optimizer_step_refusal = why
            return
        native = trainer.strategy.precision_plugin
        self.optimizer_step = OptimizerStep(
            optimizers[0],
            scaler=getattr(native, "scaler", None),
            name=f"ReplayCallback optimizer step ({type(optimizers[0]).__name__})",
            **self.step_kwargs,
        )
        self._native_precision, self._trainer = native, trainer
        trainer.strategy.precision_plugin = replayed_precision(native, self.optimizer_step)

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._release()

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._release()  # also after an exception inside fit

    def _release(self) -> None:
        for rec in self.recorders.values():
            rec.release()
        if self.optimizer_step is not None:
            self.optimizer_step.release()
        if self._trainer is not None:  # the trainer gets its own precision plugin back
            self._trainer.strategy.precision_plugin = self._native_precision
            self._trainer = self._native_precision = None

    def summary(self) -> dict[str, dict]:
        """Each recorder's journal summary and retirement (and the optimizer step's), for tables."""
        out = {
            path: {**rec.journal.summary(), "retired": rec.retire_reason}
            for path, rec in self.recorders.items()
        }
        if self.optimizer_step is not None:
            step = self.optimizer_step
            out["optimizer_step"] = {**step.journal.summary(), "retired": step.retire_reason}
        elif self.optimizer_step_refusal is not None:
            out["optimizer_step"] = {"refused": self.optimizer_step_refusal}
        return out


def whole_step(
    pl_module: L.LightningModule, net: nn.Module, loss_fn: Any, **step_kwargs: Any
) -> Any:
    """A :class:`~replaykit.step.TrainStep` for a LightningModule in manual optimization.

    Lightning's automatic optimization runs ``training_step`` (with ``self.log``'s host-side
    bookkeeping) inside a closure that the precision plugin calls from ``optimizer.step``;
    a graph would freeze that Python (under automatic optimization,
    ``ReplayCallback(..., optimizer_step=True)`` replays the network and the optimizer step as
    separate graphs around it). One graph for the whole step lives in ``training_step``::

        def __init__(self):
            super().__init__()
            self.automatic_optimization = False

        def on_train_start(self):
            self.step = whole_step(self, self.net, loss_fn, max_norm=1.0, accumulate=2)

        def training_step(self, batch, batch_idx):
            loss = self.step(batch)
            self.log("train_loss", loss)

    Each optimizer step (replayed or eager) ticks the LightningOptimizer's progress, so
    ``global_step``, ``max_steps`` and step-based checkpoints count as they would.
    Precision, scaler and clipping are the TrainStep's (``precision=``, ``scaler=``,
    ``max_norm=``), not the Trainer's: keep ``Trainer(precision="32")``.

    Under ``Trainer(strategy="ddp")`` the same code trains every rank: Lightning runs
    ``training_step`` inside DDP's forward (left as Lightning runs it), and the step is
    ``TrainStep(net, ..., ddp=trainer.strategy.model)``: it repeats DDP's gradient all-reduce
    between its two graphs, with ``no_sync`` on accumulation micro-batches, every rank agreeing
    on each call's route (:func:`ddp_wrapper`). Bitwise equal to native Lightning
    manual-optimization DDP (``manual_backward``, ``block_backward_sync``), rank by rank
    (:mod:`replaykit.testing.parity.lightning_ddp_step`). Other strategies raise ReplayError.
    """
    from ..step import TrainStep

    if pl_module.automatic_optimization:
        raise ReplayError(
            "whole_step needs manual optimization: set self.automatic_optimization = False"
        )
    trainer = getattr(pl_module, "_trainer", None)
    if trainer is not None and type(trainer.strategy).__name__ != "SingleDeviceStrategy":
        step_kwargs = {**step_kwargs, "ddp": ddp_wrapper(trainer.strategy, pl_module)}
    lopt = pl_module.optimizers()
    if isinstance(lopt, list):
        raise ReplayError("whole_step takes one optimizer; this module configures several")

    def tick() -> None:  # what LightningOptimizer.step does around the optimizer's own step
        lopt._on_before_step()
        lopt._on_after_step()

    return TrainStep(net, loss_fn, lopt.optimizer, on_optimizer_step=tick, **step_kwargs)


def ddp_wrapper(strategy: Any, pl_module: L.LightningModule) -> nn.Module:
    """The DDP wrapper whose reduction a whole step repeats under Lightning's DDP strategy.

    Lightning runs ``training_step`` inside DDP's forward (its buffer broadcast and bucket
    rebuild stay Lightning's) and, in manual optimization, keeps that forward from arming the
    reducer: ``manual_backward`` arms it. So the step runs ``net`` and arms the reducer before its
    eager backward as ``manual_backward`` would; a replay runs the reducer's all-reduce between
    its graphs. Another strategy, or a Lightning whose DDP forward arms the reducer around
    ``training_step`` (a captured backward would fire its hooks), is refused.
    """
    name = type(strategy).__name__
    model = getattr(strategy, "model", None)
    redirection = type(getattr(strategy, "_forward_redirection", None)).__name__
    if name != "DDPStrategy":
        why = "not supported (SingleDeviceStrategy and DDPStrategy are)"
    elif not is_ddp(model) or model.module is not pl_module:
        why = "its model is not a DistributedDataParallel around this LightningModule"
    elif redirection != "_DDPForwardRedirection":
        why = (
            "this Lightning's DDP forward around training_step does not leave the reducer to "
            "manual_backward, so a captured backward would fire its hooks"
        )
    else:
        return model
    raise ReplayError(
        f"whole_step under {name}: {why}. Use ReplayCallback(..., optimizer_step=True) with "
        "automatic optimization, or rk.TrainStep(ddp_model, ...) in a plain torch.distributed loop"
    )
