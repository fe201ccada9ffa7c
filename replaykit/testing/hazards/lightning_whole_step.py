"""The hazard classes under ``replaykit.lightning.whole_step``: a LightningModule in manual
optimization whose ``training_step`` calls a ``TrainStep``, fitted by a ``Trainer``.

Lightning adds its own Python around the step: ``configure_optimizers`` builds the optimizer
(and wraps it), ``on_train_start`` builds the step, ``training_step`` runs between the
Trainer's hooks, ``lr_schedulers()`` steps a schedule, ``fit(ckpt_path=...)`` reloads an
optimizer's ``state_dict`` through ``torch.load``, and ``LightningModule`` methods are the
natural ``loss_fn``. Each pattern here is one hazard class of the catalogue as a Lightning
user meets it (``api="whole_step"``): the replay arm fits with ``whole_step`` replaying, the
eager arm fits the same module with the step's eager twin (``replay=False``), from the same
seed, and the runner compares the end states bit for bit. The guard a pattern names is a
``TrainStep`` protection: its unsafe arm switches it off through ``whole_step``'s
``unsafe_disable``.

Not here, because Lightning adds nothing to them over ``rk.TrainStep`` (the step patterns
cover them): what the model's own code does (``torch.func``, checkpointing, an LSTM), and an
input written between forward and backward (both run inside the step: no user code runs
between them, so only ``loss_fn`` itself could, and then eager raises at every call).

The only module of the catalogue that uses Lightning, and only when a pattern runs: its
LightningModules are made on first use (:func:`lightning_module`), so importing the
catalogue (a child process of a ``may_hang`` pattern, a notebook) costs no Lightning import;
the catalogue lists these patterns where Lightning is installed (the ``lightning`` extra).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import tempfile
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from . import autocast
from .autograd_modes import anomaly_restored
from .backend_diffs import Unrolled
from .host_state import ArrayGain, LayerDrop, RecentScaled, seeded
from .pattern import MLP, Arm, Extras, Pattern
from .recording_call import CentredHead, CountingSGD, DinoLoss
from .step_python import FocalLoss, WarmupSGD
from .switches import Attention, ConvNet
from .under_capture import CaptureAware
from .writing import Train

API = "whole_step"
BATCH = 4

LossFn = Callable[..., torch.Tensor]
Hook = Callable[["Fitted", int], None]


def _mse(net: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return net(x).pow(2).mean()


def _sgd(net: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)


@dataclass
class Plan:
    """What one fit does: the ``loss_fn`` (or ``loss_of(module)`` for one the module holds), the
    optimizer and optional scheduler, the ``whole_step`` settings, and what the user's
    ``training_step`` does ``before`` and ``after`` each step. ``losses``: every loss returned."""

    arm: Arm
    loss_fn: LossFn | None = _mse
    loss_of: Callable[[Fitted], LossFn] | None = None
    optimizer: Callable[[nn.Module], torch.optim.Optimizer] = _sgd
    scheduler: Callable[[torch.optim.Optimizer], Any] | None = None
    step_kwargs: dict[str, Any] = field(default_factory=dict)
    before: Hook | None = None
    after: Callable[[Fitted, torch.Tensor, int], None] | None = None
    losses: list[torch.Tensor] = field(default_factory=list)


class Fitted:
    """The user's LightningModule: ``self.net`` trained by a whole step in manual optimization.

    Its methods, and its subclasses', become a LightningModule through :func:`lightning_module`.
    """

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net
        self.automatic_optimization = False
        self.plan: Plan | None = None
        self.step: Any = None

    def configure_optimizers(self) -> Any:
        assert self.plan is not None
        opt = self.plan.optimizer(self.net)
        if self.plan.scheduler is None:
            return opt
        return {"optimizer": opt, "lr_scheduler": self.plan.scheduler(opt)}

    def on_train_start(self) -> None:
        from replaykit.lightning import whole_step

        plan = self.plan
        assert plan is not None
        arm = plan.arm
        loss_fn = plan.loss_of(self) if plan.loss_of is not None else plan.loss_fn
        self.step = whole_step(
            self,
            self.net,
            loss_fn,
            replay=arm.replay,
            backend=arm.backend,
            unsafe_disable=arm.unsafe_disable if arm.replay else (),
            **plan.step_kwargs,
        )
        arm.optimizers.append(self.optimizers().optimizer)
        if arm.replay:
            arm.recorder = self.step

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        plan = self.plan
        assert plan is not None
        if plan.before is not None:
            plan.before(self, batch_idx)
        loss = self.step(*batch)
        plan.losses.append(loss.detach())
        if plan.after is not None:
            plan.after(self, loss, batch_idx)
        scheduler = self.lr_schedulers()
        if scheduler is not None:
            scheduler.step()


@functools.cache
def lightning_module(cls: type) -> type:
    """``cls`` (a :class:`Fitted`) as a LightningModule: Lightning is imported here, on first use."""
    import lightning as L

    return type(cls.__name__, (cls, L.LightningModule), {"__module__": cls.__module__})


def fitted(net: Callable[[], nn.Module] = MLP, cls: type = Fitted) -> Callable[[str], nn.Module]:
    """A pattern's ``make``: the LightningModule ``cls`` around ``net()`` on the arm's device."""
    return lambda device: lightning_module(cls)(net()).to(device)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """The Trainer's start-up lines and its hints about workers are not this harness's output."""
    log = logging.getLogger("lightning.pytorch")
    level = log.level
    log.setLevel(logging.WARNING)
    try:
        with warnings.catch_warnings():
            for noise in ("does not have many workers", "LeafSpec", "resuming from a checkpoint"):
                warnings.filterwarnings("ignore", message=f".*{noise}.*")
            yield
    finally:
        log.setLevel(level)


def trainer(arm: Arm, steps: int, **kwargs: Any) -> Any:
    """A small Trainer on the arm's device: no logger, checkpoints, progress bar or summary."""
    import lightning as L

    return L.Trainer(
        accelerator="gpu" if arm.device == "cuda" else "cpu",
        devices=1,
        max_steps=steps,
        max_epochs=-1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


def batches(steps: int, shape: tuple[int, ...] = (6,)) -> DataLoader:
    """``steps`` batches from the global generator (the runner seeds it alike in both arms)."""
    return DataLoader(TensorDataset(torch.randn(steps * BATCH, *shape)), batch_size=BATCH)


def fit(
    module: nn.Module,
    arm: Arm,
    steps: int = 6,
    trainer_kwargs: dict[str, Any] | None = None,
    shape: tuple[int, ...] = (6,),
    **plan: Any,
) -> Extras:
    """Fit ``module`` (a :class:`Fitted`) for ``steps`` optimizer steps with this ``Plan``
    (``trainer_kwargs`` go to the ``Trainer``) over batches of ``shape``; keeps every loss."""
    assert isinstance(module, Fitted)
    module.plan = Plan(arm, **plan)
    with _quiet():
        trainer(arm, steps, **(trainer_kwargs or {})).fit(module, batches(steps, shape))
    return _kept(module.plan)


def _kept(plan: Plan) -> Extras:
    return {f"loss{i}": loss for i, loss in enumerate(plan.losses)}


def at(step: int, fn: Callable[[Fitted], None]) -> Hook:
    """A ``before`` that calls ``fn(module)`` once, at batch ``step``."""

    def before(module: Fitted, batch_idx: int) -> None:
        if batch_idx == step:
            fn(module)

    return before


class ClippedWhenLarge(MLP):
    """Clips its output only when some input is large: a host read of the batch (``.all()``), as a
    data-dependent guard in a forward does; random batches take either branch."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        if (x.abs() < 2).all():
            return out
        return out.clamp(-0.5, 0.5)


def _optimizer_reloaded(module: Fitted) -> None:
    """What a callback restoring the optimizer does: its state dict loaded back (same values, new tensors)."""
    opt = module.optimizers().optimizer
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))


# --------------------------------------------------------------------------- hooks
def _forward_hook_stats(module: nn.Module, arm: Arm) -> Extras:
    """Activation statistics logged by a forward hook on a layer of the net."""
    stats: list[torch.Tensor] = []
    module.net.fc1.register_forward_hook(
        lambda mod, args, out: stats.append(out.detach().abs().mean())
    )
    kept = fit(module, arm)
    kept["activation_stats"] = torch.stack(stats)
    return kept


def _backward_hook_grad_norm(module: nn.Module, arm: Arm) -> Extras:
    """The norm of the gradient reaching the head, logged by a full backward hook."""
    norms: list[torch.Tensor] = []
    module.net.fc2.register_full_backward_hook(
        lambda mod, gin, gout: norms.append(gout[0].detach().norm())
    )
    kept = fit(module, arm)
    kept["grad_norms"] = torch.stack(norms)
    return kept


# --------------------------------------------------------------------------- what loss_fn reads
def _focal_gamma_schedule(module: nn.Module, arm: Arm) -> Extras:
    """A focal loss object's ``gamma`` annealed by the training_step before every step."""
    focal = FocalLoss(2.0)

    def before(m: Fitted, batch_idx: int) -> None:
        focal.gamma = max(0.0, 2.0 - 0.5 * batch_idx)

    return fit(module, arm, loss_fn=focal, before=before)


AUX_WEIGHT = 0.5
"""A module-level loss weight the training script sets to 0 after a few steps."""


def _global_weighted_loss(net: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = net(x)
    return out.pow(2).mean() + AUX_WEIGHT * out.abs().mean()


def _global_loss_weight(module: nn.Module, arm: Arm) -> Extras:
    global AUX_WEIGHT

    def off(m: Fitted) -> None:
        global AUX_WEIGHT
        AUX_WEIGHT = 0.0

    try:
        return fit(module, arm, loss_fn=_global_weighted_loss, before=at(3, off))
    finally:
        AUX_WEIGHT = 0.5


class WeightedByModule(Fitted):
    """The Lightning idiom: ``loss_fn`` is the module's own method, reading ``self.aux_weight``."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__(net)
        self.aux_weight = 0.5

    def compute_loss(self, net: nn.Module, x: torch.Tensor) -> torch.Tensor:
        out = net(x)
        return out.pow(2).mean() + self.aux_weight * out.abs().mean()


def _method_loss_weight(module: nn.Module, arm: Arm) -> Extras:
    def off(m: Fitted) -> None:
        m.aux_weight = 0.0  # type: ignore[attr-defined]

    return fit(module, arm, loss_fn=None, loss_of=lambda m: m.compute_loss, before=at(3, off))


class WarmedByStep(Fitted):
    """KL-style warm-up: the module's own ``compute_loss`` reads ``self.global_step`` (a Lightning
    property: the Trainer's count of optimizer steps)."""

    def compute_loss(self, net: nn.Module, x: torch.Tensor) -> torch.Tensor:
        out = net(x)
        return out.pow(2).mean() + min(1.0, self.global_step / 3) * out.abs().mean()


def _mixup_loss(net: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Mixup inside loss_fn: lambda from numpy's Beta, the batch mixed with its reverse."""
    import numpy as np

    lam = float(np.random.beta(0.4, 0.4))
    return net(lam * x + (1 - lam) * x.flip(0)).pow(2).mean()


# --------------------------------------------------------------------------- held containers
def _recent_losses(module: nn.Module, arm: Arm) -> Extras:
    """The net divides by the mean of a deque of recent losses the training_step appends to."""

    def after(m: Fitted, loss: torch.Tensor, batch_idx: int) -> None:
        m.net.recent.append(loss.item() + 1.0)

    return fit(module, arm, after=after)


def _halve_gain(module: nn.Module, arm: Arm) -> Extras:
    """The net reads ``float(self.scale[0])`` of a numpy array the training_step halves in place."""

    def before(m: Fitted, batch_idx: int) -> None:
        if batch_idx >= 3:
            m.net.scale *= 0.5

    return fit(module, arm, before=before)


# --------------------------------------------------------------------------- an optimizer's Python
def _warmup_optimizer(module: nn.Module, arm: Arm) -> Extras:
    return fit(module, arm, optimizer=lambda net: WarmupSGD(net.parameters()))


# --------------------------------------------------------------------------- the step's settings
def _set_on_step(
    attr: str, value: object, **step_kwargs: Any
) -> Callable[[nn.Module, Arm], Extras]:
    """``self.step.<attr> = value`` in training_step after the step recorded."""

    def train(module: nn.Module, arm: Arm) -> Extras:
        return fit(
            module,
            arm,
            steps=7,
            step_kwargs=step_kwargs,
            before=at(3, lambda m: setattr(m.step, attr, value)),
        )

    return train


# --------------------------------------------------------------------------- gradients leaving the net
class WithCritic(Fitted):
    """A perceptual-style loss through a second network that is trainable but not optimized."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__(net)
        self.critic = MLP(d_in=3, d_h=8, d_out=1)


def _critic_loss(module: nn.Module, arm: Arm) -> Extras:
    """The critic's gradients are zeroed before each step (they are logged after it): eager
    gives it this step's ``.grad``; the critic's parameters and ``.grad`` are in the end state."""
    return fit(
        module,
        arm,
        loss_of=lambda m: lambda net, x: m.critic(net(x)).pow(2).mean(),
        before=lambda m, i: m.critic.zero_grad(set_to_none=True),
    )


# --------------------------------------------------------------------------- side effects, lifecycle
class Counting(Fitted):
    """Its loss method counts its calls on ``self`` and weights odd and even steps apart."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__(net)
        self.calls = 0

    def counted_loss(self, net: nn.Module, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1  # Python a replay would not run: the weight would stay the recording's
        return net(x).pow(2).mean() * (1.0 + self.calls % 2)


def _counted(module: nn.Module, arm: Arm) -> Extras:
    return fit(module, arm, loss_of=lambda m: m.counted_loss)


def _unfreeze_at(step: int) -> Callable[[nn.Module, Arm], Extras]:
    """Fine-tuning's unfreeze schedule: fc1 frozen until ``step``, then trained by the same optimizer."""

    def train(module: nn.Module, arm: Arm) -> Extras:
        module.net.fc1.requires_grad_(False)

        def before(m: Fitted, i: int) -> None:
            if i == step:
                m.net.fc1.requires_grad_(True)

        return fit(module, arm, steps=8, before=before)

    return train


def _head_replaced_at(step: int) -> Callable[[nn.Module, Arm], Extras]:
    """A new task head swapped in mid-fit (new parameters the optimizer was not given)."""

    def train(module: nn.Module, arm: Arm) -> Extras:
        def before(m: Fitted, i: int) -> None:
            if i == step:
                m.net.fc2 = nn.Linear(8, 3).to(m.net.fc1.weight.device)

        return fit(module, arm, steps=8, before=before)

    return train


# --------------------------------------------------------------------------- autograd modes
def _anomaly_mid_run(module: nn.Module, arm: Arm) -> Extras:
    """Anomaly detection switched on to debug after recording; the next batch has a NaN."""

    def before(m: Fitted, batch_idx: int) -> None:
        if batch_idx == 4:
            torch.autograd.set_detect_anomaly(True)

    def nan_loss(net: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return net(x).mean()

    with anomaly_restored():
        module.plan = Plan(arm, loss_fn=nan_loss, before=before)
        data = torch.randn(6 * BATCH, 6)
        data[5 * BATCH, 0] = float("nan")  # a corrupt sample in batch 5
        with _quiet():
            trainer(arm, 6).fit(module, DataLoader(TensorDataset(data), batch_size=BATCH))
        return _kept(module.plan)


def _compress() -> contextlib.AbstractContextManager:
    """Activation compression: saved tensors kept in bfloat16, restored for backward."""
    return torch.autograd.graph.saved_tensors_hooks(
        lambda t: (t.dtype, t.to(torch.bfloat16)), lambda packed: packed[1].to(packed[0])
    )


class Compressed(Fitted):
    """Its training_step runs the step under activation compression from batch 3 on."""

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        with _compress() if batch_idx >= 3 else contextlib.nullcontext():
            super().training_step(batch, batch_idx)


# --------------------------------------------------------------------------- a float lr every step
def _lambda_lr(opt: torch.optim.Optimizer) -> Any:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.99**s)


def _step_lr(opt: torch.optim.Optimizer) -> Any:
    return torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)


# --------------------------------------------------------------------------- resume from a checkpoint
def _resumed(
    optimizer: Callable[[nn.Module], torch.optim.Optimizer],
) -> Callable[[nn.Module, Arm], Extras]:
    """Fit 3 steps and save a checkpoint, then a new Trainer resumes it (``fit(ckpt_path=...)``:
    Lightning's ``torch.load`` with its default ``weights_only``) for 3 more."""

    def train(module: nn.Module, arm: Arm) -> Extras:
        assert isinstance(module, Fitted)
        module.plan = Plan(arm, optimizer=optimizer)
        data = batches(6)
        with tempfile.TemporaryDirectory() as tmp, _quiet():
            first = trainer(arm, 3)
            first.fit(module, data)
            path = str(Path(tmp) / "mid.ckpt")
            first.save_checkpoint(path)
            trainer(arm, 6).fit(module, data, ckpt_path=path)
        return _kept(module.plan)

    return train


def _adam(net: nn.Module) -> torch.optim.Optimizer:
    """Adam as the README advises on CUDA (``capturable=True``: its step count stays on the
    device); the CPU has no capturable Adam, so there it routes eager with that reason."""
    cuda = next(net.parameters()).is_cuda
    return torch.optim.Adam(net.parameters(), lr=0.01, capturable=cuda)


def _centred_in_place(net: nn.Module, x: torch.Tensor) -> torch.Tensor:
    x.sub_(x.mean(0))  # normalizes the caller's batch, not a copy
    return net(x).pow(2).mean()


class LogsBatch(Fitted):
    """Logs each batch's mean magnitude after its step: the batch ``loss_fn`` centred in place."""

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        super().training_step(batch, batch_idx)
        assert self.plan is not None
        self.plan.losses.append(batch[0].abs().mean().detach())


# --------------------------------------------------------------------------- mixed precision
class SharedHead(autocast.SharedHead):
    """One head applied to two views (a weight used twice in one forward): autocast's net, its
    head applied twice instead of three times."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.stem(x))
        return self.head(h) + 0.5 * self.head(h.flip(0))


def _smooth_l1(net: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = net(x)
    return F.smooth_l1_loss(out.float(), torch.zeros_like(out, dtype=torch.float32))


# --------------------------------------------------------------------------- the recording call's extra runs
def _ema_target(module: nn.Module, arm: Arm) -> Extras:
    """BYOL with the target network built by the training script beside the module (the module's
    own attributes are the step's snapshot already): the loss_fn closure holding it moves it
    towards the online net (an EMA) before each loss."""
    target = copy.deepcopy(module.net).requires_grad_(False)

    def byol_loss(net: nn.Module, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            for t, p in zip(target.parameters(), net.parameters(), strict=True):
                t.mul_(0.9).add_(p, alpha=0.1)
        return (net(x) - target(x)).pow(2).mean()

    kept = fit(module, arm, loss_fn=byol_loss)
    kept.update({f"target/{n}": t for n, t in target.named_parameters()})
    return kept


class BatchNormTeacher(Fitted):
    """Distillation in Lightning: the teacher is the module's attribute, so the Trainer's
    ``train()`` leaves its BatchNorm in train mode and its statistics move at every loss."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__(net)
        self.teacher = MLP(bn=True).requires_grad_(False)

    def distil_loss(self, net: nn.Module, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            soft = self.teacher(x)
        return (net(x) - soft).pow(2).mean()


class DinoCentred(Fitted):
    """DINO in Lightning: the loss module with its centre buffer is the module's attribute."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__(net)
        self.criterion = DinoLoss()

    def dino_loss(self, net: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return self.criterion(net(x), net(x.flip(0)).detach())


def _counting_sgd(net: nn.Module) -> torch.optim.Optimizer:
    return CountingSGD(net.parameters(), lr=0.1)


def _recording_call_patterns() -> list[Pattern]:
    """The recording call's extra runs (probe, eager reference, capture) as a Lightning user
    meets them: what the LightningModule holds beside the net, and the optimizer's Python."""
    hazard = "recording_call"
    held = [
        (
            "teacher_bn",
            "a distillation teacher with BatchNorm, the module's attribute, in train mode",
            BatchNormTeacher,
            "distil_loss",
        ),
        (
            "dino_loss_centre",
            "DINO's loss module, the module's attribute, updates its centre in place",
            DinoCentred,
            "dino_loss",
        ),
    ]
    cases = [
        whole_step(
            f"whole_step_{name}",
            hazard,
            what,
            fitted(MLP, cls),
            functools.partial(_fit_method, method=method),
            guard="call_state",
        )
        for name, what, cls, method in held
    ]
    return [
        *cases,
        whole_step(
            "whole_step_ema_target_in_loss_fn",
            hazard,
            "a BYOL target network beside the module, EMA-updated by the loss_fn closure",
            fitted(),
            _ema_target,  # no guard named: with call_state off its recording still verified and
            # replayed bitwise on the CPU (the step pattern's diverges), not yet explained
        ),
        whole_step(
            "whole_step_rebound_centre_buffer",
            hazard,
            "DINO's head re-binds a centre buffer in forward (self.center = m * self.center + ...)",
            fitted(CentredHead),
            fitting(),
            guard="call_state",
            unsafe_never="the centre is a state: the recording reads it from a slot fed before each replay, which no switch turns off",
        ),
        whole_step(
            "whole_step_param_group_counter_failed_verification",
            hazard,
            "configure_optimizers returns an optimizer counting steps in its param group; the recording fails verification",
            fitted(CaptureAware),
            lambda m, a: _counter_kept(
                fit(m, a, optimizer=_counting_sgd, step_kwargs={"trust_optimizer": True}), a
            ),
            guard="call_state",
        ),
    ]


def _fit_method(module: nn.Module, arm: Arm, method: str) -> Extras:
    return fit(module, arm, loss_fn=None, loss_of=lambda m: getattr(m, method))


def _counter_kept(kept: Extras, arm: Arm) -> Extras:
    kept["counter"] = torch.tensor(float(arm.optimizers[-1].param_groups[0]["k"]))
    return kept


# --------------------------------------------------------------------------- switches flipped by a callback
def _switched_by_callback(
    flip: Callable[[], None], kept: tuple[Callable[[], Any], Callable[[Any], None]], shape: tuple
) -> Callable[[nn.Module, Arm], Extras]:
    """A Lightning callback calls ``flip()`` at batch 3's ``on_train_batch_start`` (a debugging or
    a memory callback leaving a kernel for a phase); the switch is set back after the fit."""
    import lightning as L

    class Flip(L.Callback):
        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, idx: int) -> None:
            if idx == 3:
                flip()

    def train(module: nn.Module, arm: Arm) -> Extras:
        get, put = kept
        before = get()
        try:
            return fit(module, arm, shape=shape, trainer_kwargs={"callbacks": [Flip()]})
        finally:
            put(before)

    return train


def _flash_off() -> None:
    torch.backends.cuda.enable_flash_sdp(False)


def _conv_kernels_off() -> None:
    torch.backends.mkldnn.enabled = False
    torch.backends.cudnn.enabled = False


def _conv_kernels_on(enabled: bool) -> None:
    torch.backends.mkldnn.enabled = enabled
    torch.backends.cudnn.enabled = enabled


def _switch_patterns() -> list[Pattern]:
    return [
        whole_step(
            "whole_step_flash_sdp_disabled_by_callback",
            "switches",
            "a Lightning callback calls torch.backends.cuda.enable_flash_sdp(False) at batch 3",
            fitted(Attention),
            lambda m, a: _switched_by_callback(
                _flash_off,
                (torch.backends.cuda.flash_sdp_enabled, torch.backends.cuda.enable_flash_sdp),
                (32,),
            )(m, a),
            guard="switches",
            cpu_only="this fp32 attention runs no flash kernel on CUDA (flash needs fp16/bf16): turning "
            "flash off changes no kernel there (the step pattern's unguarded arm replayed "
            "bitwise on the H200); the CPU's SDPA honours the switch",
        ),
        whole_step(
            "whole_step_conv_kernels_off_by_callback",
            "switches",
            "a Lightning callback sets torch.backends.mkldnn/cudnn.enabled = False at batch 3",
            fitted(ConvNet),
            lambda m, a: _switched_by_callback(
                _conv_kernels_off, (torch.backends.mkldnn.enabled.__bool__, _conv_kernels_on), (48,)
            )(m, a),
            guard="switches",
        ),
    ]


def whole_step(
    name: str, hazard: str, what: str, make: Callable[[str], nn.Module], train: Train, **kw: Any
) -> Pattern:
    """A whole_step pattern of the class ``hazard``."""
    return Pattern(name, hazard, what, make, train, api=API, **kw)


def fitting(**kw: Any) -> Train:
    """A whole_step pattern's ``train``: :func:`fit` with these arguments."""
    return lambda module, arm: fit(module, arm, **kw)


PATTERNS: list[Pattern] = [
    whole_step(
        "whole_step_plain_sgd",
        "host_values",
        "a plain SGD whole step under Lightning manual optimization: the control",
        fitted(),
        fitting(),
    ),
    whole_step(
        "whole_step_input_branch",
        "under_capture",
        "the net branches on its batch (x.abs() < 2).all(): each batch takes either branch",
        fitted(ClippedWhenLarge),
        fitting(steps=9),
        guard="input_reads",
    ),
    whole_step(
        "whole_step_adagrad_defaults",
        "backend_diffs",
        "configure_optimizers returns torch.optim.Adagrad with its defaults (its step count on the CPU)",
        fitted(),
        fitting(optimizer=lambda net: torch.optim.Adagrad(net.parameters())),
    ),  # the step pattern differed on the H200 only
    whole_step(
        "whole_step_block_called_twice",
        "backend_diffs",
        "the net calls a block twice per step, its weight used twice per call (gradient sum order)",
        fitted(Unrolled),
        fitting(),
    ),
    whole_step(
        "whole_step_batch_centred_in_place",
        "inputs",
        "loss_fn centres its batch in place; training_step logs the batch after the step",
        fitted(cls=LogsBatch),
        fitting(loss_fn=_centred_in_place),
        guard="write_back",
    ),
    whole_step(
        "whole_step_optimizer_state_reloaded",
        "lifecycle",
        "training_step reloads the optimizer's state dict after the step recorded",
        fitted(),
        fitting(steps=7, before=at(3, _optimizer_reloaded)),
        guard="state_identity",
    ),
    whole_step(
        "whole_step_step_lr_float",
        "host_values",
        "StepLR over a float lr from configure_optimizers halves it every 3 steps",
        fitted(),
        fitting(steps=9, scheduler=_step_lr),
        guard="host_values",
    ),
    whole_step(
        "whole_step_forward_hook_stats",
        "step_python",
        "a forward hook on the net logs activation statistics",
        fitted(),
        _forward_hook_stats,
        guard="hooks",
    ),
    whole_step(
        "whole_step_backward_hook_grad_norm",
        "step_python",
        "a full backward hook on the net logs a layer's gradient norm",
        fitted(),
        _backward_hook_grad_norm,
        guard="hooks",
    ),
    whole_step(
        "whole_step_focal_gamma_schedule",
        "step_python",
        "a focal loss object's gamma annealed in training_step every step",
        fitted(),
        _focal_gamma_schedule,
        guard="loss_inputs",
    ),
    whole_step(
        "whole_step_global_loss_weight",
        "step_python",
        "a module-level loss weight set to 0 after 3 steps",
        fitted(),
        _global_loss_weight,
        guard="loss_inputs",
    ),
    whole_step(
        "whole_step_module_method_loss",
        "step_python",
        "loss_fn is the LightningModule's method reading self.aux_weight, set to 0 after 3 steps",
        fitted(MLP, WeightedByModule),
        _method_loss_weight,
        guard="loss_inputs",
    ),
    whole_step(
        "whole_step_module_method_global_step",
        "step_python",
        "loss_fn is the LightningModule's method warming a loss weight up with self.global_step",
        fitted(MLP, WarmedByStep),
        lambda m, a: fit(m, a, loss_fn=None, loss_of=lambda m: m.compute_loss),
        guard="loss_inputs",
    ),
    whole_step(
        "whole_step_mixup_numpy_lambda",
        "host_state",
        "mixup in loss_fn with lambda from np.random.beta",
        fitted(),
        seeded(lambda m, a: fit(m, a, loss_fn=_mixup_loss)),
        guard="host_rng",
    ),
    whole_step(
        "whole_step_layerdrop_python_random",
        "host_state",
        "LayerDrop decided by random.random() in the net's forward",
        fitted(LayerDrop),
        seeded(lambda m, a: fit(m, a)),
        guard="host_rng",
    ),
    whole_step(
        "whole_step_deque_read_in_forward",
        "host_state",
        "the net reads a deque of recent losses that training_step appends to",
        fitted(RecentScaled),
        _recent_losses,
        guard="module_state",
    ),
    whole_step(
        "whole_step_numpy_array_gain_float",
        "host_state",
        "the net reads float(array[0]) of a numpy array training_step halves in place",
        fitted(ArrayGain),
        _halve_gain,
        guard="module_state",
    ),
    whole_step(
        "whole_step_warmup_optimizer",
        "step_python",
        "configure_optimizers returns a hand-written optimizer with a warm-up counter on self",
        fitted(),
        _warmup_optimizer,
        guard="optimizer_trust",
    ),
    whole_step(
        "whole_step_accumulate_changed",
        "step_python",
        "self.step.accumulate = 4 in training_step after recording (must raise)",
        fitted(),
        _set_on_step("accumulate", 4),
    ),
    whole_step(
        "whole_step_max_norm_changed",
        "step_python",
        "self.step.max_norm tightened in training_step after recording",
        fitted(),
        _set_on_step("max_norm", 0.01, max_norm=0.5),
        guard="host_values",
    ),
    whole_step(
        "whole_step_trainable_critic",
        "leaving_grads",
        "loss_fn runs a trainable critic network that the optimizer does not step",
        fitted(MLP, WithCritic),
        _critic_loss,
        guard="foreign_grads",
    ),
    whole_step(
        "whole_step_anomaly_detection_mid_run",
        "autograd_modes",
        "set_detect_anomaly(True) in training_step after recording; then a NaN batch",
        fitted(),
        _anomaly_mid_run,
        guard="autograd_modes",
    ),
    whole_step(
        "whole_step_saved_tensors_compression",
        "autograd_modes",
        "training_step runs the step under bf16 activation compression from batch 3",
        fitted(MLP, Compressed),
        fitting(),
        guard="autograd_modes",
    ),
    whole_step(
        "whole_step_lambda_lr_float",
        "step_python",
        "LambdaLR over a float lr from configure_optimizers: the lr changes every step",
        fitted(),
        fitting(steps=24, scheduler=_lambda_lr),
    ),
    whole_step(
        "whole_step_resume_sgd_checkpoint",
        "crashes",
        "fit(ckpt_path=...) resumes SGD's momentum state saved mid-run",
        fitted(),
        _resumed(_sgd),
    ),
    whole_step(
        "whole_step_resume_adam_checkpoint",
        "crashes",
        "fit(ckpt_path=...) resumes Adam's state (capturable on CUDA; its step count a tensor)",
        fitted(),
        _resumed(_adam),
    ),
    whole_step(
        "whole_step_bf16_mixed",
        "autocast",
        "whole_step(precision='bf16-mixed') over a head applied twice per forward",
        fitted(SharedHead),
        fitting(loss_fn=_smooth_l1, step_kwargs={"precision": "bf16-mixed"}),
    ),
    whole_step(
        "whole_step_trainer_bf16_mixed",
        "autocast",
        "Trainer(precision='bf16-mixed') around a whole step (whose own precision stays '32')",
        fitted(SharedHead),
        fitting(loss_fn=_smooth_l1, trainer_kwargs={"precision": "bf16-mixed"}),
    ),
    whole_step(
        "whole_step_loss_method_counts_on_self",
        "side_effects",
        "loss_fn is a LightningModule method that counts its calls on self and weights by them",
        fitted(MLP, Counting),
        _counted,
        guard="loss_inputs",
    ),
    whole_step(
        "whole_step_unfreeze_mid_fit",
        "lifecycle",
        "training_step unfreezes the first layer at batch 3 (an unfreeze schedule)",
        fitted(),
        _unfreeze_at(3),
    ),
    whole_step(
        "whole_step_head_replaced_mid_fit",
        "parameters",
        "training_step assigns a new head (net.fc2 = nn.Linear(...)) at batch 3",
        fitted(),
        _head_replaced_at(3),
        guard="param_identity",
    ),
    *_recording_call_patterns(),
    *_switch_patterns(),
]

KNOWN_LIMITS: list[Pattern] = []
"""Still silent differences (README, Known limits): kept out of ``PATTERNS``."""
