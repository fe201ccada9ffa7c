"""SILENT (new in 3410fec): a fresh empty_like(input) filled by a random in-place draw
(random_/bernoulli_/uniform_) is taken for input-derived (_filled), so a host read of it keys the
recording and is answered by re-running the draw: the default CPU generator ends elsewhere than
eager's, and the values the forward used differ."""

import torch
import torch.nn.functional as F
from torch import nn

import replaykit as rk


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 3)

    def forward(self, x, idx):
        keep = torch.empty_like(idx, dtype=torch.float32).bernoulli_(0.5)  # e.g. a random row drop
        k = int(keep.sum())  # read on the host
        return self.fc(x) * (k + 1)


def run(use_rk):
    torch.manual_seed(0)
    m = Net()
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    if use_rk:
        rk.capture(m, backend="emulated", warmup=1)
    torch.manual_seed(3)
    out = []
    for i in range(8):
        x, idx = torch.randn(4, 6, generator=torch.Generator().manual_seed(i)), torch.arange(4)
        loss = F.cross_entropy(m(x, idx), torch.tensor([0, 1, 2, 1]))
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append((loss.detach(), torch.get_rng_state()))
    return out, m


ref, _ = run(False)
got, m = run(True)
print(rk.recorder_of(m).counts)
for i, ((a, ra), (b, rb)) in enumerate(zip(ref, got, strict=False)):
    print(
        i,
        a.item(),
        b.item(),
        "loss " + ("same" if torch.equal(a, b) else "DIFF"),
        "rng " + ("same" if torch.equal(ra, rb) else "DIFF"),
    )
