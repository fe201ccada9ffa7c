"""Changes recordings cannot survive: re-recorded (replay resumes) or retired (permanent eager, a
reason, one warning), with parity either way."""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Iterator

import pytest
import torch
from torch import nn

import replaykit as rk
from replaykit.testing.nets import DetectionNet
from replaykit.verify import contexts
from replaykit.verify.bitwise import diff_states


def _train(model: nn.Module, device: str, change, steps: int = 4) -> dict:
    """Three steps, ``change(model, opt)`` after the second, return weights and grads."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(3)
    for i in range(steps):
        if i == 2:
            opt = change(model, opt) or opt
        x = torch.randn(2, 3, 8, 8, generator=g).to(device)
        out = model(x)
        sum(o.square().mean() for o in out.values()).backward()
        opt.step()
        opt.zero_grad()
    return {f"p/{k}": v.detach().clone() for k, v in model.state_dict().items()}


def _assign(model, opt):
    fresh = {k: v.clone() + 0.01 for k, v in model.state_dict().items()}
    model.load_state_dict(fresh, assign=True)
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _data(model, opt):
    for p in model.parameters():
        p.data = p.data.clone()


def _new_param(model, opt):
    model.o2m_cls.weight = nn.Parameter(model.o2m_cls.weight.detach().clone())
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _hook(model, opt):
    model.backbone[0].register_forward_hook(lambda m, i, o: None)


def _freeze(model, opt):
    model.o2o_box.weight.requires_grad_(False)


def _unfreeze(model, opt):
    model.o2o_box.weight.requires_grad_(True)  # frozen before the first call (see test below)


#: Well-defined changes: the recordings are dropped and recorded anew, and replay resumes.
RERECORDED = {
    "load_state_dict_assign": (_assign, "registered anew"),
    "param_data": (_data, "storage changed"),
    "new_parameter": (_new_param, "registered anew"),
    "requires_grad": (_unfreeze, "requires_grad"),
}


def _run(
    backend: str, device: str, name: str, change, **capture
) -> tuple[dict, dict, rk.Recorder, list]:
    torch.manual_seed(0)
    eager = DetectionNet().to(device)
    if name == "requires_grad":
        _freeze(eager, None)
    eager_state = _train(eager, device, change)
    torch.manual_seed(0)
    model = DetectionNet().to(device)
    if name == "requires_grad":
        _freeze(model, None)
    rec = rk.capture(model, backend=backend, **capture)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", rk.ReplayWarning)
        replayed = _train(model, device, change)
    return (
        eager_state,
        replayed,
        rec,
        [w for w in caught if issubclass(w.category, rk.ReplayWarning)],
    )


@pytest.mark.parametrize("name", list(RERECORDED))
def test_changes_rerecord_and_replay_resumes(backend: str, device: str, name: str) -> None:
    change, cause = RERECORDED[name]
    eager, replayed, rec, warned = _run(backend, device, name, change)
    assert diff_states(eager, replayed) == []
    assert not rec.retired and not warned
    assert rec.counts["rerecord"] == 1 and cause in rec.journal.summary()["rerecord_causes"][0]
    assert (
        rec.counts["record"] == 2 and rec.counts["replay"] == 2
    )  # the call after the change replays
    rec.release()


def test_rerecord_budget_spent_retires(backend: str, device: str) -> None:
    eager, replayed, rec, warned = _run(backend, device, "param_data", _data, max_rerecords=0)
    assert diff_states(eager, replayed) == []
    assert rec.retired and "re-record budget of 0 spent" in rec.retire_reason and len(warned) == 1
    assert rec.eager_reasons["retired"] == 2
    rec.release()


def test_a_hook_added_retires(backend: str, device: str) -> None:
    """A submodule hook would not run inside a replay: the re-recording refuses it and retires."""
    eager, replayed, rec, warned = _run(backend, device, "hook_added", _hook)
    assert diff_states(eager, replayed) == []
    assert rec.retired and "hooks" in rec.retire_reason
    assert rec.recordings == 0 and len(warned) == 1
    assert rec.eager_reasons["retired"] == 2
    rec.release()


def test_freezing_a_parameter_keeps_replaying_with_parity(backend: str, device: str) -> None:
    """Autograd drops the gradient a replay returns for a frozen parameter, as eager never computes it."""
    torch.manual_seed(0)
    eager = _train(DetectionNet().to(device), device, _freeze)
    torch.manual_seed(0)
    model = DetectionNet().to(device)
    rec = rk.capture(model, backend=backend)
    replayed = _train(model, device, _freeze)
    assert diff_states(eager, replayed) == []
    assert not rec.retired and rec.counts["replay"] == 3
    rec.release()


def test_to_dtype_rerecords(backend: str, device: str) -> None:
    torch.manual_seed(0)
    model = DetectionNet().to(device)
    rec = rk.capture(model, backend=backend)
    x = torch.randn(2, 3, 8, 8, device=device)
    sum(o.sum() for o in model(x).values()).backward()
    model.double()
    out = model(x.double())
    assert out["o2m_cls"].dtype == torch.float64
    assert not rec.retired and rec.counts["rerecord"] == 1 and rec.counts["record"] == 2
    rec.release()


def test_a_global_module_hook_retires_and_runs(backend: str, device: str) -> None:
    """A hook from ``register_module_forward_hook`` would not run inside a replay: retire, then it runs."""
    torch.manual_seed(0)
    model = DetectionNet().to(device)
    rec = rk.capture(model, backend=backend)
    x = torch.randn(2, 3, 8, 8, device=device)
    for _ in range(2):
        sum(o.sum() for o in model(x).values()).backward()
    assert rec.counts["replay"] == 1 and not rec.retired
    seen: list[str] = []
    handle = nn.modules.module.register_module_forward_hook(
        lambda m, i, o: seen.append(type(m).__name__)
    )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", rk.ReplayWarning)
            sum(o.sum() for o in model(x).values()).backward()
    finally:
        handle.remove()
    assert rec.retired and "hooks" in rec.retire_reason
    assert "Conv2d" in seen  # the submodules ran eagerly, hooks included
    rec.release()


def test_hooks_present_before_recording_retire(backend: str, device: str) -> None:
    model = DetectionNet().to(device)
    model.backbone.register_forward_pre_hook(lambda m, i: None)
    rec = rk.capture(model, backend=backend)
    model(torch.randn(2, 3, 8, 8, device=device))
    assert rec.retired and "hooks" in rec.retire_reason
    rec.release()


_IN_RECORDING = [False]


@contextlib.contextmanager
def _recording_flag() -> Iterator[None]:
    _IN_RECORDING[0] = True
    try:
        yield
    finally:
        _IN_RECORDING[0] = False


@pytest.fixture
def fails_in_recording() -> Iterator[type]:
    """A model that raises inside a recording (its warm-up), after touching BatchNorm stats: a
    capture failure. It learns that it is being recorded from a context registered for the test
    (a counter of its own calls would be put back by the recording call's state, as it should)."""
    contexts.register("test_retirement", _recording_flag)
    yield FailsInRecording
    contexts.unregister("test_retirement")


class FailsInRecording(DetectionNet):
    def forward(self, x):
        out = super().forward(x)
        if _IN_RECORDING[0]:
            raise RuntimeError("boom in warm-up")
        return out


def test_a_capture_that_raises_restores_state_and_continues_eager(
    backend: str, device: str, fails_in_recording: type
) -> None:
    torch.manual_seed(0)
    ref = DetectionNet().to(device)
    torch.manual_seed(0)
    model = fails_in_recording().to(device)
    rec = rk.capture(model, backend=backend)
    x = torch.randn(2, 3, 8, 8, device=device)
    out, ref_out = model(x), ref(x)
    assert rec.retired and "boom in warm-up" in rec.retire_reason
    for a, b in zip(ref.buffers(), model.buffers(), strict=True):
        assert torch.equal(a, b)  # warm-up's BN updates undone; the eager call updated once
    for k in out:
        assert torch.equal(out[k], ref_out[k])
    rec.release()


def test_strict_capture_failure_raises(backend: str, device: str, fails_in_recording: type) -> None:
    model = fails_in_recording().to(device)
    rec = rk.capture(model, backend=backend, strict=True)
    with pytest.raises(rk.ReplayError, match="boom"):
        model(torch.randn(2, 3, 8, 8, device=device))
    assert not rec.retired
    rec.release()


def test_user_retire_frees_and_continues(backend: str, device: str) -> None:
    torch.manual_seed(0)
    model = DetectionNet().to(device)
    rec = rk.capture(model, backend=backend)
    x = torch.randn(2, 3, 8, 8, device=device)
    sum(o.sum() for o in model(x).values()).backward()
    assert rec.recordings == 1
    rec.retire("enough")
    rec.retire("again")  # no-op
    assert rec.retired and rec.retire_reason == "enough" and rec.recordings == 0
    model(x)
    assert rec.eager_reasons["retired"] == 1
    assert [e.reason for e in rec.journal if e.kind == "retire"] == ["enough"]
    rec.release()


def test_batchnorm_with_cumulative_average_retires_and_matches_eager(
    backend: str, device: str
) -> None:
    """momentum=None reads num_batches_tracked on the host each call: a graph would freeze it."""

    def make() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, momentum=None)).to(device)

    eager, model = make(), make()
    rec = rk.capture(model, backend=backend)
    for _ in range(3):
        x = torch.randn(2, 3, 8, 8, device=device)
        for m in (eager, model):
            m(x).square().mean().backward()
    assert rec.retired and "momentum=None" in rec.retire_reason
    for a, b in zip(eager.state_dict().values(), model.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    rec.release()


def test_a_graph_kept_after_release_pins_no_static_memory() -> None:
    """A replayed call's autograd node outlives the recorder's release: it must not keep static buffers."""
    import gc
    import weakref

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    rec = rk.capture(model, backend="emulated")
    x = torch.randn(2, 4)
    model(x).sum().backward()
    kept = model(x)  # a replay whose graph stays alive
    recording = next(iter(rec._recordings.values()))
    static_input = weakref.ref(recording.static_inputs[0])
    static_output = weakref.ref(recording.static_outputs[0])
    del recording
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", rk.ReplayWarning)
        rec.release()
    gc.collect()
    assert kept.grad_fn is not None
    assert static_input() is None and static_output() is None
    del kept


class _LazyHead(nn.Module):
    """Creates its head at its first call; the head's initial weights come from torch's CPU
    generator. ``draws``: a CPU draw at every call too (noise added to the input)."""

    def __init__(self, draws: bool = False) -> None:
        super().__init__()
        self.body, self.draws = nn.Linear(4, 4), draws
        self.head: nn.Module | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.head is None:
            self.head = nn.Linear(4, 2).to(x.device)  # drawn on the CPU, then moved
        if self.draws:
            x = x + torch.rand(4).to(x.device)
        return self.head(self.body(x).relu())


@pytest.mark.parametrize("draws", [False, True], ids=["first_call", "every_call"])
def test_a_cpu_draw_beside_a_first_write_runs_that_call_eagerly(
    backend: str, device: str, draws: bool
) -> None:
    """Beside a GPU model, the draws a submodule created at the first call makes are part of that
    write: the call runs eagerly and the next records (it retired: 'forward assigns head'). A draw
    that recurs is found alone at the next call and retires. On the CPU the draws are the device's
    (the tape replays them): the same parity, replaying."""
    torch.manual_seed(0)
    model = _LazyHead(draws).to(device)
    twin = copy.deepcopy(model)
    rec = rk.capture(model, backend=backend)
    g = torch.Generator().manual_seed(1)
    for i in range(4):
        x = torch.randn(3, 4, generator=g).to(device)
        torch.manual_seed(10 + i)
        out = model(x)
        torch.manual_seed(10 + i)
        ref = twin(x)
        assert torch.equal(out, ref), rec.journal.format()
        out.square().sum().backward()
        ref.square().sum().backward()
        for p, q in zip(model.parameters(), twin.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad), rec.journal.format()
    if draws and backend == "cuda":
        assert rec.retired and "CPU generator" in rec.retire_reason, rec.summary()
    else:
        assert not rec.retired and dict(rec.eager_reasons) == {"first_write": 1}, rec.summary()
        assert rec.counts["replay"] == 2, rec.summary()
