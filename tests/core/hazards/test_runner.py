"""The hazards runner itself can fail: a broken replay arm is a SILENT DIFF, a stray error is unclear,
a hang is a failure (in this process or in a child), for both entry points (capture and step)."""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import replaykit as rk
from replaykit.testing.hazards import (
    BOTH_RAISE,
    CLEAR_ERROR,
    EAGER_ONLY_RAISED,
    HANG,
    HAZARDS,
    MLP,
    PATTERNS,
    REPLAYED,
    RETIRED,
    ROUTED,
    SILENT_DIFF,
    UNCLEAR_ERROR,
    Arm,
    Outcome,
    Pattern,
    compare_states,
    deadline,
    run_pattern,
    runner,
    step_loop,
    summary,
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

    assert (
        run_pattern(Pattern("both", "inputs", "", lambda d: MLP().to(d), both), backend).kind
        == BOTH_RAISE
    )


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
    [d] = compare_states(
        {"a": torch.tensor([1.0])}, {"a": torch.nextafter(torch.tensor([1.0]), torch.tensor([2.0]))}
    )
    assert d.ulp == 1


def test_the_catalogue_covers_every_hazard_class_with_unique_names() -> None:
    assert len({p.name for p in PATTERNS}) == len(PATTERNS)
    for hazard in HAZARDS:
        assert [p for p in PATTERNS if p.hazard == hazard], hazard
    known = {
        *rk.PROTECTIONS,
        "module_state",
        "input_aliasing",
        "input_layout",
        "argument_values",
        "repeat_backward",
        "param_identity",
        "record_probe",
        "inplace_weights",
        "state_identity",
        "host_values",
        "copy_out",
    }  # the last three: TrainStep's own
    assert {g for p in PATTERNS if p.guard for g in p.guard.split("+")} <= known


#: hazard classes without patterns for an entry point, and why (a new class must name its gaps)
NOT_APPLICABLE = {
    (
        "hook_order",
        "step",
    ): "a whole step with module or gradient hooks runs eagerly (step_python: hooks)",
    ("two_backwards", "step"): "a whole step runs its own single backward",
    (
        "hook_order",
        "whole_step",
    ): "Lightning's whole step is a TrainStep: with module or gradient hooks it runs eagerly",
    ("two_backwards", "whole_step"): "Lightning's whole step runs the TrainStep's single backward",
    (
        "recurrent",
        "whole_step",
    ): "what the model's own code does: Lightning adds nothing over TrainStep's recurrent patterns",
    (
        "kept_outputs",
        "whole_step",
    ): "Lightning's whole step is a TrainStep: the loss it hands back is a copy (the step patterns)",
    (
        "kept_grads",
        "whole_step",
    ): "Lightning's whole step is a TrainStep: it hands out gradients as the step patterns show",
}
#: classes whose Lightning whole-step patterns are still to be written (the gap, said here)
NO_LIGHTNING_YET: set[str] = set()


def test_every_hazard_class_has_patterns_for_each_entry_point_it_applies_to() -> None:
    have = {(p.hazard, p.api) for p in PATTERNS}
    for hazard in HAZARDS:
        for api in ("capture", "step", "whole_step"):
            if (hazard, api) in NOT_APPLICABLE:
                assert (hazard, api) not in have, (hazard, api)  # applies after all: say so
            elif api == "whole_step" and hazard in NO_LIGHTNING_YET:
                assert (hazard, api) not in have, hazard  # written: take it off the list
            else:
                assert (hazard, api) in have, (hazard, api)


#: (class, entry point) pairs with no unsafe arm that diverges on the CPU, and why (a guard
#: switched off there shows nothing to the CPU suite; a new gap must say why here)
NO_CPU_NEGATIVE_CONTROL = {
    ("crashes", "capture"): "crash patterns name no guard: they must end in a clear error",
    ("crashes", "step"): "crash patterns name no guard: they must end in a clear error",
    ("crashes", "whole_step"): "crash patterns name no guard: they must end in a clear error",
    ("autocast", "step"): "a whole step captures the autocast region as eager runs it: no guard",
    (
        "autocast",
        "whole_step",
    ): "a whole step captures the autocast region as eager runs it: no guard",
    ("backend_diffs", "step"): "must replay bitwise or run eagerly on both backends: no guard",
    (
        "backend_diffs",
        "whole_step",
    ): "must replay bitwise or run eagerly on both backends: no guard",
    ("leaving_grads", "capture"): "its pattern names no guard (the copy-out is the recorder's own)",
    ("step_python", "capture"): "its patterns name no guard (network replay runs no step Python)",
    (
        "kept_outputs",
        "step",
    ): "TrainStep hands back a copy of the loss: nothing kept shares static memory",
}


def test_every_class_and_entry_point_has_a_negative_control_on_the_cpu() -> None:
    """A guarded pattern whose unsafe arm diverges on the CPU, for every (class, entry point)
    pair with patterns, but those listed with a reason: the CPU suite sees each guard needed."""
    controlled: dict[tuple[str, str], bool] = {}
    for p in PATTERNS:
        on_cpu = p.guard is not None and not p.unsafe_never and not p.cuda_only
        controlled[(p.hazard, p.api)] = controlled.get((p.hazard, p.api), False) or on_cpu
    gaps = {pair for pair, ok in controlled.items() if not ok}
    assert gaps == set(NO_CPU_NEGATIVE_CONTROL), gaps ^ set(NO_CPU_NEGATIVE_CONTROL)


def test_the_cli_exits_1_on_a_failure_and_writes_json(
    monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    monkeypatch.setattr(
        runner, "PATTERNS", [_fake("nudged", _nudge), _fake("clean", lambda m: None)]
    )
    out = tmp_path / "out.json"
    assert runner.main(["--backend", "emulated", "--json", str(out)]) == 1
    rows = json.loads(out.read_text())
    assert [(r["pattern"], r["kind"], r["failed"]) for r in rows] == [
        ("nudged", SILENT_DIFF, True),
        ("clean", REPLAYED, False),
    ]
    monkeypatch.setattr(runner, "PATTERNS", [_fake("clean", lambda m: None)])
    assert runner.main(["--plain"]) == 0


# --------------------------------------------------------------------------- whole-step patterns
def _fake_step(name: str, replay_effect, loss_fn=lambda m, x: m(x).pow(2).mean()) -> Pattern:
    def train(model: nn.Module, arm: Arm) -> dict:
        kept = step_loop(model, arm, loss_fn=loss_fn)
        if arm.replay:
            replay_effect(model)
        return kept

    return Pattern(name, "inputs", "a whole-step fake", lambda d: MLP().to(d), train, api="step")


def test_a_clean_step_pattern_replays_bitwise_against_its_eager_twin(backend: str) -> None:
    outcome = run_pattern(_fake_step("clean_step", lambda m: None), backend)
    assert (outcome.kind, outcome.api) == (REPLAYED, "step"), outcome.detail
    assert outcome.journal["replay"] >= 1 and outcome.journal["record"] >= 1


def test_a_step_pattern_that_nudges_a_weight_is_a_silent_diff(backend: str) -> None:
    outcome = run_pattern(_fake_step("nudged_step", _nudge), backend)
    assert outcome.kind == SILENT_DIFF and outcome.failed
    assert outcome.detail.startswith("param/fc1.weight")


def test_the_optimizer_state_is_part_of_a_step_patterns_end_state(backend: str) -> None:
    def train(model: nn.Module, arm: Arm) -> dict:
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        step = arm.train_step(model, lambda m, x: m(x).pow(2).mean(), opt)
        for _ in range(4):
            step(arm.randn(4, 6))
        if arm.replay:
            with torch.no_grad():
                opt.state[model.fc2.bias]["momentum_buffer"][0] += 1e-3
        return {}

    outcome = run_pattern(
        Pattern("momentum", "inputs", "", lambda d: MLP().to(d), train, api="step"), backend
    )
    assert outcome.kind == SILENT_DIFF
    assert outcome.detail.startswith("optim0/fc2.bias/momentum_buffer"), outcome.detail


def test_a_step_patterns_retirement_and_routing_are_classified(backend: str) -> None:
    def flip(model: nn.Module, x: torch.Tensor) -> torch.Tensor:  # Python a replay would not repeat
        model.__dict__.setdefault("seen", []).append(1)
        return model(x).pow(2).mean()

    assert run_pattern(_fake_step("retires", lambda m: None, loss_fn=flip), backend).kind == RETIRED

    def p_every_step(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
        model.drop.p = 0.1 / (step + 1)  # a new recording per step: over the budget of one

    def budget(model: nn.Module, arm: Arm) -> dict:
        return step_loop(model, arm, before=p_every_step, max_recordings=1)

    outcome = run_pattern(
        Pattern("budget", "inputs", "", lambda d: MLP().to(d), budget, api="step"), backend
    )
    assert outcome.kind == ROUTED, outcome.line()
    assert "budget" in outcome.detail


def test_a_step_pattern_must_build_its_step_through_the_arm() -> None:
    def plain(model: nn.Module, arm: Arm) -> dict:
        return {}

    with pytest.raises(ValueError, match=r"arm\.train_step"):
        run_pattern(
            Pattern("no_step", "inputs", "", lambda d: MLP().to(d), plain, api="step"), "emulated"
        )
    with pytest.raises(ValueError, match="api"):
        Pattern("bad_api", "inputs", "", lambda d: MLP().to(d), plain, api="lightning")


# --------------------------------------------------------------------------- deadlines
def _spin_in_replay(model: nn.Module, arm: Arm) -> dict:
    if arm.replay:
        while True:  # a Python-level hang: the in-process alarm ends it
            pass
    return {}


def test_a_hang_in_this_process_is_a_failure_not_a_stuck_run() -> None:
    pat = Pattern("spins", "lifecycle", "", lambda d: MLP().to(d), _spin_in_replay)
    outcome = run_pattern(pat, "emulated", timeout=0.5)
    assert outcome.kind == HANG and outcome.failed
    assert "replay arm" in outcome.detail
    assert (
        run_pattern(_fake("after_a_hang", lambda m: None), "emulated").kind == REPLAYED
    )  # the alarm is off again


def _clean(model: nn.Module, arm: Arm) -> dict:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad(set_to_none=True)
        model(arm.randn(4, 6)).pow(2).mean().backward()
        opt.step()
    return {}


def _stuck_in_replay(model: nn.Module, arm: Arm) -> dict:
    if arm.replay:
        signal.pthread_sigmask(
            signal.SIG_BLOCK, {signal.SIGALRM}
        )  # as deaf to the alarm as native code
        time.sleep(600)
    return _clean(model, arm)


# module level: a child process finds a ``may_hang`` pattern by its module and name
IN_A_CHILD = [
    Pattern("clean_in_a_child", "lifecycle", "", lambda d: MLP().to(d), _clean, may_hang=True),
    Pattern(
        "stuck_in_a_child", "lifecycle", "", lambda d: MLP().to(d), _stuck_in_replay, may_hang=True
    ),
]


@pytest.mark.slow  # starts the child worker: torch imports again
def test_a_may_hang_pattern_runs_in_a_child_and_answers_as_here() -> None:
    outcome = run_pattern(IN_A_CHILD[0], "emulated")
    assert isinstance(outcome, Outcome)
    assert outcome.kind == REPLAYED and outcome.journal["replay"] >= 1


def _pids_file(parent: int) -> Path:
    return Path(tempfile.gettempdir()) / f"replaykit-test-child-pids-{parent}"


def _clean_noting_the_pid(model: nn.Module, arm: Arm) -> dict:
    with _pids_file(os.getppid()).open("a") as fh:  # the child's parent: this test's process
        fh.write(f"{os.getpid()}\n")
    return _clean(model, arm)


IN_A_CHILD.append(
    Pattern(
        "pid_in_a_child",
        "lifecycle",
        "",
        lambda d: MLP().to(d),
        _clean_noting_the_pid,
        may_hang=True,
    )
)


def test_may_hang_patterns_share_one_child_on_the_cpu() -> None:
    """The interpreter and torch import are paid once, not per run (about 2 s each on CI)."""
    pids = _pids_file(os.getpid())
    pids.unlink(missing_ok=True)
    try:
        outcomes = [run_pattern(IN_A_CHILD[2], "emulated") for _ in range(2)]
        assert [o.kind for o in outcomes] == [REPLAYED, REPLAYED]
        seen = pids.read_text().split()
    finally:
        pids.unlink(missing_ok=True)
    assert (
        len(seen) == 4 and len(set(seen)) == 1 and seen[0] != str(os.getpid())
    )  # both arms, twice


def _leaves_torch_settings(model: nn.Module, arm: Arm) -> dict:
    out = _clean(model, arm)
    torch.set_default_dtype(torch.float64)  # not put back, as a careless pattern would
    torch.set_grad_enabled(False)
    return out


def _needs_torch_defaults(model: nn.Module, arm: Arm) -> dict:
    if torch.get_default_dtype() != torch.float32 or not torch.is_grad_enabled():
        raise RuntimeError("an earlier pattern's settings leaked into this run")
    return _clean(model, arm)


IN_A_CHILD += [
    Pattern(name, "lifecycle", "", lambda d: MLP().to(d), train, may_hang=True)
    for name, train in (("leaks", _leaves_torch_settings), ("needs", _needs_torch_defaults))
]


def test_a_patterns_outcome_does_not_depend_on_what_ran_before_it_in_the_shared_child() -> None:
    """A fresh child per run started from torch's defaults; the shared one must too."""
    run_pattern(IN_A_CHILD[-2], "emulated")
    outcome = run_pattern(IN_A_CHILD[-1], "emulated")
    assert outcome.kind == REPLAYED, outcome.line()


def test_a_native_hang_is_killed_with_its_child_and_is_a_failure() -> None:
    start = time.perf_counter()
    outcome = run_pattern(IN_A_CHILD[1], "emulated", timeout=1.0)
    assert outcome.kind == HANG and outcome.failed, outcome.line()
    assert "killed" in outcome.detail
    assert time.perf_counter() - start < 120


def test_a_may_fault_patterns_unsafe_cuda_arm_alone_runs_in_a_child() -> None:
    """An unguarded replay that reads freed memory faulted on the H200 and poisoned the notebook's
    process for every later pattern: that arm (only that one) gets a process of its own."""
    from replaykit.testing.hazards import runs_in_child
    from replaykit.testing.hazards.catalogue import PATTERNS

    faulting = next(p for p in PATTERNS if p.name == "tensor_attribute_updated")
    assert runs_in_child(faulting, "cuda", unsafe=True)
    assert not runs_in_child(faulting, "cuda", unsafe=False)
    assert not runs_in_child(faulting, "emulated", unsafe=True)
    assert runs_in_child(IN_A_CHILD[0], "emulated", unsafe=False)  # may_hang: always


#: A worker child without torch: answers its pid, sleeps or exits on request.
_ECHO = (
    "import importlib.util as u, os, sys, time; "
    f"spec = u.spec_from_file_location('deadline', {deadline.__file__!r}); "
    "d = sys.modules['deadline'] = u.module_from_spec(spec); spec.loader.exec_module(d); "
    "sys.exit(d.serve(lambda a: str(os.getpid()) if a == ['pid'] else "
    "time.sleep(float(a[1])) or 'slept' if a[0] == 'sleep' else sys.exit(3)))"
)  # deadline.py alone (standard library only): no torch import in this child


def test_a_worker_child_serves_runs_in_turn_and_is_replaced_after_a_hang_or_a_crash() -> None:
    worker = deadline.Worker([sys.executable, "-c", _ECHO])
    try:
        first = worker.request(["pid"], 30)
        assert first.status == "done" and worker.request(["pid"], 30).stdout == first.stdout
        hung = worker.request(["sleep", "60"], 0.5)
        assert hung.status == "timeout" and worker.proc is None  # killed at the deadline
        again = worker.request(["pid"], 30)
        assert again.status == "done" and again.stdout != first.stdout  # a fresh child
        crashed = worker.request(["exit"], 30)
        assert (crashed.status, crashed.returncode) == ("crashed", 3)
        assert worker.request(["sleep", "0"], 30).stdout.strip() == "slept"
    finally:
        worker.close()


#: A worker child whose run prints without ending its line, as a progress line does.
_UNENDED = _ECHO.split("sys.exit(d.serve(")[0] + (
    "sys.exit(d.serve(lambda a: sys.stdout.write('epoch 1 ' * int(a[0])) and 'answered'))"
)


def test_a_runs_output_without_a_line_end_does_not_hide_its_answer() -> None:
    """What a run prints is not its answer: an unended line must not swallow the answer line
    (the run was read as a hang at its deadline, its child killed)."""
    worker = deadline.Worker([sys.executable, "-c", _UNENDED])
    try:
        for _ in range(2):
            result = worker.request(["1"], 10)
            assert result.status == "done", result
            assert result.stdout.strip().splitlines()[-1] == "answered", result
    finally:
        worker.close()


# --------------------------------------------------------------------------- the summary
def test_replay_coverage_counts_realistic_guarded_runs_per_api_and_backend(monkeypatch) -> None:
    from replaykit.testing.hazards import report

    known = _fake("a_known_limit", lambda m: None)
    monkeypatch.setattr(report, "KNOWN_LIMITS", [known])
    outcomes = [
        run_pattern(_fake("replays", lambda m: None), "emulated"),
        run_pattern(_fake_step("step_replays", lambda m: None), "emulated"),
        run_pattern(
            _fake_step(
                "step_retires",
                lambda m: None,
                loss_fn=lambda m, x: (
                    m.__dict__.setdefault("seen", []).append(1),
                    m(x).pow(2).mean(),
                )[1],
            ),
            "emulated",
        ),
    ]
    unsafe = Outcome("replays", "inputs", "emulated", REPLAYED, unsafe=True)
    limit = Outcome(known.name, "x", "emulated", REPLAYED)
    # eager raised too: nothing to replay, left out of the share
    failing = Outcome("eager_raises", "crashes", "emulated", BOTH_RAISE, api="step")
    result = summary([*outcomes, unsafe, limit, failing])
    assert result["coverage"] == {
        "capture/emulated": {"replayed": 1, "patterns": 1, "share": 1.0},
        "step/emulated": {"replayed": 1, "patterns": 2, "share": 0.5},
    }
    assert "replay coverage: capture/emulated 1/1 (100%), step/emulated 1/2 (50%)" in result["line"]


def test_a_gpu_script_row_that_raises_or_hangs_is_a_fail_row(capsys) -> None:
    import time

    from replaykit.testing.hazards.deadline import checked_row

    assert checked_row("passes", lambda: (True, "fine"), 5)
    assert not checked_row("raises", lambda: 1 / 0, 5)  # type: ignore[arg-type, return-value]
    assert not checked_row("hangs", lambda: (time.sleep(5), (True, ""))[1], 0.2)
    rows = capsys.readouterr().out.splitlines()
    assert [r.split()[:2] for r in rows] == [
        ["PASS", "passes"],
        ["FAIL", "raises"],
        ["FAIL", "hangs"],
    ]
    assert "ZeroDivisionError" in rows[1] and "timed out after 0.2 s" in rows[2]
