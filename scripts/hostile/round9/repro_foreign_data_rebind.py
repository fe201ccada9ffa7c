"""SILENT: a discriminator weight's .data re-bound between generator steps (WGAN weight clipping
written as p.data = p.data.clamp(...), vector_to_parameters, D.to(float64).to(float32)): the
replayed generator step keeps reading the discriminator's old memory."""

import torch
from torch import nn

import replaykit as rk


def run(mode):
    torch.manual_seed(0)
    G = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 6))
    D = nn.Sequential(nn.Linear(6, 8), nn.LeakyReLU(0.2), nn.Linear(8, 1))
    g_opt = torch.optim.SGD(G.parameters(), lr=0.05, fused=True)

    def loss_fn(g, z):
        return -D(g(z)).mean()

    step = rk.TrainStep(G, loss_fn, g_opt, backend="emulated", replay=(mode == "replay"))
    for i in range(6):
        z = torch.randn(5, 4, generator=torch.Generator().manual_seed(i))
        for p in D.parameters():  # WGAN's clipping, as many implementations write it
            p.data = p.data.clamp(-0.05, 0.05) * (0.9 if i == 3 else 1.0)
        step(z)
    return [p.detach().clone() for p in G.parameters()], step


ref, _ = run("eager")
got, step = run("replay")
print(step.counts)
print(
    "EQUAL" if all(torch.equal(a, b) for a, b in zip(ref, got, strict=False)) else "DIFF (silent)"
)
