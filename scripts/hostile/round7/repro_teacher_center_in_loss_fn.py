"""DINO-style: loss_fn holds a frozen teacher and keeps the teacher's centre on it
(`teacher.center = 0.9 * teacher.center + 0.1 * batch_mean`, read to centre the targets).
Eager: the centre moves every call. Replay: it stays put; losses and weights then differ."""

import copy

import torch
import torch.nn.functional as F
from torch import nn

import replaykit as rk


def run(replay):
    torch.manual_seed(0)
    student = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    teacher = copy.deepcopy(student).requires_grad_(False)
    teacher.center = torch.zeros(4)

    def loss_fn(s, x):
        with torch.no_grad():
            tl = teacher(x)
            t = ((tl - teacher.center) / 0.5).softmax(-1)
            teacher.center = 0.9 * teacher.center + 0.1 * tl.mean(0)
        return -(t * F.log_softmax(s(x), -1)).sum(-1).mean()

    opt = torch.optim.SGD(student.parameters(), lr=0.1)
    step = rk.TrainStep(student, loss_fn, opt, backend="emulated", replay=replay)
    g, centres = torch.Generator().manual_seed(1), []
    for _ in range(6):
        step(torch.randn(4, 8, generator=g))
        centres.append(teacher.center.clone())
    return [*centres, student[0].weight.detach().clone()], step.counts["replay"]


(e, _), (r, n) = run(False), run(True)
print("replays:", n, "| equal per call:", [torch.equal(a, b) for a, b in zip(e, r, strict=False)])
print("SAME" if all(torch.equal(a, b) for a, b in zip(e, r, strict=False)) else "DIFF")
