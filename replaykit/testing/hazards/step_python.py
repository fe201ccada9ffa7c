"""Python that a replay does not run, around a whole step: hooks present when a ``TrainStep``
records, what ``loss_fn`` reads besides tensors, an optimizer with Python state, and the
step's own settings changed after construction.

A recorded step replays the aten work of the recording call and none of its Python, so
each pattern here changes (or observes) something only Python sees after the step has
recorded (call 1 of the default ``warmup=1``; the change comes at call 3 or later).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from . import user_settings
from .host_state import ARRAY_COPY_LIVE
from .pattern import MLP, Arm, Extras, Pattern, loop, mlp, sgd, step_loop
from .writing import HazardClass, built

HAZARD = "step_python"
HC = HazardClass(HAZARD)


def _mse(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).pow(2).mean()


# --------------------------------------------------------------------------- hooks
def _forward_hook_stats(model: nn.Module, arm: Arm) -> Extras:
    """Activation statistics logged by a forward hook (a common monitoring helper)."""
    stats: list[torch.Tensor] = []
    model.fc1.register_forward_hook(lambda mod, args, out: stats.append(out.detach().abs().mean()))
    kept = step_loop(model, arm, steps=6)
    kept["activation_stats"] = torch.stack(stats)
    return kept


def _backward_hook_grad_norm(model: nn.Module, arm: Arm) -> Extras:
    """The norm of the gradient reaching a layer, logged by a full backward hook."""
    norms: list[torch.Tensor] = []
    model.fc2.register_full_backward_hook(
        lambda mod, gin, gout: norms.append(gout[0].detach().norm())
    )
    kept = step_loop(model, arm, steps=6)
    kept["grad_norms"] = torch.stack(norms)
    return kept


def _global_forward_hook(model: nn.Module, arm: Arm) -> Extras:
    """A global module forward hook (a profiler or a debugging tool) counting calls per module."""
    calls: dict[str, int] = {}
    names = {id(m): n for n, m in model.named_modules()}

    def hook(mod: nn.Module, args: tuple, out: object) -> None:
        if id(mod) in names:
            calls[names[id(mod)]] = calls.get(names[id(mod)], 0) + 1

    handle = nn.modules.module.register_module_forward_hook(hook)
    try:
        kept = step_loop(model, arm, steps=6)
    finally:
        handle.remove()
    kept["module_calls"] = torch.tensor([calls.get(n, 0) for n in sorted(names.values())])
    return kept


def _hook_added_midway(model: nn.Module, arm: Arm) -> Extras:
    """A monitoring hook attached after the step recorded (a logger switched on at step 3)."""
    stats: list[torch.Tensor] = []

    def before(m: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
        if step == 3:
            m.fc1.register_forward_hook(
                lambda mod, args, out: stats.append(out.detach().abs().mean())
            )

    kept = step_loop(model, arm, steps=6, before=before)
    kept["activation_stats"] = torch.stack(stats)
    return kept


def _global_hook_capture(model: nn.Module, arm: Arm) -> Extras:
    """The global module forward hook around a captured model's loop."""
    calls: list[str] = []
    handle = nn.modules.module.register_module_forward_hook(
        lambda mod, args, out: calls.append(type(mod).__name__)
    )
    try:
        kept = loop(model, arm, steps=4)
    finally:
        handle.remove()
    kept["module_calls"] = torch.tensor(float(len(calls)))
    return kept


def _capture_hook_stats(model: nn.Module, arm: Arm) -> Extras:
    """The forward-hook statistics under ``rk.capture`` (which refuses hooks it cannot replay)."""
    stats: list[torch.Tensor] = []
    model.fc1.register_forward_hook(lambda mod, args, out: stats.append(out.detach().abs().mean()))
    kept = loop(model, arm, steps=4)
    kept["activation_stats"] = torch.stack(stats)
    return kept


# --------------------------------------------------------------------------- what loss_fn reads
class FocalLoss:
    """A focal loss on class 0 whose ``gamma`` a schedule changes (a plain object, not a Module)."""

    def __init__(self, gamma: float = 2.0) -> None:
        self.gamma = gamma

    def __call__(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        logp = F.log_softmax(model(x), dim=1)[:, 0]
        return -((1 - logp.exp()) ** self.gamma * logp).mean()


def _focal_gamma_schedule(model: nn.Module, arm: Arm) -> Extras:
    focal = FocalLoss(2.0)

    def before(m: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
        focal.gamma = max(0.0, 2.0 - 0.5 * step)  # annealed every step

    return step_loop(model, arm, loss_fn=focal, steps=6, before=before)


def _closure_loss_weight(model: nn.Module, arm: Arm) -> Extras:
    """An auxiliary term's weight held in a closure cell, switched off after 3 steps."""
    aux_weight = 0.5

    def loss_fn(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        out = m(x)
        return out.pow(2).mean() + aux_weight * out.abs().mean()

    opt = sgd(model)
    step = arm.train_step(model, loss_fn, opt)
    kept: Extras = {}
    for i in range(6):
        if i == 3:
            aux_weight = 0.0
        kept[f"loss{i}"] = step(arm.randn(4, 6)).detach()
    return kept


def _closure_tensor_replaced(model: nn.Module, arm: Arm) -> Extras:
    """Class centres in a closure cell, recomputed as a NEW tensor after 3 steps (centre loss)."""
    centres = torch.zeros(3, device=arm.device)

    def loss_fn(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return (m(x) - centres).pow(2).mean()

    opt = sgd(model)
    step = arm.train_step(model, loss_fn, opt)
    kept: Extras = {}
    for i in range(6):
        if i == 3:
            with torch.no_grad():
                centres = model(arm.randn(16, 6)).mean(
                    0
                )  # a new tensor object, not an in-place update
        kept[f"loss{i}"] = step(arm.randn(4, 6))
    return kept


class Trainer:
    """A user's trainer whose bound method is the loss_fn; it reads ``self.alpha``."""

    def __init__(self) -> None:
        self.alpha = 1.0

    def compute_loss(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        out = model(x)
        return out.pow(2).mean() + self.alpha * out.abs().mean()


def _bound_method_loss(model: nn.Module, arm: Arm) -> Extras:
    trainer = Trainer()

    def before(m: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
        if step == 3:
            trainer.alpha = 0.1

    return step_loop(model, arm, loss_fn=trainer.compute_loss, steps=6, before=before)


class Run:
    """A training framework's run state: cycles (a loop that points back at its run) and a log
    that grows every step, as a Lightning Trainer holds."""

    def __init__(self) -> None:
        self.loop = type("Loop", (), {})()
        self.loop.run = self
        self.history: list[float] = []


class Owner(nn.Module):
    """The module that holds the model and the run (a LightningModule): its method is the loss."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net
        self.run = Run()
        self.aux_weight = 0.5

    def compute_loss(self, net: nn.Module, x: torch.Tensor) -> torch.Tensor:
        out = net(x)
        return out.pow(2).mean() + self.aux_weight * out.abs().mean()


def _owner_method_loss(model: nn.Module, arm: Arm) -> Extras:
    owner = Owner(model)
    step = arm.train_step(model, owner.compute_loss, sgd(model))
    kept: Extras = {}
    for i in range(6):
        if i == 3:
            owner.aux_weight = 0.0
        kept[f"loss{i}"] = loss = step(arm.randn(4, 6))
        owner.run.history.append(float(loss))  # the framework's log, every step
    return kept


AUX_WEIGHT = 0.5
"""A module-level loss weight the training script sets to 0 after a few steps."""


def _global_weighted_loss(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = m(x)
    return out.pow(2).mean() + AUX_WEIGHT * out.abs().mean()


def _global_loss_weight(model: nn.Module, arm: Arm) -> Extras:
    global AUX_WEIGHT

    def before(m: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
        global AUX_WEIGHT
        if step == 3:
            AUX_WEIGHT = 0.0

    try:
        return step_loop(model, arm, loss_fn=_global_weighted_loss, steps=6, before=before)
    finally:
        AUX_WEIGHT = 0.5


def _settings_weighted_loss(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = m(x)
    return out.pow(2).mean() + user_settings.sharpen(out.abs().mean())


def _settings_loss_weight(model: nn.Module, arm: Arm) -> Extras:
    """The loss calls a helper of the user's settings module, whose global the script changes."""

    def before(m: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
        user_settings.SHARPNESS = 0.0 if step >= 3 else 1.0

    try:
        return step_loop(model, arm, loss_fn=_settings_weighted_loss, steps=6, before=before)
    finally:
        user_settings.SHARPNESS = 1.0


def _criterion_module_attribute(model: nn.Module, arm: Arm) -> Extras:
    """An ``nn.SmoothL1Loss`` outside the model whose ``beta`` is changed after 3 steps."""
    criterion = nn.SmoothL1Loss(beta=1.0)

    def loss_fn(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        out = m(x)
        return criterion(out, torch.zeros_like(out))

    def before(m: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
        if step == 3:
            criterion.beta = 0.01

    return step_loop(model, arm, loss_fn=loss_fn, steps=6, before=before)


def _class_weighted(update: str) -> Callable[[nn.Module, Arm], Extras]:
    """``nn.CrossEntropyLoss(weight=w)`` outside the model; after 3 steps its class weights are
    rebalanced in place (``update="in_place"``: the graph reads the tensor) or replaced by a
    new tensor (``"replaced"``: an attribute the recording bakes in)."""

    def train(model: nn.Module, arm: Arm) -> Extras:
        criterion = nn.CrossEntropyLoss(weight=torch.ones(3, device=arm.device))

        def loss_fn(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
            return criterion(m(x), (x[:, 0] > 0).long() + (x[:, 1] > 0).long())

        def before(m: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
            if step == 3:
                new = torch.tensor([1.0, 2.0, 0.5], device=arm.device)
                if update == "in_place":
                    criterion.weight.copy_(new)
                else:
                    criterion.weight = new

        return step_loop(model, arm, loss_fn=loss_fn, steps=6, before=before)

    return train


class Reweighted:
    """Class weights kept in a numpy array by the loss and rebalanced in place between steps."""

    def __init__(self) -> None:
        import numpy as np  # here: numpy is no dependency of replaykit's core

        self.weights = np.ones(3, dtype=np.float32)

    def __call__(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        out = model(x)
        w = torch.tensor(
            self.weights, device=out.device
        )  # a copy: the graph keeps the recorded one
        return (out.pow(2) * w).mean()


def _loss_numpy_weights(model: nn.Module, arm: Arm) -> Extras:
    loss = Reweighted()

    def before(m: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
        if step >= 3:
            loss.weights[step % 3] *= 2.0  # the same array, new values

    return step_loop(model, arm, loss_fn=loss, steps=6, before=before)


class ReweightedGain(Reweighted):
    """Reads one weight of its numpy array as a Python float."""

    def __call__(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return model(x).pow(2).mean() * float(self.weights[0])


def _loss_numpy_gain(model: nn.Module, arm: Arm) -> Extras:
    loss = ReweightedGain()

    def before(m: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
        if step >= 3:
            loss.weights[0] *= 0.5

    return step_loop(model, arm, loss_fn=loss, steps=6, before=before)


class RecentLosses:
    """A loss normalised by the mean of the recent losses the training loop appends to its deque."""

    def __init__(self) -> None:
        self.recent: deque[float] = deque([1.0], maxlen=3)

    def __call__(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        raw = model(x).pow(2).mean()
        return raw / (sum(self.recent) / len(self.recent))


def _loss_deque(model: nn.Module, arm: Arm) -> Extras:
    loss = RecentLosses()
    opt = sgd(model)
    step = arm.train_step(model, loss, opt)
    kept: Extras = {}
    for i in range(6):
        value = step(arm.randn(4, 6))
        loss.recent.append(float(value) + 1.0)  # the loop's bookkeeping, between steps
        kept[f"loss{i}"] = value.detach()
    return kept


# --------------------------------------------------------------------------- an optimizer's Python
class WarmupSGD(torch.optim.Optimizer):
    """A hand-written SGD with a linear warm-up counted on ``self`` (Python state in ``step``)."""

    def __init__(self, params, lr: float = 0.1, warmup: int = 4) -> None:
        super().__init__(params, {"lr": lr})
        self.warmup, self.steps = warmup, 0

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:
        self.steps += 1
        scale = min(1.0, self.steps / self.warmup)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"] * scale)


def _warmup_optimizer(model: nn.Module, arm: Arm) -> Extras:
    return step_loop(model, arm, optimizer=lambda m: WarmupSGD(m.parameters()), steps=6)


# --------------------------------------------------------------------------- the step's own settings
def _set_on_step(
    attr: str, value: Callable[[], object], at: int = 3, **kwargs: object
) -> Callable[[nn.Module, Arm], Extras]:
    """A step loop that sets ``step.<attr>`` after the step recorded (a user tuning it mid-run)."""

    def train(model: nn.Module, arm: Arm) -> Extras:
        opt = sgd(model)
        step = arm.train_step(model, _mse, opt, **kwargs)
        kept: Extras = {}
        for i in range(7):
            if i == at:
                setattr(step, attr, value())
            kept[f"loss{i}"] = step(arm.randn(4, 6)).detach()
        return kept

    return train


def _smooth_l1_loss(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = m(x)
    return F.smooth_l1_loss(out, torch.zeros_like(out))


# --------------------------------------------------------------------------- a float lr every step
def _lambda_lr_float(model: nn.Module, arm: Arm) -> Extras:
    """LambdaLR over a float lr: the lr changes every step (most calls cannot replay)."""
    opt = sgd(model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: math.cos(s / 20))
    step = arm.train_step(model, _mse, opt)
    kept: Extras = {}
    for i in range(8):
        kept[f"loss{i}"] = step(arm.randn(4, 6)).detach()
        sched.step()
    return kept


def _teacher_in_dict_reloaded(model: nn.Module, arm: Arm) -> Extras:
    """Distillation from a frozen teacher that ``loss_fn`` reaches through a dict; at the third
    step a new checkpoint of it is loaded as new tensors (``load_state_dict(assign=True)``), as a
    loop does per epoch (every step: exact too, a new recording each call; hostile round 10)."""
    teacher = MLP().to(arm.device).requires_grad_(False)
    held = {"teacher": teacher}

    def distil(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return (m(x) - held["teacher"](x)).pow(2).mean()

    step = arm.train_step(model, distil, sgd(model))
    kept: Extras = {}
    for i in range(6):
        if i == 2:
            new = {k: v * 0.9 for k, v in teacher.state_dict().items()}
            teacher.load_state_dict(new, assign=True)
        kept[f"loss{i}"] = step(arm.randn(4, 6)).detach()
    return kept


PATTERNS: list[Pattern] = [
    HC.pattern(
        "step_forward_hook_stats",
        "a forward hook logs activation statistics while a TrainStep records",
        mlp(),
        _forward_hook_stats,
        guard="hooks",
        api="step",
    ),
    HC.pattern(
        "step_backward_hook_grad_norm",
        "a full backward hook logs a layer's gradient norm",
        mlp(),
        _backward_hook_grad_norm,
        guard="hooks",
        api="step",
    ),
    HC.pattern(
        "step_global_forward_hook",
        "a global module forward hook counts calls per module",
        mlp(),
        _global_forward_hook,
        guard="hooks",
        api="step",
    ),
    HC.pattern(
        "step_forward_hook_added_midway",
        "a forward hook attached after the step recorded",
        mlp(),
        _hook_added_midway,
        guard="hooks",
        api="step",
    ),
    HC.pattern(
        "global_forward_hook",
        "a global module forward hook around a captured model's loop",
        mlp(),
        _global_hook_capture,
    ),
    HC.pattern(
        "forward_hook_stats",
        "a forward hook logs activation statistics under rk.capture",
        mlp(),
        _capture_hook_stats,
    ),  # capture retires on hooks unconditionally: no switch to turn off
    HC.pattern(
        "step_focal_gamma_schedule",
        "a focal loss object's gamma annealed every step",
        mlp(),
        _focal_gamma_schedule,
        guard="loss_inputs",
        api="step",
    ),
    HC.pattern(
        "step_closure_loss_weight",
        "an auxiliary loss weight in a closure set to 0 after 3 steps",
        mlp(),
        _closure_loss_weight,
        guard="loss_inputs",
        api="step",
    ),
    HC.pattern(
        "step_closure_tensor_replaced",
        "centres in a closure cell replaced by a new tensor after 3 steps",
        mlp(),
        _closure_tensor_replaced,
        guard="loss_inputs",
        api="step",
    ),
    HC.pattern(
        "step_bound_method_loss",
        "loss_fn is a trainer's bound method reading self.alpha, changed after 3 steps",
        mlp(),
        _bound_method_loss,
        guard="loss_inputs",
        api="step",
    ),
    HC.pattern(
        "step_owner_method_loss",
        "loss_fn is a method of the module holding the model and a run (cycles, a growing log), reading self.aux_weight",
        mlp(),
        _owner_method_loss,
        guard="loss_inputs",
        api="step",
    ),
    HC.pattern(
        "step_global_loss_weight",
        "a module-level loss weight set to 0 after 3 steps",
        mlp(),
        _global_loss_weight,
        guard="loss_inputs",
        api="step",
    ),
    HC.pattern(
        "step_settings_module_helper",
        "the loss calls a helper in the user's settings module, whose global is set to 0 after 3 steps",
        mlp(),
        _settings_loss_weight,
        guard="loss_inputs",
        api="step",
    ),
    HC.pattern(
        "step_criterion_module_attribute",
        "an nn.SmoothL1Loss outside the model, its beta changed",
        mlp(),
        _criterion_module_attribute,
        guard="loss_inputs",
        api="step",
    ),
    HC.pattern(
        "step_class_weights_in_place",
        "CrossEntropyLoss(weight=w) outside the model, w rebalanced in place",
        mlp(),
        _class_weighted("in_place"),
        api="step",
    ),
    HC.pattern(
        "step_class_weights_replaced",
        "CrossEntropyLoss(weight=w) outside the model, w replaced by a new tensor",
        mlp(),
        _class_weighted("replaced"),
        guard="loss_inputs",
        api="step",
    ),
    HC.pattern(
        "step_loss_numpy_weights",
        "class weights in a numpy array held by the loss, rebalanced in place",
        mlp(),
        _loss_numpy_weights,
        guard="loss_inputs",
        api="step",
        unsafe_never=ARRAY_COPY_LIVE,
    ),
    HC.pattern(
        "step_loss_numpy_gain_float",
        "the loss reads float(array[0]) of a numpy array it holds, changed in place",
        mlp(),
        _loss_numpy_gain,
        guard="loss_inputs",
        api="step",
    ),
    HC.pattern(
        "step_loss_deque",
        "the loss divides by the mean of a deque of recent losses the loop appends to",
        mlp(),
        _loss_deque,
        guard="loss_inputs",
        api="step",
    ),
    HC.pattern(  # hostile round 10: silent until a module in a container keyed its tensors
        "step_frozen_teacher_in_dict_reloaded",
        "a frozen teacher loss_fn reaches through a dict, a new checkpoint of it loaded as new tensors midway",
        built(MLP),
        _teacher_in_dict_reloaded,
        guard="loss_inputs",
        api="step",
    ),
    HC.pattern(
        "step_warmup_optimizer",
        "a hand-written optimizer with a warm-up counter on self",
        mlp(),
        _warmup_optimizer,
        guard="optimizer_trust",
        api="step",
    ),
    HC.pattern(
        "step_accumulate_changed",
        "step.accumulate = 4 after the step recorded (must raise)",
        mlp(),
        _set_on_step("accumulate", lambda: 4),
        api="step",
    ),
    HC.pattern(
        "step_loss_fn_swapped",
        "step.loss_fn replaced by another loss after recording (must raise)",
        mlp(),
        _set_on_step("loss_fn", lambda: _smooth_l1_loss),
        api="step",
    ),
    HC.pattern(
        "step_max_norm_changed",
        "step.max_norm tightened after recording (clipping keys the recording)",
        mlp(),
        _set_on_step("max_norm", lambda: 0.01, max_norm=0.5),
        guard="host_values",
        api="step",
    ),
    HC.pattern(
        "step_lambda_lr_float",
        "LambdaLR over a float lr: the lr changes every step",
        mlp(),
        _lambda_lr_float,
        api="step",
    ),
]

KNOWN_LIMITS: list[Pattern] = []
"""Still silent differences (README, Known limits): kept out of ``PATTERNS``."""
