"""Parameters that are not the module's own at call time: fast weights, functional_call,
hypernetworks, parametrizations, a block registered several times.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.func import functional_call

from .pattern import MLP, Arm, Extras, Pattern, loop, mlp, set_at, sgd
from .writing import HazardClass, built, looped, stepped

HAZARD = "parameters"
HC = HazardClass(HAZARD)


def _fast_weights(model: nn.Module, arm: Arm) -> Extras:
    def call(m: nn.Module, x: torch.Tensor, step: int) -> torch.Tensor:
        fast = {n: p * 0.9 for n, p in m.named_parameters()}  # differentiable w.r.t. p
        return functional_call(m, fast, (x,))

    return loop(model, arm, call=call)


def _maml(model: nn.Module, arm: Arm) -> Extras:
    opt = sgd(model)
    kept: Extras = {}
    for step in range(3):
        opt.zero_grad(set_to_none=True)
        support, query = arm.randn(4, 6), arm.randn(4, 6)
        named = dict(model.named_parameters())
        inner = model(support).pow(2).mean()
        grads = torch.autograd.grad(inner, list(named.values()), create_graph=True)
        fast = {n: p - 0.1 * g for (n, p), g in zip(named.items(), grads, strict=True)}
        outer = functional_call(model, fast, (query,)).pow(2).mean()
        outer.backward()
        opt.step()
        kept[f"outer{step}"] = outer.detach()
    return kept


def _sam(model: nn.Module, arm: Arm, functional: bool) -> Extras:
    opt = sgd(model)
    named = dict(model.named_parameters())
    kept: Extras = {}
    for step in range(3):
        x = arm.randn(4, 6)
        opt.zero_grad(set_to_none=True)
        model(x).pow(2).mean().backward()
        norm = torch.stack([p.grad.norm() for p in named.values()]).norm()
        eps = {n: (0.05 * p.grad / (norm + 1e-12)).detach() for n, p in named.items()}
        opt.zero_grad(set_to_none=True)
        if functional:
            sharp = (
                functional_call(model, {n: p + eps[n] for n, p in named.items()}, (x,))
                .pow(2)
                .mean()
            )
            sharp.backward()
        else:
            with torch.no_grad():
                for n, p in named.items():
                    p.add_(eps[n])
            sharp = model(x).pow(2).mean()
            sharp.backward()
            with torch.no_grad():
                for n, p in named.items():
                    p.sub_(eps[n])
        opt.step()
        kept[f"sharp{step}"] = sharp.detach()
    return kept


class HyperTarget(nn.Module):
    """The captured target net; its head's weight is supplied by a hypernetwork."""

    def __init__(self) -> None:
        super().__init__()
        self.body = MLP(d_out=4)
        self.hyper = nn.Linear(2, 12)  # task embedding -> a 3x4 head weight
        self.head = nn.Linear(4, 3)


def _hypernet(model: nn.Module, arm: Arm) -> Extras:
    opt = sgd(model)
    task = arm.randn(1, 2)
    kept: Extras = {}
    for step in range(3):
        opt.zero_grad(set_to_none=True)
        feats = model.body(arm.randn(4, 6))
        weight = model.hyper(task).view(3, 4)
        out = functional_call(model.head, {"weight": weight}, (feats,))
        loss = out.pow(2).mean()
        loss.backward()
        opt.step()
        kept[f"loss{step}"] = loss.detach()
    return kept


def _parametrize_after(kind: str):
    def fn(model: nn.Module) -> None:
        if kind == "weight_norm":
            torch.nn.utils.parametrizations.weight_norm(model.fc1)
        else:
            torch.nn.utils.parametrizations.orthogonal(model.fc1)

    return lambda m, a: loop(m, a, steps=4, before=set_at(2, fn))


def _weight_norm_model(device: str) -> nn.Module:
    model = MLP()
    torch.nn.utils.parametrizations.weight_norm(model.fc1)
    return model.to(device)


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
    kept = loop(model, arm, steps=4)
    kept["still_parameter"] = torch.tensor(float(isinstance(model.layers[0].weight, nn.Parameter)))
    return kept


def _replace_bias(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    """At step 3 ``fc2.bias`` becomes a new Parameter (same values); the user moves its optimizer slot."""
    if step != 3:
        return
    old = model.fc2.bias
    model.fc2.bias = nn.Parameter(old.detach().clone())
    for group in opt.param_groups:
        group["params"] = [model.fc2.bias if p is old else p for p in group["params"]]
    if old in opt.state:
        opt.state[model.fc2.bias] = opt.state.pop(old)


PATTERNS: list[Pattern] = [
    HC.pattern(
        "functional_call_fast_weights",
        "torch.func.functional_call with fast weights",
        mlp(),
        _fast_weights,
        guard="param_identity",
    ),
    HC.pattern(
        "maml_inner_step",
        "MAML: create_graph inner step, functional_call outer loss",
        mlp(),
        _maml,
        guard="repeat_backward",
    ),
    HC.pattern(
        "sam_functional_perturbed",
        "SAM's perturbed pass through functional_call",
        mlp(),
        lambda m, a: _sam(m, a, functional=True),
        guard="param_identity",
    ),
    HC.pattern(
        "sam_inplace_perturbed",
        "SAM perturbing the weights in place (a control)",
        mlp(),
        lambda m, a: _sam(m, a, functional=False),
    ),
    HC.pattern(
        "hypernetwork_head",
        "a hypernetwork supplies a captured head's weight (stateless)",
        built(HyperTarget),
        _hypernet,
        guard="param_identity",
        target=lambda m: m.head,
    ),
    HC.pattern(
        "weight_norm_after_capture",
        "parametrizations.weight_norm registered after recording",
        mlp(),
        _parametrize_after("weight_norm"),
        guard="param_identity+module_state",
    ),
    HC.pattern(
        "orthogonal_after_capture",
        "parametrizations.orthogonal registered after recording",
        mlp(),
        _parametrize_after("orthogonal"),
        guard=None,
    ),  # retires on the storage change too
    HC.pattern(
        "weight_norm_before_capture",
        "weight_norm registered before capture (a control)",
        _weight_norm_model,
        looped(),
    ),
    HC.pattern(
        "shared_submodule_albert",
        "one block registered three times (ALBERT)",
        built(Albert),
        _albert,
    ),
    HC.pattern(
        "step_parameter_replaced",
        "a parameter replaced by a new nn.Parameter after recording",
        mlp(),
        stepped(steps=6, before=_replace_bias),
        guard="param_identity",
        api="step",
    ),
]


class TiedProjection(nn.Module):
    """Input and output projections share one weight (weight tying): read twice in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 6, bias=False)
        self.mid = nn.Linear(6, 6)
        self.out = nn.Linear(6, 6, bias=False)
        self.out.weight = self.inp.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.mid(self.inp(x))))


def _tied_plus_l2_outside(model: nn.Module, arm: Arm) -> Extras:
    """An L2 term on the tied weight in the loss, after the forward: eager's engine adds its
    gradient first, then the two reads' one by one; a replay hands autograd the two reads' sum."""
    weight = model.inp.weight
    return loop(
        model, arm, steps=4, loss=lambda out: out.pow(2).mean() + 1e-2 * weight.pow(2).sum()
    )


KNOWN_LIMITS: list[Pattern] = [
    HC.pattern(
        "tied_weight_also_read_outside",
        "a weight read twice in forward (tied) and again by the loss outside it (an L2 term)",
        built(TiedProjection),
        _tied_plus_l2_outside,
    ),
]
"""Still silent differences (docs/limits.md): kept out of ``PATTERNS``."""
