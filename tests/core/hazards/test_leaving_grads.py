"""Gradients that leave the model: a GAN generator step through a trainable discriminator."""

from __future__ import annotations

import pytest

from ._check import assert_replays, assert_safe, assert_unsafe_diverges, guarded, names


@pytest.mark.parametrize("name", names("leaving_grads"))
def test_leaving_grads_patterns_end_like_eager(backend: str, name: str) -> None:
    assert_safe(name, backend)


@pytest.mark.parametrize("name", guarded("leaving_grads"))
def test_without_the_guard_leaving_grads_patterns_diverge(backend: str, name: str) -> None:
    assert_unsafe_diverges(name, backend)


#: a second network in the loss replays now: its parameters get their gradients as eager gives them
REPLAYING = [
    "step_gan_generator_trainable_disc",
    "step_gan_generator_trainable_disc_loss_detached",
    "step_mutual_learning_trained_peer",
    "step_gan_generator_frozen_disc",
    "step_gan_disc_layer_replaced",
    "whole_step_trainable_critic",
]


@pytest.mark.parametrize("name", REPLAYING)
def test_a_second_network_in_the_loss_replays(backend: str, name: str) -> None:
    assert_replays(name, backend)
