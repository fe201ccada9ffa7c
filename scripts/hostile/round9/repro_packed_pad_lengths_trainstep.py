"""SILENT (pre-existing, 482bfb5 too): TrainStep over a packed GRU whose loss uses the lengths
pad_packed_sequence returns; lengths cycle over a few sets."""

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import replaykit as rk


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn, self.head = nn.GRU(6, 8, batch_first=True), nn.Linear(8, 3)

    def forward(self, x, lengths):
        out, _ = self.rnn(pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False))
        padded, lens = pad_packed_sequence(out, batch_first=True)
        return self.head(padded.sum(1) / lens[:, None].float())


LENGTHS = [torch.tensor([5, 7, 2, 4]), torch.tensor([7, 3, 3, 1]), torch.tensor([6, 6, 6, 6])]


def run(replay):
    torch.manual_seed(0)
    m = Net()
    opt = torch.optim.SGD(m.parameters(), lr=0.05, fused=True)
    step = rk.TrainStep(
        m, lambda m, x, L, y: F.cross_entropy(m(x, L), y), opt, backend="emulated", replay=replay
    )
    losses = []
    for i in range(7):
        x = torch.randn(4, 7, 6, generator=torch.Generator().manual_seed(i))
        losses.append(step(x, LENGTHS[i % len(LENGTHS)], torch.tensor([0, 1, 2, 1])))
    return losses, step


ref, _ = run(False)
got, step = run(True)
print(step.counts["replay"], "replays")
for i, (a, b) in enumerate(zip(ref, got, strict=False)):
    print(i, a.item(), b.item(), "" if torch.equal(a, b) else "DIFF")
if __name__ == "__main__" and __import__("os").environ.get("JOURNAL"):
    print(step.journal.format())
