# One post-accumulate hook on ONE parameter (the first layer's weight: the last gradient eager's
# backward computes) that clips all gradients at "end of backward". Replay runs it first.
import torch
import torch.nn as nn

import replaykit as rk


def train(capture):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    rec = rk.capture(model, backend="emulated", warmup=1) if capture else None
    params = list(model.parameters())
    seen = []

    def hook(_p):  # "backward done": clip everything
        seen.append(sum(q.grad is not None for q in params))
        torch.nn.utils.clip_grad_norm_([q for q in params if q.grad is not None], 0.05)

    params[0].register_post_accumulate_grad_hook(hook)
    opt = torch.optim.SGD(params, lr=0.1)
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        model(torch.randn(4, 8, generator=g)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in params], seen, rec


pe, se, _ = train(False)
pc, sc, rec = train(True)
print("grads present when hook ran: eager", se, "replay", sc)
print("params equal:", all(torch.equal(a, b) for a, b in zip(pe, pc, strict=False)))
print(rec.counts["replay"], dict(rec.eager_reasons), rec.retired)
