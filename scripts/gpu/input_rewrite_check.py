"""Inputs rewritten between a replayed forward and its backward without a version bump (R5-1).

    python scripts/gpu/input_rewrite_check.py                      # cuda backend on a GPU
    python scripts/gpu/input_rewrite_check.py --backend emulated   # on a CPU

Each pattern trains a plain eager loop and the same loop under ``rk.capture``, then the capture
again with ``unsafe_disable=("input_rewrites", "verify_recording")``. A row is ``PASS`` when the
guarded run's losses, weights and every ``.grad`` (None pattern) equal eager's bitwise and it
replayed; the ``unsafe`` column says whether the protection's absence shows (``diverges``
expected, ``equal`` means that pattern cannot show it on this backend). Each pattern runs under
a deadline (SIGALRM, 120 s). Exit status 1 on any FAIL. On cuda, last line: the host µs the
protection adds per replayed call (one copy of the input into its static buffer before the backward).
"""

from __future__ import annotations

import argparse
import signal
import warnings

import torch
from torch import nn

import replaykit as rk

PATTERNS = ("numpy_refill", "data_copy", "data_copy_nonblocking", "data_rebind", "accum_retain")


def _loop(pattern: str, backend: str, replay: bool, disable: tuple[str, ...] = ()) -> tuple:
    device = "cuda" if backend == "cuda" else "cpu"
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 4)).to(device)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(16, 8, generator=g) for _ in range(13)]
    pinned = [b.pin_memory() if device == "cuda" else b for b in batches]
    y = torch.arange(16, device=device) % 4
    buf = batches[0].numpy().copy()
    # numpy_refill: the model reads the numpy buffer itself (CPU), or its pinned mirror's device copy
    x = torch.from_numpy(buf).to(device) if pattern == "numpy_refill" else batches[0].to(device)
    rec = rk.capture(net, backend=backend, unsafe_disable=disable, multi_backward=pattern == "accum_retain") if replay else None  # fmt: skip
    kept: list[torch.Tensor | None] = []
    for i in range(12):
        opt.zero_grad()
        if pattern == "accum_retain":
            loss = nn.functional.cross_entropy(net(x), y) + net(x * 2).pow(2).mean()
        else:
            loss = nn.functional.cross_entropy(net(x), y)
        nxt = batches[i + 1]
        if pattern == "numpy_refill":
            buf[:] = nxt.numpy()
        elif pattern == "data_copy" or pattern == "accum_retain":
            x.data.copy_(nxt)
        elif pattern == "data_copy_nonblocking":
            x.data.copy_(pinned[i + 1], non_blocking=True)
        else:  # data_rebind: the staging tensor's .data rebound to the next batch
            x.data = nxt.to(device)
        if pattern == "accum_retain":
            loss.backward(retain_graph=True)
            x.data.copy_(batches[(i + 5) % 13])
        loss.backward()
        kept += [
            loss.detach(),
            *(None if p.grad is None else p.grad.clone() for p in net.parameters()),
        ]
        opt.step()
    counts = dict(rec.counts) if rec is not None else {}
    if rec is not None:
        rec.release()
    kept += [p.detach() for p in net.parameters()]
    return [None if t is None else t.cpu() for t in kept], counts


def _cost(backend: str) -> None:
    """Host µs per replayed forward+backward with the protection on and off (alternating, best of 7)."""
    import time

    device = "cuda" if backend == "cuda" else "cpu"
    best = {"on": float("inf"), "off": float("inf")}
    steps = {}
    for arm, disable in (
        ("on", ("verify_recording",)),
        ("off", ("verify_recording", "input_rewrites")),
    ):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(8, 64), nn.GELU(), nn.Linear(64, 4)).to(device)
        x = torch.randn(16, 8, device=device)
        rk.capture(net, backend=backend, unsafe_disable=disable)

        def step(net: nn.Module = net, x: torch.Tensor = x) -> None:
            net(x).sum().backward()
            net.zero_grad()

        steps[arm] = step
    for _ in range(7):
        for arm, step in steps.items():
            for _ in range(20):
                step()
            if device == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(300):
                step()
            if device == "cuda":
                torch.cuda.synchronize()
            best[arm] = min(best[arm], (time.perf_counter() - t) / 300 * 1e6)
    added = best["on"] - best["off"]
    print(f"cost: {best['on']:.1f} us per call on, {best['off']:.1f} off: {added:+.1f} us added")


def _equal(a: list, b: list) -> bool:
    return all(
        (p is None and q is None) or (p is not None and q is not None and torch.equal(p, q))
        for p, q in zip(a, b, strict=True)
    )


def _timeout(*_: object) -> None:
    raise TimeoutError("deadline")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="cuda" if torch.cuda.is_available() else "emulated")
    a = ap.parse_args()
    rk.enable_determinism()
    warnings.simplefilter("ignore", rk.ReplayWarning)
    signal.signal(signal.SIGALRM, _timeout)
    failed = 0
    print(f"{'pattern':24s} {'result':6s} {'replays':>7s}  unsafe")
    for pattern in PATTERNS:
        signal.alarm(120)
        try:
            eager, _ = _loop(pattern, a.backend, False)
            guarded, counts = _loop(pattern, a.backend, True)
            unsafe, _ = _loop(pattern, a.backend, True, ("input_rewrites", "verify_recording"))
            ok = _equal(eager, guarded) and counts.get("replay", 0) >= 10
            row = f"{'PASS' if ok else 'FAIL':6s} {counts.get('replay', 0):7d}  "
            row += "equal" if _equal(eager, unsafe) else "diverges"
        except Exception as e:
            ok, row = False, f"FAIL   {type(e).__name__}: {e}"[:200]
        finally:
            signal.alarm(0)
        failed += not ok
        print(f"{pattern:24s} {row}", flush=True)
    print("ALL PASS" if not failed else f"{failed} FAIL")
    if a.backend == "cuda":  # the emulated tape's per-call time is too noisy to show a copy
        _cost(a.backend)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
