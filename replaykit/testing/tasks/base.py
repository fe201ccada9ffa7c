"""What the four tasks share: the training loop around ``net``, optimizers, LR schedules, EMA.

A task is a LightningModule whose network is ``self.net``: ``net(x)`` maps one image batch
to a dict of head outputs, with no side effects and no host syncs, so a replay callback can
capture exactly ``net``. The loss is computed outside ``net``, from its outputs and the batch.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from torch import nn

from replaykit.testing.tasks.data import Batch

OPTIMIZERS = ("sgd", "adamw", "sgd-fused", "adamw-fused")
#: Diagnostic probes for the parity harness: each makes one replay protection matter.
PROBES = (None, "two_forwards", "keep_outputs", "drop_head")
SCHEDULERS = (None, "step", "cosine")


def conv_bn(c_in: int, c_out: int, stride: int = 1) -> nn.Sequential:
    """3x3 convolution, BatchNorm, ReLU."""
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU()
    )


def backbone(c_in: int, width: int) -> nn.Sequential:
    """Two stride-2 stages and one stride-1 stage: output stride 4, ``width`` channels."""
    return nn.Sequential(
        conv_bn(c_in, width // 2, 2), conv_bn(width // 2, width, 2), conv_bn(width, width)
    )


class TaskModule(L.LightningModule):
    """Shared Lightning loop: loss and logging, optimizer, LR schedule, EMA of ``net``.

    Subclasses set ``self.net`` and implement :meth:`losses` (named loss terms, summed into
    the training loss) and :meth:`metrics` (validation metrics).

    Args:
        lr: learning rate.
        optimizer: ``"sgd"`` (momentum 0.9) or ``"adamw"``, ``-fused`` for the fused step with a tensor lr; weights of conv/linear layers
            get ``weight_decay``, biases and norms none (two parameter groups).
        weight_decay: see ``optimizer``.
        scheduler: None, ``"step"`` (halve every ``sched_period // 2`` steps) or
            ``"cosine"`` (period ``sched_period``); stepped once per optimizer step.
        sched_period: see ``scheduler``.
        sched_interval: ``"step"`` or ``"epoch"``: when Lightning steps the scheduler.
        ema: None, or the decay of an exponential moving average of ``net.state_dict()``,
            updated after each batch on which the optimizer stepped. Kept in ``ema_state``.
        channels_last: feed ``net`` channels-last inputs.
        probe: None, or a parity-harness probe: ``"two_forwards"`` (a second forward of
            ``net`` before the backward), ``"keep_outputs"`` (every batch's outputs kept in
            ``kept_outputs``), ``"drop_head"`` (the loss reads no gradient from the last head).
        overflow_step: at this optimizer step, scale the loss so fp16 gradients overflow.
    """

    net: nn.Module

    def __init__(
        self,
        *,
        lr: float = 0.01,
        optimizer: str = "sgd",
        weight_decay: float = 1e-4,
        scheduler: str | None = None,
        sched_period: int = 4,
        sched_interval: str = "step",
        ema: float | None = None,
        channels_last: bool = False,
        probe: str | None = None,
        overflow_step: int | None = None,
    ) -> None:
        super().__init__()
        if probe not in PROBES:
            raise ValueError(f"unknown probe {probe!r}; expected one of {PROBES}")
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {optimizer!r}; expected one of {OPTIMIZERS}")
        if scheduler not in SCHEDULERS:
            raise ValueError(f"unknown scheduler {scheduler!r}; expected one of {SCHEDULERS}")
        if ema is not None and not 0.0 < ema < 1.0:
            raise ValueError(f"ema decay must be in (0, 1), got {ema}")
        self.save_hyperparameters()
        self.lr, self.optimizer_name, self.weight_decay = lr, optimizer, weight_decay
        self.scheduler_name, self.sched_period = scheduler, sched_period
        if sched_interval not in ("step", "epoch"):
            raise ValueError(f"sched_interval must be 'step' or 'epoch', got {sched_interval!r}")
        self.sched_interval = sched_interval
        self.ema_decay, self.channels_last = ema, channels_last
        self.ema_state: dict[str, torch.Tensor] | None = None
        self.probe, self.overflow_step = probe, overflow_step
        self.kept_outputs: list[dict[str, torch.Tensor]] = []
        self._steps_at_batch_start = 0

    # -- the task's own parts -------------------------------------------------------------

    def losses(self, out: dict[str, torch.Tensor], batch: Batch) -> dict[str, torch.Tensor]:
        """Named loss terms; the training loss is their sum."""
        raise NotImplementedError

    def metrics(self, out: dict[str, torch.Tensor], batch: Batch) -> dict[str, torch.Tensor]:
        """Named validation metrics (logged with a ``val_`` prefix)."""
        raise NotImplementedError

    # -- the loop ---------------------------------------------------------------------------

    def image(self, batch: Batch) -> torch.Tensor:
        """The batch's image, converted to channels-last when the task asks for it."""
        x = batch["image"]
        return x.contiguous(memory_format=torch.channels_last) if self.channels_last else x

    def loss(self, out: dict[str, torch.Tensor], batch: Batch) -> tuple[torch.Tensor, dict]:
        """The summed loss and its terms, computed in float32 from ``net``'s outputs."""
        parts = self.losses({k: v.float() for k, v in out.items()}, batch)
        return torch.stack(list(parts.values())).sum(), parts

    def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        x = self.image(batch)
        out = self.net(x)
        if self.probe == "keep_outputs":
            self.kept_outputs.append(out)
        elif self.probe == "drop_head":
            last = sorted(out)[-1]
            out = {k: v.detach() if k == last else v for k, v in out.items()}
        loss, parts = self.loss(out, batch)
        if self.probe == "two_forwards":
            extra = self.net(x.flip(0))  # before the first forward's backward
            loss = (
                loss + 0.01 * torch.stack([o.float().square().mean() for o in extra.values()]).sum()
            )
        if self.overflow_step is not None and self.trainer.global_step == self.overflow_step:
            loss = loss * 1e12  # fp16 gradients overflow: GradScaler skips the step and backs off
        n = x.shape[0]
        self.log("train_loss", loss, batch_size=n)
        for name, value in parts.items():
            self.log(f"train_{name}", value, batch_size=n)
        return loss

    def validation_step(self, batch: Batch, batch_idx: int) -> None:
        x = self.image(batch)
        out = self.net(x)
        loss, _ = self.loss(out, batch)
        n = x.shape[0]
        self.log("val_loss", loss, batch_size=n)
        for name, value in self.metrics({k: v.float() for k, v in out.items()}, batch).items():
            self.log(f"val_{name}", value, batch_size=n)

    def configure_optimizers(self) -> Any:
        decay, no_decay = [], []
        for module in self.net.modules():
            for name, p in module.named_parameters(recurse=False):
                is_weight = name == "weight" and isinstance(
                    module, nn.Conv2d | nn.ConvTranspose2d | nn.Linear
                )
                (decay if is_weight else no_decay).append(p)
        groups = [
            {"params": decay, "weight_decay": self.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        groups = [g for g in groups if g["params"]]
        # "-fused": a fused step with a tensor lr, which a scheduler updates in place (a recorded
        # optimizer step reads it at every replay; a float lr is baked into the recording)
        fused = self.optimizer_name.endswith("-fused")
        kw: dict[str, Any] = (
            {"fused": True, "lr": torch.tensor(self.lr, device=self.device)}
            if fused
            else {"lr": self.lr}
        )
        if self.optimizer_name.startswith("sgd"):
            opt: torch.optim.Optimizer = torch.optim.SGD(groups, momentum=0.9, **kw)
        else:
            opt = torch.optim.AdamW(groups, **kw)
        if self.scheduler_name is None:
            return opt
        if self.scheduler_name == "step":
            sched: Any = torch.optim.lr_scheduler.StepLR(
                opt, step_size=max(1, self.sched_period // 2), gamma=0.5
            )
        else:
            sched = torch.optim.lr_scheduler.CosineAnnealingLR(
                opt, T_max=self.sched_period, eta_min=self.lr * 0.01
            )
        return {
            "optimizer": opt,
            "lr_scheduler": {"scheduler": sched, "interval": self.sched_interval},
        }

    # -- EMA ----------------------------------------------------------------------------------

    def on_fit_start(self) -> None:
        if self.ema_decay is None:
            return
        if self.ema_state is None:
            self.ema_state = {k: v.detach().clone() for k, v in self.net.state_dict().items()}
        else:  # resumed from a checkpoint, or a second fit
            self.ema_state = {k: v.to(self.device) for k, v in self.ema_state.items()}

    def on_train_batch_start(self, batch: Batch, batch_idx: int) -> None:
        self._steps_at_batch_start = self.trainer.global_step

    def on_train_batch_end(self, outputs: Any, batch: Batch, batch_idx: int) -> None:
        # Lightning's global step counts optimizer steps, so it moved on exactly the batches
        # that closed an accumulation window (or the epoch's last, partial window).
        if self.ema_state is not None and self.trainer.global_step != self._steps_at_batch_start:
            self.update_ema()

    @torch.no_grad()
    def update_ema(self) -> None:
        """One EMA update from ``net``'s current state (floats blended, the rest copied)."""
        assert self.ema_state is not None and self.ema_decay is not None
        for name, value in self.net.state_dict().items():
            average = self.ema_state[name]
            if average.is_floating_point():
                average.lerp_(value, 1.0 - self.ema_decay)
            else:
                average.copy_(value)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.ema_state is not None:
            checkpoint["ema_state"] = {k: v.detach().clone() for k, v in self.ema_state.items()}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if "ema_state" in checkpoint:
            self.ema_state = {k: v.clone() for k, v in checkpoint["ema_state"].items()}
