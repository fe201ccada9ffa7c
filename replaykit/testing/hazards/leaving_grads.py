"""Gradients that leave the model: a loss that reaches trainable parameters outside it.

A GAN's generator step backpropagates through the discriminator: eager gives the
discriminator's parameters ``.grad`` (the next discriminator step zeroes it, but a
gradient penalty, a logger or an accumulation reads it). A recording of the generator's
step knows only the model's parameters.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .pattern import MLP, Arm, Extras, Pattern, sgd
from .writing import HazardClass, built

HAZARD = "leaving_grads"
HC = HazardClass(HAZARD)


class Generator(MLP):
    """Noise (6) to a sample (6)."""

    def __init__(self) -> None:
        super().__init__(d_in=6, d_h=8, d_out=6)


def _gan(
    model: nn.Module,
    arm: Arm,
    freeze_d: bool,
    api: str,
    before: Callable[[nn.Module, torch.optim.Optimizer, int], None] | None = None,
    keep_graph: bool = True,
) -> Extras:
    """Alternating steps: the discriminator eagerly, the generator through ``rk.TrainStep``
    (``api="step"``) or as a plain loop over the captured generator (``api="capture"``).
    ``keep_graph``: the discriminator's loss (and with it its autograd graph) is still alive at
    the generator step, as in most GAN loops; else it is kept detached."""
    disc = MLP(d_in=6, d_h=8, d_out=1).to(arm.device)
    d_opt = torch.optim.SGD(disc.parameters(), lr=0.05, momentum=0.9)
    g_opt = sgd(model, lr=0.05)

    def g_loss(g: nn.Module, z: torch.Tensor) -> torch.Tensor:
        return -disc(g(z)).mean()

    step = arm.train_step(model, g_loss, g_opt) if api == "step" else None
    kept: Extras = {}
    for i in range(6):
        if before is not None:
            before(disc, d_opt, i)
        real, z = arm.randn(4, 6) + 1.0, arm.randn(4, 6)
        d_opt.zero_grad(set_to_none=True)
        d_loss = disc(model(z).detach()).mean() - disc(real).mean()
        d_loss.backward()
        if not keep_graph:
            d_loss = d_loss.detach()
        d_opt.step()
        if freeze_d:
            disc.requires_grad_(
                False
            )  # the usual care: no discriminator gradients in the generator step
        if step is not None:
            kept[f"g_loss{i}"] = step(arm.randn(4, 6))
        else:
            g_opt.zero_grad(set_to_none=True)
            loss = g_loss(model, arm.randn(4, 6))
            loss.backward()
            g_opt.step()
            kept[f"g_loss{i}"] = loss.detach()
        if freeze_d:
            disc.requires_grad_(True)
        kept[f"d_loss{i}"] = d_loss.detach()
    for name, p in disc.named_parameters():
        kept[f"disc/{name}"] = p.detach()
        kept[f"disc_grad/{name}"] = None if p.grad is None else p.grad.detach()
    return kept


def _mutual(model: nn.Module, arm: Arm) -> Extras:
    """Mutual learning: the loss pulls a student and a trained peer together; the peer's optimizer
    steps after every two micro-batches (``accumulate=2``), so its ``.grad`` is None at the first
    and accumulates in place at the second."""
    peer = MLP().to(arm.device)
    p_opt = torch.optim.SGD(peer.parameters(), lr=0.05, momentum=0.9)

    def loss_fn(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        s, t = m(x), peer(x)
        return (s - t).pow(2).mean() + 0.1 * t.pow(2).mean()

    step = arm.train_step(model, loss_fn, sgd(model, lr=0.05), accumulate=2)
    kept: Extras = {}
    for i in range(10):
        kept[f"loss{i}"] = step(arm.randn(4, 6))
        if i % 2 == 1:
            p_opt.step()
            p_opt.zero_grad(set_to_none=True)
    for name, p in peer.named_parameters():
        kept[f"peer/{name}"] = p.detach()
        kept[f"peer_grad/{name}"] = None if p.grad is None else p.grad.detach()
    return kept


PATTERNS: list[Pattern] = [
    HC.pattern(
        "step_gan_generator_trainable_disc",
        "a GAN generator step whose loss runs a trainable discriminator outside the model",
        built(Generator),
        lambda m, a: _gan(m, a, False, "step"),
        guard="foreign_grads",
        api="step",
        cpu_only="on the H200 the unsafe arm's capture fails and the step retires, exact: the "
        "discriminator's loss, still alive, holds its parameters' gradient accumulators made on the "
        "default stream, which the captured backward would have to wait on; the guarded step stands "
        "in for them during the capture (memory/foreign.py), the unsafe one knows of no leaves",
    ),
    HC.pattern(
        "step_gan_generator_trainable_disc_loss_detached",
        "the same GAN loop keeping the discriminator's loss detached (`d_loss = d_loss.detach()`)",
        built(Generator),
        lambda m, a: _gan(m, a, False, "step", keep_graph=False),
        guard="foreign_grads",
        api="step",
    ),
    HC.pattern(
        "step_mutual_learning_trained_peer",
        "mutual learning: the loss runs a peer network trained by its own optimizer (accumulate=2)",
        built(MLP),
        _mutual,
        guard="foreign_grads",
        api="step",
    ),
    HC.pattern(
        "step_gan_generator_frozen_disc",
        "the same with the discriminator frozen (requires_grad_(False)) for the generator step",
        built(Generator),
        lambda m, a: _gan(m, a, True, "step"),
        api="step",
    ),
    HC.pattern(
        "gan_captured_generator",
        "a captured generator; the discriminator runs eagerly around it",
        built(Generator),
        lambda m, a: _gan(m, a, False, "capture"),
    ),
]


def _replaced_layer(disc: nn.Module, d_opt: torch.optim.Optimizer, i: int) -> None:
    """At the fourth step the discriminator's head is re-initialised as a new layer, which its
    optimizer steps instead of the old one (whose gradients stay as they were: same layout)."""
    if i == 3:
        torch.manual_seed(5)
        old = {id(p) for p in disc.fc2.parameters()}
        disc.fc2 = nn.Linear(8, 1).to(disc.fc1.weight.device)
        group = d_opt.param_groups[0]
        group["params"] = [p for p in group["params"] if id(p) not in old]
        d_opt.add_param_group({"params": list(disc.fc2.parameters())})


PATTERNS.append(
    Pattern(
        "step_gan_disc_layer_replaced",
        HAZARD,
        "a GAN generator step through a trainable discriminator whose head is replaced midway",
        lambda d: Generator().to(d),
        # the discriminator's loss kept detached: without the owners check the new head's
        # parameters are nobody's leaves, and their accumulators (the loss holds them, made on the
        # default stream) would fail a CUDA capture instead of showing the stale head
        lambda m, a: _gan(m, a, False, "step", _replaced_layer, keep_graph=False),
        # loss_fn's key reads the discriminator's state too since hostile round 11 (a new head is
        # a new key): both are switched off for the old head to replay
        guard="foreign_owners+loss_inputs",
        api="step",
    )
)
