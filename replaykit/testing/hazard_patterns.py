"""The hazard catalogue: realistic training patterns that a frozen replay can get wrong.

Each :class:`Pattern` builds a tiny model on a device and trains it a few steps as a
user would write it. The runner (:mod:`replaykit.testing.hazards`) runs every pattern
twice from the same seed, once eagerly and once under ``rk.capture``, and compares
the end states bit for bit. A pattern's ``train`` gets the model (captured or not)
and an :class:`Arm`; it returns the extra tensors it keeps (losses, outputs, input
gradients, hook call order), which join the parameters, gradients and buffers.

Imports only torch and the public core API.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

Extras = dict[str, "torch.Tensor | None"]

HAZARDS: tuple[str, ...] = (
    "two_backwards", "host_values", "parameters", "inputs", "side_effects", "lifecycle", "hook_order",
)


@dataclass
class Arm:
    """What a pattern's ``train`` knows about the run it is in."""

    device: str
    name: str  # "eager", "replay" or "unsafe"
    recorder: object | None = None

    def randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=self.device)


@dataclass(frozen=True)
class Pattern:
    """One realistic training pattern.

    ``guard``: the ``unsafe_disable`` name of the protection that keeps it exact (its
    unsafe arm must diverge). ``cuda_only`` / ``cpu_only``: why the unsafe arm diverges
    only on that backend (the other's unsafe test is skipped with this reason);
    ``unsafe_never``: why no backend measured here shows it (the guard's negative
    control is another pattern). ``kernel_dependent``: the unsafe arm's divergence comes
    from a kernel's sensitivity to layout or aliasing, which differs between machines
    (it diverged on the development CPU, not on the H200 host's CPU): where it does not
    show, the notebook says so instead of failing. ``target``: which module to
    capture (default: the whole model).
    """

    name: str
    hazard: str
    what: str
    make: Callable[[str], nn.Module]
    train: Callable[[nn.Module, Arm], Extras]
    guard: str | None = None  # "a+b": both switched off in the unsafe arm
    cuda_only: str | None = None
    cpu_only: str | None = None
    unsafe_never: str | None = None
    kernel_dependent: bool = False  # the unsafe arm diverges only where kernels are layout/alias sensitive
    target: Callable[[nn.Module], nn.Module] | None = None
    tags: tuple[str, ...] = field(default=())


# --------------------------------------------------------------------------- nets
class MLP(nn.Module):
    """Linear -> (BatchNorm) -> ReLU -> Dropout -> Linear, with knobs users flip."""

    def __init__(self, d_in: int = 6, d_h: int = 8, d_out: int = 3, bn: bool = False, p: float = 0.0) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_h)
        self.bn = nn.BatchNorm1d(d_h) if bn else nn.Identity()
        self.drop = nn.Dropout(p)
        self.fc2 = nn.Linear(d_h, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(torch.relu(self.bn(self.fc1(x)))))


def _mlp(**kw) -> Callable[[str], nn.Module]:
    return lambda device: MLP(**kw).to(device)


def _sgd(model: nn.Module, lr: float = 0.1) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)


def _loop(
    model: nn.Module,
    arm: Arm,
    steps: int = 3,
    shape: tuple[int, ...] = (4, 6),
    call: Callable[[nn.Module, torch.Tensor, int], torch.Tensor] | None = None,
    before: Callable[[nn.Module, int], None] | None = None,
    loss: Callable[[torch.Tensor], torch.Tensor] = lambda out: out.pow(2).mean(),
) -> Extras:
    """The plain loop: zero_grad, forward, loss, backward, step; keeps every loss."""
    opt = _sgd(model)
    kept: Extras = {}
    for step in range(steps):
        if before is not None:
            before(model, step)
        opt.zero_grad(set_to_none=True)
        x = arm.randn(*shape)
        out = call(model, x, step) if call is not None else model(x)
        value = loss(out)
        value.backward()
        opt.step()
        kept[f"loss{step}"] = value.detach()
    return kept


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p for p in model.parameters() if p.requires_grad]


# =========================================================================== 1. two backwards
def _retain_two_losses(model: nn.Module, arm: Arm) -> Extras:
    opt = _sgd(model)
    kept: Extras = {}
    for step in range(3):
        opt.zero_grad(set_to_none=True)
        out = model(arm.randn(4, 6))
        first = out[:, 0].pow(2).mean()
        second = out[:, 1:].abs().mean()
        first.backward(retain_graph=True)  # .grad = g1
        second.backward()  # .grad = g1 + g2
        opt.step()
        kept[f"loss{step}"] = (first + second).detach()
    return kept


def _same_loss_twice(model: nn.Module, arm: Arm) -> Extras:
    opt = _sgd(model)
    for _ in range(3):
        opt.zero_grad(set_to_none=True)
        loss = model(arm.randn(4, 6)).pow(2).mean()
        loss.backward(retain_graph=True)
        loss.backward()  # 2 * g
        opt.step()
    return {}


def _pcgrad(model: nn.Module, arm: Arm) -> Extras:
    opt = _sgd(model)
    params = _params(model)
    kept: Extras = {}
    for step in range(3):
        opt.zero_grad(set_to_none=True)
        out = model(arm.randn(4, 6))
        task1 = out[:, 0].pow(2).mean()
        task2 = (out[:, 1] - 1).pow(2).mean()
        g1 = torch.autograd.grad(task1, params, retain_graph=True)
        g2 = torch.autograd.grad(task2, params)  # g1 must keep its values
        kept.update({f"g1_{step}_{i}": g.detach().clone() for i, g in enumerate(g1)})
        flat1, flat2 = torch.cat([g.flatten() for g in g1]), torch.cat([g.flatten() for g in g2])
        dot = (flat1 * flat2).sum()
        coef = torch.where(dot < 0, dot / flat2.pow(2).sum(), torch.zeros_like(dot))
        for p, a, b in zip(params, g1, g2, strict=True):
            p.grad = a - coef * b + b
        opt.step()
    return kept


class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(6, 8)
        self.head1 = nn.Linear(8, 1)
        self.head2 = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.shared(x))
        return self.head1(h), self.head2(h)


def _gradnorm(model: nn.Module, arm: Arm) -> Extras:
    weights = torch.ones(2, device=arm.device, requires_grad=True)
    opt = _sgd(model)
    wopt = torch.optim.SGD([weights], lr=0.05)
    kept: Extras = {}
    for step in range(3):
        opt.zero_grad(set_to_none=True)
        wopt.zero_grad(set_to_none=True)
        o1, o2 = model(arm.randn(4, 6))
        losses = torch.stack([o1.pow(2).mean(), (o2 - 1).pow(2).mean()])
        norms = torch.stack([
            torch.autograd.grad(weights[i] * losses[i], model.shared.weight, retain_graph=True, create_graph=True)[0].norm()
            for i in range(2)
        ])
        target = (norms.mean() * (losses / losses.mean()) ** 0.5).detach()
        gradnorm_loss = (norms - target).abs().sum()
        weights.grad = torch.autograd.grad(gradnorm_loss, weights, retain_graph=True)[0]
        (weights.detach() * losses).sum().backward()
        opt.step()
        wopt.step()
        kept[f"norms{step}"] = norms.detach()
    kept["task_weights"] = weights.detach()
    return kept


def _gradient_penalty(model: nn.Module, arm: Arm) -> Extras:
    opt = _sgd(model)
    kept: Extras = {}
    for step in range(3):
        opt.zero_grad(set_to_none=True)
        x = arm.randn(4, 6).requires_grad_()
        critic = model(x)
        (gx,) = torch.autograd.grad(critic.sum(), x, create_graph=True)
        penalty = (gx.norm(dim=1) - 1).pow(2).mean()
        (critic.mean() + 10 * penalty).backward()
        opt.step()
        kept[f"penalty{step}"] = penalty.detach()
        kept[f"x_grad{step}"] = x.grad
    return kept


def _retained_across_recordings(model: nn.Module, arm: Arm) -> Extras:
    opt = _sgd(model)
    for _ in range(3):
        opt.zero_grad(set_to_none=True)
        big = model(arm.randn(4, 6)).pow(2).mean()
        big.backward(retain_graph=True)
        model(arm.randn(2, 6)).pow(2).mean().backward()  # another recording replays in between
        big.backward()  # the retained graph of the first recording, differentiated again
        opt.step()
    return {}


def _hessian_vector(model: nn.Module, arm: Arm) -> Extras:
    """A Hessian-vector product (curvature regularizer): grad of (grad . v)."""
    opt = _sgd(model)
    params = _params(model)
    kept: Extras = {}
    for step in range(3):
        opt.zero_grad(set_to_none=True)
        loss = model(arm.randn(4, 6)).pow(2).mean()
        grads = torch.autograd.grad(loss, params, create_graph=True)
        vs = [torch.ones_like(g) for g in grads]
        curvature = sum((g * v).sum() for g, v in zip(grads, vs, strict=True))
        (loss + 0.01 * curvature).backward()
        opt.step()
        kept[f"curvature{step}"] = curvature.detach()
    return kept


TWO_BACKWARDS = [
    Pattern("retain_graph_two_losses", "two_backwards", "backward(retain_graph=True) per loss: .grad = g1 + g2",
            _mlp(), _retain_two_losses, guard="repeat_backward"),
    Pattern("same_loss_backward_twice", "two_backwards", "one loss backward twice: .grad = 2 g (a control: "
            "overwriting g with g is harmless, so no unsafe arm can diverge)",
            _mlp(), _same_loss_twice),
    Pattern("pcgrad_autograd_grad", "two_backwards", "autograd.grad once per task (PCGrad): g1 keeps its values",
            _mlp(), _pcgrad, guard="repeat_backward"),
    Pattern("gradnorm_create_graph", "two_backwards", "GradNorm: create_graph gradient norms of a shared layer",
            lambda d: TwoHeads().to(d), _gradnorm, guard="repeat_backward"),
    Pattern("gradient_penalty_input", "two_backwards", "WGAN-GP: create_graph gradient penalty on the input",
            _mlp(), _gradient_penalty, guard="repeat_backward"),
    Pattern("hessian_vector_penalty", "two_backwards", "create_graph on the parameters: a curvature penalty",
            _mlp(), _hessian_vector, guard="repeat_backward"),
    Pattern("retained_across_recordings", "two_backwards", "retained graph differentiated after another shape replayed",
            _mlp(), _retained_across_recordings, guard="repeat_backward",
            unsafe_never="the hold's generation check raises before any stale read, with repeat_backward off too"),
]


# =========================================================================== 2. host values
def _set_at(step_at: int, fn: Callable[[nn.Module], None]) -> Callable[[nn.Module, int], None]:
    def before(model: nn.Module, step: int) -> None:
        if step == step_at:
            fn(model)

    return before


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

    return _loop(model, arm, steps=4, call=call)


def _setter(attr: str, value: object, step: int = 2, sub: str | None = None):
    def fn(model: nn.Module) -> None:
        setattr(model.get_submodule(sub) if sub else model, attr, value)

    return _set_at(step, fn)


HOST_VALUES = [
    Pattern("submodule_bn_eval", "host_values", "model.bn.eval() on a submodule after recording (BN frozen)",
            _mlp(bn=True), lambda m, a: _loop(m, a, steps=4, before=_set_at(2, lambda m: m.bn.eval())),
            guard="module_state"),
    Pattern("submodule_dropout_eval", "host_values", "model.drop.eval() on a submodule after recording",
            _mlp(p=0.5), lambda m, a: _loop(m, a, steps=4, before=_set_at(2, lambda m: m.drop.eval())),
            guard="module_state"),
    Pattern("bn_momentum_changed", "host_values", "bn.momentum changed after recording",
            _mlp(bn=True), lambda m, a: _loop(m, a, steps=4, before=_setter("momentum", 0.5, sub="bn")),
            guard="module_state"),
    Pattern("bn_momentum_none_after_record", "host_values", "bn.momentum = None (cumulative average) after recording",
            _mlp(bn=True), lambda m, a: _loop(m, a, steps=4, before=_setter("momentum", None, sub="bn")),
            guard="module_state"),
    Pattern("dropout_p_annealed", "host_values", "dropout.p annealed every step",
            _mlp(p=0.5),
            lambda m, a: _loop(m, a, steps=4, before=lambda m, s: setattr(m.drop, "p", 0.5 - 0.15 * s)),
            guard="module_state"),
    Pattern("temperature_schedule", "host_values", "a Python float attribute used as a temperature schedule",
            lambda d: Tempered().to(d),
            lambda m, a: _loop(m, a, steps=4, before=lambda m, s: setattr(m, "temperature", 1.0 / (1 + s)),
                               loss=lambda o: -o[:, 0].mean()),
            guard="module_state"),
    Pattern("config_object_argument", "host_values", "an argument object's .scale changes between calls",
            lambda d: Scaled().to(d), _config_arg, guard="argument_values"),
    Pattern("flag_attribute_branch", "host_values", "a boolean attribute switches a residual branch",
            lambda d: Branchy().to(d), lambda m, a: _loop(m, a, steps=4, before=_setter("use_residual", True)),
            guard="module_state"),
]


# =========================================================================== 3. parameters
def _fast_weights(model: nn.Module, arm: Arm) -> Extras:
    def call(m: nn.Module, x: torch.Tensor, step: int) -> torch.Tensor:
        fast = {n: p * 0.9 for n, p in m.named_parameters()}  # differentiable w.r.t. p
        return functional_call(m, fast, (x,))

    return _loop(model, arm, call=call)


def _maml(model: nn.Module, arm: Arm) -> Extras:
    opt = _sgd(model)
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
    opt = _sgd(model)
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
            sharp = functional_call(model, {n: p + eps[n] for n, p in named.items()}, (x,)).pow(2).mean()
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
    opt = _sgd(model)
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

    return lambda m, a: _loop(m, a, steps=4, before=_set_at(2, fn))


def _weight_norm_model(device: str) -> nn.Module:
    model = MLP()
    torch.nn.utils.parametrizations.weight_norm(model.fc1)
    return model.to(device)


PARAMETERS = [
    Pattern("functional_call_fast_weights", "parameters", "torch.func.functional_call with fast weights",
            _mlp(), _fast_weights, guard="param_identity"),
    Pattern("maml_inner_step", "parameters", "MAML: create_graph inner step, functional_call outer loss",
            _mlp(), _maml, guard="repeat_backward"),
    Pattern("sam_functional_perturbed", "parameters", "SAM's perturbed pass through functional_call",
            _mlp(), lambda m, a: _sam(m, a, functional=True), guard="param_identity"),
    Pattern("sam_inplace_perturbed", "parameters", "SAM perturbing the weights in place (a control)",
            _mlp(), lambda m, a: _sam(m, a, functional=False)),
    Pattern("hypernetwork_head", "parameters", "a hypernetwork supplies a captured head's weight (stateless)",
            lambda d: HyperTarget().to(d), _hypernet, guard="param_identity", target=lambda m: m.head),
    Pattern("weight_norm_after_capture", "parameters", "parametrizations.weight_norm registered after recording",
            _mlp(), _parametrize_after("weight_norm"), guard="param_identity+module_state"),
    Pattern("orthogonal_after_capture", "parameters", "parametrizations.orthogonal registered after recording",
            _mlp(), _parametrize_after("orthogonal"), guard=None),  # retires on the storage change too
    Pattern("weight_norm_before_capture", "parameters", "weight_norm registered before capture (a control)",
            _weight_norm_model, lambda m, a: _loop(m, a)),
]


# =========================================================================== 4. inputs
class Centering(nn.Module):
    """Centres its input in place (a user's preprocessing inside forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.sub_(x.mean(dim=0, keepdim=True))
        return self.net(x)


def _inplace_input(model: nn.Module, arm: Arm) -> Extras:
    kept: Extras = {}

    def call(m: nn.Module, x: torch.Tensor, step: int) -> torch.Tensor:
        out = m(x)
        kept[f"caller_x{step}"] = x.clone()  # eager changed the caller's tensor
        return out

    kept.update(_loop(model, arm, call=call))
    return kept


class PairScore(nn.Module):
    """Self-attention-like scores; a shortcut projects once when q is k."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(6, 5)

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        if q is k:
            h = self.proj(q)
            return h @ h.t()
        return self.proj(q) @ self.proj(k).t()


def _q_is_k(model: nn.Module, arm: Arm) -> Extras:
    def call(m: nn.Module, x: torch.Tensor, step: int) -> torch.Tensor:
        return m(x, x) if step in (1, 2) else m(x, x.clone())

    return _loop(model, arm, steps=4, call=call)


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.attn(q, k, v, need_weights=False)[0]


def _mha(model: nn.Module, arm: Arm) -> Extras:
    def call(m: nn.Module, x: torch.Tensor, step: int) -> torch.Tensor:
        y = x.clone()
        return m(x, y, y) if step == 0 else m(x, x, x)  # record cross-style, then self-attention

    return _loop(model, arm, steps=3, shape=(2, 3, 8), call=call)


def _layout(kind: str) -> Callable[[nn.Module, Arm], Extras]:
    def call(m: nn.Module, x: torch.Tensor, step: int) -> torch.Tensor:
        if kind == "transposed":
            return m(x.t().contiguous().t())
        if kind == "sliced":
            return m(torch.cat([x, x], dim=1)[:, ::2])
        if kind == "offset":
            return m(torch.cat([x[:1], x])[1:])
        row = x[:1].clone().requires_grad_()
        out = m(row.expand(4, 6))
        kept[f"row_grad_src{step}"] = row
        return out

    kept: Extras = {}

    def train(model: nn.Module, arm: Arm) -> Extras:
        kept.clear()
        result = _loop(model, arm, call=call)
        for name in list(kept):
            kept[name] = kept[name].grad
        return {**result, **kept}

    return train


class Gated(nn.Module):
    """Uses its input twice inside; the caller also adds it around (a skip connection)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.gate = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * torch.sigmoid(self.gate(x)) + x.pow(2)


class Upstream(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(3, 6)
        self.block = Gated()


def _used_twice(model: nn.Module, arm: Arm) -> Extras:
    opt = _sgd(model)
    kept: Extras = {}
    for step in range(3):
        opt.zero_grad(set_to_none=True)
        x = model.emb(arm.randn(4, 3))
        y = model.block(x) + x  # skip connection around the captured block
        loss = y.pow(2).mean()
        x.retain_grad()
        loss.backward()
        opt.step()
        kept[f"x_grad{step}"] = x.grad
    return kept


class Angle(nn.Module):
    """An orientation head: atan2 of a signed offset against the features."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor, offset: float) -> torch.Tensor:
        h = self.fc(x)
        return h + torch.atan2(torch.full_like(h, offset), h)


class Clipped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor, clip: float) -> torch.Tensor:
        h = self.fc(x)
        return torch.nan_to_num(h.clamp(-clip, clip), nan=0.5) + h


_SAME_BITS_ON_CPU = (
    "a contiguous copy of this layout gives the same bits on the CPU kernels (clone keeps dense strides; "
    "CPU matmul packs strided operands first), and on the H200 with torch 2.11 too (measured); "
    "offset_input is the layout guard's negative control"
)
_SAME_BITS_ON_H200 = "on the H200 with torch 2.11 these CUDA kernels gave the same bits either way (measured)"

INPUTS = [
    Pattern("inplace_input_mutation", "inputs", "forward centres its input in place (the caller sees it)",
            lambda d: Centering().to(d), _inplace_input, guard="record_probe"),
    Pattern("same_tensor_q_is_k", "inputs", "model(x, x) takes an `is` shortcut; model(x, x.clone()) does not",
            lambda d: PairScore().to(d), _q_is_k, guard="input_aliasing", kernel_dependent=True),
    Pattern("mha_self_attention", "inputs", "nn.MultiheadAttention(x, x, x) vs distinct key/value tensors",
            lambda d: Attention().to(d), _mha, guard="input_aliasing", cpu_only=_SAME_BITS_ON_H200, kernel_dependent=True),
    Pattern("transposed_input", "inputs", "a transposed (column-major) input",
            _mlp(), _layout("transposed"), guard="input_layout", unsafe_never=_SAME_BITS_ON_CPU),
    Pattern("sliced_input", "inputs", "a strided slice as input",
            _mlp(), _layout("sliced"), guard="input_layout", unsafe_never=_SAME_BITS_ON_CPU),
    Pattern("offset_input", "inputs", "an input view with a storage offset",
            _mlp(), _layout("offset"), guard="input_layout", cpu_only=_SAME_BITS_ON_H200, kernel_dependent=True),
    Pattern("expanded_input", "inputs", "an expanded (stride-0) input requiring grad",
            _mlp(), _layout("expanded"), guard="input_layout", unsafe_never=_SAME_BITS_ON_CPU),
    Pattern("input_used_twice_and_skip", "inputs", "an input used twice inside and around a skip connection",
            lambda d: Upstream().to(d), _used_twice, guard="record_probe", target=lambda m: m.block),
    Pattern("negative_zero_argument", "inputs", "a float argument -0.0 after 0.0 (atan2 sees the sign)",
            lambda d: Angle().to(d),
            lambda m, a: _loop(m, a, steps=4, call=lambda m, x, s: m(x, -0.0 if s % 2 else 0.0)),
            guard="argument_values"),
    Pattern("nan_argument", "inputs", "a fresh NaN float argument per call (NaN != NaN as a key), then a number",
            lambda d: Clipped().to(d),
            lambda m, a: _loop(m, a, steps=4, call=lambda m, x, s: m(x, float("nan") if s < 2 else 1.0))),
]


# =========================================================================== 5. side effects
class Noisy(nn.Module):
    """Feature noise from the module's own Generator."""

    def __init__(self, device: str) -> None:
        super().__init__()
        self.net = MLP()
        self.gen = torch.Generator(device=device).manual_seed(7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        noise = torch.randn(x.shape, generator=self.gen, device=x.device)
        return self.net(x + 0.1 * noise)


def _noisy(model: nn.Module, arm: Arm) -> Extras:
    kept = _loop(model, arm, steps=4)
    kept["generator_state"] = model.gen.get_state()  # advanced exactly once per call, as in eager
    return kept


class RunningCentre(nn.Module):
    """A plain tensor attribute (not a buffer) updated in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 3)
        self.centre = torch.zeros(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        self.centre = 0.9 * self.centre.to(h.device) + 0.1 * h.detach().mean(0)
        return h - self.centre


class MoE(nn.Module):
    """Two experts and a gate; the load-balancing loss is stored on the module."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(6, 2)
        self.experts = nn.ModuleList([nn.Linear(6, 3), nn.Linear(6, 3)])
        self.aux_loss = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.gate(x), dim=1)
        self.aux_loss = 2 * probs.mean(0).pow(2).sum()
        return sum(probs[:, i : i + 1] * e(x) for i, e in enumerate(self.experts))


def _moe(model: nn.Module, arm: Arm) -> Extras:
    kept: Extras = {}

    def loss(out: torch.Tensor) -> torch.Tensor:
        return out.pow(2).mean() + 0.1 * model.aux_loss

    kept.update(_loop(model, arm, loss=loss))
    kept["aux_loss"] = model.aux_loss.detach()
    return kept


class Masked(nn.Module):
    """Returns only the rows a data-dependent mask keeps (boolean indexing)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.net(x)
        return h[h.sum(dim=1) > 0]


class Nonzero(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = (x[:, 0] > 0).nonzero().squeeze(1)
        return self.net(x.index_select(0, rows))


class ItemNorm(nn.Module):
    """Normalises by a host-side maximum read with .item()."""

    def __init__(self) -> None:
        super().__init__()
        self.net = MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.net(x)
        return h / (h.detach().abs().max().item() + 1.0)


class SparseEmb(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 6, sparse=True)
        self.fc = nn.Linear(6, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.fc(self.emb(ids).mean(dim=1))


def _sparse(model: nn.Module, arm: Arm) -> Extras:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kept: Extras = {}
    for step in range(3):
        opt.zero_grad(set_to_none=True)
        ids = torch.randint(0, 20, (4, 5), device=arm.device)
        loss = model(ids).pow(2).mean()
        loss.backward()
        kept[f"emb_grad{step}"] = model.emb.weight.grad.to_dense()
        opt.step()
    model.emb.weight.grad = None  # a sparse .grad has no dense end state to compare
    return kept


class Warmup(nn.Module):
    """A Python counter incremented in forward drives a warm-up factor."""

    def __init__(self) -> None:
        super().__init__()
        self.net = MLP()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.net(x) * min(1.0, self.calls / 4)


def _with_attr(attr: str) -> Callable[[nn.Module, Arm], Extras]:
    def train(model: nn.Module, arm: Arm) -> Extras:
        kept = _loop(model, arm, steps=4)
        value = getattr(model, attr)
        kept[attr] = value if isinstance(value, torch.Tensor) else torch.tensor(float(value))
        return kept

    return train


SIDE_EFFECTS = [
    Pattern("private_generator", "side_effects", "noise from the module's own torch.Generator",
            lambda d: Noisy(d).to(d), _noisy, guard="record_probe"),
    Pattern("tensor_attribute_updated", "side_effects", "a plain tensor attribute updated in forward",
            lambda d: RunningCentre().to(d), _with_attr("centre"), guard="record_probe"),
    Pattern("moe_aux_loss_attribute", "side_effects", "an auxiliary loss stored on the module, added to the loss",
            lambda d: MoE().to(d), _moe, guard="record_probe"),
    Pattern("boolean_mask_output", "side_effects", "a data-dependent output shape (boolean masking)",
            lambda d: Masked().to(d), lambda m, a: _loop(m, a, steps=4), guard=None),  # both backends refuse it at capture too
    Pattern("nonzero_rows", "side_effects", "rows picked with nonzero(): data-dependent shapes inside",
            lambda d: Nonzero().to(d), lambda m, a: _loop(m, a, steps=4), guard=None),  # both backends refuse it at capture too
    Pattern("item_in_forward", "side_effects", ".item() read inside forward",
            lambda d: ItemNorm().to(d), lambda m, a: _loop(m, a, steps=4), guard=None),  # both backends refuse it at capture too
    Pattern("sparse_embedding_grad", "side_effects", "nn.Embedding(sparse=True): sparse gradients",
            lambda d: SparseEmb().to(d), _sparse, guard=None),  # both backends refuse it at capture too
    Pattern("python_counter", "side_effects", "a Python counter incremented in forward (warm-up factor)",
            lambda d: Warmup().to(d), _with_attr("calls"), guard="record_probe"),
]


# =========================================================================== 6. lifecycle
def _inplace_weights(model: nn.Module, arm: Arm) -> Extras:
    opt = _sgd(model)
    for _ in range(3):
        opt.zero_grad(set_to_none=True)
        loss = model(arm.randn(4, 6)).pow(2).mean()
        with torch.no_grad():
            model.fc2.weight.mul_(0.5)  # eager: "modified by an inplace operation" at backward
        loss.backward()
        opt.step()
    return {}


def _threaded(model: nn.Module, arm: Arm) -> Extras:
    opt = _sgd(model)
    kept: Extras = {}

    def step(i: int) -> None:
        opt.zero_grad(set_to_none=True)
        loss = model(arm.randn(4, 6)).pow(2).mean()
        loss.backward()
        opt.step()
        kept[f"loss{i}"] = loss.detach()

    for i in range(4):
        if i == 2:
            errors: list[BaseException] = []
            worker = threading.Thread(target=_catching, args=(errors, step, i))
            worker.start()
            worker.join()
            if errors:
                raise errors[0]
        else:
            step(i)
    return kept


def _catching(errors: list[BaseException], fn: Callable[[int], None], i: int) -> None:
    try:
        fn(i)
    except BaseException as exc:
        errors.append(exc)


LIFECYCLE = [
    Pattern("inplace_weights_before_backward", "lifecycle", "weights scaled in place between forward and backward",
            _mlp(), _inplace_weights, guard="inplace_weights"),
    Pattern("step_in_another_thread", "lifecycle", "one training step runs in a second thread",
            _mlp(), _threaded),
]


# =========================================================================== 7. hook order
def _hooked(kind: str, register_at: int = 0) -> Callable[[nn.Module, Arm], Extras]:
    def train(model: nn.Module, arm: Arm) -> Extras:
        order: list[int] = []
        params = _params(model)

        def register() -> None:
            for i, p in enumerate(params):
                if kind == "post_accumulate":
                    p.register_post_accumulate_grad_hook(lambda _p, i=i: order.append(i))
                else:
                    def clip(g: torch.Tensor, i: int = i) -> torch.Tensor:
                        order.append(i)
                        return g.clamp(-0.05, 0.05)
                    p.register_hook(clip)

        kept = _loop(model, arm, steps=4, before=lambda m, s: register() if s == register_at else None)
        kept["hook_order"] = torch.tensor(order, dtype=torch.int64)
        return kept

    return train


def _optimizer_in_backward(model: nn.Module, arm: Arm) -> Extras:
    order: list[int] = []
    opts = {p: torch.optim.SGD([p], lr=0.1, momentum=0.9) for p in _params(model)}

    def hook(p: torch.Tensor, i: int) -> None:
        order.append(i)
        opts[p].step()
        opts[p].zero_grad(set_to_none=True)

    for i, p in enumerate(_params(model)):
        p.register_post_accumulate_grad_hook(lambda p, i=i: hook(p, i))
    kept: Extras = {}
    for step in range(3):
        loss = model(arm.randn(4, 6)).pow(2).mean()
        loss.backward()
        kept[f"loss{step}"] = loss.detach()
    kept["hook_order"] = torch.tensor(order, dtype=torch.int64)
    return kept


HOOK_ORDER = [
    Pattern("post_accumulate_hook_order", "hook_order", "register_post_accumulate_grad_hook on every parameter",
            _mlp(bn=True), _hooked("post_accumulate"), guard="record_probe"),  # hooks before the first record
    Pattern("post_accumulate_hook_midway", "hook_order", "post-accumulate hooks registered after recording",
            _mlp(bn=True), _hooked("post_accumulate", register_at=2), guard="param_identity"),  # the hook watcher
    Pattern("tensor_hook_clip", "hook_order", "p.register_hook clipping each gradient, order recorded",
            _mlp(bn=True), _hooked("tensor"), guard="record_probe"),
    Pattern("optimizer_in_backward", "hook_order", "per-parameter optimizers stepping in post-accumulate hooks",
            _mlp(bn=True), _optimizer_in_backward, guard="record_probe"),
]


PATTERNS: list[Pattern] = [
    *TWO_BACKWARDS, *HOST_VALUES, *PARAMETERS, *INPUTS, *SIDE_EFFECTS, *LIFECYCLE, *HOOK_ORDER,
]


def by_hazard(hazard: str) -> list[Pattern]:
    """The catalogue's patterns of one hazard class."""
    if hazard not in HAZARDS:
        raise KeyError(f"unknown hazard {hazard!r}; choose from {HAZARDS}")
    return [p for p in PATTERNS if p.hazard == hazard]


def pattern(name: str) -> Pattern:
    for p in PATTERNS:
        if p.name == name:
            return p
    raise KeyError(f"no hazard pattern named {name!r}")



from .hazard_autocast import AUTOCAST, AUTOCAST_LIMITS  # noqa: E402 - found by the model zoo (#14)
from .hazard_review import KNOWN_LIMITS, REVIEW  # noqa: E402 - the review's patterns reuse the nets above

PATTERNS += REVIEW + AUTOCAST
KNOWN_LIMITS = KNOWN_LIMITS + AUTOCAST_LIMITS
"""``KNOWN_LIMITS`` stay out of the catalogue: they are still silent differences (README, Known limits)."""
__all__ = ["HAZARDS", "KNOWN_LIMITS", "PATTERNS", "Pattern", "by_hazard", "pattern"]
