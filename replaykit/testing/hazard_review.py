"""Patterns an adversarial review found after the first catalogue: each was a silent difference
(or an unclear error) on the emulated backend before the fix named beside it.

``REVIEW`` joins the catalogue (``hazard_patterns.PATTERNS``); ``KNOWN_LIMITS`` are still
silent differences, documented in the README, and their tests are strict xfails, so a fix
shows up as a failure to update.
"""

from __future__ import annotations

import dataclasses
import types

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .hazard_patterns import MLP, Arm, Extras, Pattern, _loop, _sgd


def _steps(model: nn.Module, arm: Arm, step, n: int = 4, opt=None) -> Extras:
    """``n`` optimizer steps of ``step(model, arm) -> loss``, keeping each loss."""
    opt = opt or _sgd(model)
    kept: Extras = {}
    for i in range(n):
        opt.zero_grad(set_to_none=True)
        loss = step(model, arm)
        loss.backward()
        opt.step()
        kept[f"loss{i}"] = loss.detach()
    return kept


# ---------------------------------------------------------------- parameters: a shared submodule
class Albert(nn.Module):
    """One block registered three times (ALBERT): stand-ins used to stay in its _parameters."""

    def __init__(self) -> None:
        super().__init__()
        block = nn.Linear(6, 6)
        self.layers = nn.ModuleList([block] * 3)
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


def _albert(model: nn.Module, arm: Arm) -> Extras:
    kept = _loop(model, arm, steps=4)
    kept["still_parameter"] = torch.tensor(float(isinstance(model.layers[0].weight, nn.Parameter)))
    return kept


# ---------------------------------------------------------------- side effects: what the module holds
class Cache(nn.Module):
    """Writes a feature into a dict it holds; the loss reads it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 8), nn.Linear(8, 3)
        self.feats: dict[str, torch.Tensor] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc1(x))
        self.feats["h"] = h
        return self.fc2(h)


class Stats(nn.Module):
    """Appends a statistic to a list it holds."""

    def __init__(self) -> None:
        super().__init__()
        self.net = MLP()
        self.log: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.net(x)
        self.log.append(out.detach().mean())
        return out


def _stats(model: nn.Module, arm: Arm) -> Extras:
    kept = _loop(model, arm, steps=4)
    kept["entries"] = torch.tensor(float(len(model.log)))
    return kept


class TensorAttrWithGrad(nn.Module):
    """A trainable temperature kept as a plain tensor attribute (CLIP's logit_scale, not a Parameter)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = MLP()
        self.logit_scale = torch.tensor(1.5, requires_grad=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x) * self.logit_scale.exp()


def _tensor_attr(model: nn.Module, arm: Arm) -> Extras:
    opt = torch.optim.SGD([*model.parameters(), model.logit_scale], lr=0.1)
    kept = _steps(model, arm, lambda m, a: m(a.randn(4, 6)).pow(2).mean(), opt=opt)
    kept["scale"] = model.logit_scale.detach().clone()
    return kept


# ---------------------------------------------------------------- host values held out of the tree
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


# ---------------------------------------------------------------- inputs: an output that is the input
class ReturnsInputView(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.fc(x[:, :3] * 1.0), x[:, 3:]


def _view_then_inplace(model: nn.Module, arm: Arm) -> Extras:
    def step(m: nn.Module, a: Arm) -> torch.Tensor:
        x = a.randn(4, 6)
        y, view = m(x)
        view.mul_(0.0)  # eager zeroes the caller's x[:, 3:]
        return y.pow(2).mean() + x.pow(2).mean()

    return _steps(model, arm, step)


# ---------------------------------------------------------------- known limits (still silent)
class Seeded(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = MLP(p=0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch.manual_seed(123)  # not an aten op: a tape (and a graph) does not repeat it
        return self.net(x)


class Checkpointed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = MLP(d_out=6, p=0.3)
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(checkpoint(self.block, x, use_reentrant=False))


class ClassScaled(nn.Module):
    SCALE = 1.0

    def __init__(self) -> None:
        super().__init__()
        self.net = MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x) * type(self).SCALE


def _class_attribute(model: nn.Module, arm: Arm) -> Extras:
    try:
        return _loop(model, arm, steps=4, before=lambda m, step: setattr(ClassScaled, "SCALE", 1.0 / (step + 1)))
    finally:
        ClassScaled.SCALE = 1.0


REVIEW = [
    Pattern("shared_submodule_albert", "parameters", "one block registered three times (ALBERT)",
            lambda d: Albert().to(d), _albert),
    Pattern("feature_dict_in_forward", "side_effects", "forward writes a feature into a dict the loss reads",
            lambda d: Cache().to(d),
            lambda m, a: _steps(m, a, lambda m, a: m(a.randn(4, 6)).pow(2).mean() + 0.1 * m.feats["h"].pow(2).mean()), guard="record_probe"),
    Pattern("list_append_in_forward", "side_effects", "forward appends a statistic to a list it holds",
            lambda d: Stats().to(d), _stats, guard="record_probe"),
    Pattern("object_attribute_set_in_forward", "side_effects", "forward stores its output on an object it holds",
            lambda d: _HeldState().to(d),
            lambda m, a: _steps(m, a, lambda m, a: (m(a.randn(4, 6)), m.state.last)[1].pow(2).mean()), guard="record_probe"),
    Pattern("tensor_attribute_with_grad", "side_effects", "a trainable plain tensor attribute (logit_scale)",
            lambda d: TensorAttrWithGrad().to(d), _tensor_attr, guard="record_probe"),
    Pattern("slots_config", "host_values", "a __slots__ dataclass config whose scale is annealed",
            lambda d: SlotScaled().to(d),
            lambda m, a: _loop(m, a, steps=4, before=lambda m, step: setattr(m.cfg, "scale", 1.0 / (step + 1))), guard="module_state"),
    Pattern("hidden_teacher_eval", "host_values", "a teacher kept in a list is put in eval mode",
            lambda d: Distill(d).to(d),
            lambda m, a: _loop(m, a, steps=4, before=lambda m, step: m._teacher[0].eval() if step == 2 else None), guard="module_state"),
    Pattern("hidden_teacher_dropout_p", "host_values", "a teacher kept in a list has its dropout p annealed",
            lambda d: Distill(d).to(d),
            lambda m, a: _loop(m, a, steps=4, before=lambda m, step: setattr(m._teacher[0].drop, "p", 0.5 - 0.1 * step)), guard="module_state"),
    Pattern("output_view_of_input_mutated", "inputs", "forward returns x[:, 3:]; the caller zeroes it in place",
            lambda d: ReturnsInputView().to(d), _view_then_inplace, guard="record_probe"),
]


class _HeldState(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = MLP()
        self.state = types.SimpleNamespace(last=None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.net(x)
        self.state.last = out
        return out


# Silent once; now the recording's verification (its first replay against eager) routes them eager.
REVIEW += [
    Pattern("manual_seed_in_forward", "side_effects", "torch.manual_seed inside forward (not an aten op)",
            lambda d: Seeded().to(d), lambda m, a: _loop(m, a, steps=4), guard="verify_recording"),
    Pattern("checkpointed_dropout", "side_effects", "torch.utils.checkpoint around a block with dropout",
            lambda d: Checkpointed().to(d), lambda m, a: _loop(m, a, steps=4), guard="verify_recording"),
]

KNOWN_LIMITS = [
    Pattern("class_attribute", "host_values", "a class attribute read in forward changes",
            lambda d: ClassScaled().to(d), _class_attribute),
]
