"""The four tiny tasks and their synthetic data: they fit, deterministically, in every layout."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch

from replaykit.testing.parity.end_state import snapshot
from replaykit.testing.tasks import LAYOUTS, TASKS, SyntheticDataModule, make_datamodule, make_task
from replaykit.testing.tasks.data import batch_sizes
from replaykit.verify.bitwise import diff_states

pytestmark = pytest.mark.filterwarnings(
    "ignore:.*does not have many workers.*",
    "ignore:Total length of `DataLoader` across ranks is zero.*",
    "ignore:`isinstance.treespec, LeafSpec.` is deprecated",
)

TASK_NAMES = list(TASKS)


class Recorder(L.Callback):
    """Per training batch: its size, whether net saw channels-last input, the global step."""

    def __init__(self) -> None:
        self.sizes: list[int] = []
        self.steps: list[int] = []
        self.channels_last: list[bool] = []

    def on_fit_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        def hook(_module: torch.nn.Module, args: tuple) -> None:
            if pl_module.training:
                self.channels_last.append(args[0].is_contiguous(memory_format=torch.channels_last))

        self._handle = pl_module.net.register_forward_pre_hook(hook)

    def on_fit_end(self, trainer: L.Trainer, pl_module: Any) -> None:
        self._handle.remove()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.sizes.append(len(batch["image"]))
        self.steps.append(trainer.global_step)


def fit(
    task: str,
    layout: str = "contiguous",
    seed: int = 0,
    *,
    max_steps: int = 3,
    accumulate: int = 1,
    callbacks: list[L.Callback] | None = None,
    task_kw: dict[str, Any] | None = None,
    data_kw: dict[str, Any] | None = None,
) -> tuple[L.LightningModule, L.Trainer]:
    """One quiet CPU fit from ``seed`` (model init and data)."""
    L.seed_everything(seed, verbose=False)
    model = make_task(task, **(task_kw or {}))
    data = make_datamodule(task, layout, seed=seed, **(data_kw or {}))
    trainer = L.Trainer(
        max_steps=max_steps,
        max_epochs=1,
        accumulate_grad_batches=accumulate,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        log_every_n_steps=1,
        deterministic=True,
        callbacks=callbacks or [],
    )
    trainer.fit(model, data)
    return model, trainer


# Each task in two layouts, with the optimizer, schedule and EMA options spread over them.
CASES = [
    ("detection", "contiguous", {"scheduler": "cosine", "ema": 0.9}),
    ("detection", "channels_last", {"optimizer": "adamw", "dropout": 0.2}),
    ("pose", "contiguous", {"optimizer": "adamw", "scheduler": "step", "ema": 0.9}),
    ("pose", "partial_last", {"channels_last": True}),
    ("oriented", "contiguous", {"optimizer": "adamw", "ema": 0.99}),
    ("oriented", "channels_last", {"scheduler": "step", "channels_last": True}),
    ("segmentation", "contiguous", {"scheduler": "cosine", "ema": 0.9}),
    ("segmentation", "partial_between", {"optimizer": "adamw"}),
]


@pytest.mark.parametrize(("task", "layout", "kw"), CASES, ids=[f"{t}-{lay}" for t, lay, _ in CASES])
def test_same_seed_same_end_state_and_another_seed_differs(task, layout, kw) -> None:
    first = snapshot(*fit(task, layout, seed=0, task_kw=kw))
    second = snapshot(*fit(task, layout, seed=0, task_kw=kw))
    assert diff_states(first, second) == []
    other = snapshot(*fit(task, layout, seed=1, task_kw=kw))
    rows = diff_states(first, other)
    assert any(row.name.startswith("param/net.") for row in rows)
    assert all(row.problem == "values" for row in rows)


@pytest.mark.parametrize("task", TASK_NAMES)
def test_loss_reaches_every_parameter(task: str) -> None:
    """Every head output is read by the loss, so no parameter's grad stays None."""
    torch.manual_seed(0)
    model = make_task(task)
    batch = next(iter(make_datamodule(task).train_dataloader()))
    out = model.net(model.image(batch))
    assert isinstance(out, dict)
    assert all(isinstance(v, torch.Tensor) for v in out.values())
    loss, parts = model.loss(out, batch)
    assert loss.ndim == 0 and torch.isfinite(loss)
    assert set(parts) and all(p.ndim == 0 for p in parts.values())
    loss.backward()
    missing = [n for n, p in model.net.named_parameters() if p.grad is None]
    assert missing == []
    assert 1_000 < sum(p.numel() for p in model.net.parameters()) < 50_000
    assert any(isinstance(m, torch.nn.BatchNorm2d) for m in model.net.modules())
    assert any(isinstance(m, torch.nn.Dropout) for m in model.net.modules())


@pytest.mark.parametrize("task", TASK_NAMES)
def test_partial_batch_inside_accumulation_window(task: str) -> None:
    rec = Recorder()
    model, trainer = fit(task, "partial_between", max_steps=-1, accumulate=2, callbacks=[rec])
    assert rec.sizes == [4, 4, 2, 4, 4, 4]
    # the partial batch (index 2) opens a window: no step after it, one after its partner
    assert rec.steps == [0, 1, 1, 2, 2, 3]
    assert trainer.global_step == 3
    assert "val_loss" in trainer.callback_metrics
    again = snapshot(*fit(task, "partial_between", max_steps=-1, accumulate=2))
    assert diff_states(snapshot(model, trainer), again) == []


@pytest.mark.parametrize("task", TASK_NAMES)
def test_empty_val_runs(task: str) -> None:
    rec = Recorder()
    _, trainer = fit(task, "empty_val", max_steps=-1, callbacks=[rec])
    assert len(rec.sizes) == 6 and trainer.global_step == 6
    assert "train_loss" in trainer.callback_metrics
    assert not any(key.startswith("val_") for key in trainer.callback_metrics)


@pytest.mark.parametrize(
    ("layout", "option", "expected"),
    [("contiguous", False, False), ("contiguous", True, True), ("channels_last", False, True)],
)
def test_channels_last_input_reaches_net(layout: str, option: bool, expected: bool) -> None:
    rec = Recorder()
    fit("segmentation", layout, callbacks=[rec], task_kw={"channels_last": option})
    assert rec.channels_last == [expected] * 3


class EmaRecorder(L.Callback):
    """The EMA state before each training batch and at the end of training."""

    def __init__(self) -> None:
        self.states: list[dict[str, torch.Tensor]] = []
        self.steps: list[int] = []

    def _record(self, trainer: L.Trainer, pl_module: Any) -> None:
        self.states.append({k: v.clone() for k, v in pl_module.ema_state.items()})
        self.steps.append(trainer.global_step)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._record(trainer, pl_module)

    def on_train_end(self, trainer, pl_module) -> None:
        self._record(trainer, pl_module)


def test_ema_changes_only_after_optimizer_steps(tmp_path) -> None:
    rec = EmaRecorder()
    model, trainer = fit(
        "detection",
        "partial_last",
        max_steps=-1,
        accumulate=2,
        callbacks=[rec],
        task_kw={"ema": 0.5},
    )
    # batches [4, 4, 4, 4, 4, 2]: the optimizer steps after batches 1, 3 and 5 (partial)
    assert rec.steps == [0, 0, 1, 1, 2, 2, 3]
    initial = {k: v.detach() for k, v in rec.states[0].items()}
    for before, after, step_before, step_after in zip(
        rec.states, rec.states[1:], rec.steps, rec.steps[1:], strict=False
    ):
        changed = diff_states(before, after) != []
        assert changed == (step_after != step_before)
    # after training the EMA lags the weights, and lies between them and the start
    weight = "backbone.0.0.weight"
    ema = model.ema_state[weight]
    assert not torch.equal(ema, model.net.state_dict()[weight])
    assert not torch.equal(ema, initial[weight])
    assert torch.equal(model.ema_state["backbone.0.1.num_batches_tracked"], torch.tensor(6))

    path = tmp_path / "last.ckpt"
    trainer.save_checkpoint(path)
    restored = TASKS["detection"].load_from_checkpoint(path)
    assert restored.ema_decay == 0.5
    assert diff_states(restored.ema_state, model.ema_state) == []


def test_layout_batch_sizes() -> None:
    assert batch_sizes(24, 4, "contiguous") == [4] * 6
    assert batch_sizes(22, 4, "partial_last") == [4] * 5 + [2]
    assert batch_sizes(22, 4, "partial_between") == [4, 4, 2, 4, 4, 4]
    assert batch_sizes(9, 4, "partial_between") == [4, 1, 4]
    for layout in LAYOUTS:
        data = make_datamodule("pose", layout, batch_size=4)
        sizes = [len(b["image"]) for b in data.train_dataloader()]
        assert sizes == data.train_sizes
        assert sum(len(b["image"]) for b in data.val_dataloader()) == data.n_val
    assert make_datamodule("pose", "empty_val").n_val == 0


def test_data_is_deterministic_per_seed() -> None:
    a, b = SyntheticDataModule("oriented", seed=3), SyntheticDataModule("oriented", seed=3)
    c = SyntheticDataModule("oriented", seed=4)
    assert diff_states(a.train_data, b.train_data) == []
    assert diff_states(a.val_data, b.val_data) == []
    assert diff_states(a.train_data, c.train_data) != []


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: make_task("classification"), "unknown task"),
        (lambda: make_datamodule("classification", "contiguous"), "unknown task"),
        (lambda: make_datamodule("pose", "shuffled"), "unknown layout"),
        (lambda: SyntheticDataModule("pose", layout="shuffled"), "unknown layout"),
        (lambda: make_task("pose", optimizer="lion"), "unknown optimizer"),
        (lambda: make_task("pose", scheduler="plateau"), "unknown scheduler"),
        (lambda: make_task("pose", ema=1.0), "ema decay"),
        (lambda: make_datamodule("pose", "contiguous", n_train=10), "not a multiple"),
        (lambda: make_datamodule("pose", "partial_last", n_train=8), "partial batch"),
        (lambda: make_datamodule("pose", "empty_val", n_val=4), "n_val=0"),
    ],
)
def test_bad_names_raise_value_error(call, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()
