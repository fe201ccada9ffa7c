"""Why a kept output (``preds.append(logits.detach())``) routes ``live_alias`` on CUDA.

    python -m scripts.gpu.kept_outputs_diag [--device cuda]

Trains an MLP under ``rk.capture`` five calls, keeping each call's logits, and prints, whenever
copy-out leaves an alias, what it reads: each handed-out storage's use count against its
baseline, each gradient buffer's, and which half is still marked handed out.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import replaykit as rk
from replaykit.memory import copy_out


def _patch() -> None:
    original = copy_out.StaticAliases.copy_out
    use = copy_out._use_count

    def loud(self):  # type: ignore[no-untyped-def]
        h = self._handout
        before = (list(map(use, h.cdatas)), list(h.baseline), list(map(use, self._grad_cdatas)))
        copied, ok = original(self)
        if not ok:
            print(f"copy_out left an alias: copied {copied}; groups {h.groups}")
            print(f"  before: outputs use {before[0]} baseline {before[1]}; grads use {before[2]}")
            print(f"  after:  outputs use {list(map(use, h.cdatas))} baseline {h.baseline}")
            print(f"  grads use {list(map(use, self._grad_cdatas))} baseline {self._grad_baseline}")
            print(f"  outputs_out {self._outputs_out} grads_out {self._grads_out}")
            print(f"  owned {[h.owned(i) for i in range(len(h.tensors))]}")
            ptrs = [t.untyped_storage().data_ptr() for t in h.statics]
            print(f"  static output storage ptrs {ptrs}, sizes {[t.shape for t in h.statics]}")
        return copied, ok

    copy_out.StaticAliases.copy_out = loud


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    _patch()
    print(f"swap {copy_out._swap is not None}, alias storage {copy_out._alias_storage is not None}")
    torch.manual_seed(0)
    # the whole step first, on a fresh network, keeping each call's loss
    net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3)).to(args.device)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    step = rk.TrainStep(net, lambda m, x: m(x).square().mean(), opt)
    losses = [step(torch.randn(4, 6, device=args.device)) for _ in range(7)]
    print(step.summary(), [float(v) for v in losses][:3])
    for e in step.journal:
        if e.kind in ("refuse", "retire"):
            print("  ", e.kind, str(e.reason)[:300], str(getattr(e, "detail", ""))[:600])
    step.release()
    net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3)).to(args.device)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    rec = rk.capture(net)
    kept = []
    for i in range(5):
        opt.zero_grad(set_to_none=True)
        logits = net(torch.randn(4, 6, device=args.device))
        logits.square().mean().backward()
        opt.step()
        kept.append(logits.detach())
        print(f"call {i + 1}: {[(e.kind, e.reason) for e in rec.journal if e.call == i + 1][:3]}")
    print(rec.summary())
    rec.release()
    # the same network under a TrainStep after its recorder was released, the kept outputs alive
    step = rk.TrainStep(net, lambda m, x: m(x).square().mean(), opt)
    losses = [step(torch.randn(4, 6, device=args.device)) for _ in range(7)]
    print("after capture:", step.summary())
    for e in step.journal:
        if e.kind in ("refuse", "retire"):
            print("  ", e.kind, str(e.reason)[:300], str(e.detail)[:600])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
