"""Network replay of batches sliced from one preloaded tensor, and the held-class keys, on a GPU.

    python scripts/gpu/sliced_batches_check.py [--device cuda|cpu]

Each pattern trains eagerly and under ``rk.capture`` (``backend="auto"``: CUDA graphs on a GPU,
emulated on a CPU) and prints ``PASS`` when the end weights are bitwise equal and the capture
replayed (the sliced loops must replay: they keyed the storage offset before and never did);
``FAIL`` otherwise, with the counts. Each pattern runs under a deadline (SIGALRM, 120 s).
"""

from __future__ import annotations

import argparse
import signal
import warnings

import torch
from torch import nn

import replaykit as rk


class Config:
    temperature = 1.0


class Tempered(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Sequential(nn.Linear(8, 64), nn.GELU(), nn.Linear(64, 4))
        self.cfg = Config()  # no value of its own: reads Config.temperature

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) / self.cfg.temperature


def _loop(device: str, replay: bool, pattern: str) -> tuple[list[torch.Tensor], dict]:
    Config.temperature = 1.0
    torch.manual_seed(0)
    net = (Tempered() if pattern == "held_class" else nn.Sequential(
        nn.Linear(8, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 4))).to(device)  # fmt: skip
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator(device="cpu").manual_seed(1)
    X = torch.randn(8 * 40 + 3, 8, generator=g).to(device)
    Y = torch.randint(0, 4, (8 * 40 + 3,), generator=g).to(device)
    rec = rk.capture(net) if replay else None
    for i in range(40):
        s = 8 * i + (i % 3 if pattern == "odd_offsets" else 0)  # odd offsets: other alignments
        if pattern == "held_class" and i == 20:
            Config.temperature = 2.0
        loss = nn.functional.cross_entropy(net(X[s : s + 8]), Y[s : s + 8])
        loss.backward()
        opt.step()
        opt.zero_grad()
    counts = dict(rec.counts) if rec is not None else {}
    if rec is not None:
        rec.release()
    Config.temperature = 1.0
    return [p.detach().cpu() for p in net.parameters()], counts


def _timeout(*_: object) -> None:
    raise TimeoutError("deadline")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args()
    rk.enable_determinism()
    warnings.simplefilter("ignore", rk.ReplayWarning)
    signal.signal(signal.SIGALRM, _timeout)
    failed = 0
    for pattern in ("aligned_slices", "odd_offsets", "held_class"):
        signal.alarm(120)
        try:
            eager, _ = _loop(a.device, False, pattern)
            replayed, counts = _loop(a.device, True, pattern)
            same = all(torch.equal(x, y) for x, y in zip(eager, replayed, strict=True))
            ok = same and counts.get("replay", 0) >= 20
            verdict = "PASS" if ok else "FAIL"
            detail = f"bitwise={same} counts={counts}"
        except Exception as exc:  # the table names it
            verdict, detail = "FAIL", f"{type(exc).__name__}: {exc}"[:200]
        finally:
            signal.alarm(0)
        failed += verdict == "FAIL"
        print(f"{pattern:16s} {a.device:5s} {verdict}  {detail}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
