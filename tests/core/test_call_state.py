"""A call that ends eager leaves exactly what eager leaves: the recording call's extra runs (probe,
eager reference, capture) are put back whatever its outcome (refused, retired), the Python values
of the optimizer's param groups and what loss_fn holds included, and print once per call."""

from __future__ import annotations

import contextlib
import io
import logging
import signal
from collections.abc import Iterator

import pytest
import torch
from torch import nn

import replaykit as rk
from replaykit.testing.hazards.pattern import MLP
from replaykit.testing.hazards.recording_call import CentredHead, CountingSGD, DinoLoss
from replaykit.testing.hazards.under_capture import CaptureAware


@pytest.fixture(autouse=True)
def _deadline() -> Iterator[None]:
    """Each test under 120 s: a recording call that hangs (a retry loop that never settles) fails
    the test instead of the suite."""

    def _expired(signum: int, frame: object) -> None:
        raise TimeoutError("a call-state test ran past 120 s")

    previous = signal.signal(signal.SIGALRM, _expired)
    signal.alarm(120)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


CALLS = 4
_TICKS = 0  # a global loss_fn counts its calls in
_CALLED = 0  # a global the model's forward counts its calls in


class _Printing(CaptureAware):
    """Prints and counts its calls in a global: one per call, as eager."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        global _CALLED
        _CALLED += 1
        print("forward")
        return super().forward(x)


def _world(outcome: str, device: str = "cpu") -> dict:
    """Model, optimizer and a loss_fn holding a teacher with BatchNorm in train mode, DINO's loss
    module and (``retired``) a closure counter, a global counter and a list it appends to."""
    global _TICKS, _CALLED
    _TICKS = _CALLED = 0
    torch.manual_seed(0)
    model = _Printing().to(device)
    teacher = MLP(bn=True).requires_grad_(False).to(device)  # statistics that move: train mode
    criterion = DinoLoss().to(device)
    seen: list[float] = []
    count = 0

    def loss_fn(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        nonlocal count
        global _TICKS
        with torch.no_grad():
            soft = teacher(x)
        loss = criterion(m(x), soft)
        if outcome == "retired":
            count += 1
            _TICKS += 1
            seen.append(count)
        return loss

    opt = CountingSGD(model.parameters(), lr=0.1, momentum=0.9)
    state = {
        "count": lambda: count,
        "ticks": lambda: _TICKS,
        "seen": lambda: list(seen),
        "called": lambda: _CALLED,
    }
    return {"model": model, "opt": opt, "loss_fn": loss_fn, "teacher": teacher}, state, criterion


def _end(env: dict, state: dict, criterion: nn.Module, printed: list[int]) -> dict:
    model, opt = env["model"], env["opt"]
    out = {f"p {n}": p.detach().clone() for n, p in model.named_parameters()}
    out |= {f"g {n}": p.grad for n, p in model.named_parameters()}
    out |= {f"b {n}": b.clone() for n, b in model.named_buffers()}
    out |= {f"teacher {n}": t.clone() for n, t in env["teacher"].state_dict().items()}
    out["centre"] = criterion.center.clone()
    for i, s in enumerate(opt.state.values()):
        out |= {f"opt {i} {k}": v for k, v in s.items()}
    out["groups"] = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    out |= {k: read() for k, read in state.items()}
    out["printed"] = printed
    return out


def _run(
    outcome: str, replay: bool | None, unsafe: tuple[str, ...] = (), backend: str = "emulated"
) -> tuple[dict, object]:
    """``replay=None``: the plain eager loop, written here; else TrainStep (or its twin)."""
    device = "cuda" if backend == "cuda" else "cpu"
    env, state, criterion = _world(outcome, device)
    model, opt, loss_fn = env["model"], env["opt"], env["loss_fn"]
    step = None
    if replay and outcome == "diverged":
        # the forward's global counter would retire the step at its first call (forward_inputs
        # sees it change); off, each diverged call's call state alone must put it back
        unsafe = (*unsafe, "forward_inputs")
    if replay is not None:
        step = rk.TrainStep(
            model,
            loss_fn,
            opt,
            replay=replay,
            backend=backend,
            warmup=0,
            trust_optimizer=True,
            unsafe_disable=unsafe,
        )
    g = torch.Generator().manual_seed(1)
    printed = []
    for _ in range(CALLS):
        x = torch.randn(4, 6, generator=g).to(device)
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            if step is not None:
                step(x)
            else:
                loss_fn(model, x).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        printed.append(buf.getvalue().count("forward"))
    return _end(env, state, criterion, printed), step


def _differences(a: dict, b: dict) -> list[str]:
    out = []
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            same = (x is None) == (y is None) and (x is None or torch.equal(x, y))
        else:
            same = x == y
        if not same:
            out.append(k)
    return out


@pytest.mark.parametrize("outcome", ["diverged", "retired"])
def test_a_step_routed_eager_ends_as_a_plain_eager_loop(outcome: str, backend: str) -> None:
    """Every recording call fails verification (``diverged``) or its reference run stands and
    retires the step (``retired``: loss_fn changes Python values): the end state, Python included,
    is the plain loop's."""
    eager, _ = _run(outcome, None, backend=backend)
    twin, _ = _run(outcome, False, backend=backend)
    assert not _differences(eager, twin)
    replayed, step = _run(outcome, True, backend=backend)
    assert step.counts["replay"] == 0
    if outcome == "diverged":
        # the counter keys a new recording each call (until the optimizer's step leaves the
        # graph, its host values varying): each is refused, or its key's refusal routes it
        refused = [e for e in step.journal if e.kind == "refuse" and e.reason == "diverged"]
        assert len(refused) + step.eager_reasons["diverged"] == CALLS and not step.retired
    else:
        assert step.retired
    assert not _differences(eager, replayed), _differences(eager, replayed)


def test_without_the_call_state_a_refused_step_differs(backend: str) -> None:
    eager, _ = _run("diverged", None, backend=backend)
    unsafe, _ = _run("diverged", True, unsafe=("call_state",), backend=backend)
    assert {"groups", "teacher bn.running_mean", "centre", "printed", "called"} <= set(
        _differences(eager, unsafe)
    )


_FORWARDS = 0


class _Counting(CentredHead):
    """Re-binds its centre buffer, counts calls in a global and prints: a recording call's
    probe, reference and capture each do all three."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        global _FORWARDS
        _FORWARDS += 1
        print("forward")
        logging.getLogger("replaykit.test_call_state").warning("forward")
        return super().forward(x)


@pytest.mark.parametrize("unsafe", [(), ("call_state",)], ids=["safe", "unsafe"])
def test_a_capture_routed_eager_ends_as_a_plain_eager_loop(
    unsafe: tuple[str, ...], backend: str
) -> None:
    """The probe, the reference and the capture each re-bind the centre, count, print and log."""
    log = io.StringIO()
    logger = logging.getLogger("replaykit.test_call_state")
    handler = logging.StreamHandler(log)
    logger.addHandler(handler)
    try:
        ends = _capture_runs(unsafe, log, backend)
    finally:
        logger.removeHandler(handler)
    (eager, n_eager, p_eager), (replayed, n_replayed, p_replayed) = ends
    same = all(torch.equal(eager[k], replayed[k]) for k in eager)
    if unsafe:
        assert not (same and n_eager == n_replayed and p_eager == p_replayed)
        return
    assert same and n_eager == n_replayed and p_eager == p_replayed == [(1, 1)] * CALLS


def _capture_runs(unsafe: tuple[str, ...], log: io.StringIO, backend: str) -> list:
    ends, device = [], "cuda" if backend == "cuda" else "cpu"
    for replay in (False, True):
        global _FORWARDS
        _FORWARDS = 0
        torch.manual_seed(0)
        model = _Counting().to(device)
        if replay:
            rk.capture(model, backend=backend, unsafe_disable=unsafe)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(1)
        printed = []
        for _ in range(CALLS):
            buf = io.StringIO()
            logged = len(log.getvalue())
            with contextlib.redirect_stdout(buf):
                model(torch.randn(4, 6, generator=g).to(device)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            lines = log.getvalue()[logged:].count("forward")
            printed.append((buf.getvalue().count("forward"), lines))
        end = {n: t.clone() for n, t in model.state_dict().items()}
        ends.append((end, _FORWARDS, printed))
    return ends


class _ReadingSGD(CountingSGD):
    """Reads a weight's norm on the host after its counter moved: no capture can hold that
    read, so the recording call's capture fails after the step's Python ran, and it ends eager."""

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        loss = super().step(closure)
        self.norm = float(self.param_groups[0]["params"][0].norm())
        return loss


def _optimizer_step_run(
    backend: str, replay: bool, unsafe: tuple[str, ...], optimizer: type
) -> tuple[dict, int, object]:
    from replaykit.optimizer_step import OptimizerStep

    device = "cuda" if backend == "cuda" else "cpu"
    torch.manual_seed(0)
    net = nn.Linear(6, 3).to(device)
    opt = optimizer(net.parameters(), lr=0.1, momentum=0.9)
    step = (
        OptimizerStep(opt, backend=backend, warmup=0, trust_optimizer=True, unsafe_disable=unsafe)
        if replay
        else None
    )
    g = torch.Generator().manual_seed(1)
    for _ in range(CALLS):
        net(torch.randn(4, 6, generator=g).to(device)).pow(2).mean().backward()
        if step is None:
            opt.step()
        else:
            step(opt.step)
        opt.zero_grad(set_to_none=True)
    end = {n: t.detach().clone() for n, t in net.state_dict().items()}
    end |= {f"momentum {i}": s["momentum_buffer"].clone() for i, s in enumerate(opt.state.values())}
    end |= {f"grad {n}": p.grad for n, p in net.named_parameters()}
    return end, opt.param_groups[0]["k"], step


@pytest.mark.parametrize("ends", ["recorded", "eager"])
@pytest.mark.parametrize("unsafe", [(), ("call_state",)], ids=["safe", "unsafe"])
def test_an_optimizer_step_keeps_its_param_group_counter_once_per_call(
    backend: str, unsafe: tuple[str, ...], ends: str
) -> None:
    """OptimizerStep's recording call runs the body at capture and again eagerly (its
    verification, or the eager run after a failed capture: ``ends="eager"``): the param group's
    counter must move once per call, as eager's, and the weights, momentum and gradients end as
    eager's. On CUDA the capture runs no kernel but runs the step's Python, so the unsafe arm's
    counter still moves twice per recording call (the emulated one's weights move twice too)."""
    optimizer = CountingSGD if ends == "recorded" else _ReadingSGD
    (eager, k_eager, _), (replayed, k_replayed, step) = (
        _optimizer_step_run(backend, replay, unsafe, optimizer) for replay in (False, True)
    )
    if ends == "eager":
        assert step.retired and "capture failed" in step.retire_reason, step.summary()
    if unsafe:
        assert k_replayed != k_eager
        return
    assert k_replayed == k_eager == CALLS
    assert eager.keys() == replayed.keys()
    assert not _differences(eager, replayed), _differences(eager, replayed)


class _Lookahead(torch.optim.Optimizer):
    """A Lookahead-style wrapper: its own counter, the base optimizer's groups and state."""

    def __init__(self, base: torch.optim.Optimizer) -> None:
        self.base, self.k = base, 0
        self.param_groups, self.defaults, self.state = base.param_groups, base.defaults, {}

    def step(self, closure=None):  # type: ignore[override]
        self.base.step()
        self.k += 1
        for group in self.param_groups:
            group["pulls"] = group.get("pulls", 0) + 1


def test_the_call_state_puts_back_a_wrapped_optimizers_python_and_state() -> None:
    """What a recording call's extra run of a wrapper's step changes: its counter, a param-group
    key, the base optimizer's state (created at its first step)."""
    from replaykit.verify.call_state import CallState
    from replaykit.verify.step_check import StepSnapshot

    net = nn.Linear(3, 2)
    opt = _Lookahead(torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))
    net(torch.ones(1, 3)).sum().backward()
    params = list(net.parameters())
    state = CallState(StepSnapshot(net, opt, None, None, params, True), net, opt)
    before = [p.detach().clone() for p in params]
    opt.step()
    assert opt.k == 1 and opt.base.state and opt.param_groups[0]["pulls"] == 1
    state.restore()
    assert opt.k == 0 and not opt.base.state and "pulls" not in opt.param_groups[0]
    assert all(torch.equal(b, p) for b, p in zip(before, params, strict=True))
