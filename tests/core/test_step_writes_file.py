"""A step whose own code writes a file (hostile round 13: a loss appended to a CSV).

A replay runs no Python, and no run can take a write back: the recording call's extra runs each
appended, replays none. The step now retires at the recording call with its first run standing
(the file gets eager's one line per call); ``rk.capture`` retires at its recording call, whose
probe has written once already (said in the warning).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from torch import nn

import replaykit as rk


def _train(
    path: Path, backend: str | None, unsafe: tuple[str, ...] = (), device: str = "cpu"
) -> tuple[int, dict]:
    path.write_text("")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def loss_fn(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with path.open("a") as f:
            f.write("step\n")
        return (m(x) - y).pow(2).mean()

    step = (
        rk.TrainStep(model, loss_fn, opt, backend=backend, unsafe_disable=unsafe)
        if backend
        else None
    )
    g = torch.Generator().manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(5):
            x, y = (
                torch.randn(5, 6, generator=g).to(device),
                torch.randn(5, 3, generator=g).to(device),
            )
            if step is not None:
                step(x, y)
            else:
                loss_fn(model, x, y).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
    return path.read_text().count("\n"), dict(step.counts) if step is not None else {}


def test_step_that_writes_a_file_writes_it_once_per_call(
    backend: str, device: str, tmp_path: Path
) -> None:
    path = tmp_path / "log.csv"
    lines, _ = _train(path, None, device=device)
    replayed, counts = _train(path, backend, device=device)
    assert replayed == lines == 5
    assert counts["replay"] == 0
    assert _train(path, backend, ("side_effects",), device)[0] != lines


def _device(backend: str) -> str:
    return "cuda" if backend == "cuda" else "cpu"


class Logging(nn.Sequential):
    path: str

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with open(self.path, "a") as f:
            f.write("forward\n")
        return super().forward(x)


def _logging_model(path: Path, backend: str, unsafe: tuple[str, ...] = ()) -> Logging:
    model = Logging(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)).to(_device(backend))
    model.path = str(path)
    rk.capture(model, backend=backend, unsafe_disable=unsafe)
    return model


def test_capture_of_a_forward_that_writes_a_file_retires(backend: str, tmp_path: Path) -> None:
    model = _logging_model(tmp_path / "log.csv", backend)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(4):
            model(torch.randn(5, 6, device=_device(backend))).sum().backward()
    recorder = rk.recorder_of(model)
    assert recorder.counts["replay"] == 0
    assert "log.csv" in (recorder.retire_reason or "")
    # the recording call's probe wrote once more; every later call once, as eager
    assert Path(model.path).read_text().count("\n") == 5


def test_capture_unsafe_arm_replays_the_file_write_away(backend: str, tmp_path: Path) -> None:
    model = _logging_model(tmp_path / "log.csv", backend, ("record_probe",))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(4):
            model(torch.randn(5, 6, device=_device(backend))).sum().backward()
    assert Path(model.path).read_text().count("\n") != 4
