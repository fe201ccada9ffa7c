"""Was SILENT (fixed: prints ``equal`` three times): a reference to ``p.grad`` kept across
``zero_grad(set_to_none=False)`` stopped aliasing it.

Eager: ``zero_grad(set_to_none=False)`` zeroes ``p.grad`` in place and the next backward accumulates
into the same tensor, so a kept reference (``g = p.grad``, a view, or ``.data``) *is* the new
gradient. Under ``rk.capture`` the call after the recording ran eagerly (``live_alias``), but the
recording's copy-out had already given ``p.grad`` a fresh tensor: the kept view held the recorded
call's gradient and the user's metric differed, with no word. Copy-out now moves a held gradient with
every holder of its storage, and these loops replay.

    PYTHONPATH=$PWD python scripts/hostile/round4/repro_grad_alias_kept.py
"""

import torch
import torch.nn.functional as F

import replaykit as rk


def run(replay: bool, keep) -> list[torch.Tensor]:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    xs = [(torch.randn(8, 8), torch.randint(0, 4, (8,))) for _ in range(4)]
    seen, prev = [], None
    with rk.capture(m, backend="emulated") if replay else torch.enable_grad():
        for x, y in xs:
            opt.zero_grad(set_to_none=False)
            F.cross_entropy(m(x), y).backward()
            if prev is not None:
                seen.append(prev.clone())  # what the kept reference holds after this backward
            opt.step()
            prev = keep(m[0].weight.grad)
    return seen


for name, keep in [
    ("ref", lambda g: g),
    ("view", lambda g: g.view(-1)),
    ("data", lambda g: g.data),
]:
    for i, (a, b) in enumerate(zip(run(False, keep), run(True, keep), strict=True)):
        if not torch.equal(a.view(-1), b.view(-1)):
            print(
                f"{name}: kept grad differs after call {i + 1}: max abs {(a - b).abs().max():.3g}"
            )
            break
    else:
        print(f"{name}: equal")
