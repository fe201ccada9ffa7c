"""The hazards runner itself can fail: a broken replay arm is a SILENT DIFF, a stray error is unclear."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import replaykit as rk
from replaykit.testing.hazards import (
    BOTH_RAISE,
    CLEAR_ERROR,
    EAGER_ONLY_RAISED,
    HAZARDS,
    MLP,
    PATTERNS,
    REPLAYED,
    SILENT_DIFF,
    UNCLEAR_ERROR,
    Arm,
    Pattern,
    compare_states,
    run_pattern,
    runner,
)


def _fake(name: str, replay_effect) -> Pattern:
    def train(model: nn.Module, arm: Arm) -> dict:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            model(arm.randn(4, 6)).pow(2).mean().backward()
            opt.step()
        if arm.name != "eager":
            replay_effect(model)
        return {}

    return Pattern(name, "inputs", "a deliberately broken fake", lambda d: MLP().to(d), train)


def _nudge(model: nn.Module) -> None:
    with torch.no_grad():
        model.fc1.weight[0, 0] += 1e-7


def _raise(error: BaseException):
    def effect(model: nn.Module) -> None:
        raise error

    return effect


def test_a_replay_arm_that_nudges_a_weight_is_a_silent_diff(backend: str) -> None:
    outcome = run_pattern(_fake("nudged", _nudge), backend)
    assert outcome.kind == SILENT_DIFF
    assert outcome.failed
    assert outcome.detail.startswith("param/fc1.weight")
    assert "ulp" in outcome.detail


def test_a_replay_error_that_is_not_a_replay_error_is_unclear(backend: str) -> None:
    assert run_pattern(_fake("stray", _raise(RuntimeError("boom"))), backend).kind == UNCLEAR_ERROR
    clear = run_pattern(_fake("refused", _raise(rk.ReplayError("refused"))), backend)
    assert clear.kind == CLEAR_ERROR and not clear.failed


def test_eager_errors_are_both_raise_or_a_failure(backend: str) -> None:
    def train(model: nn.Module, arm: Arm) -> dict:
        if arm.name == "eager":
            raise RuntimeError("only eager")
        return {}

    pat = Pattern("eager_only", "inputs", "", lambda d: MLP().to(d), train)
    assert run_pattern(pat, backend).kind == EAGER_ONLY_RAISED

    def both(model: nn.Module, arm: Arm) -> dict:
        raise RuntimeError("always")

    assert run_pattern(Pattern("both", "inputs", "", lambda d: MLP().to(d), both), backend).kind == BOTH_RAISE


def test_a_clean_fake_replays_bitwise(backend: str) -> None:
    outcome = run_pattern(_fake("clean", lambda m: None), backend)
    assert outcome.kind == REPLAYED, outcome.detail
    assert outcome.journal["replay"] >= 1


def test_the_comparison_sees_none_patterns_signed_zeros_and_nans() -> None:
    t = torch.tensor([1.0, 0.0])
    assert compare_states({"a": t}, {"a": t.clone()}) == []
    assert [d.problem for d in compare_states({"a": t}, {"a": None})] == ["none"]
    assert [d.problem for d in compare_states({"a": t}, {"b": t})] == ["missing", "missing"]
    assert [d.problem for d in compare_states({"a": t}, {"a": t.double()})] == ["dtype"]
    [d] = compare_states({"a": t}, {"a": torch.tensor([1.0, -0.0])})
    assert d.problem == "values" and d.max_abs == 0.0  # -0.0 is not 0.0: the bits differ
    nan = torch.tensor([float("nan")])
    assert compare_states({"a": nan}, {"a": nan.clone()}) == []
    [d] = compare_states({"a": torch.tensor([1.0])}, {"a": torch.nextafter(torch.tensor([1.0]), torch.tensor([2.0]))})
    assert d.ulp == 1


def test_the_catalogue_covers_every_hazard_class_with_unique_names() -> None:
    assert len({p.name for p in PATTERNS}) == len(PATTERNS)
    for hazard in HAZARDS:
        assert [p for p in PATTERNS if p.hazard == hazard], hazard
    known = {*rk.PROTECTIONS, "module_state", "input_aliasing", "input_layout", "argument_values",
             "repeat_backward", "param_identity", "record_probe", "inplace_weights"}
    assert {g for p in PATTERNS if p.guard for g in p.guard.split("+")} <= known


def test_the_cli_exits_1_on_a_failure_and_writes_json(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setattr(runner, "PATTERNS", [_fake("nudged", _nudge), _fake("clean", lambda m: None)])
    out = tmp_path / "out.json"
    assert runner.main(["--backend", "emulated", "--json", str(out)]) == 1
    rows = json.loads(out.read_text())
    assert [(r["pattern"], r["kind"], r["failed"]) for r in rows] == [
        ("nudged", SILENT_DIFF, True), ("clean", REPLAYED, False),
    ]
    monkeypatch.setattr(runner, "PATTERNS", [_fake("clean", lambda m: None)])
    assert runner.main(["--plain"]) == 0
