"""Guards: host-side values a recording depends on are part of its key; writes are noticed in O(1)."""

from __future__ import annotations

import functools
import pickle
import threading
import time
import types

import pytest
import torch
from torch import nn

import replaykit as rk
from replaykit.guards import module as guards
from replaykit.guards.keys import value_key
from replaykit.guards.module import ModuleGuard
from replaykit.protections import negative_control


class Scheduled(nn.Module):
    """Dropout, BatchNorm and a float attribute read in forward: what a graph freezes."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.bn = nn.BatchNorm1d(6)
        self.drop = nn.Dropout(0.25)
        self.temperature = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.bn(self.lin(x))) / self.temperature


def _pair(device: str) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    eager = Scheduled().to(device)
    model = Scheduled().to(device)
    model.load_state_dict(eager.state_dict())
    return eager, model


def _halved_linear(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return nn.functional.linear(x, self.weight, self.bias) * 0.5


def _halving_backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
    """A torch.compile backend whose kernels give other bits than eager's (as inductor's may)."""
    return lambda *args: [t * 0.5 for t in gm(*args)]


CHANGES = {
    "temperature": lambda m: setattr(m, "temperature", 0.5),
    # what a submodule calls instead of its class's forward
    "submodule_forward": lambda m: setattr(
        m.lin, "forward", types.MethodType(_halved_linear, m.lin)
    ),
    "dropout_p": lambda m: setattr(m.drop, "p", 0.6),
    "submodule_eval": lambda m: m.bn.eval(),
    "momentum": lambda m: setattr(m.bn, "momentum", 0.9),
    "momentum_none": lambda m: setattr(m.bn, "momentum", None),
}


def _train(model: nn.Module, device: str, change, steps: int = 5) -> dict[str, torch.Tensor]:
    torch.manual_seed(7)  # dropout draws the same masks in both arms
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(3)
    for i in range(steps):
        if i == 2:
            change(model)
        model(torch.randn(4, 6, generator=g).to(device)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _equal(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("name", list(CHANGES))
def test_a_changed_host_value_records_anew_and_matches_eager(
    backend: str, device: str, name: str
) -> None:
    eager, model = _pair(device)
    reference = _train(eager, device, CHANGES[name])
    rec = rk.capture(model, backend=backend)
    replayed = _train(model, device, CHANGES[name])
    assert _equal(reference, replayed)
    assert rec.counts["record"] + len(rec.eager_reasons) >= 2 or rec.retired  # the change was seen
    rec.release()


@pytest.mark.parametrize("name", list(CHANGES))
def test_without_the_module_state_guard_a_changed_value_diverges(
    backend: str, device: str, name: str
) -> None:
    """The negative control: replay freezes the recorded value (on CPU too: the emulated backend replays frozen ops)."""
    eager, model = _pair(device)
    reference = _train(eager, device, CHANGES[name])
    rec = rk.capture(model, backend=backend, unsafe_disable=("module_state",))
    replayed = _train(model, device, CHANGES[name])
    assert not _equal(reference, replayed)
    rec.release()


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x))


class _Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block, self.head = _Block(), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(x))


def _outer_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).square().mean()


STEP_CHANGES = {
    "block.compile()": lambda m: m.block.compile(backend=_halving_backend),
    "torch.compile(block)": lambda m: setattr(
        m, "block", torch.compile(m.block, backend=_halving_backend)
    ),
    "block.forward patched": lambda m: setattr(
        m.block, "forward", types.MethodType(lambda self, x: torch.tanh(self.lin(x)), m.block)
    ),
}


@pytest.mark.parametrize(
    ("change", "unsafe"),
    [
        *((c, ()) for c in STEP_CHANGES),
        # a new wrapper is a new submodule (retires, param_identity's scope): no module_state arm
        *((c, negative_control("module_state")) for c in STEP_CHANGES if "torch.compile" not in c),
    ],
)
def test_a_submodule_compiled_or_patched_after_recording_is_not_replayed_as_recorded(
    change: str, unsafe: tuple[str, ...]
) -> None:
    """``module.compile()`` and a patched ``forward`` change what the module runs without touching
    a value the forward reads: the step must not replay the recording made before."""

    def run(replay: bool) -> tuple[list[torch.Tensor], rk.TrainStep]:
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = _Outer()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        step = rk.TrainStep(model, _outer_loss, opt, replay=replay, unsafe_disable=unsafe)
        g = torch.Generator().manual_seed(1)
        for i in range(6):
            if i == 3:
                STEP_CHANGES[change](model)
            step(torch.randn(4, 8, generator=g))
        return [p.detach().clone() for p in model.parameters()], step

    twin, _ = run(False)
    replayed, step = run(True)
    equal = all(map(torch.equal, twin, replayed))
    if unsafe:
        assert step.counts["replay"] >= 3 and not equal, step.summary()  # the recording replayed
    else:
        assert equal, step.summary()


def test_the_class_forward_put_back_each_step_keeps_replaying() -> None:
    """Lightning's strategies patch ``forward`` around a training_step and put back the bound
    method they read. The class's own forward bound anew (a new object each step) is the forward
    the recording ran: no new recording (keyed by identity, each step would record anew)."""
    torch.manual_seed(0)
    model = _Outer()
    step = rk.TrainStep(model, _outer_loss, torch.optim.SGD(model.parameters(), lr=0.1))
    for i in range(6):
        if i >= 3:
            model.block.forward = types.MethodType(_Block.forward, model.block)
        step(torch.randn(4, 8))
    assert step.counts["record"] == 1 and step.counts["replay"] == 4, step.summary()


def test_a_value_set_back_replays_its_earlier_recording() -> None:
    model = Scheduled()
    rec = rk.capture(model, backend="emulated")
    x = torch.randn(4, 6)
    for p in (0.25, 0.5, 0.25, 0.5):
        model.drop.p = p
        model(x).sum().backward()
    assert rec.counts["record"] == 2 and rec.counts["replay"] == 2
    rec.release()


def test_an_unchanged_module_costs_one_comparison() -> None:
    model = Scheduled()
    guard = ModuleGuard(model)
    first = guard.verdict()
    assert guard.verdict() is first  # no write: the cached verdict, no walk over the tree
    model.drop.p = 0.5
    changed = guard.verdict()
    assert changed is not first and changed.key != first.key
    model.drop.p = 0.25
    assert guard.verdict().key == first.key
    guard.close()


def test_writes_to_unwatched_modules_do_not_move_the_epoch() -> None:
    watched, other = Scheduled(), Scheduled()
    guard = ModuleGuard(watched)
    before = guards.epoch()
    other.temperature = 3.0
    assert guards.epoch() == before
    watched.temperature = 3.0
    assert guards.epoch() != before
    guard.close()


def test_close_gives_back_plain_dicts_and_pickles_plainly() -> None:
    model = Scheduled()
    guard = ModuleGuard(model)
    assert type(model.lin._parameters) is not dict
    loaded = pickle.loads(pickle.dumps(model))
    assert type(loaded.lin._parameters) is dict
    guard.close()
    assert (
        type(model.lin._parameters) is dict
        and type(model.lin._forward_hooks).__name__ == "OrderedDict"
    )


def test_functions_are_keyed_by_code_and_captured_values() -> None:
    """A new lambda each step can reuse a freed one's id: keyed by id, it replayed a stale recording."""

    def make(c: float):
        return lambda x: x * c

    assert value_key(make(1.0)) != value_key(make(2.0))
    assert value_key(make(1.0)) == value_key(make(1.0))
    assert value_key(functools.partial(torch.mul, other=2.0)) != value_key(
        functools.partial(torch.mul, other=3.0)
    )


def test_value_keys_follow_bits() -> None:
    assert value_key(0.0) != value_key(-0.0)
    assert value_key(float("nan")) == value_key(float("nan"))
    assert value_key(1) != value_key(True)
    assert value_key((1.0, [2, 3])) == value_key((1.0, [2, 3]))


def test_functional_call_routes_eager_until_the_parameters_are_back(
    backend: str, device: str
) -> None:
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(5, 5), nn.Tanh(), nn.Linear(5, 2)).to(device)
    model = nn.Sequential(nn.Linear(5, 5), nn.Tanh(), nn.Linear(5, 2)).to(device)
    model.load_state_dict(eager.state_dict())
    rec = rk.capture(model, backend=backend)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        x = torch.randn(3, 5, generator=g).to(device)
        for m in (eager, model):
            fast = {n: p - 0.1 for n, p in m.named_parameters()}  # MAML-style fast weights
            (torch.func.functional_call(m, fast, (x,)).square().sum() + m(x).sum()).backward()
    for p, q in zip(eager.parameters(), model.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)
    assert rec.eager_reasons["parameters_swapped"] == 3 and rec.counts["replay"] == 2
    rec.release()


def test_functional_call_without_the_identity_guard_diverges(backend: str, device: str) -> None:
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(5, 5), nn.Tanh(), nn.Linear(5, 2)).to(device)
    model = nn.Sequential(nn.Linear(5, 5), nn.Tanh(), nn.Linear(5, 2)).to(device)
    model.load_state_dict(eager.state_dict())
    rec = rk.capture(model, backend=backend, unsafe_disable=("param_identity",))
    x = torch.randn(3, 5, device=device)
    model(x).sum().backward()  # record with the module's own parameters
    grads = []
    for m in (eager, model):
        m.zero_grad()
        fast = {n: p * 2 for n, p in m.named_parameters()}
        torch.func.functional_call(m, fast, (x,)).square().sum().backward()
        grads.append([p.grad.clone() for p in m.parameters()])
    assert any(not torch.equal(a, b) for a, b in zip(*grads, strict=True))
    rec.release()


@pytest.mark.parametrize("which", ["weight", "bias"])
def test_weights_changed_between_forward_and_backward_raise_exactly_when_eager_does(
    backend: str, device: str, which: str
) -> None:
    """Eager checks the tensors its backward saved: a Linear's weight, not its bias."""
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)).to(device)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)).to(device)
    model.load_state_dict(eager.state_dict())
    rec = rk.capture(model, backend=backend)
    raised = []
    for m in (eager, model):
        try:
            for _ in range(3):
                out = m(torch.ones(2, 4, device=device))
                with torch.no_grad():
                    getattr(m[2], which).mul_(0.5)
                out.sum().backward()
            raised.append(False)
        except RuntimeError as exc:
            assert "modified by an inplace operation" in str(exc)
            raised.append(True)
    assert raised == [which == "weight"] * 2
    if which == "bias":
        assert rec.counts["replay"] == 2
        for p, q in zip(eager.parameters(), model.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad)
    rec.release()


_SLOW_RUNS = [0]  # counted outside the module: a forward changing what the module holds is refused


class _Slow(nn.Module):
    """Its second run (the probe's, with stand-ins in place of the parameters) lets another thread in."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.inside = threading.Event()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _SLOW_RUNS[0] += 1
        if _SLOW_RUNS[0] == 2:
            self.inside.set()
            time.sleep(0.3)
        return self.lin(x)


def test_another_threads_call_never_sees_the_stand_in_parameters() -> None:
    _SLOW_RUNS[0] = 0
    model = _Slow()
    weight = (
        model.lin.weight
    )  # the real parameter (model.lin.weight reads stand-ins while they are in place)
    rec = rk.capture(model, backend="emulated")
    got: list = []

    def other() -> None:
        model.inside.wait(5)
        out = model(torch.ones(2, 3))
        got.append(torch.autograd.grad(out.sum(), [weight], allow_unused=True)[0])

    thread = threading.Thread(target=other)
    thread.start()
    model(torch.ones(2, 3)).sum().backward()  # the first call records: its probe runs on stand-ins
    thread.join()
    assert got and got[0] is not None and torch.equal(got[0], torch.full((3, 3), 2.0))
    assert rec.eager_reasons["thread"] == 1
    rec.release()


def test_the_probe_leaves_no_reference_cycle() -> None:
    """Seen on the H200 as 1.2 MB never given back: a saved output kept as itself holds its own graph."""
    import gc
    import weakref

    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh())  # tanh saves its own output
    rec = rk.capture(model, backend="emulated")
    model(torch.randn(2, 4)).sum().backward()
    static = weakref.ref(next(iter(rec._recordings.values())).static_inputs[0])
    rec.release()
    gc.collect()
    assert static() is None


def test_a_re_bound_tensor_never_meets_its_predecessors_key() -> None:
    """A key names a tensor by identity and holds it: Python gives a new tensor a freed one's
    ``id``, and a graph keyed by the old tensor reads the old memory (a global re-bound each step)."""
    from replaykit.guards.keys import value_key

    old = value_key(torch.tensor(0.0))  # the key is the tensor's only holder now
    for i in range(1, 2000):
        assert value_key(torch.tensor(float(i))) != old, i
