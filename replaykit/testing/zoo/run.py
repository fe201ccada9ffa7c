"""The zoo's parity runner: each model × precision × accumulation × API trained eagerly and under replay.

``api="capture"``: the same plain PyTorch loop as :mod:`replaykit.testing.parity.trial` (seed,
batches, SGD with momentum, gradient accumulation; autocast for ``16-mixed``/``bf16-mixed``,
with a GradScaler for fp16), run three times from identical state: eager, eager again
(parity presupposes that eager repeats itself), and with ``rk.capture(module)``. The end
states (parameters, buffers, optimizer state, every optimizer step's gradients with their
None pattern, losses, GradScaler scale) are compared with :func:`replaykit.verify.bitwise.diff_states`.
``api="step"``: the same training as one ``rk.TrainStep`` (its eager twin, ``replay=False``,
twice, then replayed), compared the same way (its gradients are None after every step).

A row's verdict:

- ``bitwise``: replayed and bitwise equal to eager;
- ``eager: <reason>`` / ``retired: <reason>``: replaykit ran the model eagerly and said why
  (bitwise equal too: checked; not replayed, so never a pass by routing: ``replayed`` is False);
- ``error: ReplayError: ...``: replaykit refused loudly;
- ``DIFFERS: ...``: a silent difference, a bug (the notebook fails on it);
- ``eager not repeatable: ...``: two eager runs differ, so parity means nothing here;
- ``skipped: ...`` / ``not run on cpu: ...``: a missing package, or fp16 the CPU cannot run.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from replaykit.capturing import capture
from replaykit.errors import ReplayError, ReplayWarning
from replaykit.step import TrainStep
from replaykit.verify.bitwise import TensorDiff, diff_states

from ..parity.scenario import PRECISIONS, journal_counts, median_steady
from ..parity.trial import flat_state, grads, scaled_step
from ..progress import run_each
from . import MODELS, build, names, unavailable
from .hf import unpadded
from .workload import invoke

State = dict[str, "torch.Tensor | None"]
AUTOCAST = {"32": None, "16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}
#: ``capture``: network replay in a plain loop; ``step``: the whole step (``rk.TrainStep``)
APIS = ("capture", "step")
PADDINGS = ("padded", "unpadded", "mixed")


@dataclass(frozen=True)
class ZooCase:
    """One row: a zoo model trained ``steps`` optimizer steps of ``accumulation`` micro-batches of ``batch``."""

    model: str
    precision: str = "32"
    accumulation: int = 1
    steps: int = 3
    batch: int = 2
    seed: int = 0
    device: str = "cpu"
    backend: str = "auto"
    check_every: int = 0
    api: str = "capture"
    #: a language model's batches: ``padded`` (the last row), ``unpadded``, or ``mixed`` (alternating)
    padding: str = "padded"

    @property
    def name(self) -> str:
        step = "/step" if self.api == "step" else ""
        pad = "" if self.padding == "padded" else f"/{self.padding}"
        return f"{self.model}/{self.precision}/acc{self.accumulation}{step}{pad}"


@dataclass
class ZooArm:
    """What one training run ended with."""

    state: State
    recorder: dict[str, Any] | None = None
    journal: str = ""
    step_ms: list[float] = field(default_factory=list)
    error: str | None = None


@dataclass
class ZooResult:
    """The three runs of one case and the replay arm's differences from eager."""

    case: ZooCase
    arms: dict[str, ZooArm]
    diffs: list[TensorDiff]
    eager_diffs: list[TensorDiff]
    skipped: str | None = None

    @property
    def verdict(self) -> str:
        return verdict(self)

    @property
    def silent(self) -> bool:
        """A silent difference: replay ended elsewhere than eager and nothing said so."""
        return self.verdict.startswith("DIFFERS")

    @property
    def failed(self) -> bool:
        return self.silent or self.verdict.startswith("ERROR")


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _refusals(rec) -> list[str]:
    return [f"{e.reason}: {e.detail}" for e in rec.journal if e.kind == "refuse"]


def train(case: ZooCase, capture_kwargs: dict[str, Any] | None = None) -> ZooArm:
    """Train ``case`` from its seed: eagerly when ``capture_kwargs`` is None, else under replay
    (``rk.capture``, or ``rk.TrainStep`` for ``api="step"``)."""
    if case.precision not in AUTOCAST:
        raise ValueError(f"unknown precision {case.precision!r}; choose from {PRECISIONS}")
    if case.api not in APIS:
        raise ValueError(f"unknown api {case.api!r}; choose from {APIS}")
    if case.api == "step":
        return _train_step(case, capture_kwargs)
    module, loss_fn, opt, batches, scaler = _setup(case)
    device_type = torch.device(case.device).type
    dtype = AUTOCAST[case.precision]
    rec = capture(module, **capture_kwargs) if capture_kwargs is not None else None
    torch.manual_seed(case.seed + 1)  # dropout and stochastic depth draw alike in every arm
    state: State = {}
    losses: list[torch.Tensor] = []
    step_ms: list[float] = []
    error = None
    step = 0
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ReplayWarning)
            for i, (args, targets) in enumerate(batches):
                _sync(case.device)
                t0 = time.perf_counter()
                with (
                    torch.autocast(device_type, dtype=dtype) if dtype is not None else nullcontext()
                ):
                    loss = loss_fn(invoke(module, args), targets)
                scaled = loss / case.accumulation
                (scaler.scale(scaled) if scaler is not None else scaled).backward()
                if (i + 1) % case.accumulation == 0:
                    if scaler is not None:
                        scaler.unscale_(opt)
                    state.update(grads(module, f"grad/step{step}"))
                    scaled_step(opt, scaler)
                    step += 1
                _sync(case.device)
                step_ms.append((time.perf_counter() - t0) * 1e3)
                losses.append(loss.detach().float().cpu())
    except Exception as exc:  # an arm that raises is a row with its error, not a crashed matrix
        error = f"{type(exc).__name__}: {exc}"
    arm = _finish(module, opt, state, losses, scaler, step_ms, error, rec)
    if rec is not None:
        rec.release()
    return arm


def _train_step(case: ZooCase, replay_kwargs: dict[str, Any] | None) -> ZooArm:
    """:func:`train` through one ``rk.TrainStep``: its eager twin when ``replay_kwargs`` is None."""
    module, loss_fn, opt, batches, scaler = _setup(case)
    kwargs = dict(replay_kwargs or {})
    step = TrainStep(
        module,
        lambda m, args, targets: loss_fn(invoke(m, args), targets),
        opt,
        scaler=scaler,
        accumulate=case.accumulation,
        precision=case.precision,
        replay=replay_kwargs is not None,
        **kwargs,
    )
    torch.manual_seed(case.seed + 1)
    losses: list[torch.Tensor] = []
    step_ms: list[float] = []
    error = None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ReplayWarning)
            for args, targets in batches:
                _sync(case.device)
                t0 = time.perf_counter()
                loss = step(args, targets)
                _sync(case.device)
                step_ms.append((time.perf_counter() - t0) * 1e3)
                losses.append(loss.detach().float().cpu())
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    arm = _finish(module, opt, {}, losses, scaler, step_ms, error, step if step.replay else None)
    step.release()
    return arm


def _setup(case: ZooCase) -> tuple[nn.Module, Callable, torch.optim.Optimizer, list, Any]:
    """What every arm of a case trains: the model, its loss, SGD, the batches, a GradScaler for fp16."""
    device_type = torch.device(case.device).type
    if device_type == "cuda":
        from replaykit.verify.determinism import enable_determinism

        enable_determinism()  # parity presupposes that eager repeats itself
    torch.manual_seed(case.seed)
    module, make_batch, loss_fn = build(case.model)
    module = module.to(case.device).train()
    opt = torch.optim.SGD(module.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)
    g = torch.Generator().manual_seed(1000 + case.seed)
    batches = [
        _padding(make_batch(case.batch, case.device, g), case.padding, i)
        for i in range(case.steps * case.accumulation)
    ]
    scaler = torch.amp.GradScaler(device_type) if case.precision == "16-mixed" else None
    return module, loss_fn, opt, batches, scaler


def _padding(batch: Any, padding: str, i: int) -> Any:
    """A language model's batch with its padding as asked (other models' batches as they are)."""
    args, targets = batch
    unpad = padding == "unpadded" or (padding == "mixed" and i % 2 == 1)
    if not unpad or not isinstance(args, dict) or "attention_mask" not in args:
        return batch
    return unpadded(args), targets


def _finish(
    module: nn.Module,
    opt: torch.optim.Optimizer,
    state: State,
    losses: list[torch.Tensor],
    scaler: Any,
    step_ms: list[float],
    error: str | None,
    entry: Any,
) -> ZooArm:
    """The arm's end state on the CPU (per-step gradients in ``state``, then the model and optimizer,
    the losses, the scaler's scale) and, for a replaying ``entry``, its journal."""
    state = {**state, **flat_state(module, opt)}
    state = {k: None if v is None else v.cpu() for k, v in state.items()}
    state["losses"] = torch.stack(losses) if losses else torch.zeros(0)
    if scaler is not None:
        state["scaler/scale"] = torch.tensor(scaler.get_scale(), dtype=torch.float64)
    arm = ZooArm(state, step_ms=step_ms, error=error)
    if entry is not None:
        arm.recorder = {
            **entry.journal.summary(),
            "retired": entry.retire_reason,
            "refusals": _refusals(entry),
        }
        arm.journal = entry.journal.format()
    return arm


def run_case(case: ZooCase, unsafe: tuple[str, ...] = ()) -> ZooResult:
    """Eager twice and replay once (``unsafe``: protections switched off, a negative control)."""
    why = unavailable(case.model)
    if why:
        return ZooResult(case, {}, [], [], skipped=why)
    eager = train(case)
    again = train(case)
    kwargs: dict[str, Any] = {"backend": case.backend, "check_every": case.check_every}
    if unsafe:
        kwargs["unsafe_disable"] = tuple(unsafe)
    replay = train(case, kwargs)
    arms = {"eager": eager, "eager_again": again, "replay": replay}
    return ZooResult(
        case, arms, diff_states(eager.state, replay.state), diff_states(eager.state, again.state)
    )


def verdict(r: ZooResult) -> str:
    """See the module docstring."""
    if r.skipped:
        return f"skipped: {r.skipped}"
    eager, replay = r.arms["eager"], r.arms["replay"]
    if eager.error:
        if r.case.precision == "16-mixed" and torch.device(r.case.device).type == "cpu":
            return f"not run on cpu: fp16 autocast: {eager.error}"
        return f"ERROR: eager raised {eager.error}"
    if r.eager_diffs:
        return f"eager not repeatable: {len(r.eager_diffs)} tensors differ between two eager runs ({r.eager_diffs[0].name})"
    if replay.error:
        if replay.error.startswith(ReplayError.__name__):
            return f"error: {replay.error}"
        return f"ERROR: replay raised {replay.error}"
    if r.diffs:
        return f"DIFFERS: {len(r.diffs)} tensors ({r.diffs[0].name})"
    rec = replay.recorder or {}
    if rec.get("retired"):
        return f"retired: {rec['retired']}"
    if not rec.get("replay"):
        reasons = rec.get("refusals") or [
            f"{k} x{v}" for k, v in rec.get("eager_reasons", {}).items()
        ]
        return "eager: " + "; ".join(reasons)
    return "bitwise"


def cases(
    models: Iterable[str],
    precisions: Iterable[str] = ("32",),
    accumulations: Iterable[int] = (1, 2),
    apis: Iterable[str] = ("capture",),
    paddings: Iterable[str] = ("padded",),
    **common: Any,
) -> list[ZooCase]:
    """model × precision × accumulation × API × padding (``models`` may say ``"all"`` or a
    group; a padding other than ``padded`` only for the models whose batches have a mask)."""
    return [
        ZooCase(m, p, a, api=api, padding=pad, **common)
        for m in names(models)
        for p in precisions
        for a in accumulations
        for api in apis
        for pad in paddings
        if pad == "padded" or m.startswith("hf_")
    ]


def run_matrix(zoo_cases: Iterable[ZooCase], progress: bool = True) -> Iterator[ZooResult]:
    """Run the cases one by one, yielding each result (a tqdm bar when ``progress``)."""
    yield from run_each(
        list(zoo_cases), run_case, "zoo", progress, lambda c, r: f"{c.name}: {r.verdict[:40]}"
    )


def rows(results: Iterable[ZooResult]) -> list[dict[str, Any]]:
    """One row per case: the verdict, bitwise yes/no, the journal (replays, eager routes, retirement), step times."""
    out = []
    for r in results:
        c = r.case
        replay = r.arms.get("replay")
        rec = (replay.recorder if replay else None) or {}
        eager_ms = median_steady(r.arms["eager"].step_ms) if "eager" in r.arms else float("nan")
        replay_ms = median_steady(replay.step_ms) if replay else float("nan")
        out.append(
            {
                "model": c.model if c.padding == "padded" else f"{c.model} ({c.padding})",
                "source": MODELS[c.model].source,
                "precision": c.precision,
                "accumulation": c.accumulation,
                "api": c.api,
                "verdict": r.verdict,
                "replayed": r.verdict == "bitwise",
                "bitwise": bool(r.arms)
                and not r.diffs
                and not r.eager_diffs
                and not any(a.error for a in r.arms.values()),
                "records": rec.get("record", 0),
                **journal_counts(rec),
                "tensors_differing": len(r.diffs),
                "max_ulp": max((d.max_ulp for d in r.diffs), default=0),
                "eager_step_ms": eager_ms,
                "replay_step_ms": replay_ms,
                "replay_vs_eager": replay_ms / eager_ms
                if eager_ms and eager_ms == eager_ms
                else float("nan"),
                "case": asdict(c),
            }
        )
    return out


COLUMNS = (
    "model",
    "api",
    "precision",
    "accumulation",
    "verdict",
    "replays",
    "eager",
    "eager_reasons",
    "retired",
    "eager_step_ms",
    "replay_step_ms",
    "replay_vs_eager",
)


def summary(results: Iterable[ZooResult]) -> dict[str, Any]:
    """Counts by verdict kind, the silent differences by name, how many rows replayed, one line for a
    log. A row that ran eagerly (routed or retired) is equal to eager but not replayed."""
    results = list(results)
    kinds: dict[str, int] = {}
    for r in results:
        kind = r.verdict.split(":", 1)[0]
        kinds[kind] = kinds.get(kind, 0) + 1
    silent = [r.case.name for r in results if r.silent]
    failed = [r.case.name for r in results if r.failed]
    tally = ", ".join(f"{n} {k}" for k, n in sorted(kinds.items()))
    replayed = sum(r.verdict == "bitwise" for r in results)
    return {
        "line": f"zoo: {len(results)} rows: {tally}; replayed {replayed} of {len(results)}; "
        f"silent differences: {len(silent)}",
        "rows": len(results),
        "replayed": replayed,
        "verdicts": kinds,
        "silent": silent,
        "failed": failed,
    }


def build_parser():
    import argparse

    p = argparse.ArgumentParser(
        prog="python -m replaykit.testing.zoo.run",
        description="Train zoo models eagerly and under replay; print each row's verdict (exit 1 on a silent difference).",
    )
    p.add_argument(
        "--models",
        nargs="+",
        default=["resnet18", "transformer_lm"],
        help="zoo models, a group (transformers, transformers_small), or all",
    )
    p.add_argument("--precisions", nargs="+", default=["32"], choices=PRECISIONS)
    p.add_argument("--accumulations", nargs="+", type=int, default=[1, 2])
    p.add_argument("--apis", nargs="+", default=["capture"], choices=APIS)
    p.add_argument("--steps", type=int, default=3, help="optimizer steps per run")
    p.add_argument("--device", default="cpu")
    p.add_argument(
        "--padding",
        nargs="+",
        default=["padded"],
        choices=PADDINGS,
        help="language models' batches: the last row padded, none, or alternating",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    from replaykit.workflow import tables

    args = build_parser().parse_args(argv)
    chosen = cases(
        args.models,
        args.precisions,
        args.accumulations,
        args.apis,
        args.padding,
        steps=args.steps,
        device=args.device,
    )
    results = list(run_matrix(chosen, progress=False))
    print(tables.text(rows(results), COLUMNS[:9]))
    line = summary(results)
    print(line["line"])
    return 1 if line["failed"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
