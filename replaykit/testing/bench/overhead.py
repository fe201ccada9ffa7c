"""replaykit's own host time per replayed call, measured with a backend that does no work.

    python -m replaykit.testing.bench.overhead [--blocks 100] [--calls 2000] [--rounds 7] [--zero-in-place]

A replayed call costs the graph launches plus replaykit's Python: routing, guards,
copy-out checks, the hold, the journal. The launches are the backend's; this measures
the rest. The ``null`` backend's recordings replay nothing and hand back fixed buffers,
and the same forward+backward is timed through a bare ``autograd.Function`` shaped like
``make_graphed_callables``' (inputs and parameters in, fixed outputs out, fixed
gradients back). The difference, per call, is what replaykit adds. replaykit enters
autograd through ``Function``'s C entry point, skipping ``Function.apply``'s Python pass
over every argument, which the bare arm (like ``make_graphed_callables``) pays; the
same bare Function entered the same way gives ``added vs C entry``, replaykit's own
Python alone. Arms run interleaved, round by round, in one process; the median round counts.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence

import torch
from torch import nn

from ...backends.base import (
    Backend,
    Recording,
    Region,
    Subject,
    differentiable_indices,
    flatten_outputs,
    grad_targets,
)
from ...protections import PROTECTIONS
from ...recorder import Recorder

GUARDS = (
    "module_state",
    "param_identity",
    "argument_values",
    "input_aliasing",
    "input_layout",
    "inplace_weights",
)


class NullRecording(Recording):
    """Replays nothing: fixed outputs, fixed gradients (what a graph would leave in static memory)."""

    def __init__(self, subject: Subject) -> None:
        self.static_inputs, self.params = subject.static_inputs, subject.params
        outs, self.out_spec = flatten_outputs(subject.fn(*self.static_inputs))
        self.differentiable = differentiable_indices(outs)
        self.static_outputs = [o.detach().clone() for o in outs]
        self.static_grads = [
            torch.zeros_like(t) for t in grad_targets(self.static_inputs, self.params)
        ]

    def replay_forward(self) -> None:
        self.generation += 1

    def backward(
        self, grads: Sequence[torch.Tensor | None]
    ) -> tuple[list[torch.Tensor | None], str | None]:
        # getattr: scripts/overhead_vs.py --zero-in-place runs this module against older trees too
        handed = getattr(self, "handed_grads", None) or self.static_grads
        return [g.detach() for g in handed], None

    def exact_backward(self, grads: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
        return list(self.static_grads)

    def free(self) -> None:
        self.static_outputs, self.static_grads, self.static_inputs = [], [], []


class NullBackend(Backend):
    name = "null"

    def record(self, subject: Subject) -> Recording:
        return NullRecording(subject)

    def region(self, fixed: Sequence[torch.Tensor]) -> Region:
        raise NotImplementedError("the no-op backend measures network replay's host time only")


def network(blocks: int = 100) -> nn.Module:
    """``blocks`` × (Linear, LayerNorm, ReLU): 3·blocks + 1 modules, 4·blocks parameters."""
    layers: list[nn.Module] = []
    for _ in range(blocks):
        layers += [nn.Linear(8, 8), nn.LayerNorm(8), nn.ReLU()]
    return nn.Sequential(*layers)


class _Bare(torch.autograd.Function):
    """The same call shape without replaykit: make_graphed_callables' own Function does this much."""

    @staticmethod
    def forward(
        ctx,
        outputs: torch.Tensor,
        grads: list[torch.Tensor],
        x: torch.Tensor,
        *params: torch.Tensor,
    ) -> torch.Tensor:
        ctx.grads = grads
        return outputs.detach()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return (None, None, None, *[g.detach() for g in ctx.grads])


def _timer(step: Callable[[], None], calls: int) -> float:
    t = time.perf_counter()
    for _ in range(calls):
        step()
    return (time.perf_counter() - t) / calls


def _zero_grads(params: list[torch.Tensor], in_place: bool) -> None:
    """``zero_grad``: ``.grad`` None (nothing left to copy out), or zeroed in place (the next
    backward accumulates into it)."""
    if in_place:
        torch._foreach_zero_([p.grad for p in params if p.grad is not None])
    else:
        for p in params:
            p.grad = None


def measure(
    blocks: int = 100, calls: int = 2000, rounds: int = 7, in_place: bool = False
) -> dict[str, float]:
    """Median µs per forward+backward: bare Function (through apply, and through its C entry), replaykit,
    replaykit with its guards off; between calls ``zero_grad(set_to_none=not in_place)``."""
    torch.set_num_threads(1)
    x = torch.randn(4, 8)
    arms: dict[str, Callable[[], None]] = {}
    models = []
    # the null backend's fixed buffers differ from eager by design: its recordings are not verified
    # (a verification runs once per recording, never on the per-call path measured here)
    recorders = []
    for name, disabled in (
        ("replaykit", frozenset({"verify_recording"})),
        ("replaykit, guards off", frozenset({*GUARDS, "verify_recording"})),
    ):
        model = network(blocks)
        recorders.append(Recorder(model, NullBackend(), 1, 8, False, disabled))
        params = list(model.parameters())

        def step(model: nn.Module = model, params: list = params) -> None:
            model(x).sum().backward()
            _zero_grads(params, in_place)

        step()
        arms[name] = step
        models.append(model)
    bare_params = list(network(blocks).parameters())
    bare_out = torch.zeros(4, 8)
    bare_grads = [torch.zeros_like(p) for p in bare_params]

    def bare() -> None:
        _Bare.apply(bare_out, bare_grads, x, *bare_params).sum().backward()
        _zero_grads(bare_params, in_place)

    bare_c = super(torch.autograd.Function, _Bare).apply  # what Function.apply calls after its pass

    def bare_entry() -> None:
        bare_c(bare_out, bare_grads, x, *bare_params).sum().backward()
        _zero_grads(bare_params, in_place)

    arms = {"bare Function": bare, "bare Function, C entry": bare_entry, **arms}
    samples: dict[str, list[float]] = {k: [] for k in arms}
    for _ in range(rounds):
        for name, step in arms.items():
            samples[name].append(_timer(step, calls) * 1e6)
    for rec in recorders:  # a timing of eager calls would say nothing about replaykit's overhead
        if rec.counts["replay"] < rounds * calls or rec.eager_reasons:
            raise RuntimeError(f"the measured arm did not replay every call: {rec.summary()}")
    med = {k: statistics.median(v) for k, v in samples.items()}
    n_modules = len(list(models[0].modules()))
    return {
        "modules": float(n_modules),
        "parameters": float(len(list(models[0].parameters()))),
        **{f"{k} us": v for k, v in med.items()},
        "added us": med["replaykit"] - med["bare Function"],
        "added vs C entry us": med["replaykit"] - med["bare Function, C entry"],
        "guards us": med["replaykit"] - med["replaykit, guards off"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=100)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument(
        "--zero-in-place",
        action="store_true",
        help="zero_grad(set_to_none=False) between calls: backwards accumulate into .grad",
    )
    args = parser.parse_args(argv)
    result = measure(args.blocks, args.calls, args.rounds, args.zero_in_place)
    for key, value in result.items():
        print(f"{key:>28}: {value:.1f}")
    assert set(GUARDS) <= set(PROTECTIONS)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
