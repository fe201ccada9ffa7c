"""Gradients that leave the model: a loss that reaches trainable parameters outside it.

A GAN's generator step backpropagates through the discriminator: eager gives the
discriminator's parameters ``.grad`` (the next discriminator step zeroes it, but a
gradient penalty, a logger or an accumulation reads it). A recording of the generator's
step knows only the model's parameters.
"""

from __future__ import annotations

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


def _gan(model: nn.Module, arm: Arm, freeze_d: bool, api: str) -> Extras:
    """Alternating steps: the discriminator eagerly, the generator through ``rk.TrainStep``
    (``api="step"``) or as a plain loop over the captured generator (``api="capture"``)."""
    disc = MLP(d_in=6, d_h=8, d_out=1).to(arm.device)
    d_opt = torch.optim.SGD(disc.parameters(), lr=0.05, momentum=0.9)
    g_opt = sgd(model, lr=0.05)

    def g_loss(g: nn.Module, z: torch.Tensor) -> torch.Tensor:
        return -disc(g(z)).mean()

    step = arm.train_step(model, g_loss, g_opt) if api == "step" else None
    kept: Extras = {}
    for i in range(6):
        real, z = arm.randn(4, 6) + 1.0, arm.randn(4, 6)
        d_opt.zero_grad(set_to_none=True)
        d_loss = disc(model(z).detach()).mean() - disc(real).mean()
        d_loss.backward()
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


PATTERNS: list[Pattern] = [
    HC.pattern(
        "step_gan_generator_trainable_disc",
        "a GAN generator step whose loss runs a trainable discriminator outside the model",
        built(Generator),
        lambda m, a: _gan(m, a, False, "step"),
        guard="foreign_grads",
        api="step",
        cpu_only="on the H200 (11e42d2) the unguarded capture itself fails (the discriminator's gradients "
        "accumulate into memory allocated outside it) and the step retires, exact",
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

KNOWN_LIMITS: list[Pattern] = []
"""Still silent differences (README, Known limits): kept out of ``PATTERNS``."""
