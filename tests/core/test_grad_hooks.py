"""Gradient hooks on several parameters replay under ``rk.capture`` in eager's order: the recording
learns the order eager's backward reaches the parameters in, and a replay hands the gradients to
autograd through a chain that keeps it (protection ``hook_order``). Each call is compared with a
plain eager loop: losses, parameters, every ``.grad`` and its None pattern, the hooks' log."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

import replaykit as rk
from replaykit.protections import negative_control

from ._same import same

Register = Callable[[list[nn.Parameter], list], None]


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))


def _post_accumulate(params: list[nn.Parameter], log: list) -> None:
    for i, p in enumerate(params):
        p.register_post_accumulate_grad_hook(lambda _p, i=i: log.append(i))


def _clip(params: list[nn.Parameter], log: list) -> None:
    def hook(g: torch.Tensor, i: int) -> torch.Tensor:
        log.append(i)
        return g.clamp(-0.05, 0.05)

    for i, p in enumerate(params):
        p.register_hook(lambda g, i=i: hook(g, i))


def _peeking(params: list[nn.Parameter], log: list) -> None:
    """Each hook logs which other parameters hold a gradient yet (eager: the later layers only)."""
    for i, p in enumerate(params):
        p.register_post_accumulate_grad_hook(
            lambda _p, i=i: log.append((i, tuple(q.grad is not None for q in params)))
        )


def _end_of_backward(params: list[nn.Parameter], log: list) -> None:
    """One hook, on the first layer's weight (the last gradient eager computes), that clips every
    gradient "once backward is done": in eager it sees them all."""

    def hook(_p: nn.Parameter) -> None:
        present = [q for q in params if q.grad is not None]
        log.append(len(present))
        torch.nn.utils.clip_grad_norm_(present, 0.05)

    params[0].register_post_accumulate_grad_hook(hook)


def _optimizer_in_backward(params: list[nn.Parameter], log: list) -> None:
    opts = {p: torch.optim.SGD([p], lr=0.1, momentum=0.9) for p in params}

    def hook(p: nn.Parameter, i: int) -> None:
        log.append(i)
        opts[p].step()
        opts[p].zero_grad(set_to_none=True)

    for i, p in enumerate(params):
        p.register_post_accumulate_grad_hook(lambda p, i=i: hook(p, i))


def _train(
    register: Register,
    device: str,
    backend: str | None,
    unsafe: tuple[str, ...] = (),
    register_at: int = 0,
) -> tuple[list, list, rk.Recorder | None]:
    """Five steps (captured unless ``backend`` is None): what each leaves, the log, the recorder."""
    torch.manual_seed(0)
    model = _model().to(device)
    params = list(model.parameters())
    rec = rk.capture(model, backend=backend, unsafe_disable=unsafe) if backend else None
    opt = torch.optim.SGD(params, lr=0.1)
    log: list = []
    seen = []
    for step in range(5):
        if step == register_at:
            register(params, log)
        opt.zero_grad(set_to_none=False)
        loss = model(torch.randn(4, 6, device=device)).pow(2).mean()
        loss.backward()
        grads = [None if p.grad is None else p.grad.clone() for p in params]
        opt.step()
        seen.append((loss.detach(), grads, [p.detach().clone() for p in params]))
    return seen, log, rec


HOOKS = [
    pytest.param(_post_accumulate, id="post_accumulate_log"),
    pytest.param(_clip, id="tensor_hook_clip"),
    pytest.param(_peeking, id="hook_reads_other_grads"),
    pytest.param(_optimizer_in_backward, id="optimizer_in_backward"),
    pytest.param(_end_of_backward, id="one_hook_clips_every_gradient"),
]


@pytest.mark.parametrize("register", HOOKS)
def test_gradient_hooks_run_in_eager_order_after_a_replay(
    backend: str, device: str, register: Register
) -> None:
    eager, eager_log, _ = _train(register, device, None)
    replayed, log, rec = _train(register, device, backend)
    for call, (want, got) in enumerate(zip(eager, replayed, strict=True), 1):
        assert same(want, got), f"call {call}: {rec.journal.format()}"
    assert log == eager_log
    assert rec.counts["replay"] >= 3 and not rec.retired, rec.summary()


@pytest.mark.parametrize("register", [HOOKS[0], HOOKS[2], HOOKS[4]])
def test_without_hook_order_the_engine_picks_another_order(
    backend: str, device: str, register: Register
) -> None:
    """The negative control: the gradients handed out at once, the hooks log another order."""
    _, eager_log, _ = _train(register, device, None)
    _, log, _ = _train(register, device, backend, negative_control("hook_order"))
    assert log != eager_log


def test_hooks_added_after_a_recording_record_anew(backend: str, device: str) -> None:
    """A recording made without hooks has no order: new hooks drop it, the next call learns one."""
    eager, eager_log, _ = _train(_post_accumulate, device, None, register_at=2)
    replayed, log, rec = _train(_post_accumulate, device, backend, register_at=2)
    assert same(eager, replayed) and log == eager_log
    assert "gradient hooks changed" in rec.journal.format(), rec.summary()
    assert rec.counts["replay"] >= 2, rec.summary()


class TwoHeads(nn.Module):
    """Two differentiable outputs: eager may backpropagate one before the other's gradient arrives."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(6, 8)
        self.a, self.b = nn.Linear(8, 3), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.relu(self.body(x))
        return self.a(h), self.b(h)


def test_hooks_beside_several_outputs_run_eagerly(backend: str, device: str) -> None:
    def train(captured: bool) -> tuple[list, list, rk.Recorder | None]:
        torch.manual_seed(0)
        model = TwoHeads().to(device)
        log: list = []
        _post_accumulate(list(model.parameters()), log)
        rec = rk.capture(model, backend=backend) if captured else None
        seen = []
        for _ in range(3):
            a, b = model(torch.randn(4, 6, device=device))
            (a.pow(2).mean() + b.abs().mean()).backward()
            seen.append([p.grad.clone() for p in model.parameters()])
        return seen, log, rec

    eager, eager_log, _ = train(False)
    replayed, log, rec = train(True)
    assert same(eager, replayed) and log == eager_log
    assert rec.counts["replay"] == 0, rec.summary()
    assert "beside 2 differentiable outputs" in (rec.retire_reason or ""), rec.summary()
