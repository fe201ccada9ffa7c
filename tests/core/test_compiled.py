"""torch.compile'd models under replay: exact against the compiled twin, or eager with the reason.

On the CPU the emulated tape cannot see inductor's C++ kernels: a recording over them is refused
(protection ``compiled_code``), and the unsafe arm shows the silent difference it prevents. A
dispatcher-visible backend (``backend="eager"``) shows the rest of the machinery on the CPU: a
compilation that starts inside a recording aborts it, the call runs eagerly (``compiling``) and
the next one records. On CUDA (``-m cuda``) inductor's kernels replay.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch
import torch._dynamo

import replaykit as rk
from replaykit.errors import ReplayError
from replaykit.guards.compiled import CompileWatch
from replaykit.protections import negative_control
from replaykit.testing.parity.compiled_trial import MLP, CompiledConfig, model_loss, trial

#: torch 2.4's dynamo compiles again at every recording attempt and cannot report a compiled frame
#: run: there compiled code never records on the emulated backend (it runs eagerly, with a reason)
DYNAMO_24 = not hasattr(torch._dynamo.eval_frame, "set_guard_complete_hook")
records_compiled_code = pytest.mark.skipif(
    DYNAMO_24, reason="torch 2.4: compiled code never records on the emulated backend"
)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles anew: dynamo's per-code recompile limit is not shared between tests."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.slow
@pytest.mark.parametrize("entry", ["step", "capture"])
def test_inductor_model_replays_on_cuda_or_runs_eagerly_on_the_cpu(backend, device, entry):
    cfg = CompiledConfig(entry=entry, accumulate=2, device=device, backend=backend)
    cfg.repeat = entry == "step" or backend == "cuda"  # the twin's repeatability: once on the CPU
    result = trial(cfg)
    assert (
        result.repeatable is not False
    )  # the compiled twin repeats itself: a difference is replay's
    assert result.equal, result.diffs[:3]
    if backend == "emulated" or entry == "capture":  # capture: see the donated-buffers test
        assert result.entry.retired and "torch.compile'd" in result.entry.retire_reason
    else:
        assert result.counts["replay"] > 0, result.summary


@records_compiled_code
def test_without_the_refusal_the_tape_replays_stale_inductor_buffers():
    # steps=5: under the tape dynamo recompiles once (its function-mode guard), which aborts a recording
    cfg = CompiledConfig(
        entry="step", steps=5, repeat=False, unsafe=negative_control("compiled_code")
    )
    result = trial(cfg)
    assert result.counts["replay"] > 0, result.summary
    assert not result.equal  # silent: nothing retired, nothing warned


def test_a_captured_compiled_module_whose_backward_donates_buffers_retires_saying_so():
    """rk.capture runs a recording's backward again (its exact and verified backwards), and
    inductor's compiled backward donates its buffers: on the H200 that raised in the training loop.
    The recorder retires before recording, naming the way that works (rk.TrainStep)."""
    cfg = CompiledConfig(entry="capture", steps=5, repeat=False, unsafe=("compiled_code",))
    result = trial(cfg)
    assert result.equal, result.diffs[:3]
    assert result.entry.retired and "donates" in result.entry.retire_reason, result.summary


@records_compiled_code
@pytest.mark.parametrize("entry", ["step", "capture"])
def test_a_compilation_inside_a_recording_aborts_it_and_the_next_call_records(entry):
    # backend="eager" runs dynamo's graph through the dispatcher: the tape can replay it
    # a TrainStep's verification runs the twin's body before it captures, which compiles there:
    # without it the compilation meets the capture, the path under test
    unsafe = ("compiled_code",) if entry == "capture" else ("compiled_code", "verify_recording")
    cfg = CompiledConfig(
        entry=entry, accumulate=2, steps=4, compile={"backend": "eager"}, unsafe=unsafe
    )
    result = trial(cfg)
    assert result.equal, result.diffs[:3]
    assert result.entry.eager_reasons["compiling"] >= 1, result.summary
    assert result.counts["record"] >= 1 and result.counts["replay"] >= 1, result.summary


@records_compiled_code
def test_recording_leaves_the_model_compiled():
    """Dynamo skips frames under a dispatch mode and marks their code skipped for good; the
    tape's mode says it ignores compile internals, so the model stays compiled."""
    torch.manual_seed(0)
    model = MLP(1, 8)
    compiled = torch.compile(model, backend="eager")  # dispatcher-visible: the tape may record it
    x, y = torch.randn(4, 8), torch.randint(0, 10, (4,))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = rk.TrainStep(compiled, model_loss, opt, unsafe_disable=("compiled_code",))
    for _ in range(4):
        step(x, y)
    assert step.counts["record"] >= 1, step.summary()  # the tape ran the compiled frames
    with CompileWatch(True) as watch, torch.no_grad():
        compiled(x)
    assert watch.frames >= 1, "the model no longer runs compiled code after a recording"


@pytest.mark.parametrize("options", [{"mode": "reduce-overhead"}, {"backend": "cudagraphs"}])
def test_compiled_with_its_own_cuda_graphs_is_refused(options):
    model = MLP(1, 8)
    compiled = torch.compile(model, **options)
    with pytest.raises(ReplayError, match="CUDA graphs of its own"):
        rk.TrainStep(compiled, model_loss, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ReplayError, match="CUDA graphs of its own"):
        rk.capture(compiled)


def test_enable_determinism_makes_inductor_deterministic():
    import torch._inductor.config as inductor

    names = ("fallback_random", "max_autotune", "deterministic")  # deterministic: torch 2.5+
    saved = {n: getattr(inductor, n) for n in names if hasattr(inductor, n)}
    try:
        for n in saved:
            setattr(inductor, n, n == "max_autotune")
        rk.enable_determinism()
        assert inductor.fallback_random and not inductor.max_autotune
        assert "deterministic" not in saved or inductor.deterministic
    finally:
        for n, v in saved.items():
            setattr(inductor, n, v)


def _gelu_times_1_5(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.gelu(x) * 1.5


@functools.cache
def _scaled_gelu() -> Callable[[torch.Tensor], torch.Tensor]:
    """One compiled function for the module's tests, compiled at first use: ``torch.compile`` at
    import loads inductor (2 s) in every worker that merely collects this file."""
    return torch.compile(_gelu_times_1_5)


class _CallsCompiled(torch.nn.Module):
    """A plain module whose forward calls a compiled function: no compiled module in the tree."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(_scaled_gelu()(self.a(x)))


@pytest.mark.parametrize("unsafe", [(), negative_control("compiled_code")])
def test_a_compiled_function_inside_the_forward_is_seen_by_its_frames(unsafe):
    def run(replay: bool) -> tuple[list[torch.Tensor], rk.TrainStep]:
        if DYNAMO_24:  # each arm compiles afresh; its recompiles diverge within 24 steps there
            torch._dynamo.reset()
        torch.manual_seed(0)
        model = _CallsCompiled()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        step = rk.TrainStep(model, model_loss, opt, replay=replay, unsafe_disable=unsafe)
        g = torch.Generator().manual_seed(1)
        for _ in range(24 if DYNAMO_24 else 6):
            step(torch.randn(4, 8, generator=g), torch.randint(0, 10, (4,), generator=g))
        return [p.detach().clone() for p in model.parameters()], step

    twin, _ = run(False)
    replayed, step = run(True)
    equal = all(map(torch.equal, twin, replayed))
    if unsafe:
        # silent without the refusal (on torch 2.4 every call ran eagerly, compiling, and still differs)
        assert (DYNAMO_24 or step.counts["replay"] > 0) and not equal, step.summary()
    else:
        assert equal and step.retired and "torch.compile'd" in step.retire_reason, step.summary()
