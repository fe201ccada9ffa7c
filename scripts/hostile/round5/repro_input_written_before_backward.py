"""Round 5 SILENT: an input whose memory is rewritten between a forward and its backward without
moving the tensor's version counter (a numpy view of a reused loader buffer, a ``.data`` copy).

Eager's backward reads the saved input as it is at backward time (the new values: the weight
gradient mixes two batches, and eager raises nothing because no version moved); the replayed
backward reads the static copy made at the forward. Prints one line per variant: SILENT or equal.

    python scripts/hostile/round5/repro_input_written_before_backward.py
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

import replaykit as rk


def run(replay: bool, how: str) -> list[torch.Tensor]:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    rng = np.random.default_rng(0)
    buf = rng.standard_normal((8, 8)).astype(np.float32)
    x = torch.from_numpy(buf) if how == "numpy" else torch.tensor(buf)
    y = torch.arange(8) % 4
    out = []
    with rk.capture(m, backend="emulated") if replay else torch.enable_grad():
        for _ in range(5):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(m(x), y)
            nxt = rng.standard_normal((8, 8)).astype(np.float32)
            if how == "numpy":
                buf[:] = nxt  # the loader prefetches into its buffer
            elif how == "data":
                x.data.copy_(torch.from_numpy(nxt))
            else:  # control: the next batch in a new tensor
                x = torch.from_numpy(nxt)
            loss.backward()
            opt.step()
            out.append(loss.detach())
    return out + [p.detach().clone() for p in m.parameters()]


if __name__ == "__main__":
    for how in ("numpy", "data", "control"):
        a, b = run(False, how), run(True, how)
        ok = all(torch.equal(p, q) for p, q in zip(a, b, strict=True))
        print(f"{how:8s} {'equal' if ok else 'SILENT'}")
