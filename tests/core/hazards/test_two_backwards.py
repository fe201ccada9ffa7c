"""More than one backward through one replayed forward: retain_graph, autograd.grad per loss, create_graph."""

from __future__ import annotations

import pytest
import torch

import replaykit as rk
from replaykit.testing.hazards.pattern import MLP

from ._check import assert_safe, assert_unsafe_diverges, guarded, names


@pytest.mark.parametrize("name", names("two_backwards"))
def test_two_backwards_end_like_eager(backend: str, name: str) -> None:
    assert_safe(name, backend)


@pytest.mark.parametrize("name", guarded("two_backwards"))
def test_without_repeat_backward_they_diverge(backend: str, name: str) -> None:
    assert_unsafe_diverges(name, backend)


def test_the_first_autograd_grad_keeps_its_values(backend: str, device: str) -> None:
    """PCGrad / GradNorm: the second autograd.grad must not rewrite the tensors the first returned."""
    torch.manual_seed(0)
    model = MLP().to(device)
    rec = rk.capture(model, backend=backend)
    params = list(model.parameters())
    try:
        for _ in range(3):  # record, then replays
            out = model(torch.randn(4, 6, device=device))
            first = torch.autograd.grad(out[:, 0].sum(), params, retain_graph=True)
            kept = [g.clone() for g in first]
            try:
                torch.autograd.grad(out[:, 1].sum(), params)
            except rk.ReplayError:
                continue  # a clear refusal is allowed
            for before, g in zip(kept, first, strict=True):
                assert torch.equal(before, g)
    finally:
        rec.release()


def test_a_gradient_penalty_is_exact_or_refused(backend: str, device: str) -> None:
    """create_graph=True: the penalty alone must give eager's parameter gradients, never nothing."""
    torch.manual_seed(0)
    eager, replayed = MLP().to(device), MLP().to(device)
    replayed.load_state_dict(eager.state_dict())
    rec = rk.capture(replayed, backend=backend)
    try:
        for _ in range(3):
            x = torch.randn(4, 6, device=device)
            grads = []
            for model in (eager, replayed):
                model.zero_grad(set_to_none=True)
                xi = x.clone().requires_grad_()
                try:
                    (gx,) = torch.autograd.grad(model(xi).sum(), xi, create_graph=True)
                    (gx.norm(dim=1) - 1).pow(2).mean().backward()
                except rk.ReplayError:
                    assert model is replayed
                    return
                grads.append([p.grad for p in model.parameters()])
            for name, a, b in zip(dict(eager.named_parameters()), *grads, strict=True):
                assert (a is None) == (b is None), name
                assert a is None or torch.equal(a, b), name
    finally:
        rec.release()
