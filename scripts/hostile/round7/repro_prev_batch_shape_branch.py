"""Online smoothing: the forward adds the previous batch's features when the batch size matches
(`if self.prev is not None and self.prev.shape == h.shape: h = h + 0.5 * self.prev`), then keeps
`self.prev = h.detach()`. Batch sizes 4,4,6,4,6,6,4,6: a bare RuntimeError from replaykit's state
feed (`slot.copy_`: size 6 vs 4); sizes 4,6,4,4,4,4,4,6,4: a silent difference."""

import torch
import torch.nn.functional as F
from torch import nn

import replaykit as rk


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.net, self.head, self.prev = nn.Linear(8, 8), nn.Linear(8, 4), None

    def forward(self, x):
        h = self.net(x)
        if self.prev is not None and self.prev.shape == h.shape:
            h = h + 0.5 * self.prev
        self.prev = h.detach()
        return self.head(h)


def run(replay, sizes):
    torch.manual_seed(0)
    m = Net()
    step = rk.TrainStep(
        m,
        lambda m, x, y: F.cross_entropy(m(x), y),
        torch.optim.SGD(m.parameters(), lr=0.1),
        backend="emulated",
        replay=replay,
    )
    g = torch.Generator().manual_seed(1)
    for b in sizes:
        step(torch.randn(b, 8, generator=g), torch.randint(0, 4, (b,), generator=g))
    return m.prev.clone(), m.head.weight.detach().clone()


for sizes in ((4, 4, 6, 4, 6, 6, 4, 6), (4, 6, 4, 4, 4, 4, 4, 6, 4)):
    e = run(False, sizes)
    try:
        r = run(True, sizes)
        print(
            sizes, "SAME" if all(torch.equal(a, b) for a, b in zip(e, r, strict=True)) else "DIFF"
        )
    except rk.ReplayError as ex:
        print(sizes, "clear ReplayError:", ex)
    except Exception as ex:
        print(sizes, f"UNCLEAR {type(ex).__name__}: {ex}")
