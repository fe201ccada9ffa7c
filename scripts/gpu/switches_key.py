"""On the GPU host: which kernel switches this torch exposes, what key() costs per call, and whether
a flipped switch records anew under rk.capture and rk.TrainStep on CUDA (one compact table; < 1 min).

    python scripts/gpu/switches_key.py
"""

from __future__ import annotations

import timeit
import warnings

import torch
from torch import nn

import replaykit as rk
from replaykit.guards import switches


def _cost_us() -> float:
    return min(timeit.repeat(switches.key, number=200, repeat=200)) / 200 * 1e6


def _flip(entry: str, flip: str) -> str:
    """Records before and after one flip (sdpa: flash off; cudnn: off; tf32: matmul TF32 on)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Flatten(), nn.Linear(8 * 6 * 6, 4)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if entry == "capture":
        rec = rk.capture(model)

        def step(x: torch.Tensor) -> None:
            opt.zero_grad(set_to_none=True)
            model(x).square().mean().backward()
            opt.step()
    else:
        rec = rk.TrainStep(model, lambda m, x: m(x).square().mean(), opt)
        step = rec
    before = switches.key()
    try:
        for i in range(6):
            if i == 3:
                if flip == "sdpa":
                    torch.backends.cuda.enable_flash_sdp(False)
                elif flip == "cudnn":
                    torch.backends.cudnn.enabled = False
                else:
                    torch.backends.cuda.matmul.allow_tf32 = True
            step(torch.randn(4, 3, 8, 8, device="cuda"))
        return f"record {rec.counts['record']} replay {rec.counts['replay']}"
    finally:
        for s, value, now in zip(switches.SWITCHES, before, switches.key(), strict=True):
            if value != now:
                s.set(value)
        rec.release()


def main() -> None:
    warnings.simplefilter("ignore")
    print(
        f"torch {torch.__version__}  switches {len(switches.SWITCHES)}  key() {_cost_us():.2f} us"
    )
    print("names:", ", ".join(switches.NAMES))
    print(f"{'entry':8} {'flip':6} result (expect record 2)")
    for entry in ("capture", "step"):
        for flip in ("sdpa", "cudnn", "tf32"):
            print(f"{entry:8} {flip:6} {_flip(entry, flip)}")


if __name__ == "__main__":
    main()
