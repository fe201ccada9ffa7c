"""The runner: each catalogue pattern eager vs replayed, classified per API and backend.

    python -m replaykit.testing.hazards --backend emulated [--unsafe] [--hazard inputs] [--api step|whole_step] [--json out.json]

prints the outcome table and the summary (with the replay coverage), and exits 1 when
any outcome is a failure (a silent difference, an eager error the replay swallowed, a
replay error that is not a ``ReplayError``, a hang). With ``--unsafe`` it runs each
guarded pattern with its guard switched off instead; there a failure is an unsafe arm
that did NOT diverge.

A capture pattern's replay arm runs under ``rk.capture``; a step pattern's replay arm is
``rk.TrainStep`` and its eager arm the step's eager twin (``replay=False``), both from the
same seed; a whole_step pattern is a step pattern inside a Lightning ``Trainer.fit``. Every run has a deadline (:mod:`.deadline`): in this process, or in a child
process for patterns marked ``may_hang``.

The outcomes are :mod:`.outcome`'s; the table and summary (with the replay coverage)
:mod:`.report`'s.

Imports only torch and the public core API (``import replaykit as rk``).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import sys
import time
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict
from typing import Any

import torch
from torch import nn

import replaykit as rk
from replaykit.protections import negative_control

from . import deadline
from .catalogue import HAZARDS, KNOWN_LIMITS, PATTERNS
from .outcome import CRASHED, HANG, ArmResult, Outcome, State, classify
from .pattern import APIS, Arm, Extras, Pattern
from .report import summary, table

#: A pattern run's deadline unless the pattern or the caller sets one (seconds, both arms).
TIMEOUT_S = 120.0


def end_state(
    model: nn.Module, extras: Extras, optimizers: Sequence[torch.optim.Optimizer] = ()
) -> State:
    """Parameters, their ``.grad``, buffers, the pattern's extras and the ``optimizers``'
    state (a step pattern's: what the step updates), detached copies."""
    state: State = {}
    for name, p in model.named_parameters():
        state[f"param/{name}"] = p.detach().clone()
        state[f"grad/{name}"] = None if p.grad is None else p.grad.detach().clone()
    for name, b in model.named_buffers():
        state[f"buffer/{name}"] = b.detach().clone()
    for name, t in extras.items():
        state[f"out/{name}"] = None if t is None else t.detach().clone()
    names = {p: n for n, p in model.named_parameters()}
    for i, opt in enumerate(optimizers):
        for j, (p, slots) in enumerate(opt.state.items()):
            for key, value in slots.items():
                where = f"optim{i}/{names.get(p, f'param{j}')}/{key}"
                if isinstance(value, torch.Tensor):
                    state[where] = value.detach().clone()
                elif isinstance(value, (int, float)):  # a step count kept as a number
                    state[where] = torch.tensor(value)
    return state


def _device_of(backend: str) -> str:
    return "cuda" if backend == "cuda" else "cpu"


def _run_arm(
    pat: Pattern, device: str, backend: str, disable: tuple[str, ...], name: str
) -> ArmResult:
    """One arm from the seed: ``name`` "eager" is the reference (plain PyTorch, or the step's eager twin)."""
    torch.manual_seed(0)
    model = pat.make(device)
    arm = Arm(device, name, backend=backend, unsafe_disable=disable)
    result = ArmResult(None, None)
    try:
        if pat.api == "capture" and arm.replay:
            target = pat.target(model) if pat.target is not None else model
            arm.recorder = rk.capture(target, backend=backend, unsafe_disable=disable)
        torch.manual_seed(1)
        extras = pat.train(model, arm)
        result.state = end_state(model, extras, arm.optimizers)
    except Exception as exc:  # the outcome classifies it
        result.error = exc
    finally:
        rec = arm.recorder
        if rec is not None:
            result.journal = _journal(rec)
            try:
                rec.release()
            except Exception as exc:  # a release that fails is a finding too
                result.journal["release_error"] = f"{type(exc).__name__}: {exc}"
    if pat.api != "capture" and arm.replay and arm.recorder is None and result.error is None:
        raise ValueError(
            f"step pattern {pat.name!r} built no TrainStep: build it with arm.train_step"
        )
    return result


def _journal(rec: Any) -> dict[str, Any]:
    return {
        **rec.counts,
        "eager_reasons": dict(rec.eager_reasons),
        "retired": bool(rec.retired),
        "retire_reason": rec.retire_reason,
    }


def run_pattern(
    pattern: Pattern, backend: str, unsafe: bool = False, timeout: float | None = None
) -> Outcome:
    """Classify ``pattern`` on ``backend``; ``unsafe`` switches its guard off in the replay arm.

    ``timeout`` (default: the pattern's ``timeout_s``, else :data:`TIMEOUT_S`) bounds both
    arms together; past it the outcome is ``hang``. A ``may_hang`` pattern (and a ``may_fault``
    one's unsafe CUDA arm) runs in a child process (:func:`.deadline.run_child`), which is
    killed at the deadline.
    """
    seconds = timeout or pattern.timeout_s or TIMEOUT_S
    if unsafe and pattern.guard is None:
        raise ValueError(f"pattern {pattern.name!r} names no guard to switch off")
    if runs_in_child(pattern, backend, unsafe):
        return _run_in_child(pattern, backend, unsafe, seconds)
    return _run_here(pattern, backend, unsafe, seconds)


def runs_in_child(pattern: Pattern, backend: str, unsafe: bool) -> bool:
    """Whether this run needs a process of its own: a native hang no deadline here could stop,
    or a fault that would poison this process's CUDA context for every later pattern."""
    return pattern.may_hang or (unsafe and backend == "cuda" and pattern.may_fault)


def _outcome(
    pattern: Pattern, backend: str, unsafe: bool, kind: str, detail: str, start: float, **kw: Any
) -> Outcome:
    return Outcome(
        pattern.name,
        pattern.hazard,
        backend,
        kind,
        detail,
        unsafe,
        pattern.guard,
        seconds=round(time.perf_counter() - start, 3),
        kernel_dependent=pattern.kernel_dependent,
        api=pattern.api,
        **kw,
    )


def _run_here(pattern: Pattern, backend: str, unsafe: bool, seconds: float) -> Outcome:
    device = _device_of(backend)
    if device == "cuda":
        from replaykit.verify.determinism import (
            enable_determinism,  # the core's, as the parity suite uses
        )

        enable_determinism()
    start = time.perf_counter()
    disable = negative_control(*pattern.guard.split("+")) if unsafe and pattern.guard else ()
    arm = "eager"
    try:
        with deadline.alarm(seconds), _torch_settings_kept():
            eager = _run_arm(pattern, device, backend, (), arm)
            arm = "unsafe" if unsafe else "replay"
            replay = _run_arm(pattern, device, backend, disable, arm)
    except deadline.Timeout:
        return _outcome(
            pattern, backend, unsafe, HANG, f"the {arm} arm ran past {seconds:g} s", start
        )
    kind, detail, diffs = classify(eager, replay)
    return _outcome(
        pattern, backend, unsafe, kind, detail, start, journal=replay.journal, diffs=diffs
    )


@contextlib.contextmanager
def _torch_settings_kept() -> Iterator[None]:
    """Put back the process-wide torch settings a run changed: the next pattern (here, or in the
    shared child of ``may_hang`` runs) starts from the same ones whatever ran before it."""
    saved = (
        torch.get_default_dtype(),
        torch.is_grad_enabled(),
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.is_anomaly_enabled(),
        torch.is_anomaly_check_nan_enabled(),
        torch.get_float32_matmul_precision(),
    )
    try:
        yield
    finally:
        dtype, grad, algorithms, warn_only, anomaly, check_nan, precision = saved
        torch.set_default_dtype(dtype)
        torch.set_grad_enabled(grad)
        torch.use_deterministic_algorithms(algorithms, warn_only=warn_only)
        torch.autograd.set_detect_anomaly(anomaly, check_nan=check_nan)
        torch.set_float32_matmul_precision(precision)


#: A CPU backend's child: one interpreter serves every ``may_hang`` run (:class:`.deadline.Worker`).
_SERVE = "import sys; from replaykit.testing.hazards.runner import serve_children; sys.exit(serve_children())"


def _run_in_child(pattern: Pattern, backend: str, unsafe: bool, seconds: float) -> Outcome:
    """The pattern in a child interpreter (found there by its module and name), killed at the
    deadline: a fresh one per CUDA run, the shared worker on the CPU backends."""
    start = time.perf_counter()
    args = [pattern.make.__module__, pattern.name, backend, str(int(unsafe)), repr(seconds)]
    if backend == "cuda":
        code = "import sys; from replaykit.testing.hazards.runner import child_main; sys.exit(child_main(sys.argv[1:]))"
        child = deadline.run_child([sys.executable, "-c", code, *args], seconds)
    else:
        child = deadline.shared_worker([sys.executable, "-c", _SERVE]).request(args, seconds)
    if child.status == "timeout":
        return _outcome(
            pattern,
            backend,
            unsafe,
            HANG,
            f"no end after {seconds:g} s (its process was killed)",
            start,
        )
    answer = child.stdout.strip().splitlines()[-1:] if child.status == "done" else []
    if not answer:
        last = (child.stderr.strip().splitlines() or ["no output"])[-1]
        return _outcome(
            pattern,
            backend,
            unsafe,
            CRASHED,
            f"its process exited {child.returncode}: {last}"[:200],
            start,
        )
    return Outcome(**{**json.loads(answer[0]), "seconds": round(time.perf_counter() - start, 3)})


def find_pattern(module: str, name: str) -> Pattern:
    """The pattern ``name``: in the catalogue, its known limits, or ``module`` (a module-level
    ``Pattern`` or list of them) - how a child process finds a ``may_hang`` pattern."""
    found = [*PATTERNS, *KNOWN_LIMITS]
    for value in vars(importlib.import_module(module)).values():
        if isinstance(value, Pattern):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found += [v for v in value if isinstance(v, Pattern)]
    for p in found:
        if p.name == name:
            return p
    raise KeyError(f"no hazard pattern {name!r} in the catalogue or in {module}")


def child_main(argv: Sequence[str]) -> int:
    """A child process's run: ``module name backend unsafe seconds``; prints the outcome as JSON."""
    warnings.simplefilter("ignore", rk.ReplayWarning)
    pattern = find_pattern(*argv[:2])
    print(deadline.READY, flush=True)
    print("\n" + _child_run(pattern, argv), flush=True)  # its own line: the run's may be unended
    return 0


def serve_children() -> int:
    """A worker child's loop (:func:`.deadline.serve`): each request is a ``child_main`` run."""
    warnings.simplefilter("ignore", rk.ReplayWarning)
    return deadline.serve(lambda argv: _child_run(find_pattern(*argv[:2]), argv))


def _child_run(pattern: Pattern, argv: Sequence[str]) -> str:
    _, _, backend, unsafe, seconds = argv
    outcome = _run_here(pattern, backend, unsafe == "1", float(seconds))
    return json.dumps(asdict(outcome), default=str)


def run_all(
    backends: Sequence[str] | str,
    patterns: Iterable[Pattern] | None = None,
    unsafe: bool = False,
    timeout: float | None = None,
) -> list[Outcome]:
    """Every pattern (default: the whole catalogue) on every backend.

    Unsafe runs take the guarded patterns whose divergence this backend shows (see
    ``Pattern.cuda_only``/``cpu_only``/``unsafe_never``).
    """
    if isinstance(backends, str):
        backends = [backends]
    chosen = list(PATTERNS if patterns is None else patterns)
    return [
        run_pattern(p, b, unsafe=unsafe, timeout=timeout)
        for b in backends
        for p in chosen
        if not unsafe or shows_unsafe(p, b)
    ]


def shows_unsafe(pattern: Pattern, backend: str) -> bool:
    """Whether ``pattern``'s unsafe arm is expected to diverge on ``backend``."""
    if pattern.guard is None or pattern.unsafe_never:
        return False
    return not (pattern.cuda_only and backend != "cuda") and not (
        pattern.cpu_only and backend == "cuda"
    )


# --------------------------------------------------------------------------- table and CLI


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m replaykit.testing.hazards", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--backend",
        action="append",
        choices=["emulated", "cuda"],
        help="repeatable; default emulated",
    )
    parser.add_argument(
        "--hazard", action="append", choices=HAZARDS, help="only these hazard classes"
    )
    parser.add_argument("--pattern", action="append", help="only these patterns, by name")
    parser.add_argument(
        "--api", action="append", choices=APIS, help="only the patterns of these entry points"
    )
    parser.add_argument(
        "--timeout",
        type=float,
        help=f"seconds per pattern run (default: the pattern's, else {TIMEOUT_S:g})",
    )
    parser.add_argument(
        "--unsafe", action="store_true", help="switch each guard off: every arm must diverge"
    )
    parser.add_argument(
        "--plain", action="store_true", help="a plain text table instead of markdown"
    )
    parser.add_argument("--json", metavar="PATH", help="write the outcomes as JSON")
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore", rk.ReplayWarning)
    chosen = [
        p
        for p in PATTERNS
        if (not args.hazard or p.hazard in args.hazard)
        and (not args.pattern or p.name in args.pattern)
        and (not args.api or p.api in args.api)
    ]
    outcomes = run_all(
        args.backend or ["emulated"], chosen, unsafe=args.unsafe, timeout=args.timeout
    )
    print(table(outcomes, markdown=not args.plain))
    print(summary(outcomes)["line"])
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(
                [{**asdict(o), "failed": o.failed} for o in outcomes], fh, indent=1, default=str
            )
    return 1 if any(o.failed for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
