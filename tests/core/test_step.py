"""Whole-step replay (TrainStep): bitwise equal to its eager twin, or eager/retired with a reason.

Every guard has an unsafe arm that diverges on the CPU (the emulated backend replays the
recorded aten sequence, so a frozen host value shows as it would on a GPU).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

import replaykit as rk
from replaykit.memory import copy_out
from replaykit.protections import in_scope
from replaykit.step import TrainStep
from replaykit.testing.parity.step_trial import PROBES, SmallNet, StepConfig, small_loss, trial


def _cfg(device: str, backend: str, **kw) -> StepConfig:
    return StepConfig(device=device, backend=backend, **kw)


def _replayed(result) -> int:
    return result.step.counts["replay"] + result.step.counts["record"]


@pytest.mark.parametrize(
    ("optimizer", "accumulate", "clip", "ema", "scheduler"),
    [
        (o, a, c, e, s)
        for o, a, (c, e, s) in itertools.product(
            ["sgd", "adamw"], [1, 2, 3], [(None, None, False), (1.0, 0.9, True)]
        )
    ],
)
def test_whole_step_matches_its_eager_twin(
    backend, device, optimizer, accumulate, clip, ema, scheduler
):
    result = trial(
        _cfg(
            device,
            backend,
            optimizer=optimizer,
            accumulate=accumulate,
            clip=clip,
            ema=ema,
            scheduler=scheduler,
        )
    )
    assert result.equal, result.diffs[:3]
    assert result.step.counts["replay"] >= 3 * accumulate, result.step.journal
    assert result.step.retire_reason is None
    assert result.twin.counts["record"] == result.twin.counts["replay"] == 0


def test_the_twin_is_eager_and_the_partial_batch_has_its_own_recording(backend, device):
    result = trial(_cfg(device, backend, accumulate=2, partial_last=True))
    assert result.equal, result.diffs[:3]
    phases = [e.reason for e in result.step.journal if e.kind == "record"]
    assert sorted(phases) == [
        "first",
        "last",
        "last",
    ]  # the partial last micro-batch records its own 'last'


@pytest.mark.parametrize("precision", ["bf16-mixed"])
def test_mixed_precision(backend, device, precision):
    result = trial(_cfg(device, backend, optimizer="adamw", precision=precision, accumulate=2))
    assert result.equal, result.diffs[:3]
    assert result.step.counts["replay"] > 0


@pytest.mark.parametrize("accumulate", [1, 2])
def test_grad_scaler_with_a_fused_optimizer_skips_on_the_device(backend, device, accumulate):
    result = trial(
        _cfg(
            device,
            backend,
            optimizer="adamw",
            scaler=True,
            clip=1.0,
            accumulate=accumulate,
            overflow_step=3,
            steps=6,
        )
    )
    assert result.equal, result.diffs[:3]
    assert result.step.counts["replay"] > 0 and not result.step.eager_reasons.keys() - {"warmup"}


def test_a_non_fused_scaler_step_replays_the_network_and_steps_eagerly(backend, device):
    """GradScaler.step with a non-fused optimizer reads found_inf on the host: the forward and
    backward replay, the scaler's step runs eagerly after each replay, and the run is eager's."""
    result = trial(_cfg(device, backend, optimizer="sgd_float", scaler=True))
    assert result.equal, result.diffs[:3]
    assert result.step.counts["replay"] > 0
    assert "found_inf on the host" in result.step.optimizer_eager


def test_a_float_lr_changed_by_hand_records_anew(backend, device):
    result = trial(_cfg(device, backend, optimizer="sgd_float", probe="float_lr"))
    assert result.equal, result.diffs[:3]
    assert result.step.counts["record"] == 3  # step, partial step, step at the new lr


@pytest.mark.parametrize("probe", sorted(PROBES))
def test_each_guard_keeps_replay_exact(backend, device, probe):
    opt = (
        "sgd_float" if probe in ("float_lr", "load_state") else "sgd"
    )  # a tensor lr's id would key load_state too
    result = trial(
        _cfg(
            device, backend, optimizer=opt, probe=probe, accumulate=2 if probe == "keep_grad" else 1
        )
    )
    assert result.equal, result.diffs[:3]


@pytest.mark.parametrize("probe", sorted(PROBES))
def test_without_its_guard_each_probe_diverges(backend, device, probe):
    """The negative control: the guard is what keeps the run exact."""
    opt = (
        "sgd_float" if probe in ("float_lr", "load_state") else "sgd"
    )  # a tensor lr's id would key load_state too
    result = trial(
        _cfg(
            device,
            backend,
            optimizer=opt,
            probe=probe,
            accumulate=2 if probe == "keep_grad" else 1,
            unsafe=(PROBES[probe],),
        )
    )
    assert not result.equal, f"{probe} without {PROBES[probe]} still matched: the guard is untested"


def test_every_step_protection_has_a_negative_control():
    """Each TrainStep protection is switched off in some unsafe arm that must diverge: a trial probe
    here, or a step pattern of the hazard catalogue (tests/core/hazards)."""
    from replaykit.testing.hazards import PATTERNS

    controlled = set(PROBES.values()) | {
        "verify_recording",  # test_a_capture_time_branch_is_caught_at_recording
        "shared_pool",  # tests/core/test_memory.py: a step reads overwritten gradients
        "rank_agreement",  # tests/core/test_ddp_step.py: rank 0 replays while rank 1 records
    }
    controlled |= {g for p in PATTERNS if p.api == "step" and p.guard for g in p.guard.split("+")}
    controlled.add("compiled_code")  # tests/core/test_compiled.py (a compiled model: slow to build)
    assert set(in_scope("step")) <= controlled, sorted(set(in_scope("step")) - controlled)


def test_capture_failure_retires_and_the_step_stays_exact(backend, device):
    def item_loss(model, x, y):
        loss = small_loss(model, x, y)
        return loss * (2.0 if loss.item() > 0 else 1.0)  # a host read: a graph cannot replay it

    results = []
    for replay in (False, True):
        torch.manual_seed(0)
        model = SmallNet().to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        step = TrainStep(model, item_loss, opt, replay=replay)
        g = torch.Generator().manual_seed(1)
        torch.manual_seed(2)
        losses = [
            step(
                torch.randn(6, 8, generator=g).to(device),
                torch.randint(0, 4, (6,), generator=g).to(device),
            )
            for _ in range(4)
        ]
        results.append((model, losses, step))
    (m0, l0, _), (m1, l1, step) = results
    assert step.retired and step.retire_reason.startswith("capture failed")
    assert all(torch.equal(a, b) for a, b in zip(l0, l1, strict=True))
    assert all(
        torch.equal(a, b)
        for a, b in zip(m0.state_dict().values(), m1.state_dict().values(), strict=True)
    )


def test_clear_errors_for_bad_input():
    model = SmallNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(rk.ReplayError, match="accumulate"):
        TrainStep(model, small_loss, opt, accumulate=0)
    with pytest.raises(rk.ReplayError, match="precision"):
        TrainStep(model, small_loss, opt, precision="fp8")
    with pytest.raises(rk.ReplayError, match="unknown unsafe_disable"):
        TrainStep(model, small_loss, opt, unsafe_disable=("nothing",))
    rec = rk.capture(model)
    with pytest.raises(rk.ReplayError, match=r"captured by rk\.capture"):
        TrainStep(model, small_loss, opt)
    rec.release()


def test_settings_a_recording_bakes_in_are_fixed_and_max_norm_is_not():
    """``step.config`` is frozen; its settings read as attributes; assigning one raises ReplayError."""
    model = SmallNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = TrainStep(model, small_loss, opt, accumulate=2, backend="emulated")
    assert step.model is model and step.optimizer is opt and step.accumulate == 2
    for name, value in (("accumulate", 4), ("model", SmallNet()), ("backend", None)):
        with pytest.raises(rk.ReplayError, match=f"TrainStep.{name} is fixed"):
            setattr(step, name, value)
    with pytest.raises(AttributeError):
        step.config.accumulate = 4
    assert step.accumulate == 2
    step.max_norm = 0.5  # keys the recordings: may change
    assert step.max_norm == 0.5


def test_lbfgs_is_refused_at_construction():
    """TrainStep steps the optimizer without a closure; LBFGS needs one (its twin could not run either)."""
    model = nn.Linear(8, 4)
    with pytest.raises(rk.ReplayError, match="closure"):
        TrainStep(
            model,
            lambda m, x, y: nn.functional.cross_entropy(m(x), y),
            torch.optim.LBFGS(model.parameters()),
        )


@pytest.mark.parametrize("accumulate", [1, 2])
def test_an_adam_without_capturable_replays_the_network_and_steps_eagerly(
    backend, device, accumulate
):
    """torch's default Adam (capturable=False) reads its step counter on the host: no graph can
    hold its step, so it runs eagerly after each replayed forward+backward, bitwise eager's."""
    result = trial(
        _cfg(device, backend, optimizer="adam_plain", accumulate=accumulate, clip=1.0, ema=0.9)
    )
    assert result.equal, result.diffs[:3]
    assert result.step.counts["replay"] >= 3 * accumulate, result.step.journal
    assert "capturable=True" in result.step.optimizer_eager
    assert not result.step.eager_reasons.keys() - {"warmup"}


def test_a_float_lr_set_at_every_step_moves_the_optimizer_step_out_of_the_graph(backend, device):
    """SGD with a float lr a scheduler sets at every step: a recorded step bakes the lr in, so each
    value needed a recording (then ``budget``: all eager). After the second value the step runs
    eagerly after each replay instead (one re-record); the network keeps replaying."""
    runs = []
    for replay in (True, False):
        torch.manual_seed(0)
        net = SmallNet().to(device)
        opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        step = TrainStep(net, small_loss, opt, backend=backend, replay=replay)
        g = torch.Generator().manual_seed(3)
        for _ in range(9):
            x = torch.randn(8, 8, generator=g).to(device)
            step(x, torch.randint(0, 4, (8,), generator=g).to(device))
            sched.step()
        runs.append((net, step))
    (a, replayed), (b, _) = runs
    for (ka, va), vb in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(va, vb), ka
    assert replayed.counts["rerecord"] == 1 and replayed.counts["replay"] >= 5, replayed.journal
    assert "float lr" in replayed.optimizer_eager


def test_an_optimizer_that_reads_its_state_on_the_host_steps_eagerly_after_the_replay(
    backend, device
):
    """Adagrad's step counter is a CPU tensor it reads on the host: on CUDA that is known up front;
    on the CPU tape the capture of its step fails. Either way the step runs eagerly after each
    replayed forward+backward from then on, bitwise eager's."""
    runs = []
    for replay in (True, False):
        torch.manual_seed(0)
        net = SmallNet().to(device)
        opt = torch.optim.Adagrad(net.parameters(), lr=0.05)
        step = TrainStep(net, small_loss, opt, backend=backend, replay=replay)
        g = torch.Generator().manual_seed(3)
        for _ in range(7):
            x = torch.randn(8, 8, generator=g).to(device)
            step(x, torch.randint(0, 4, (8,), generator=g).to(device))
        runs.append((net, opt, step))
    (a, oa, replayed), (b, ob, _) = runs
    for (ka, va), vb in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(va, vb), ka
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(oa.state[pa]["sum"], ob.state[pb]["sum"])
    assert replayed.counts["replay"] >= 4 and replayed.retire_reason is None, replayed.journal
    assert replayed.optimizer_eager is not None


def test_an_eager_optimizer_step_reads_a_float_lr_every_step_without_recording_anew(
    backend, device
):
    """A scheduler's float lr changes at every step: a recorded optimizer would record anew per
    value; an eager one reads it itself, so one recording serves every step."""
    torch.manual_seed(0)
    runs = []
    for replay in (True, False):
        torch.manual_seed(0)
        net = SmallNet().to(device)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        step = TrainStep(net, small_loss, opt, backend=backend, replay=replay, max_norm=1.0)
        g = torch.Generator().manual_seed(3)
        for _ in range(8):
            x = torch.randn(8, 8, generator=g).to(device)
            step(x, torch.randint(0, 4, (8,), generator=g).to(device))
            sched.step()
        runs.append((net, opt, step))
    (a, oa, replayed), (b, ob, _) = runs
    for (ka, va), vb in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(va, vb), ka
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert pa.grad is None and pb.grad is None
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(oa.state[pa][k], ob.state[pb][k]), k
    assert replayed.counts["record"] == 1 and replayed.counts["replay"] == 6, replayed.journal


# ----------------------------------------------------------------- review findings (one test each)
def _ce(model, x, y):
    return nn.functional.cross_entropy(model(x), y)


def _pair(build, drive, device):
    """``build(replay) -> env`` (model, opt, step, ...), ``drive(env, g) -> kept tensors``: the eager
    twin and the replayed run compared bitwise (model, gradients, optimizer, kept tensors)."""
    from replaykit.testing.parity.end_state import module_state, optimizer_state
    from replaykit.verify.bitwise import diff_states

    states, envs = [], []
    for replay in (False, True):
        torch.manual_seed(0)
        env = build(replay)
        torch.manual_seed(1)
        kept = drive(env, torch.Generator().manual_seed(2))
        state = module_state(env["model"])
        state.update(optimizer_state([env["opt"]]))
        state.update(
            {
                f"kept/{i}": None if t is None else t.detach().cpu().clone()
                for i, t in enumerate(kept)
            }
        )
        states.append(state)
        envs.append(env)
    return diff_states(*states), envs[1]["step"]


def _batches(g, device, n=6):
    return torch.randn(n, 8, generator=g).to(device), torch.randint(0, 4, (n,), generator=g).to(
        device
    )


def test_a_disabled_grad_scaler_is_a_plain_step(backend, device):
    """GradScaler(enabled=False) (or the CUDA one on a machine without CUDA) has no growth settings."""

    def build(replay):
        model = SmallNet().to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        scaler = torch.amp.GradScaler(device, enabled=False)
        return {
            "model": model,
            "opt": opt,
            "step": TrainStep(model, small_loss, opt, scaler=scaler, max_norm=1.0, replay=replay),
        }

    diffs, step = _pair(
        build, lambda env, g: [env["step"](*_batches(g, device)) for _ in range(5)], device
    )
    assert not diffs, diffs[:3]
    assert step.counts["replay"] >= 3, step.journal


@pytest.mark.parametrize("accumulate", [1, 2])
def test_a_layer_frozen_mid_training_records_anew(backend, device, accumulate):
    """A recording computes and applies gradients for the parameters that required grad when it
    was made; freezing one later must not replay its update."""

    def build(replay):
        model = SmallNet().to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        return {
            "model": model,
            "opt": opt,
            "step": TrainStep(
                model, small_loss, opt, max_norm=1.0, accumulate=accumulate, replay=replay
            ),
        }

    def drive(env, g):
        losses = []
        for i in range(6 * accumulate):
            losses.append(env["step"](*_batches(g, device)))
            if i == 3 * accumulate - 1 + (accumulate > 1):  # mid-accumulation when accumulating
                env["model"].body[0].requires_grad_(False)
        return losses

    diffs, step = _pair(build, drive, device)
    assert not diffs, diffs[:3]
    assert step.counts["replay"] > 0 and step.retire_reason is None


def _assert_rerecorded(step: TrainStep, cause: str) -> None:
    """Dropped and recorded anew at the change, and the calls after it replay."""
    assert not step.retired and step.counts["rerecord"] == 1, step.summary()
    assert cause in step.journal.summary()["rerecord_causes"][0]
    last = [e.kind for e in step.journal if e.kind in ("record", "replay", "eager")][-2:]
    assert last == ["replay", "replay"], step.journal.format()


@pytest.mark.parametrize("optimizer", ["sgd_float", "adamw"])
def test_optimizer_state_assigned_by_hand_rerecords(backend, device, optimizer):
    """``opt.state[p][k] = torch.zeros_like(p)`` (a moment reset) leaves the recorded tensor alive at
    its address: no pointer check sees it, the assignment itself must."""
    from replaykit.testing.parity.step_trial import make_optimizer

    def build(replay):
        model = SmallNet().to(device)
        opt = make_optimizer(optimizer, model, device)
        return {
            "model": model,
            "opt": opt,
            "step": TrainStep(model, small_loss, opt, replay=replay),
        }

    def drive(env, g):
        losses = []
        for i in range(6):
            losses.append(env["step"](*_batches(g, device)))
            if i == 2:
                for p, state in env["opt"].state.items():
                    for k in ("momentum_buffer", "exp_avg"):
                        if k in state:
                            state[k] = torch.zeros_like(p)
        return losses

    diffs, step = _pair(build, drive, device)
    assert not diffs, diffs[:3]
    _assert_rerecorded(step, "opt.state[p][k]")


def test_ema_tensors_reassigned_rerecord(backend, device):
    """``ema.params = [...]`` (an EMA reset to the current weights) after recording: a replay would
    keep lerping into the old tensors."""

    def build(replay):
        model = SmallNet().to(device)
        opt = torch.optim.SGD(model.parameters(), lr=torch.tensor(0.05, device=device), fused=True)
        ema = rk.EMA(model, 0.9)
        return {
            "model": model,
            "opt": opt,
            "ema": ema,
            "step": TrainStep(model, small_loss, opt, ema=ema, replay=replay),
        }

    def drive(env, g):
        for i in range(6):
            env["step"](*_batches(g, device))
            if i == 2:
                env["ema"].params = [p.detach().clone() for p in env["model"].parameters()]
        return list(env["ema"].params)

    diffs, step = _pair(build, drive, device)
    assert not diffs, diffs[:3]
    _assert_rerecorded(step, "EMA")


def test_an_input_requiring_grad_routes_eager(backend, device):
    """Saliency or adversarial training: eager's backward gives the input a .grad."""

    def drive(env, g):
        grads = []
        for _ in range(4):
            x, y = _batches(g, device)
            x.requires_grad_(True)
            env["step"](x, y)
            grads.append(x.grad)
        return grads

    def build(replay):
        model = SmallNet().to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        return {
            "model": model,
            "opt": opt,
            "step": TrainStep(model, small_loss, opt, replay=replay),
        }

    diffs, step = _pair(build, drive, device)
    assert not diffs, diffs[:3]
    assert step.eager_reasons["input_requires_grad"] == 3


def test_the_same_tensor_twice_stays_one_tensor_inside_the_recording(backend, device):
    """``step(x, x, y)``: nn.MultiheadAttention's self-attention path (``query is key``), or any
    ``a is b`` in the loss, must see one tensor in the recording as in eager."""

    def loss(model, a, b, y):
        return small_loss(model, a, y) * (1.0 if a is b else 2.0)

    def build(replay):
        model = SmallNet().to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        return {"model": model, "opt": opt, "step": TrainStep(model, loss, opt, replay=replay)}

    def drive(env, g):
        losses = []
        for _ in range(5):
            x, y = _batches(g, device)
            losses.append(env["step"](x, x, y))
        return losses

    diffs, step = _pair(build, drive, device)
    assert not diffs, diffs[:3]
    assert step.counts["replay"] >= 3


class _RoundRobin(SmallNet):
    """A forward that assigns what it reads next call (two heads in turn)."""

    def __init__(self) -> None:
        super().__init__()
        self.head2 = nn.Linear(16, 4)
        self.task = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        out = self.head(h) if self.task == 0 else self.head2(h)
        self.task = 1 - self.task
        return out


def _in_place_loss(model, x, y):
    x.mul_(0.5)  # preprocessing in place: eager changes the caller's tensor
    return small_loss(model, x, y)


@pytest.mark.parametrize("case", ["assigns_attribute", "writes_input", "changes_container"])
def test_a_step_a_replay_cannot_repeat_retires_after_its_recording_call(backend, device, case):
    """A replay runs no Python: a forward assigning a module attribute it reads or a loss_fn
    writing a container the model holds. The recording call's work stands (it ran the body once,
    as eager does) and the step retires. A loss_fn writing its input in place replays instead:
    the caller's tensor gets the replay's values (``write_back``)."""

    def container_loss(model, x, y):
        model.history["task"] = 1 - model.history.get(
            "task", 0
        )  # two values in turn: both get recorded
        return small_loss(model, x, y) * (1.0 + model.history["task"])

    def build(replay):
        model = (_RoundRobin() if case == "assigns_attribute" else SmallNet()).to(device)
        model.history = {}
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        loss = {
            "assigns_attribute": small_loss,
            "writes_input": _in_place_loss,
            "changes_container": container_loss,
        }[case]
        return {
            "model": model,
            "opt": opt,
            "step": TrainStep(model, loss, opt, replay=replay, warmup=2),
        }

    def drive(env, g):
        x, y = _batches(g, device)
        kept = [
            env["step"](x, y) for _ in range(6)
        ]  # one batch, overfitted: the caller's x is read again
        return [*kept, x]

    diffs, step = _pair(build, drive, device)
    assert not diffs, diffs[:3]
    if case == "writes_input":
        assert not step.retired and step.counts["replay"] >= 3, step.journal
        return
    assert step.retire_reason is not None and "replay would" in step.retire_reason, step.journal


@pytest.mark.parametrize("way", ["move", "eager"])
@pytest.mark.parametrize("keep", ["detach", "data", "view"])
def test_a_gradient_kept_through_a_view_keeps_its_values(backend, device, keep, way, monkeypatch):
    """A gradient kept between micro-batches as ``.detach()``, ``.data`` or a view shares the
    buffer the next step's first micro-batch overwrites: moved with its storage where torch can
    swap it (the calls replay), else copy-out cannot reach it and the call runs eagerly."""
    if way == "eager":
        monkeypatch.setattr(copy_out, "_swap", None)
    elif not copy_out.holders_move():
        pytest.skip("this torch cannot move a held storage")
    how = {"detach": torch.Tensor.detach, "data": lambda t: t.data, "view": lambda t: t.view(-1)}[
        keep
    ]

    def build(replay):
        model = SmallNet().to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        return {
            "model": model,
            "opt": opt,
            "step": TrainStep(model, small_loss, opt, accumulate=2, replay=replay),
        }

    def drive(env, g):
        kept = []
        for i in range(10):
            env["step"](*_batches(g, device))
            if i % 2 == 0:
                kept.append(
                    how(env["model"].head.weight.grad)
                )  # a gradient-norm history, read later
        return kept

    diffs, step = _pair(build, drive, device)
    assert not diffs, diffs[:3]
    if way == "eager":
        assert step.eager_reasons["live_alias"] > 0
    else:
        assert step.eager_reasons["live_alias"] == 0 and step.counts["copy_out"] > 0


@pytest.mark.parametrize("verify", [True, False])
def test_a_failed_capture_puts_back_the_attributes_its_forward_assigned(backend, device, verify):
    """A capture failing at ``.item()`` has run the forward's Python; the twin's body then runs it
    again: an attribute it assigned (a round-robin flag) must not move twice. With verification on,
    its eager half runs first and sees the assignment before any capture: that run is the call."""

    def item_loss(model, x, y):
        loss = small_loss(model, x, y)
        return loss * (2.0 if loss.item() > 100 else 1.0)

    def build(replay):
        model = _RoundRobin().to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        return {
            "model": model,
            "opt": opt,
            "step": TrainStep(
                model,
                item_loss,
                opt,
                replay=replay,
                warmup=2,
                unsafe_disable=() if verify or not replay else ("verify_recording",),
            ),
        }

    diffs, step = _pair(
        build, lambda env, g: [env["step"](*_batches(g, device)) for _ in range(6)], device
    )
    assert not diffs, diffs[:3]
    expected = "the step assigns _RoundRobin.task" if verify else "capture failed"
    assert step.retire_reason is not None and step.retire_reason.startswith(expected)


def test_batches_sliced_from_one_preloaded_tensor_share_a_recording(backend, device):
    """A GPU-resident dataset sliced per step: offsets differ, alignment does not; one recording serves."""
    results = []
    for replay in (False, True):
        torch.manual_seed(0)
        model = SmallNet().to(device)
        opt = torch.optim.SGD(
            model.parameters(), lr=torch.tensor(0.05, device=device), momentum=0.9, fused=True
        )
        step = TrainStep(model, small_loss, opt, replay=replay)
        g = torch.Generator().manual_seed(1)
        # 64 rows: 2048 bytes of inputs and 512 bytes of int64 targets per batch, so every slice
        # starts on the allocator's alignment (512 bytes on CUDA); others would record per class
        xs = torch.randn(8 * 64, 8, generator=g).to(device)
        ys = torch.randint(0, 4, (8 * 64,), generator=g).to(device)
        torch.manual_seed(2)
        losses = [step(xs[i * 64 : (i + 1) * 64], ys[i * 64 : (i + 1) * 64]) for i in range(8)]
        results.append((model, losses, step))
    (m0, l0, _), (m1, l1, step) = results
    assert step.counts["record"] == 1 and step.counts["replay"] == 6, step.journal
    assert all(torch.equal(a, b) for a, b in zip(l0, l1, strict=True))
    assert all(
        torch.equal(a, b)
        for a, b in zip(m0.state_dict().values(), m1.state_dict().values(), strict=True)
    )


def test_a_slice_of_another_alignment_records_its_own(backend, device):
    """What the alignment key is for: a batch starting mid-way in an aligned block is another recording."""
    torch.manual_seed(0)
    model = SmallNet().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    step = TrainStep(model, small_loss, opt)
    xs = torch.randn(200, 8, device=device)
    ys = torch.randint(0, 4, (200,), device=device)
    for start in (0, 64, 128, 1, 65):  # element 1: 32 bytes into x's block, 8 into y's
        step(xs[start : start + 16], ys[start : start + 16])
    assert step.counts["record"] >= 2, step.journal


class _CaptureBranch(SmallNet):
    """Code that computes differently while a CUDA stream captures (transformers' mask builders
    branch on ``torch.cuda.is_current_stream_capturing()``; the emulated backend answers True too)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        try:
            capturing = torch.cuda.is_current_stream_capturing()
        except RuntimeError:  # a CPU-only build has no CUDA runtime to ask
            capturing = False
        return out * (1 + 2**-10) if capturing else out


@pytest.mark.parametrize("unsafe", [(), ("verify_recording",)], ids=["verified", "unsafe"])
def test_a_capture_time_branch_is_caught_at_recording(backend, device, unsafe):
    """The recording call is compared with the twin's body from the same state: a difference routes
    that signature eager and the state is eager's; without the check the capture branch replays."""

    def build(replay):
        model = _CaptureBranch().to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        step = TrainStep(
            model, small_loss, opt, replay=replay, unsafe_disable=unsafe if replay else ()
        )
        return {"model": model, "opt": opt, "step": step}

    def drive(env, g):
        return [env["step"](*_batches(g, device)) for _ in range(5)]

    diffs, step = _pair(build, drive, device)
    if unsafe:
        assert diffs and step.counts["replay"] > 0
        return
    assert not diffs, diffs[:3]
    assert step.eager_reasons["diverged"] == 3 and not step.retired
    refusal = next(e for e in step.journal if e.kind == "refuse")
    assert refusal.detail.startswith("the recording differs from eager: loss")


class _TorchLayerDrop(SmallNet):
    """transformers' LayerDrop: ``torch.rand([])`` drawn on the host and compared there."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        if torch.rand([]) < 0.5:  # a CPU draw, read on the host
            h = h * 0.5
        return self.head(h)


class _TorchNoise(SmallNet):
    """A CPU draw that reaches the computation (a 0-dim CPU tensor scales GPU activations)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x) * (1 + torch.rand([])))


@pytest.mark.parametrize("arm", ["guarded", "unguarded", "escaped"])
def test_a_cpu_generator_draw_beside_a_gpu_model_is_drawn_before_the_replay(backend, device, arm):
    """Beside a GPU model torch's CPU generator is host state a CUDA graph never advances, and a
    graph would freeze the branch the first draw took. A draw read on the host only (LayerDrop)
    is learnt: each call draws it before choosing a recording, keyed by the branch, and leaves the
    generator where eager does. A draw reaching the computation retires. On the CPU backend the
    draw is the device's: the tape repeats it at each replay, and refuses its host read."""
    if arm == "unguarded" and backend != "cuda":
        pytest.skip("the frozen draw exists beside a GPU model only")

    def build(replay):
        model = (_TorchNoise if arm == "escaped" else _TorchLayerDrop)().to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        kw = {"unsafe_disable": ("host_rng",)} if arm == "unguarded" else {}
        return {"model": model, "opt": opt, "step": TrainStep(model, _ce, opt, replay=replay, **kw)}

    def drive(env, g):
        out = [env["step"](*_batches(g, device)) for _ in range(12)]
        return [*out, torch.tensor(float(torch.rand([])))]  # where the CPU stream stands

    diffs, step = _pair(build, drive, device)
    if arm == "unguarded":
        assert diffs, step.summary()
        return
    assert not diffs, diffs[:3]
    if backend == "cuda" and arm == "guarded":
        assert not step.retired and step.counts["replay"] >= 4, step.summary()
        assert step.counts["record"] == 2, step.summary()  # one recording per branch
        return
    if backend != "cuda" and arm == "escaped":  # the tape draws again at each replay, as the device
        assert not step.retired and step.counts["replay"] >= 4, step.summary()
        return
    assert step.retire_reason is not None and step.counts["replay"] == 0, step.summary()
    if backend == "cuda":
        assert "CPU generator" in step.retire_reason


def test_a_step_that_re_records_keeps_replaying_with_its_old_losses_held(
    backend: str, device: str
) -> None:
    """Unfreezing a layer re-records every recording (the old pool's graphs all go) while the
    losses handed out before are still held: the new recordings replay, bitwise with eager."""

    def run(replay: bool) -> tuple[list[torch.Tensor], nn.Module, rk.TrainStep | None]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to(device)
        model[0].requires_grad_(False)
        opt = torch.optim.SGD(model[2].parameters(), lr=0.1)

        def loss_fn(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
            return m(x).square().mean()

        step = rk.TrainStep(model, loss_fn, opt, backend=backend) if replay else None
        losses = []
        g = torch.Generator().manual_seed(1)
        for i in range(12):
            if i == 5:
                model[0].requires_grad_(True)
                opt.add_param_group({"params": list(model[0].parameters())})
            x = torch.randn(16, 8, generator=g).to(device)
            if step is not None:
                losses.append(step(x))
            else:
                opt.zero_grad(set_to_none=True)
                loss = loss_fn(model, x)
                loss.backward()
                opt.step()
                losses.append(loss.detach())
        return losses, model, step

    eager_losses, eager, _ = run(False)
    losses, model, step = run(True)
    assert step is not None and not step.retired, step.summary()
    assert step.counts["record"] == 2 and step.counts["replay"] >= 3, step.summary()
    assert all(torch.equal(a, b) for a, b in zip(losses, eager_losses, strict=True))
    for p, q in zip(model.parameters(), eager.parameters(), strict=True):
        assert torch.equal(p, q)


def test_the_eager_twin_releases_and_keeps_running(device: str) -> None:
    """``replay=False`` has no backend: release() (the zoo's eager arm calls it) must not need one."""
    model = nn.Linear(4, 2).to(device)
    step = rk.TrainStep(
        model,
        lambda m, x: m(x).square().mean(),
        torch.optim.SGD(model.parameters(), lr=0.1),
        replay=False,
    )
    x = torch.randn(3, 4, device=device)
    step(x)
    step.release()
    before = model.weight.detach().clone()
    step(x)  # the twin still trains
    assert not torch.equal(model.weight, before)


class _TrainerClass:
    """The "Trainer class" pattern: the loss closes over ``self``, which holds the step itself."""

    def __init__(self, backend: str, device: str, replay: bool = True) -> None:
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to(device)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9)
        self.crit = nn.CrossEntropyLoss()
        self.step = rk.TrainStep(
            self.model, lambda m, x, y: self.crit(m(x), y), self.opt, backend=backend, replay=replay
        )


def test_a_loss_closing_over_an_object_that_holds_the_step_replays(
    backend: str, device: str
) -> None:
    """Keying the loss's closure walked self -> step -> loss -> self without end (RecursionError at
    the second call): ``self`` is then unkeyable, as one that is so from the start, and warned
    of; the step replays, bitwise."""
    runs = [_TrainerClass(backend, device, replay) for replay in (True, False)]
    g = torch.Generator().manual_seed(1)
    with pytest.warns(rk.ReplayWarning, match="no longer be keyed"):
        for _ in range(6):
            x, y = (
                torch.randn(8, 8, generator=g).to(device),
                torch.randint(0, 4, (8,), generator=g).to(device),
            )
            for t in runs:
                t.step(x.clone(), y.clone())
    replayed, eager = runs
    for a, b in zip(replayed.model.parameters(), eager.model.parameters(), strict=True):
        assert torch.equal(a, b)
    assert replayed.step.counts["replay"] >= 3, replayed.step.summary()
