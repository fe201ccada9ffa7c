"""What the recording call's CallState adds over the step snapshot it wraps, side by side.

    python scripts/gpu/call_state_cost.py [--device cpu|cuda] [--layers 4] [--repeat 50]

Times taking and restoring a ``StepSnapshot`` (what the recording call took before) and a
``CallState`` around the same snapshot (name bindings, what loss_fn holds, the optimizer's
Python) on TinyLM under AdamW, with a loss_fn that holds a teacher LM (a module outside the
model, snapshotted whole) and without one. Only the recording call pays either: replays take no
snapshot. Prints one row per case (milliseconds, best of ``--repeat``: a shared machine's noise is one-sided).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from replaykit.guards.code import LossInputs
from replaykit.testing.zoo.language import VOCAB, TinyLM
from replaykit.verify.call_state import CallState
from replaykit.verify.step_check import StepSnapshot


def _ms(fn, repeat: int, device: str) -> float:
    times = []
    for _ in range(repeat):
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
    return min(times)  # a shared machine: the least disturbed run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=50)
    a = ap.parse_args()
    torch.manual_seed(0)
    model = TinyLM(layers=a.layers).to(a.device)
    teacher = TinyLM(layers=a.layers).to(a.device).requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, VOCAB, (8, 17), device=a.device)
    F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
    opt.step()  # the optimizer's state exists, as at a recording call after warm-up
    params = [p for p in model.parameters() if p.requires_grad]

    def plain(m, x, y):
        return F.cross_entropy(m(x).flatten(0, 1), y.flatten())

    def distil(m, x, y):
        with torch.no_grad():
            soft = teacher(x).softmax(-1)
        return F.cross_entropy(m(x).flatten(0, 1), soft.flatten(0, 1))

    def snapshot():
        return StepSnapshot(model, opt, None, None, params, True)

    print(f"TinyLM layers={a.layers} device={a.device} (ms, best of {a.repeat})")
    print(f"{'case':<50}{'take':>8}{'restore':>9}{'total':>8}")
    rows = [("StepSnapshot (before)", snapshot, None)]
    for name, loss_fn in (("plain loss_fn", plain), ("loss_fn holding a teacher", distil)):
        code = LossInputs(loss_fn, model)

        def state(code=code):
            return CallState(snapshot(), model, opt, [code])

        rows.append((f"CallState, {name}", state, None))
    for name, loss_fn in (("plain loss_fn", plain), ("loss_fn holding a teacher", distil)):
        code = LossInputs(loss_fn, model)

        def extra(code=code):  # the call state's own part: around a snapshot that costs nothing
            return CallState(_Nothing(), model, opt, [code])

        rows.append((f"  CallState's own part, {name}", extra, None))
    for name, take, _ in rows:
        held = take()
        t_take = _ms(take, a.repeat, a.device)
        t_restore = _ms(held.restore, a.repeat, a.device)
        print(f"{name:<50}{t_take:>8.2f}{t_restore:>9.2f}{t_take + t_restore:>8.2f}")


class _Nothing:
    def restore(self) -> None:
        pass


if __name__ == "__main__":
    main()
