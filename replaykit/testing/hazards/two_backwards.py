"""Two backwards through one forward: retained graphs, autograd.grad per task, create_graph.

A replay hands out one set of static gradient buffers per recording, so a second backward
through the same forward must accumulate into (or differentiate) what the first left, as
eager does; ``repeat_backward`` guards it.
"""

from __future__ import annotations

import torch
from torch import nn

from .pattern import Arm, Extras, Pattern, mlp, sgd, trainable
from .writing import HazardClass, built

HAZARD = "two_backwards"
HC = HazardClass(HAZARD)


def _retain_two_losses(model: nn.Module, arm: Arm) -> Extras:
    opt = sgd(model)
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
    opt = sgd(model)
    for _ in range(3):
        opt.zero_grad(set_to_none=True)
        loss = model(arm.randn(4, 6)).pow(2).mean()
        loss.backward(retain_graph=True)
        loss.backward()  # 2 * g
        opt.step()
    return {}


def _pcgrad(model: nn.Module, arm: Arm) -> Extras:
    opt = sgd(model)
    params = trainable(model)
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
    opt = sgd(model)
    wopt = torch.optim.SGD([weights], lr=0.05)
    kept: Extras = {}
    for step in range(3):
        opt.zero_grad(set_to_none=True)
        wopt.zero_grad(set_to_none=True)
        o1, o2 = model(arm.randn(4, 6))
        losses = torch.stack([o1.pow(2).mean(), (o2 - 1).pow(2).mean()])
        norms = torch.stack(
            [
                torch.autograd.grad(
                    weights[i] * losses[i],
                    model.shared.weight,
                    retain_graph=True,
                    create_graph=True,
                )[0].norm()
                for i in range(2)
            ]
        )
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
    opt = sgd(model)
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
    opt = sgd(model)
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
    opt = sgd(model)
    params = trainable(model)
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


PATTERNS: list[Pattern] = [
    HC.pattern(
        "retain_graph_two_losses",
        "backward(retain_graph=True) per loss: .grad = g1 + g2",
        mlp(),
        _retain_two_losses,
        guard="repeat_backward",
    ),
    HC.pattern(
        "same_loss_backward_twice",
        "one loss backward twice: .grad = 2 g (a control: "
        "overwriting g with g is harmless, so no unsafe arm can diverge)",
        mlp(),
        _same_loss_twice,
    ),
    HC.pattern(
        "pcgrad_autograd_grad",
        "autograd.grad once per task (PCGrad): g1 keeps its values",
        mlp(),
        _pcgrad,
        guard="repeat_backward",
    ),
    HC.pattern(
        "gradnorm_create_graph",
        "GradNorm: create_graph gradient norms of a shared layer",
        built(TwoHeads),
        _gradnorm,
        guard="repeat_backward",
    ),
    HC.pattern(
        "gradient_penalty_input",
        "WGAN-GP: create_graph gradient penalty on the input",
        mlp(),
        _gradient_penalty,
        guard="repeat_backward",
    ),
    HC.pattern(
        "hessian_vector_penalty",
        "create_graph on the parameters: a curvature penalty",
        mlp(),
        _hessian_vector,
        guard="repeat_backward",
    ),
    HC.pattern(
        "retained_across_recordings",
        "retained graph differentiated after another shape replayed",
        mlp(),
        _retained_across_recordings,
        guard="repeat_backward",
        unsafe_never="the hold's generation check raises before any stale read, with repeat_backward off too",
    ),
]
