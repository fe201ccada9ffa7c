"""Host-side values a graph freezes: submodules' modes, BN momentum, dropout p, float and flag
attributes, config objects, values held outside the module tree.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from . import user_settings
from .pattern import MLP, Arm, Extras, Pattern, loop, mlp, set_at, setter, step_loop
from .writing import HazardClass, Train, built, each_step, looped, stepped

HAZARD = "host_values"
HC = HazardClass(HAZARD)


class Tempered(nn.Module):
    """Logits divided by a Python float temperature the training loop anneals."""

    def __init__(self) -> None:
        super().__init__()
        self.net = MLP()
        self.temperature = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.log_softmax(self.net(x) / self.temperature, dim=1)


class Scaled(nn.Module):
    """Reads ``cfg.scale`` of a config object passed as an argument."""

    def __init__(self) -> None:
        super().__init__()
        self.net = MLP()

    def forward(self, x: torch.Tensor, cfg: Config) -> torch.Tensor:
        return self.net(x) * cfg.scale


class Config:
    def __init__(self, scale: float) -> None:
        self.scale = scale


class Branchy(nn.Module):
    """A boolean attribute switches a residual branch on (a curriculum flag)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 6)
        self.fc2 = nn.Linear(6, 3)
        self.use_residual = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc1(x))
        if self.use_residual:
            h = h + x
        return self.fc2(h)


def _config_arg(model: nn.Module, arm: Arm) -> Extras:
    cfg = Config(1.0)

    def call(m: nn.Module, x: torch.Tensor, step: int) -> torch.Tensor:
        cfg.scale = 1.0 / (step + 1)  # the same object, a new value
        return m(x, cfg)

    return loop(model, arm, steps=4, call=call)


@dataclasses.dataclass(slots=True)
class SlotConfig:
    scale: float = 1.0


class SlotScaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = MLP()
        self.cfg = SlotConfig()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x) * self.cfg.scale


class Distill(nn.Module):
    """A frozen teacher kept in a list (so it is not a registered submodule)."""

    def __init__(self, device: str = "cpu") -> None:
        super().__init__()
        self.net = MLP()
        teacher = MLP(p=0.5).to(device)  # ``.to()`` on the student does not reach it
        teacher.requires_grad_(False)
        self._teacher = [teacher]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            target = self._teacher[0](x)
        return self.net(x) - target


class ClassScaled(nn.Module):
    SCALE = 1.0

    def __init__(self) -> None:
        super().__init__()
        self.net = MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x) * type(self).SCALE


#: a module-level setting the forward reads (a schedule writes it between steps)
TEMPERATURE = 1.0


class GlobalTempered(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x) / TEMPERATURE


def _global_temperature(model: nn.Module, arm: Arm) -> Extras:
    global TEMPERATURE
    try:

        def anneal(m: nn.Module, step: int) -> None:
            global TEMPERATURE
            TEMPERATURE = 2.0 if step >= 2 else 1.0  # one change: recorded anew, then replayed

        return loop(model, arm, steps=4, before=anneal)
    finally:
        TEMPERATURE = 1.0


class SettingsScaled(nn.Module):
    """Reads a plain value of the user's settings module (``user_settings.SCALE``)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x) * user_settings.SCALE


class HelperSharpened(nn.Module):
    """Calls a helper function of another module, which reads that module's global."""

    def __init__(self) -> None:
        super().__init__()
        self.net = MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return user_settings.sharpen(self.net(x))


class GradReverse(torch.autograd.Function):
    """A gradient reversal layer (DANN): identity forward, ``-LAMBD`` times the gradient backward."""

    LAMBD = 1.0  # the training loop anneals it

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return grad * -GradReverse.LAMBD


class DomainAdversarial(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Linear(6, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(GradReverse.apply(torch.tanh(self.features(x))))


def _grad_reversal(model: nn.Module, arm: Arm) -> Extras:
    try:
        return loop(
            model,
            arm,
            steps=4,
            before=lambda m, step: setattr(GradReverse, "LAMBD", 0.5 if step >= 2 else 1.0),
        )
    finally:
        GradReverse.LAMBD = 1.0


class ScheduledScale(nn.Module):
    """Calls a schedule function it was handed (``self.scale = fn``), whose closure the loop advances."""

    def __init__(self) -> None:
        super().__init__()
        self.net = MLP()
        done = [0]
        self.scale = lambda: 1.0 / (1 + done[0])
        self.advance = lambda: done.__setitem__(0, done[0] + 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x) * self.scale()


def _scheduled_scale(model: nn.Module, arm: Arm) -> Extras:
    return loop(model, arm, steps=4, before=lambda m, step: m.advance() if step == 2 else None)


def _settings_at(name: str, at: int, value: float) -> Callable[[nn.Module, Arm], Extras]:
    """A loop whose schedule sets ``user_settings.<name>`` once, at step ``at`` (then put back)."""

    def train(model: nn.Module, arm: Arm) -> Extras:
        try:
            return loop(
                model,
                arm,
                steps=4,
                before=lambda m, step: setattr(user_settings, name, value if step >= at else 1.0),
            )
        finally:
            setattr(user_settings, name, 1.0)

    return train


def _class_attribute(model: nn.Module, arm: Arm) -> Extras:
    try:
        return loop(
            model,
            arm,
            steps=4,
            before=lambda m, step: setattr(ClassScaled, "SCALE", 1.0 / (step + 1)),
        )
    finally:
        ClassScaled.SCALE = 1.0


# --------------------------------------------------------------------------- whole steps (rk.TrainStep)
def _lr_scaled_at(
    at: int, factor: float
) -> Callable[[nn.Module, torch.optim.Optimizer, int], None]:
    """A ``step_loop`` ``before``: every group's float lr scaled by hand once, at step ``at``."""

    def before(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
        if step == at:
            for group in opt.param_groups:
                group["lr"] = group["lr"] * factor

    return before


def _temperature_at(
    at: int, value: float
) -> Callable[[nn.Module, torch.optim.Optimizer, int], None]:
    def before(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
        if step == at:
            model.temperature = value

    return before


class _DictTeacher(MLP):
    """A student minus a frozen teacher kept in a plain dict attribute (not a registered module)."""

    def __init__(self, device: str) -> None:
        super().__init__()
        self.held = {"teacher": MLP().to(device).requires_grad_(False)}
        self.to(device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) - self.held["teacher"](x)


def _reload_teacher(model: nn.Module, step: int) -> None:
    """At the third step a new teacher checkpoint is loaded as new tensors (``assign=True``), as a
    loop does per epoch (every step: exact too, a new recording each call; hostile round 10)."""
    if step == 2:
        teacher = model.held["teacher"]
        new = {k: v * 0.9 for k, v in teacher.state_dict().items()}
        teacher.load_state_dict(new, assign=True)


PATTERNS: list[Pattern] = [
    HC.pattern(
        "submodule_bn_eval",
        "model.bn.eval() on a submodule after recording (BN frozen)",
        mlp(bn=True),
        lambda m, a: loop(m, a, steps=4, before=set_at(2, lambda m: m.bn.eval())),
        guard="module_state",
    ),
    HC.pattern(
        "submodule_dropout_eval",
        "model.drop.eval() on a submodule after recording",
        mlp(p=0.5),
        lambda m, a: loop(m, a, steps=4, before=set_at(2, lambda m: m.drop.eval())),
        guard="module_state",
    ),
    *HC.twins(  # hostile round 10's teacher, held by the model: its tensors key the recording
        "teacher_in_dict_reloaded",
        "a frozen teacher in a plain dict attribute, a new checkpoint of it loaded as new tensors midway",
        _DictTeacher,
        looped(steps=6, before=_reload_teacher),
        stepped(steps=6, before=each_step(_reload_teacher)),
        guard="module_state",
    ),
    HC.pattern(
        "bn_momentum_changed",
        "bn.momentum changed after recording",
        mlp(bn=True),
        looped(steps=4, before=setter("momentum", 0.5, sub="bn")),
        guard="module_state",
    ),
    HC.pattern(
        "bn_momentum_none_after_record",
        "bn.momentum = None (cumulative average) after recording",
        mlp(bn=True),
        looped(steps=4, before=setter("momentum", None, sub="bn")),
        guard="module_state",
    ),
    HC.pattern(
        "dropout_p_annealed",
        "dropout.p annealed every step",
        mlp(p=0.5),
        lambda m, a: loop(m, a, steps=4, before=lambda m, s: setattr(m.drop, "p", 0.5 - 0.15 * s)),
        guard="module_state",
    ),
    HC.pattern(
        "temperature_schedule",
        "a Python float attribute used as a temperature schedule",
        built(Tempered),
        lambda m, a: loop(
            m,
            a,
            steps=4,
            before=lambda m, s: setattr(m, "temperature", 1.0 / (1 + s)),
            loss=lambda o: -o[:, 0].mean(),
        ),
        guard="module_state",
    ),
    HC.pattern(
        "config_object_argument",
        "an argument object's .scale changes between calls",
        built(Scaled),
        _config_arg,
        guard="argument_values",
    ),
    HC.pattern(
        "flag_attribute_branch",
        "a boolean attribute switches a residual branch",
        built(Branchy),
        looped(steps=4, before=setter("use_residual", True)),
        guard="module_state",
    ),
    HC.pattern(
        "slots_config",
        "a __slots__ dataclass config whose scale is annealed",
        built(SlotScaled),
        lambda m, a: loop(
            m, a, steps=4, before=lambda m, step: setattr(m.cfg, "scale", 1.0 / (step + 1))
        ),
        guard="module_state",
    ),
    HC.pattern(
        "hidden_teacher_eval",
        "a teacher kept in a list is put in eval mode",
        lambda d: Distill(d).to(d),
        lambda m, a: loop(
            m, a, steps=4, before=lambda m, step: m._teacher[0].eval() if step == 2 else None
        ),
        guard="module_state",
    ),
    HC.pattern(
        "hidden_teacher_dropout_p",
        "a teacher kept in a list has its dropout p annealed",
        lambda d: Distill(d).to(d),
        lambda m, a: loop(
            m, a, steps=4, before=lambda m, step: setattr(m._teacher[0].drop, "p", 0.5 - 0.1 * step)
        ),
        guard="module_state",
    ),
    HC.pattern(
        "step_plain_sgd",
        "a plain SGD step (momentum, float lr) under rk.TrainStep: the control",
        mlp(),
        stepped(),
        api="step",
    ),
    HC.pattern(
        "step_float_lr_changed",
        "a float lr halved by hand after the step recorded",
        mlp(),
        stepped(steps=6, before=_lr_scaled_at(3, 0.5)),
        guard="host_values",
        api="step",
    ),
    HC.pattern(
        "step_temperature_changed",
        "a float attribute the forward reads, changed after recording",
        built(Tempered),
        lambda m, a: step_loop(
            m, a, loss_fn=lambda m, x: -m(x)[:, 0].mean(), steps=6, before=_temperature_at(3, 0.5)
        ),
        guard="module_state",
        api="step",
    ),
]

PATTERNS += [
    # read outside the module tree: keyed by the recorder's forward inputs
    HC.pattern(
        "class_attribute",
        "a class attribute read in forward changes",
        built(ClassScaled),
        _class_attribute,
        guard="forward_inputs",
    ),
    HC.pattern(
        "grad_reversal_class_attribute",
        "a gradient reversal Function (DANN) whose lambda, a class attribute, the loop anneals",
        built(DomainAdversarial),
        _grad_reversal,
        guard="forward_inputs",
        cuda_only="the emulated backend runs a Function's backward Python at every backward; a CUDA graph freezes it",
    ),
    HC.pattern(
        "function_attribute_schedule",
        "a schedule function held as a module attribute, its closure advanced by the loop",
        built(ScheduledScale),
        _scheduled_scale,
        # the module guard polls a closure function attribute too since hostile round 12
        guard="forward_inputs+module_state",
    ),
    *(
        HC.pattern(name, what, built(net), _settings_at(attr, 2, value), guard="forward_inputs")
        for name, what, net, attr, value in (
            (
                "settings_module_value",
                "a plain value of the user's settings module (settings.SCALE) the forward reads, changed by the loop",
                SettingsScaled,
                "SCALE",
                0.5,
            ),
            (
                "helper_function_global",
                "a helper function in another module, reading that module's global, changed by the loop",
                HelperSharpened,
                "SHARPNESS",
                3.0,
            ),
        )
    ),
    HC.pattern(
        "global_temperature",
        "a module-level temperature the forward reads, annealed by the loop",
        built(GlobalTempered),
        _global_temperature,
        guard="forward_inputs",
    ),
]


EPOCH = 0  # a module global the loop advances, which the forwards below read only through code they call


class EpochSchedule:
    """A schedule object whose value is a property computed from the global ``EPOCH``."""

    @property
    def scale(self) -> float:
        return 1.0 / (1 + EPOCH)


class PropertyScaled(nn.Module):
    """Reads ``self.sched.scale``: a held schedule's property, which reads the global epoch."""

    def __init__(self) -> None:
        super().__init__()
        self.net = MLP()
        self.sched = EpochSchedule()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x) * self.sched.scale


class DecoratedMethodScaled(nn.Module):
    """Calls its own ``@torch.no_grad()`` method, which reads the global epoch: the decorator's
    wrapper is torch's code, the method it wraps (``__wrapped__``) the user's."""

    def __init__(self) -> None:
        super().__init__()
        self.net = MLP()

    @torch.no_grad()
    def scale(self) -> float:
        return 1.0 / (1 + EPOCH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x) * self.scale()


def _epoch_from(at: int) -> Callable[[nn.Module, int], None]:
    """``before(model, step)``: the epoch is 1 from step ``at`` (recorded anew, then replayed)."""

    def before(model: nn.Module, step: int) -> None:
        global EPOCH
        EPOCH = 1 if step >= at else 0

    return before


def _epoch_put_back(train: Train) -> Train:
    def run(model: nn.Module, arm: Arm) -> Extras:
        global EPOCH
        try:
            return train(model, arm)
        finally:
            EPOCH = 0

    return run


PATTERNS += [
    # a global read through code the forward reaches by attribute: keyed as one it names
    *(
        pattern
        for name, what, net in (
            (
                "global_through_property",
                "a held schedule's @property reads a module global the loop advances",
                PropertyScaled,
            ),
            (
                "global_through_decorated_method",
                "the model's own @torch.no_grad() method reads a module global the loop advances",
                DecoratedMethodScaled,
            ),
        )
        for pattern in HC.twins(
            name,
            what,
            built(net),
            _epoch_put_back(looped(steps=4, before=_epoch_from(2))),
            _epoch_put_back(stepped(before=each_step(_epoch_from(2)))),
            guard="forward_inputs",
        )
    ),
]


def _halved_linear(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, self.weight, self.bias) * 0.5


def _patch_fc1(model: nn.Module) -> None:
    """A submodule's forward replaced on the instance (an adapter, a debugging wrapper)."""
    model.fc1.forward = types.MethodType(_halved_linear, model.fc1)


PATTERNS += [
    # what a module calls instead of its class's forward: keyed by identity
    *HC.twins(
        "submodule_forward_patched",
        "a submodule's forward replaced on the instance after recording",
        mlp(),
        looped(steps=4, before=set_at(2, _patch_fc1)),
        lambda m, a: step_loop(m, a, before=lambda m, o, s: _patch_fc1(m) if s == 2 else None),
        guard="module_state",
    ),
]


class Rebound(MLP):
    """An MLP of its own class, so that rebinding the class's forward touches no other pattern."""


def _tanh_forward(self: MLP, x: torch.Tensor) -> torch.Tensor:
    return self.fc2(torch.tanh(self.fc1(x)))


def _rebind_at(cls: type, name: str, value: Any, step: int) -> Callable[..., None]:
    """Before ``step``: ``cls.<name> = value`` (a script rebinding a method on the class)."""

    def rebind(*args: Any) -> None:  # loop's (model, step) or step_loop's (model, optimizer, step)
        if args[-1] == step:
            setattr(cls, name, value)

    return rebind


def _class_rebound(cls: type, name: str, value: Any) -> tuple[Train, Train]:
    """The capture loop and the whole step, ``cls.<name>`` rebound at step 2 and put back after."""

    def restoring(train: Train) -> Train:
        def run(model: nn.Module, arm: Arm) -> Extras:
            original = vars(cls).get(name)
            try:
                return train(model, arm)
            finally:
                if original is None:
                    delattr(cls, name)
                else:
                    setattr(cls, name, original)

        return run

    rebind = _rebind_at(cls, name, value, 2)
    return (
        restoring(looped(steps=4, before=rebind)),
        restoring(lambda m, a: step_loop(m, a, before=rebind)),
    )


class Helped(MLP):
    """An MLP whose forward calls a method of its class: the method is what a script rebinds."""

    def act(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


PATTERNS += HC.twins(
    "class_forward_rebound",
    "the model class's forward rebound (Model.forward = f) after recording",
    built(Rebound),
    *_class_rebound(Rebound, "forward", _tanh_forward),
    guard="forward_inputs",
)
PATTERNS += HC.twins(
    "class_helper_rebound",
    "a method the forward calls rebound on the class (Model.act = f) after recording",
    built(Helped),
    *_class_rebound(Helped, "act", lambda self, x: torch.tanh(x)),
    guard="forward_inputs",
)


class HeldConfig:
    """A config whose defaults live on the class: an instance without a value of its own reads them."""

    temperature = 1.0


class ConfigTempered(nn.Module):
    """Holds a config object (``as_class=False``) or the config class itself (config-as-class)."""

    def __init__(self, as_class: bool) -> None:
        super().__init__()
        self.net = MLP()
        self.cfg = HeldConfig if as_class else HeldConfig()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x) / self.cfg.temperature


def _held_config_trains() -> tuple[Train, Train]:
    """``HeldConfig.temperature`` set by the loop at step 2 (the instance keeps no value of its own)."""

    def anneal(m: nn.Module, step: int) -> None:
        HeldConfig.temperature = 2.0 if step >= 2 else 1.0

    def put_back(train: Train) -> Train:
        def run(m: nn.Module, a: Arm) -> Extras:
            try:
                return train(m, a)
            finally:
                HeldConfig.temperature = 1.0

        return run

    return put_back(looped(steps=4, before=anneal)), put_back(stepped(before=each_step(anneal)))


for _as_class, _name, _what in (
    (False, "held_config_class_default", "a held config object's class default (Config.temperature) set by the loop"),
    (True, "held_config_class", "config-as-class held by the module (self.cfg = Config), its attribute set by the loop"),
):  # fmt: skip
    PATTERNS += HC.twins(
        _name,
        _what,
        built(ConfigTempered, _as_class),
        *_held_config_trains(),
        guard="forward_inputs",
    )

KNOWN_LIMITS: list[Pattern] = []
"""Still silent differences (README, Known limits): kept out of ``PATTERNS``."""
