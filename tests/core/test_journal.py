"""The journal stays bounded over long runs with exact counts, and the routing state stays flat."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import replaykit as rk
from replaykit.journal import Journal


def test_a_million_events_stay_bounded_with_exact_counts() -> None:
    j = Journal(tail=100)
    j.add("record", 1)
    for call in range(2, 1_000_002):
        j.add("replay", call)
        if call % 1000 == 0:
            j.add("eager", call, "hold")
    j.add("retire", 1_000_002, "done")
    j.add("eager", 1_000_003, "retired")
    assert j.counts["replay"] == 1_000_000
    assert j.eager_reasons == {"hold": 1000, "retired": 1}
    assert len(j) <= 100 + 5
    kept = list(j)
    assert [e.kind for e in kept][:2] == ["record", "replay"]
    assert ("retire", "done") in [(e.kind, e.reason) for e in kept]
    assert ("eager", "hold") in [(e.kind, e.reason) for e in kept]
    assert [e.seq for e in kept] == sorted(e.seq for e in kept)
    assert j.dropped == j.total - len(j)
    assert "journal:" in j.format()


def test_routing_state_is_flat_over_many_replays() -> None:
    model = nn.Linear(4, 4)
    rec = rk.capture(model, backend="emulated")
    x = torch.randn(2, 4)
    sizes = []
    for i in range(3000):
        model(x).sum().backward()
        if i in (1500, 2999):
            sizes.append((len(rec.journal), len(rec._aliases), rec.recordings))
    assert sizes[0] == sizes[1]
    assert rec.counts["replay"] == 2999
    rec.release()


def test_tick_keeps_what_add_keeps() -> None:
    added, ticked = Journal(tail=5), Journal(tail=5)
    events = [
        ("record", 1, None),
        *[(k, c, r) for c in range(2, 12) for k, r in (("replay", None), ("hold_end", "backward"))],
    ]
    events += [
        ("eager", 12, "hold"),
        ("hold_end", 12, "dropped"),
        ("replay", 13, None),
        ("retire", 14, "done"),
    ]
    for kind, call, reason in events:
        added.add(kind, call, reason)
        ticked.tick(kind, call, reason)
    assert list(ticked) == list(added)
    assert ticked.counts == added.counts and ticked.total == added.total == len(events)
    assert ticked.summary() == added.summary()


_SCALE = 1.0


class _Scaled(nn.Module):
    """Divides by a module global the loop changes: each new value needs a recording of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) / _SCALE


def test_each_new_recording_says_what_no_earlier_one_shared(backend: str, device: str) -> None:
    """A host value that changes every call records every call and replays nothing; ``summary()``
    and the budget warning name what the recordings differed in, for both entry points."""
    global _SCALE
    model = _Scaled().to(device)
    with rk.capture(model, backend=backend) as rec:
        for i in range(4):
            _SCALE = 1.0 + i
            model(torch.randn(2, 4, device=device)).sum().backward()
        model(torch.randn(3, 4, device=device)).sum().backward()
    assert "recorded anew for: forward_reads x3; shapes x1" in rec.summary(), rec.summary()
    details = [e.detail for e in rec.journal if e.kind == "record"]
    assert details[0] == "[2x4] recording 1" and details[-1].endswith("(new shapes)"), details

    scale = [0.5]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = rk.TrainStep(
        model, lambda m, x: m(x).pow(2).mean() * scale[0], opt, backend=backend, max_recordings=2
    )
    with pytest.warns(rk.ReplayWarning, match="recordings differed in a value loss_fn reads"):
        for i in range(24):
            scale[0] = 1.0 + i
            step(torch.randn(2, 4, device=device))
    assert "recorded anew for: loss_reads x1" in step.summary(), step.summary()
    assert step.eager_reasons["budget"] > 12
