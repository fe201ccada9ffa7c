"""What keeping eager's gradient-hook order costs a replayed ``rk.capture`` step (guards/grad_hooks.py).

Side by side in one process, an MLP of ``--layers`` Linear layers trained with ``rk.capture``:
no hooks; a post-accumulate hook on every parameter (the chain: eager's order); the same hooks
with ``hook_order`` switched off (the engine's order, the negative control). Each arm's hook log
at its first step is compared with an eager twin's. Prints a table (ms per step, median of rounds) and
PASS/FAIL. Runs on the CPU too (``--device cpu``, emulated backend)."""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

import replaykit as rk


def _model(layers: int, width: int, device: str) -> nn.Module:
    torch.manual_seed(0)
    mods: list[nn.Module] = []
    for _ in range(layers):
        mods += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*mods).to(device)


def _run(args: argparse.Namespace, arm: str, steps: int) -> tuple[float, list]:
    """ms per step (median of rounds) and the hook log's first step."""
    model = _model(args.layers, args.width, args.device)
    log: list[int] = []
    if arm != "no hooks":
        for i, p in enumerate(model.parameters()):
            p.register_post_accumulate_grad_hook(lambda _p, i=i: log.append(i))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    backend = "cuda" if args.device == "cuda" else "emulated"
    unsafe = ("hook_order",) if arm == "hooks, engine order (unsafe)" else ()
    rec = None if arm == "eager" else rk.capture(model, backend=backend, unsafe_disable=unsafe)
    g = torch.Generator(device=args.device).manual_seed(1)
    xs = [torch.randn(args.batch, args.width, device=args.device, generator=g) for _ in range(8)]
    times = []
    first: list[int] = []
    for r in range(args.rounds + 1):
        if args.device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        for s in range(steps):
            opt.zero_grad(set_to_none=True)
            model(xs[s % 8]).pow(2).mean().backward()
            opt.step()
            if r == 0 and s == 0:
                first = list(log)
        if args.device == "cuda":
            torch.cuda.synchronize()
        if r:  # round 0 records
            times.append((time.perf_counter() - t) / steps * 1e3)
    if rec is not None:
        rec.release()
    return statistics.median(times), first


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    rk.enable_determinism()
    _, eager_log = _run(args, "eager", 4)
    rows = []
    ok = True
    for arm in ("no hooks", "hooks, eager order (chain)", "hooks, engine order (unsafe)"):
        ms, log = _run(args, arm, args.steps)
        same_log = log == eager_log if arm != "no hooks" else None
        rows.append((arm, ms, same_log))
        if arm == "hooks, eager order (chain)":
            ok &= bool(same_log)
        if arm == "hooks, engine order (unsafe)":
            ok &= not same_log  # the control must show another order
    params = 2 * args.layers
    print(
        f"| arm ({args.layers} layers, {params} hooked parameters, {args.device}) | ms/step | hook order = eager's |"
    )
    print("|---|---|---|")
    for arm, ms, same in rows:
        print(f"| {arm} | {ms:.3f} | {'-' if same is None else same} |")
    chain, engine = rows[1][1], rows[2][1]
    print(
        f"chain cost: {chain - engine:+.3f} ms/step ({(chain - engine) / params * 1e3:+.1f} us per hooked parameter)"
    )
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
