"""UNCLEAR ERROR repro (no DDP needed): loss_fn is a lambda closing over ``self``, an object that
holds the TrainStep itself (the common "Trainer class" pattern). Keying the closure's values
walks self -> step -> config -> loss_fn -> self ... without cycle protection: RecursionError
(not a ReplayError), raised from the step call.

    cd /work/wt/hostile2 && PYTHONPATH=$PWD OMP_NUM_THREADS=1 \
        /work/main/.venv/bin/python scripts/hostile/ddp/repro_closure_cycle.py
"""

import torch
from torch import nn

import replaykit as rk


class Trainer:
    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9)
        self.crit = nn.CrossEntropyLoss()
        self.step = rk.TrainStep(
            self.model, lambda m, x, y: self.crit(m(x), y), self.opt, backend="emulated"
        )

    def fit(self, n: int) -> None:
        g = torch.Generator().manual_seed(1)
        for i in range(n):
            x, y = torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)
            try:
                self.step(x, y)
            except Exception as exc:
                print(
                    f"call {i + 1}: {type(exc).__module__}.{type(exc).__name__}: {str(exc)[:120]}"
                )
                return
        print("no error:", self.step.summary())


Trainer().fit(6)
