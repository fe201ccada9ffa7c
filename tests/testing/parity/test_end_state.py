"""snapshot(): the end state of a run as a flat dict of CPU tensors, keyed as documented."""

from __future__ import annotations

from types import SimpleNamespace

import lightning as L
import pytest
import torch
from lightning.pytorch.plugins import MixedPrecision
from torch import nn

from replaykit.testing.parity.end_state import scheduler_state, snapshot
from replaykit.testing.tasks import make_datamodule, make_task
from replaykit.verify.bitwise import diff_states

pytestmark = pytest.mark.filterwarnings(
    "ignore:.*does not have many workers.*",
    "ignore:`isinstance.treespec, LeafSpec.` is deprecated",
)


def _cpu_fp16_scaler_works() -> bool:
    try:
        scaler = torch.amp.GradScaler("cpu")
        with torch.autocast("cpu", dtype=torch.float16):
            y = nn.Linear(2, 2)(torch.ones(1, 2)).sum()
        scaler.scale(y).backward()
        return True
    except (RuntimeError, NotImplementedError):
        return False


@pytest.fixture(scope="module")
def fitted() -> tuple[L.LightningModule, L.Trainer]:
    """Detection, one full epoch: SGD with momentum, a step schedule, EMA, validation, and
    fp16 + GradScaler where the CPU supports it."""
    L.seed_everything(0, verbose=False)
    model = make_task("detection", scheduler="step", ema=0.9)
    plugins = []
    if _cpu_fp16_scaler_works():
        plugins = [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))]
    trainer = L.Trainer(
        max_epochs=1,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        plugins=plugins,
    )
    trainer.fit(model, make_datamodule("detection", "contiguous"))
    return model, trainer


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")
def test_keys_cover_the_documented_state(fitted) -> None:
    model, trainer = fitted
    state = snapshot(model, trainer)
    params = [n for n, _ in model.named_parameters()]
    assert {f"param/{n}" for n in params} <= state.keys()
    assert {f"grad/{n}" for n in params} <= state.keys()
    assert {f"buffer/{n}" for n, _ in model.named_buffers()} <= state.keys()
    assert "buffer/net.backbone.0.1.num_batches_tracked" in state
    assert "buffer/net.backbone.0.1.running_mean" in state
    # (the grads themselves are None here: Lightning releases them before the epoch-end
    # validation, through LightningModule.on_validation_model_zero_grad)
    first = params[0]
    assert f"optim/0/{first}/momentum_buffer" in state
    assert state["optim/0/group0/lr"].dtype == torch.float64
    assert state["optim/0/group0/lr"].ndim == 0
    assert state["optim/0/group1/weight_decay"].item() == 0.0
    assert state["sched/0/last_epoch"].dtype == torch.int64
    assert state["sched/0/last_epoch"].item() == trainer.global_step == 6
    assert "sched/0/_last_lr/0" in state
    assert {f"ema/{k}" for k in model.ema_state} <= state.keys()
    assert {"logged/train_loss", "logged/val_loss", "logged/val_box_l1"} <= state.keys()
    assert state["progress/global_step"].item() == 6
    if trainer.precision_plugin.scaler is not None:
        assert state["scaler/scale"].dtype == torch.float32
        assert state["scaler/_growth_tracker"].dtype == torch.int32
        assert state["scaler/growth_factor"].dtype == torch.float64
    for key, value in state.items():
        assert value is None or (isinstance(value, torch.Tensor) and value.device.type == "cpu"), (
            key
        )


def test_snapshot_is_a_copy(fitted) -> None:
    model, trainer = fitted
    before = snapshot(model, trainer)
    assert diff_states(before, snapshot(model, trainer)) == []
    weight = model.net.o2o_box.weight
    saved = weight.detach().clone()
    with torch.no_grad():
        weight.add_(1.0)
    try:
        rows = diff_states(before, snapshot(model, trainer))
    finally:
        with torch.no_grad():
            weight.copy_(saved)
    assert [r.name for r in rows] == ["param/net.o2o_box.weight"]


class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(3, 2)
        self.unused = nn.Linear(3, 2)
        self.norm = nn.BatchNorm1d(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(self.norm(x))


def test_none_grads_stay_none_and_count_in_the_diff() -> None:
    torch.manual_seed(0)
    net = TwoHeads()
    net(torch.randn(4, 3)).sum().backward()
    state = snapshot(net)
    assert state["grad/unused.weight"] is None and state["grad/unused.bias"] is None
    assert state["grad/used.weight"] is not None
    assert state["buffer/norm.num_batches_tracked"].item() == 1
    assert not any(key.startswith(("optim/", "sched/", "scaler/", "logged/")) for key in state)

    net.unused.weight.grad = torch.zeros_like(net.unused.weight)
    rows = diff_states(state, snapshot(net))
    assert [(r.name, r.problem) for r in rows] == [("grad/unused.weight", "none_pattern")]


@pytest.mark.parametrize(
    "make",
    [
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
        lambda p: torch.optim.AdamW(p, lr=0.1),
    ],
    ids=["sgd", "adamw"],
)
def test_optimizer_state_after_a_step(make) -> None:
    torch.manual_seed(0)
    net = TwoHeads()
    opt = make(net.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    assert not any(k.startswith("optim/0/used.") for k in snapshot(net, optimizers=[opt]))
    net(torch.randn(4, 3)).sum().backward()
    opt.step()
    sched.step()
    state = snapshot(net, optimizers=[opt], schedulers=[sched])
    keys = {k for k in state if k.startswith("optim/0/used.weight/")}
    expected = (
        {"momentum_buffer"}
        if isinstance(opt, torch.optim.SGD)
        else {"step", "exp_avg", "exp_avg_sq"}
    )
    assert keys == {f"optim/0/used.weight/{k}" for k in expected}
    assert not any(k.startswith("optim/0/unused.") for k in state)  # None grad: no state
    assert state["optim/0/group0/lr"].item() == 0.05
    assert state["sched/0/_last_lr/0"].item() == 0.05
    assert state["sched/0/last_epoch"].item() == 1
    if isinstance(opt, torch.optim.SGD):
        assert torch.equal(state["optim/0/used.weight/momentum_buffer"], state["grad/used.weight"])
    else:
        assert state["optim/0/group0/betas/1"].item() == 0.999


def test_numbers_become_0d_tensors() -> None:
    sched = SimpleNamespace(
        state_dict=lambda: {"i": 3, "f": 0.5, "b": True, "s": "skip", "n": None, "l": [1.0, 2]}
    )
    state = scheduler_state([sched])
    assert state["sched/0/i"].dtype == torch.int64 and state["sched/0/i"].ndim == 0
    assert state["sched/0/f"].dtype == torch.float64
    assert state["sched/0/b"].dtype == torch.bool
    assert state["sched/0/n"] is None
    assert state["sched/0/l/0"].dtype == torch.float64 and state["sched/0/l/1"].dtype == torch.int64
    assert "sched/0/s" not in state


def test_logger_metrics_that_differ_are_kept_apart() -> None:
    trainer = SimpleNamespace(
        optimizers=[],
        lr_scheduler_configs=[],
        precision_plugin=SimpleNamespace(),
        callback_metrics={"loss": torch.tensor(1.0), "acc": torch.tensor(0.5)},
        logged_metrics={"loss": torch.tensor(1.0), "acc": torch.tensor(0.25), "epoch": 0},
        global_step=2,
        current_epoch=0,
    )
    state = snapshot(nn.Linear(1, 1), trainer)  # type: ignore[arg-type]
    logged = {k: v.item() for k, v in state.items() if k.startswith("logged/")}
    assert logged == {
        "logged/loss": 1.0,
        "logged/acc": 0.5,
        "logged/logger/acc": 0.25,
        "logged/epoch": 0,
    }
