"""A recording collected by the garbage collector while another capture runs (the collector runs
whenever Python allocates, inside a captured forward too): the outputs its caller still holds
move to memory of their own, and that move must not be recorded into the other capture, whose
replays would repeat its copy from memory freed after it (on CUDA: into a held tensor, from a
block the pool gives to other tensors). The move waits for the next call of any entry point."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

import replaykit as rk

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


class Collecting(nn.Module):
    """A forward that runs the garbage collector (as any allocation in it may)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gc.collect()
        return self.fc(x).tanh() * 3


def test_a_held_output_of_a_recording_collected_inside_a_capture_keeps_its_values() -> None:
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 16)).cuda()
    rk.capture(a, backend="cuda")
    x = torch.randn(8, 16, device="cuda")
    for _ in range(4):
        out = a(x)
        out.sum().backward()
    held = out.detach()
    expected = held.clone()
    b = Collecting().cuda()
    rec_b = rk.capture(b, backend="cuda")
    b(torch.randn(8, 16, device="cuda")).sum().backward()  # its warm-up: nothing to collect yet
    gc.disable()
    try:
        cycle: list = [a]
        cycle.append(cycle)  # a's recording goes at the next collection: inside b's capture
        del a, cycle, out
        for i in range(6):
            b(torch.randn(8, 16, device="cuda") * i).sum().backward()
            torch.cuda.synchronize()
            assert torch.equal(held, expected), i
    finally:
        gc.enable()
    assert rec_b.counts["replay"] >= 3, rec_b.summary()


def test_a_collection_due_inside_a_capture_waits_for_its_end() -> None:
    """With garbage from an earlier recording (its CUDA graphs, pools and hand-outs in a cycle)
    and the collector set to run at nearly every allocation, a new recording still captures and
    replays: collections wait for the capture's end (``backends/collector.py``)."""
    torch.manual_seed(0)
    old = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 16)).cuda()
    rk.capture(old, backend="cuda")
    x = torch.randn(8, 16, device="cuda")
    for _ in range(3):
        old(x).sum().backward()
    cycle: list = [old]
    cycle.append(cycle)
    del old, cycle
    threshold = gc.get_threshold()
    gc.set_threshold(1, 1, 1)
    try:
        new = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)).cuda()
        rec = rk.capture(new, backend="cuda")
        for i in range(5):
            new(x * i).sum().backward()
    finally:
        gc.set_threshold(*threshold)
    assert not rec.retired and rec.counts["replay"] >= 3, rec.summary()
