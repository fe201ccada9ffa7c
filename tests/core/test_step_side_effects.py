"""TrainStep's ``side_effects`` protection: a step whose Python writes what a replay would not
(a model attribute, a dict the model holds) retires, exactly; switched off, the replays skip
those writes and the run differs from eager. A batch written in place replays instead: the
``write_back`` protection copies the replay's values into the caller's tensor; switched off, the
caller's batch keeps its old values.

The step trains on one batch repeatedly, so a write a replay skips changes every later step.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch
from torch import nn

import replaykit as rk
from replaykit.protections import negative_control
from replaykit.verify.bitwise import diff_states

Loss = Callable[[nn.Module, torch.Tensor], torch.Tensor]


def _writes_input(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    x.mul_(0.5)  # the caller's batch: eager halves it every step
    return m(x).pow(2).mean()


def _writes_input_data(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    x.data.mul_(0.5)  # through .data: no version counter of x moves
    return m(x).pow(2).mean()


def _assigns_attribute(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    m.scale = 3.0 - m.scale  # a float on the model, alternating 2, 1, 2...: the step reads it
    return m(x).pow(2).mean() * m.scale


def _changes_held_dict(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    m.history["task"] = 1 - m.history["task"]  # a task flag the model holds, alternating
    return m(x).pow(2).mean() * (1.0 + m.history["task"])


WRITES: dict[str, Loss] = {
    "attribute": _assigns_attribute,
    "held_dict": _changes_held_dict,
}


def _train(
    loss_fn: Loss,
    replay: bool,
    device: str,
    backend: str,
    unsafe: tuple[str, ...] = (),
    **kwargs: object,
) -> tuple[dict[str, torch.Tensor | None], rk.TrainStep]:
    """Six steps on one batch; the end state: parameters, losses, the batch (and its version after
    each step: a replay moves it as eager's write does), the model's host values."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)).to(device)
    model.scale, model.history = 1.0, {"task": 0}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = rk.TrainStep(
        model,
        loss_fn,
        opt,
        replay=replay,
        backend=backend,
        warmup=1,
        unsafe_disable=unsafe,
        **kwargs,
    )
    x = torch.randn(4, 6, device=device)
    state: dict[str, torch.Tensor | None] = {}
    try:
        for i in range(6):
            state[f"loss{i}"] = step(x).detach()
            state[f"batch_version{i}"] = torch.tensor(x._version)
    finally:
        step.release()
    state |= {f"param/{n}": p.detach() for n, p in model.named_parameters()}
    state["batch"] = x
    state["scale"] = torch.tensor(model.scale, dtype=torch.float64)
    state["task"] = torch.tensor(model.history["task"])
    return state, step


@pytest.mark.parametrize("write", sorted(WRITES))
def test_a_step_that_writes_retires_and_ends_like_eager(backend: str, device: str, write: str):
    eager, _ = _train(WRITES[write], False, device, backend)
    replayed, step = _train(WRITES[write], True, device, backend)
    assert diff_states(eager, replayed) == [], step.journal
    assert step.retired and "a replay would" in step.retire_reason, step.retire_reason
    assert step.counts["replay"] == 0


@pytest.mark.parametrize("write", sorted(WRITES))
def test_without_side_effects_a_step_that_writes_differs(backend: str, device: str, write: str):
    """The negative control: with the check off the write is recorded once and replays skip it."""
    eager, _ = _train(WRITES[write], False, device, backend)
    unsafe, step = _train(WRITES[write], True, device, backend, negative_control("side_effects"))
    assert diff_states(eager, unsafe) != [], step.journal
    assert step.counts["replay"] > 0 and not step.retired


def test_without_side_effects_host_rng_still_retires(backend: str, device: str):
    """The switch covers the writes only: a draw from Python's random is host_rng's, still on."""

    def draws(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return m(x).pow(2).mean() * random.random()

    random.seed(0)
    eager, _ = _train(draws, False, device, backend)
    random.seed(0)
    replayed, step = _train(draws, True, device, backend, negative_control("side_effects"))
    assert diff_states(eager, replayed) == [], step.journal
    assert step.retired and "Python's random" in step.retire_reason, step.retire_reason


# accumulate=2 with check_every=1 retires on main already (a checked "first" phase reports a
# none_pattern difference for a plain loss too): not this protection's case
@pytest.mark.parametrize(
    ("accumulate", "check_every", "loss_fn"),
    [
        (1, 0, _writes_input),
        (2, 0, _writes_input),
        (1, 1, _writes_input),
        (1, 0, _writes_input_data),
    ],
    ids=["step", "accumulate", "checked", "data"],
)
def test_a_step_that_writes_its_batch_replays_like_eager(
    backend: str, device: str, accumulate: int, check_every: int, loss_fn: Loss
):
    """``loss_fn`` halves the caller's batch in place: replays (each micro-batch's, each checked
    one's) leave it as eager does, its version moved (a write through ``.data`` moves none: it is
    found by the values it changed)."""
    kw = {"accumulate": accumulate, "check_every": check_every}
    eager, _ = _train(loss_fn, False, device, backend, **kw)
    replayed, step = _train(loss_fn, True, device, backend, **kw)
    assert diff_states(eager, replayed) == [], step.journal
    assert step.counts["replay"] >= 2 and not step.retired, step.journal


def test_without_write_back_a_step_that_writes_its_batch_differs(backend: str, device: str):
    """The negative control: the replays write their static copy of the batch, not the caller's."""
    eager, _ = _train(_writes_input, False, device, backend)
    unsafe, step = _train(_writes_input, True, device, backend, negative_control("write_back"))
    assert diff_states(eager, unsafe) != [], step.journal
    assert step.counts["replay"] > 0 and not step.retired


def _writes_first(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    x.mul_(0.5)  # eager's write shows through y where y shares x's memory
    return (m(x) + m(y)).pow(2).mean()


def _two_batches(aliased_at: tuple[int, ...], replay: bool, device: str, backend: str) -> tuple:
    torch.manual_seed(0)
    model = nn.Linear(6, 3).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = rk.TrainStep(model, _writes_first, opt, replay=replay, backend=backend, warmup=1)
    kept = []
    try:
        for i in range(5):
            x = torch.randn(4, 6, device=device)
            y = x.view(4, 6) if i in aliased_at else x.clone()
            kept += [step(x, y).detach(), x, y]
    finally:
        step.release()
    return [*kept, *(p.detach() for p in model.parameters())], step


@pytest.mark.parametrize("aliased_at", [(1,), (2, 4)], ids=["recording", "replay"])
def test_a_written_batch_sharing_memory_with_another_runs_eagerly(
    backend: str, device: str, aliased_at: tuple[int, ...]
):
    """``step(x, x.view(...))``: eager's write to x shows in y, a replay's copies are apart. At the
    recording call the step retires with the write's reason; at a replay the call runs eagerly."""
    eager, _ = _two_batches(aliased_at, False, device, backend)
    replayed, step = _two_batches(aliased_at, True, device, backend)
    assert all(torch.equal(a, b) for a, b in zip(eager, replayed, strict=True)), step.journal
    if aliased_at == (1,):
        assert step.retired and "writes input 0 in place" in step.retire_reason
    else:
        assert step.eager_reasons["written_input_aliased"] == 2, step.journal
        assert step.counts["replay"] >= 1


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_host_batch_written_beside_a_gpu_model_retires():
    """A CPU batch written in place by a step on a GPU model: a CUDA graph does not repeat the host
    op, so no write-back can be exact; the step retires with the write's reason, like eager."""

    def host_loss(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        x.mul_(0.5)  # on the host
        return m(x.to("cuda")).pow(2).mean()

    results = []
    for replay in (False, True):
        torch.manual_seed(0)
        model = nn.Linear(6, 3).cuda()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        step = rk.TrainStep(model, host_loss, opt, replay=replay, backend="cuda", warmup=1)
        x = torch.randn(4, 6)
        losses = [step(x).detach().cpu() for _ in range(5)]
        step.release()
        results.append([*losses, x, *(p.detach().cpu() for p in model.parameters())])
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True)), step.journal
    assert step.retired and "on the CPU beside a GPU model" in step.retire_reason, step.journal
