"""Try recording CUDA RNNs with dropout: cuDNN's dropout state put back by the call state.

Run from the repository root on a GPU machine:  python scripts/gpu/rnn_dropout_try.py
(``--device cpu``: fp32 on the CPU's emulated backend, SGD for AdamW: no cuDNN there, a sanity run.)

A 2-layer nn.LSTM / nn.GRU with dropout 0.2 in training, fp32 and bf16 autocast, trains
8 steps under rk.TrainStep (TS) and under rk.capture + a plain loop (CAP); each is compared with a
plain eager loop from the same seeds (model seed, CUDA seed: cuDNN's dropout state is seeded from
the CUDA generator at the first dropout forward, batches). One line per case:

  <net> <prec> <entry> exact=Y/N losses=k/8 rec/rep/eager/retire=a/b/c/d <reasons> PASS|FAIL

PASS: every loss and the final state torch.equal to eager, and at least one replay. With --unsafe (call_state off, the
dropout state not put back) PASS means the case DIVERGED (exact=N): the negative control. "+drop" cases add an nn.Dropout
drawing from the CUDA generator (fp32 only). Each case runs under a 60 s alarm;
the script stops starting cases after 200 s.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import time
import traceback

sys.path.insert(0, os.getcwd())

import torch
from torch import nn

import replaykit as rk

STEPS, BATCH, SEQ, FEAT, HID, CLASSES = 8, 4, 6, 8, 16, 5
CASE_S, BUDGET_S = 60, 190
UNSAFE: tuple[str, ...] = ()  # --unsafe: ("call_state",), the dropout state not put back


class Net(nn.Module):
    """``kind`` "lstm" / "gru"; "+drop": an nn.Dropout before the head too, drawing from the CUDA
    generator cuDNN's dropout state is seeded from (a seed drawn in a recording call's extra run
    and not drawn again by the real one would shift every later mask: exact=N shows it)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        cls = {"lstm": nn.LSTM, "gru": nn.GRU}[kind.split("+")[0]]
        self.rnn = cls(FEAT, HID, num_layers=2, dropout=0.2, batch_first=True)
        self.drop = nn.Dropout(0.1) if kind.endswith("+drop") else nn.Identity()
        self.head = nn.Linear(HID, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.drop(self.rnn(x)[0]))


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())


def seeded_model(kind: str, device: str) -> Net:
    torch.manual_seed(0)
    model = Net(kind).to(device)
    if device == "cuda":
        torch.cuda.manual_seed_all(7)  # cuDNN's dropout state is seeded from this at first use
    return model


def batches(device: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1234)
    return [
        (
            torch.randn(BATCH, SEQ, FEAT, generator=g).to(device),
            torch.randint(0, CLASSES, (BATCH, SEQ), generator=g).to(device),
        )
        for _ in range(STEPS)
    ]


def optimizer(model: nn.Module, device: str) -> torch.optim.Optimizer:
    if device == "cuda":  # its step counter on the device: the whole step replays it
        return torch.optim.AdamW(model.parameters(), lr=1e-2, capturable=True)
    return torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)


def autocast(device: str, prec: str) -> contextlib.AbstractContextManager:
    if prec == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device, dtype=torch.bfloat16)


def plain_step(model: nn.Module, opt: torch.optim.Optimizer, device: str, prec: str):
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        with autocast(device, prec):
            loss = loss_fn(model, x, y)
        loss.backward()
        opt.step()
        return loss.detach().clone()

    return step


def run(kind: str, prec: str, device: str, entry: str) -> tuple[list, dict, object]:
    """entry: "eager", "TS" or "CAP"; the losses, the end state and the runner (or None)."""
    backend = "cuda" if device == "cuda" else "emulated"
    model = seeded_model(kind, device)
    opt = optimizer(model, device)
    runner = None
    if entry == "TS":
        precision = "32" if prec == "fp32" else "bf16-mixed"
        runner = rk.TrainStep(
            model, loss_fn, opt, precision=precision, backend=backend, unsafe_disable=UNSAFE
        )
        step = lambda x, y: runner(x, y).detach().clone()  # noqa: E731
    else:
        if entry == "CAP":
            runner = rk.capture(model, backend=backend, unsafe_disable=UNSAFE)
        step = plain_step(model, opt, device, prec)
    losses = [step(x, y) for x, y in batches(device)]
    if device == "cuda":
        torch.cuda.synchronize()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    state |= {
        f"opt{i}/{k}": v.detach().clone()
        for i, s in enumerate(opt.state.values())
        for k, v in s.items()
        if isinstance(v, torch.Tensor)
    }
    return losses, state, runner


def compare(ref: tuple, out: tuple) -> tuple[bool, int]:
    same = sum(torch.equal(a, b) for a, b in zip(ref[0], out[0], strict=True))
    states = ref[1].keys() == out[1].keys() and all(
        torch.equal(ref[1][k], out[1][k]) for k in ref[1]
    )
    return same == STEPS and states, same


class Timeout(Exception):
    pass


def _alarm(*_: object) -> None:
    raise Timeout()


def case(kind: str, prec: str, device: str, entry: str, ref: tuple) -> bool:
    t0 = time.perf_counter()
    label = f"{kind:9s} {prec:4s} {entry:3s}"
    try:
        out = run(kind, prec, device, entry)
    except Timeout:
        print(f"{label} TIMEOUT ({CASE_S} s) FAIL", flush=True)
        return False
    except Exception as e:
        print(f"{label} ERROR {type(e).__name__}: {str(e)[:200]} FAIL", flush=True)
        traceback.print_exc(limit=4, file=sys.stdout)
        return False
    runner = out[2]
    exact, same = compare(ref, out)
    c = runner.counts
    counts = "/".join(str(c.get(n, 0)) for n in ("record", "replay", "eager", "retire"))
    reasons = dict(runner.eager_reasons)
    retire = f" retire={runner.retire_reason!r}"[:160] if runner.retired else ""
    replays = c.get("replay", 0)
    # --unsafe is the negative control: without the call state the masks must differ
    ok = not exact if UNSAFE else exact and replays > 0
    print(
        f"{label} exact={'Y' if exact else 'N'} losses={same}/{STEPS} rec/rep/eager/retire={counts} "
        f"{reasons}{retire} {time.perf_counter() - t0:.1f}s {'PASS' if ok else 'FAIL'}",
        flush=True,
    )
    with contextlib.suppress(Exception):
        runner.release()
    return ok


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--unsafe", action="store_true", help="call_state off: must diverge (PASS=N)")
    args = ap.parse_args()
    global UNSAFE
    UNSAFE = ("call_state",) if args.unsafe else ()
    rk.enable_determinism()
    print(
        f"torch {torch.__version__} cudnn "
        f"{torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None} "
        f"device {args.device}",
        flush=True,
    )
    signal.signal(signal.SIGALRM, _alarm)
    t0 = time.perf_counter()
    passed = total = 0
    for kind in ("lstm", "gru", "lstm+drop", "gru+drop"):
        # bf16 autocast on CUDA only (the CPU's oneDNN has no bf16 LSTM); "+drop" in fp32 only
        precs = ("fp32", "bf16") if args.device == "cuda" and "+" not in kind else ("fp32",)
        for prec in precs:
            signal.alarm(CASE_S)
            try:
                ref = run(kind, prec, args.device, "eager")
                again = run(kind, prec, args.device, "eager")
            except Timeout:
                print(f"{kind:9s} {prec:4s} eager TIMEOUT", flush=True)
                continue
            finally:
                signal.alarm(0)
            print(f"{kind:9s} {prec:4s} eager repeats={'Y' if compare(ref, again)[0] else 'N'}")
            for entry in ("TS", "CAP"):
                if time.perf_counter() - t0 > BUDGET_S:
                    print(f"{kind:9s} {prec:4s} {entry:3s} SKIPPED (budget) FAIL", flush=True)
                    total += 1
                    continue
                signal.alarm(CASE_S)
                try:
                    passed += case(kind, prec, args.device, entry, ref)
                finally:
                    signal.alarm(0)
                total += 1
    print(f"{passed}/{total} PASS in {time.perf_counter() - t0:.0f}s", flush=True)


if __name__ == "__main__":
    main()
