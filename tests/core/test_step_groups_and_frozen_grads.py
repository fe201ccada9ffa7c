"""A layer frozen while it holds a gradient, and parameters moved between param groups (hostile round 13).

Frozen mid-cycle: ``requires_grad_(False)`` between two micro-batches leaves the first one's
``.grad``, and eager's optimizer steps it; a recording keys and hands over the trainable gradients
only, so the call that steps runs eagerly (reason ``frozen_grad``) and the next ones replay.
Regrouped: a group's ``params`` list edited (a parameter moved, removed, the lists swapped) steps
with another group's lr in eager; the optimizer watch notices and the step records anew.
Each scenario trains an eager twin (``replay=False``) and a replaying step from one seed and
compares every parameter, gradient (None pattern), optimizer state and loss with ``torch.equal``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import replaykit as rk
from replaykit.guards.optimizer import FROZEN_GRAD
from replaykit.optimizer_step import OptimizerStep

Snapshot = list[torch.Tensor | float | int | bool | str | None]
Edit = Callable[[nn.Module, torch.optim.Optimizer, int], None]


def _net(device: str) -> nn.Sequential:
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3)).to(device)


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x), y)


def _batch(i: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    return torch.randn(8, 6, generator=g).to(device), torch.randint(0, 3, (8,), generator=g).to(
        device
    )


def _snapshot(model: nn.Module, opt: torch.optim.Optimizer, loss: torch.Tensor) -> Snapshot:
    """Everything a call leaves: parameters, gradients (None kept), optimizer state and groups, loss."""
    out: Snapshot = [loss.detach().clone()]
    for p in model.parameters():
        out += [p.detach().clone(), None if p.grad is None else p.grad.clone()]
    for g in opt.param_groups:  # which parameters each group steps, and its values
        out += [len(g["params"])] + [v for k, v in sorted(g.items()) if k != "params"]
        for p in g["params"]:
            out += [t.clone() for _, t in sorted(opt.state.get(p, {}).items())]
    return out


def _equal(a: list[Snapshot], b: list[Snapshot]) -> bool:
    """torch.equal per tensor, None only against None, the rest by ``==``."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        if len(x) != len(y):
            return False
        for u, v in zip(x, y, strict=True):
            if isinstance(u, torch.Tensor) or isinstance(v, torch.Tensor):
                ok = isinstance(u, torch.Tensor) and isinstance(v, torch.Tensor)
                if not (ok and u.dtype == v.dtype and torch.equal(u, v)):
                    return False
            elif u != v:
                return False
    return True


def _step(model: nn.Module, opt: torch.optim.Optimizer, replay: bool, **kw: object) -> rk.TrainStep:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # an unsafe arm warns
        return rk.TrainStep(model, _loss, opt, replay=replay, backend="emulated", **kw)


def _eager_reasons(step: rk.TrainStep) -> dict[int, str]:
    return {e.call: e.reason for e in step.journal if e.kind == "eager"}


def _routes(step: rk.TrainStep) -> dict[int, str]:
    """Each call's route: replay, record or eager."""
    return {e.call: e.kind for e in step.journal if e.kind in ("replay", "record", "eager")}


# ----------------------------------------------------------------- a layer frozen mid-cycle
OPTIMIZERS: dict[str, Callable[[nn.Module], torch.optim.Optimizer]] = {
    "sgd": lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
    "sgd_fused": lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, fused=True),
    "adamw_fused": lambda m: torch.optim.AdamW(m.parameters(), lr=0.01, fused=True),
    # capturable=False: the step runs eagerly after each replay and reads .grad itself
    "adamw": lambda m: torch.optim.AdamW(m.parameters(), lr=0.01),
}


def _freeze_train(
    replay: bool,
    optimizer: str,
    schedule: Callable[[int], bool],
    epochs: int,
    unsafe: Sequence[str] = (),
) -> tuple[list[Snapshot], rk.TrainStep]:
    """accumulate=2, three batches an epoch: ``schedule(epoch)`` says whether the backbone trains,
    so a change lands between the two micro-batches of a cycle."""
    torch.manual_seed(0)
    model = _net("cpu")
    opt = OPTIMIZERS[optimizer](model)
    step = _step(model, opt, replay, accumulate=2, unsafe_disable=unsafe)
    out = []
    for epoch in range(epochs):
        model[0].requires_grad_(schedule(epoch))
        for b in range(3):
            loss = step(*_batch(10 * epoch + b, "cpu"))
            out.append(_snapshot(model, opt, loss))
    return out, step


def _odd_epochs_frozen(epoch: int) -> bool:
    return epoch % 2 == 0


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_a_layer_frozen_between_micro_batches_steps_as_eager(optimizer: str) -> None:
    eager, _ = _freeze_train(False, optimizer, _odd_epochs_frozen, 4)
    replayed, step = _freeze_train(True, optimizer, _odd_epochs_frozen, 4)
    assert _equal(eager, replayed)
    assert step.counts["replay"] >= 3, step.summary()
    frozen = [c for c, r in _eager_reasons(step).items() if r == FROZEN_GRAD]
    if step.optimizer_eager is None:  # the step is recorded: the calls stepping a stale .grad
        assert frozen == [4, 10], step.summary()  # each first 'last' of a frozen epoch
    else:  # stepped eagerly after the replay: it reads the frozen .grad as eager does
        assert frozen == [], step.summary()


def test_after_the_frozen_gradient_is_stepped_the_calls_replay() -> None:
    """Frozen once, mid-cycle, for good: one eager call; the frozen layout records, then replays."""
    eager, _ = _freeze_train(False, "sgd", lambda epoch: epoch == 0, 4)
    replayed, step = _freeze_train(True, "sgd", lambda epoch: epoch == 0, 4)
    assert _equal(eager, replayed)
    routes = _routes(step)
    assert _eager_reasons(step) == {1: "warmup", 2: "warmup", 4: FROZEN_GRAD}
    assert [routes[c] for c in range(7, 13)] == ["replay"] * 6, step.summary()


def _grad_set_on_frozen(
    replay: bool, unsafe: Sequence[str] = ()
) -> tuple[list[Snapshot], rk.TrainStep]:
    """accumulate=1, the backbone frozen from the start; at calls 4 and 6 a gradient is set on
    its weight by hand (an outside regulariser): eager's optimizer steps it, zero_grad clears it."""
    torch.manual_seed(0)
    model = _net("cpu")
    model[0].requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step = _step(model, opt, replay, unsafe_disable=unsafe)
    out = []
    for i in range(8):
        if i in (3, 5):
            model[0].weight.grad = torch.full_like(model[0].weight, 0.5)
        loss = step(*_batch(i, "cpu"))
        out.append(_snapshot(model, opt, loss))
    return out, step


def test_a_gradient_on_a_frozen_parameter_runs_that_step_eagerly_and_the_next_replays() -> None:
    eager, _ = _grad_set_on_frozen(False)
    replayed, step = _grad_set_on_frozen(True)
    assert _equal(eager, replayed)
    routes = _routes(step)
    assert _eager_reasons(step) == {1: "warmup", 4: FROZEN_GRAD, 6: FROZEN_GRAD}
    # call 5 records anew: call 4's step gave the frozen weight a momentum buffer (new state)
    assert [routes[c] for c in (3, 5, 7, 8)] == ["replay", "record", "replay", "replay"]


def test_without_param_identity_a_frozen_layer_steps_a_stale_gradient() -> None:
    """The negative control: the frozen-gradient check is what keeps both runs exact."""
    eager, _ = _freeze_train(False, "sgd", _odd_epochs_frozen, 4)
    replayed, _ = _freeze_train(True, "sgd", _odd_epochs_frozen, 4, unsafe=["param_identity"])
    assert not _equal(eager, replayed)
    eager, _ = _grad_set_on_frozen(False)
    replayed, _ = _grad_set_on_frozen(True, unsafe=["param_identity"])
    assert not _equal(eager, replayed)


# ----------------------------------------------------------------- parameters moved between groups
def _move_head(model: nn.Module, opt: torch.optim.Optimizer, i: int) -> None:
    """Layer-wise lr re-assigned: the head leaves the slow group for the fast one, in place."""
    slow, fast = opt.param_groups[0]["params"], opt.param_groups[1]["params"]
    for p in model[2].parameters():
        del slow[[id(q) for q in slow].index(id(p))]
        fast.append(p)


def _drop_head_bias(model: nn.Module, opt: torch.optim.Optimizer, i: int) -> None:
    """The head's bias leaves the optimizer: eager stops stepping it and keeps its gradient."""
    slow = opt.param_groups[0]["params"]
    del slow[[id(q) for q in slow].index(id(model[2].bias))]


def _swap_lists(model: nn.Module, opt: torch.optim.Optimizer, i: int) -> None:
    """``g["params"] = [...]``: the groups trade their parameters (and so their lrs)."""
    a, b = opt.param_groups
    a["params"], b["params"] = list(b["params"]), list(a["params"])


def _reorder(model: nn.Module, opt: torch.optim.Optimizer, i: int) -> None:
    """The same parameters in another order within their group."""
    opt.param_groups[0]["params"].reverse()


EDITS: dict[str, Edit] = {
    "moved": _move_head,
    "removed": _drop_head_bias,
    "swapped": _swap_lists,
    "reordered": _reorder,
}


def _regroup_train(
    replay: bool, edit: str, unsafe: Sequence[str] = ()
) -> tuple[list[Snapshot], rk.TrainStep]:
    torch.manual_seed(0)
    model = _net("cpu")
    head = list(model[2].parameters()) if edit == "swapped" else []
    backbone = [p for p in model.parameters() if all(p is not h for h in head)]
    opt = torch.optim.SGD(
        [{"params": backbone, "lr": 0.01}, {"params": head, "lr": 0.1}], momentum=0.9
    )
    step = _step(model, opt, replay, unsafe_disable=unsafe)
    out = []
    for i in range(7):
        if i == 3:
            EDITS[edit](model, opt, i)
        loss = step(*_batch(i, "cpu"))
        out.append(_snapshot(model, opt, loss))
    return out, step


@pytest.mark.parametrize("edit", sorted(EDITS))
def test_a_param_group_edited_in_place_records_anew(edit: str) -> None:
    eager, _ = _regroup_train(False, edit)
    replayed, step = _regroup_train(True, edit)
    assert _equal(eager, replayed)
    assert step.counts["rerecord"] == 1, step.summary()
    routes = _routes(step)
    assert routes[4] == "record" and routes[6] == routes[7] == "replay", step.summary()


@pytest.mark.parametrize("protection", ["state_identity", "param_identity"])
def test_without_its_watch_a_moved_parameter_keeps_its_recorded_group(protection: str) -> None:
    """The negative control: the optimizer watch (``state_identity``) is what keeps both runs
    exact; its groups' check is off with ``param_identity`` too (a parameter replaced in the model
    and in its group is that protection's hazard)."""
    eager, _ = _regroup_train(False, "moved")
    replayed, _ = _regroup_train(True, "moved", unsafe=[protection])
    assert not _equal(eager, replayed)


def _optimizer_step_train(replay: bool, unsafe: Sequence[str] = ()) -> list[Snapshot]:
    """The same move under the optimizer step alone (``OptimizerStep`` shares the watch)."""
    torch.manual_seed(0)
    model = _net("cpu")
    opt = torch.optim.SGD(
        [{"params": list(model.parameters()), "lr": 0.01}, {"params": [], "lr": 0.1}],
        momentum=0.9,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step = OptimizerStep(opt, unsafe_disable=unsafe, backend="emulated") if replay else None
    out = []
    for i in range(7):
        if i == 3:
            _move_head(model, opt, i)
        opt.zero_grad(set_to_none=True)
        loss = _loss(model, *_batch(i, "cpu"))
        loss.backward()
        opt.step() if step is None else step(opt.step)
        out.append(_snapshot(model, opt, loss))
    return out


def test_the_optimizer_step_alone_records_anew_after_a_move() -> None:
    eager = _optimizer_step_train(False)
    assert _equal(eager, _optimizer_step_train(True))
    assert not _equal(eager, _optimizer_step_train(True, unsafe=["state_identity"]))
