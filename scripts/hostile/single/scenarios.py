"""Realistic single-process training loops; each ``fn(ctx) -> dict`` of what to compare.

``ctx.capture(model)`` is ``rk.capture(model, backend="emulated")`` under replay and nothing in
eager; ``ctx.step(...)`` is ``rk.TrainStep(..., backend="emulated")`` under replay and the same
work written by hand in eager. Everything else is the user's own code.
"""

from __future__ import annotations

import copy
import io
import math
import random
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from harness import scenario
from torch import nn

# ----------------------------------------------------------------------------- tiny models


def mlp(i=8, h=16, o=4):
    return nn.Sequential(nn.Linear(i, h), nn.ReLU(), nn.Linear(h, o))


class Block(nn.Module):
    """A torchvision-style BasicBlock."""

    def __init__(self, c):
        super().__init__()
        self.c1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.b1 = nn.BatchNorm2d(c)
        self.c2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.b2 = nn.BatchNorm2d(c)

    def forward(self, x):
        y = F.relu(self.b1(self.c1(x)))
        return F.relu(x + self.b2(self.c2(y)))


class TinyResNet(nn.Module):
    def __init__(self, c=8, classes=5):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU()
        )
        self.layer1 = Block(c)
        self.layer2 = Block(c)
        self.fc = nn.Linear(c, classes)

    def forward(self, x):
        x = self.layer2(self.layer1(self.stem(x)))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class MBBlock(nn.Module):
    """MobileNetV2 inverted residual."""

    def __init__(self, c, e=2):
        super().__init__()
        h = c * e
        self.net = nn.Sequential(
            nn.Conv2d(c, h, 1, bias=False), nn.BatchNorm2d(h), nn.ReLU6(),
            nn.Conv2d(h, h, 3, padding=1, groups=h, bias=False), nn.BatchNorm2d(h), nn.ReLU6(),
            nn.Conv2d(h, c, 1, bias=False), nn.BatchNorm2d(c),
        )  # fmt: skip

    def forward(self, x):
        return x + self.net(x)


def mobilenet(c=8, classes=5):
    return nn.Sequential(
        nn.Conv2d(3, c, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU6(),
        MBBlock(c), MBBlock(c), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.2),
        nn.Linear(c, classes),
    )  # fmt: skip


def images(n, b=6, hw=8, classes=5, seed=10):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(b, 3, hw, hw, generator=g), torch.randint(0, classes, (b,), generator=g))
            for _ in range(n)]  # fmt: skip


def vecs(n, b=8, f=8, classes=4, seed=11):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(b, f, generator=g), torch.randint(0, classes, (b,), generator=g))
            for _ in range(n)]  # fmt: skip


class LSTMLM(nn.Module):
    def __init__(self, v=20, d=12, tie=True, cell=nn.LSTM):
        super().__init__()
        self.emb = nn.Embedding(v, d)
        self.rnn = cell(d, d, batch_first=True)
        self.drop = nn.Dropout(0.1)
        self.out = nn.Linear(d, v)
        if tie:
            self.out.weight = self.emb.weight

    def forward(self, x, h=None):
        y, h = self.rnn(self.drop(self.emb(x)), h)
        return self.out(self.drop(y)), h


class TinyGPT(nn.Module):
    def __init__(self, v=24, d=16, heads=2, layers=2, T=10):
        super().__init__()
        self.tok = nn.Embedding(v, d)
        self.pos = nn.Parameter(torch.zeros(1, T, d))
        layer = nn.TransformerEncoderLayer(d, heads, 32, dropout=0.1, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, v, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, x, pad=None):
        T = x.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(T)
        h = self.tok(x) + self.pos[:, :T]
        h = self.enc(h, mask=mask, src_key_padding_mask=pad)
        return self.head(h)


def ce(m, x, y):
    return F.cross_entropy(m(x), y)


def sgd(m, lr=0.05, **kw):
    return torch.optim.SGD(m.parameters(), lr=lr, momentum=0.9, **kw)


def adamw(params, lr=1e-3, **kw):
    return torch.optim.AdamW(params, lr=lr, fused=True, capturable=True, **kw)


# ================================================================= rk.capture (network replay)


@scenario("capture")
def cap_resnet_mixup_numpy(ctx):
    m, data = TinyResNet(), images(10)
    opt = sgd(m, nesterov=True, weight_decay=5e-4)
    losses = []
    with ctx.capture(m):
        for x, y in data:
            lam = float(np.random.beta(0.4, 0.4))
            idx = torch.from_numpy(np.random.permutation(len(x)))
            xm = lam * x + (1 - lam) * x[idx]
            out = m(xm)
            loss = lam * F.cross_entropy(out, y, label_smoothing=0.1) + (1 - lam) * F.cross_entropy(
                out, y[idx], label_smoothing=0.1)  # fmt: skip
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    return {"m": m, "opt": opt, "losses": losses}


@scenario("capture")
def cap_resnet_cutmix_torch(ctx):
    m, data = TinyResNet(), images(10)
    opt = sgd(m)
    losses = []
    with ctx.capture(m):
        for x, y in data:
            x = x.clone()
            lam = torch.distributions.Beta(1.0, 1.0).sample().item()
            perm = torch.randperm(x.size(0))
            H = x.size(2)
            r = int(H * math.sqrt(1 - lam))
            cx, cy = random.randint(0, H - 1), random.randint(0, H - 1)
            x1, x2, y1, y2 = (
                max(cx - r // 2, 0),
                min(cx + r // 2, H),
                max(cy - r // 2, 0),
                min(cy + r // 2, H),
            )
            x[:, :, x1:x2, y1:y2] = x[perm, :, x1:x2, y1:y2]
            lam = 1 - (x2 - x1) * (y2 - y1) / (H * H)
            out = m(x)
            loss = lam * F.cross_entropy(out, y) + (1 - lam) * F.cross_entropy(out, y[perm])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach())
    return {"m": m, "opt": opt, "losses": losses}


@scenario("capture")
def cap_resnet_averagedmodel_ema(ctx):
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    m, data = TinyResNet(), images(10)
    ema = AveragedModel(m, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=True)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True)
    with ctx.capture(m):
        for x, y in data:
            loss = ce(m, x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            ema.update_parameters(m)
    ema.eval()
    with torch.no_grad():
        val = ema(data[0][0])
    return {"m": m, "opt": opt, "ema": ema, "val": val}


@scenario("capture")
def cap_channels_last_bf16_autocast_clip(ctx):
    m = TinyResNet().to(memory_format=torch.channels_last)
    data = images(10)
    opt = sgd(m)
    losses = []
    with ctx.capture(m):
        for x, y in data:
            x = x.to(memory_format=torch.channels_last)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = m(x)
                loss = F.cross_entropy(out, y)
            loss.backward()
            nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            losses.append(loss.float().item())
    return {"m": m, "opt": opt, "losses": losses}


@scenario("capture")
def cap_fp16_gradscaler(ctx):
    m, data = mobilenet(), images(10)
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    losses = []
    with ctx.capture(m):
        for x, y in data:
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(m(x), y)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(m.parameters(), 2.0)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            losses.append(loss.detach().float())
    return {"m": m, "opt": opt, "scaler": scaler, "losses": losses}


@scenario("capture")
def cap_onecycle_float_lr(ctx):
    m, data = mlp(), vecs(12)
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.2, total_steps=12)
    with ctx.capture(m):
        for x, y in data:
            loss = ce(m, x, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
    return {"m": m, "opt": opt}


@scenario("capture")
def cap_freeze_unfreeze_backbone(ctx):
    m, data = TinyResNet(), images(10)
    for p in m.stem.parameters():
        p.requires_grad_(False)
    opt = sgd(m)
    with ctx.capture(m):
        for i, (x, y) in enumerate(data):
            if i == 5:
                for p in m.stem.parameters():
                    p.requires_grad_(True)
            loss = ce(m, x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
    return {"m": m, "opt": opt}


@scenario("capture")
def cap_bn_eval_validation_between(ctx):
    m, data = TinyResNet(), images(10)
    opt = sgd(m)
    vals = []
    with ctx.capture(m):
        for i, (x, y) in enumerate(data):
            m.train()
            loss = ce(m, x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            if i % 3 == 2:
                m.eval()
                vals.append(m(data[0][0]).detach())  # validation without no_grad
                with torch.no_grad():
                    vals.append(m(data[1][0]))
    return {"m": m, "opt": opt, "vals": vals}


@scenario("capture")
def cap_lstm_tbptt(ctx):
    m = LSTMLM()
    g = torch.Generator().manual_seed(3)
    stream = torch.randint(0, 20, (4, 61), generator=g)
    opt = torch.optim.Adam(m.parameters(), lr=3e-3)
    h = None
    losses = []
    with ctx.capture(m):
        for t in range(0, 60, 6):
            x, y = stream[:, t : t + 6], stream[:, t + 1 : t + 7]
            out, h = m(x, h)
            h = tuple(s.detach() for s in h)
            loss = F.cross_entropy(out.reshape(-1, 20), y.reshape(-1))
            opt.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(m.parameters(), 0.5)
            opt.step()
            losses.append(loss.detach())
    return {"m": m, "opt": opt, "losses": losses, "h": list(h)}


@scenario("capture")
def cap_gru_teacher_forcing_random(ctx):
    class Seq2Seq(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(12, 8)
            self.enc = nn.GRU(8, 16, batch_first=True)
            self.dec = nn.GRUCell(8, 16)
            self.out = nn.Linear(16, 12)

        def forward(self, src, tgt, tf):
            _, h = self.enc(self.emb(src))
            h = h[0]
            inp = tgt[:, 0]
            outs = []
            for t in range(1, tgt.shape[1]):
                h = self.dec(self.emb(inp), h)
                o = self.out(h)
                outs.append(o)
                inp = tgt[:, t] if tf else o.argmax(-1)
            return torch.stack(outs, 1)

    m = Seq2Seq()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(4)
    with ctx.capture(m):
        for _ in range(10):
            src, tgt = (
                torch.randint(0, 12, (4, 5), generator=g),
                torch.randint(0, 12, (4, 6), generator=g),
            )
            tf = random.random() < 0.5
            out = m(src, tgt, tf)
            loss = F.cross_entropy(out.reshape(-1, 12), tgt[:, 1:].reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
    return {"m": m, "opt": opt}


@scenario("capture")
def cap_packed_sequences(ctx):
    class Cls(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(15, 8, padding_idx=0)
            self.rnn = nn.LSTM(8, 8, batch_first=True)
            self.fc = nn.Linear(8, 3)

        def forward(self, x, lengths):
            packed = nn.utils.rnn.pack_padded_sequence(
                self.emb(x), lengths, batch_first=True, enforce_sorted=False
            )
            _, (h, _) = self.rnn(packed)
            return self.fc(h[-1])

    m = Cls()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(5)
    with ctx.capture(m):
        for _ in range(8):
            lengths = torch.randint(2, 7, (4,), generator=g)
            x = torch.randint(1, 15, (4, 6), generator=g) * (torch.arange(6) < lengths[:, None])
            y = torch.randint(0, 3, (4,), generator=g)
            loss = F.cross_entropy(m(x, lengths), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return {"m": m, "opt": opt}


@scenario("capture")
def cap_gpt_padding_mask_per_batch(ctx):
    m = TinyGPT()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True)
    g = torch.Generator().manual_seed(6)
    losses = []
    with ctx.capture(m):
        for i in range(10):
            x = torch.randint(0, 24, (3, 10), generator=g)
            pad = torch.zeros(3, 10, dtype=torch.bool)
            if i % 2:
                pad[0, 7:] = True
            logits = m(x, pad)
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, 24), x[:, 1:].reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
    return {"m": m, "opt": opt, "losses": losses}


@scenario("capture")
def cap_accum_variable_micro_last_partial(ctx):
    m, opt = mlp(), None
    opt = sgd(m)
    g = torch.Generator().manual_seed(7)
    xs = torch.randn(37, 8, generator=g)
    ys = torch.randint(0, 4, (37,), generator=g)
    with ctx.capture(m):
        for _epoch in range(2):
            for s in range(0, 37, 12):  # batches of 12,12,12,1; micro 4,4,4
                xb, yb = xs[s : s + 12], ys[s : s + 12]
                n = len(xb)
                for ms in range(0, n, 4):
                    loss = F.cross_entropy(m(xb[ms : ms + 4]), yb[ms : ms + 4], reduction="sum") / n
                    loss.backward()
                opt.step()
                opt.zero_grad()
    return {"m": m, "opt": opt}


@scenario("capture")
def cap_checkpoint_roundtrip_midrun(ctx):
    m, data = TinyResNet(), images(10)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True)
    with ctx.capture(m):
        for i, (x, y) in enumerate(data):
            loss = ce(m, x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            if i == 4:
                buf = io.BytesIO()
                torch.save({"model": m.state_dict(), "opt": opt.state_dict()}, buf)
                buf.seek(0)
                ck = torch.load(buf)
                m.load_state_dict(ck["model"])
                opt.load_state_dict(ck["opt"])
    return {"m": m, "opt": opt}


@scenario("capture")
def cap_lr_by_hand_and_new_group(ctx):
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    head = nn.Linear(4, 4)
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    data = vecs(10)
    with ctx.capture(m):
        for i, (x, y) in enumerate(data):
            if i == 3:
                for gr in opt.param_groups:
                    gr["lr"] *= 0.5
            if i == 5:
                opt.add_param_group({"params": head.parameters(), "lr": 0.01})
            out = m(x)
            if i >= 5:
                out = head(out)
            loss = F.cross_entropy(out, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
    return {"m": m, "head": head, "opt": opt}


@scenario("capture")
def cap_forward_hook_logging(ctx):
    m, data = TinyResNet(), images(8)
    opt = sgd(m)
    stats = []
    with ctx.capture(m):
        for i, (x, y) in enumerate(data):
            if i == 3:
                m.layer1.register_forward_hook(
                    lambda mod, inp, out: stats.append(out.detach().mean())
                )
            loss = ce(m, x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
    return {"m": m, "opt": opt, "stats": stats}


@scenario("capture")
def cap_metrics_keep_outputs(ctx):
    m, data = mlp(), vecs(10)
    opt = sgd(m)
    kept_logits, kept_losses = [], []
    with ctx.capture(m):
        for x, y in data:
            logits = m(x)
            loss = F.cross_entropy(logits, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            kept_logits.append(logits.detach())  # accuracy at epoch end
            kept_losses.append(loss)  # a loss tensor kept with its graph
    acc = torch.stack(
        [(lg.argmax(1) == y).float().mean() for lg, (_, y) in zip(kept_logits, data, strict=False)]
    )
    return {
        "m": m,
        "opt": opt,
        "logits": kept_logits,
        "losses": [lt.detach() for lt in kept_losses],
        "acc": acc,
    }


@scenario("capture")
def cap_dropout_anneal_and_stochastic_depth(ctx):
    class DropPath(nn.Module):
        def __init__(self, p):
            super().__init__()
            self.p = p

        def forward(self, x):
            if not self.training or self.p == 0:
                return x
            keep = torch.rand(x.shape[0], 1, device=x.device) >= self.p
            return x * keep / (1 - self.p)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.l1, self.l2, self.out = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)
            self.dp = DropPath(0.2)
            self.drop = nn.Dropout(0.5)

        def forward(self, x):
            h = F.gelu(self.l1(x))
            h = h + self.dp(F.gelu(self.l2(h)))
            return self.out(self.drop(h))

    m, data = Net(), vecs(10)
    opt = sgd(m)
    with ctx.capture(m):
        for i, (x, y) in enumerate(data):
            m.drop.p = 0.5 * (1 - i / 10)
            loss = ce(m, x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
    return {"m": m, "opt": opt}


@scenario("capture")
def cap_early_stopping_val_nograd(ctx):
    m, data = mlp(), vecs(12)
    val = vecs(2, seed=99)
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    best, bad, stopped = float("inf"), 0, -1
    with ctx.capture(m):
        for i, (x, y) in enumerate(data):
            loss = ce(m, x, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            m.eval()
            with torch.no_grad():
                v = sum(ce(m, vx, vy).item() for vx, vy in val)
            m.train()
            if v < best - 1e-4:
                best, bad = v, 0
            else:
                bad += 1
                if bad >= 2:
                    stopped = i
                    break
    return {"m": m, "opt": opt, "best": best, "stopped": stopped}


@scenario("capture")
def cap_dqn_target_polyak(ctx):
    q, _data = mlp(6, 16, 3), None
    target = copy.deepcopy(q)
    for p in target.parameters():
        p.requires_grad_(False)
    opt = torch.optim.Adam(q.parameters(), lr=1e-3)
    rng = np.random.default_rng(0)
    buf_s = torch.from_numpy(rng.standard_normal((64, 6)).astype(np.float32))
    buf_a = torch.from_numpy(rng.integers(0, 3, 64))
    buf_r = torch.from_numpy(rng.standard_normal(64).astype(np.float32))
    buf_s2 = torch.from_numpy(rng.standard_normal((64, 6)).astype(np.float32))
    eps_hist = []
    with ctx.capture(q):
        for step in range(10):
            eps = max(0.05, 1.0 - step / 5)
            eps_hist.append(eps)
            idx = torch.from_numpy(rng.choice(64, 8, replace=False))
            s, a, r, s2 = buf_s[idx], buf_a[idx], buf_r[idx], buf_s2[idx]
            with torch.no_grad():
                tgt = r + 0.99 * target(s2).max(1).values
            qsa = q(s).gather(1, a[:, None]).squeeze(1)
            loss = F.smooth_l1_loss(qsa, tgt)
            opt.zero_grad()
            loss.backward()
            nn.utils.clip_grad_value_(q.parameters(), 1.0)
            opt.step()
            with torch.no_grad():
                for tp, p in zip(target.parameters(), q.parameters(), strict=False):
                    tp.mul_(0.95).add_(p, alpha=0.05)
    return {"q": q, "target": target, "opt": opt}


@scenario("capture")
def cap_ppo_shared_actor_critic(ctx):
    class AC(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(6, 32), nn.Tanh())
            self.pi = nn.Linear(32, 3)
            self.v = nn.Linear(32, 1)

        def forward(self, s):
            h = self.body(s)
            return self.pi(h), self.v(h).squeeze(-1)

    ac = AC()
    opt = torch.optim.Adam(ac.parameters(), lr=3e-4, eps=1e-5)
    g = torch.Generator().manual_seed(8)
    obs = torch.randn(32, 6, generator=g)
    with torch.no_grad():
        logits, old_v = ac(obs)
        dist = torch.distributions.Categorical(logits=logits)
        act = dist.sample()
        old_logp = dist.log_prob(act)
    ret = torch.randn(32, generator=g)
    adv = ret - old_v
    kls = []
    with ctx.capture(ac):
        for _epoch in range(3):
            perm = np.random.permutation(32)
            for mb in range(0, 32, 8):
                i = torch.from_numpy(perm[mb : mb + 8])
                logits, v = ac(obs[i])
                d = torch.distributions.Categorical(logits=logits)
                logp = d.log_prob(act[i])
                a = adv[i]
                a = (a - a.mean()) / (a.std() + 1e-8)
                ratio = (logp - old_logp[i]).exp()
                pg = -torch.min(ratio * a, ratio.clamp(0.8, 1.2) * a).mean()
                v_clip = old_v[i] + (v - old_v[i]).clamp(-0.2, 0.2)
                vl = 0.5 * torch.max((v - ret[i]) ** 2, (v_clip - ret[i]) ** 2).mean()
                loss = pg + 0.5 * vl - 0.01 * d.entropy().mean()
                opt.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(ac.parameters(), 0.5)
                opt.step()
                kls.append(((ratio - 1) - (logp - old_logp[i])).mean().item())
    return {"ac": ac, "opt": opt, "kls": kls}


@scenario("capture")
def cap_sac_twin_critics_alpha(ctx):
    actor = nn.Sequential(nn.Linear(5, 32), nn.ReLU(), nn.Linear(32, 4))
    q1, q2 = mlp(7, 32, 1), mlp(7, 32, 1)
    q1_t, q2_t = copy.deepcopy(q1), copy.deepcopy(q2)
    log_alpha = torch.zeros((), requires_grad=True)
    a_opt = torch.optim.Adam(actor.parameters(), lr=3e-4)
    q_opt = torch.optim.Adam([*q1.parameters(), *q2.parameters()], lr=3e-4)
    al_opt = torch.optim.Adam([log_alpha], lr=3e-4)
    g = torch.Generator().manual_seed(9)
    S, S2, R = (
        torch.randn(64, 5, generator=g),
        torch.randn(64, 5, generator=g),
        torch.randn(64, generator=g),
    )
    A = torch.randn(64, 2, generator=g).tanh()

    def policy(s):
        mu, log_std = actor(s).chunk(2, -1)
        std = log_std.clamp(-5, 2).exp()
        u = mu + std * torch.randn_like(mu)
        a = u.tanh()
        logp = (
            torch.distributions.Normal(mu, std).log_prob(u) - torch.log(1 - a.pow(2) + 1e-6)
        ).sum(-1)
        return a, logp

    with ctx.capture(actor), ctx.capture(q1), ctx.capture(q2):
        for _ in range(8):
            i = torch.from_numpy(np.random.randint(0, 64, 16))
            s, a, r, s2 = S[i], A[i], R[i], S2[i]
            alpha = log_alpha.exp().detach()
            with torch.no_grad():
                a2, logp2 = policy(s2)
                sa2 = torch.cat([s2, a2], -1)
                tq = torch.min(q1_t(sa2), q2_t(sa2)).squeeze(-1) - alpha * logp2
                y = r + 0.99 * tq
            sa = torch.cat([s, a], -1)
            q_loss = F.mse_loss(q1(sa).squeeze(-1), y) + F.mse_loss(q2(sa).squeeze(-1), y)
            q_opt.zero_grad()
            q_loss.backward()
            q_opt.step()
            pa, logp = policy(s)
            spa = torch.cat([s, pa], -1)
            pi_loss = (alpha * logp - torch.min(q1(spa), q2(spa)).squeeze(-1)).mean()
            a_opt.zero_grad()
            pi_loss.backward()
            a_opt.step()
            al_loss = -(log_alpha * (logp.detach() - 2.0)).mean()
            al_opt.zero_grad()
            al_loss.backward()
            al_opt.step()
            with torch.no_grad():
                for t, s_ in zip(
                    [*q1_t.parameters(), *q2_t.parameters()],
                    [*q1.parameters(), *q2.parameters()],
                    strict=False,
                ):
                    t.lerp_(s_, 0.005)
    return {"actor": actor, "q1": q1, "q2": q2, "q1t": q1_t, "q2t": q2_t, "alpha": log_alpha,
            "opts": [a_opt, q_opt, al_opt]}  # fmt: skip


@scenario("capture")
def cap_multi_loss_two_optimizers_gan(ctx):
    G = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
    D = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
    og = torch.optim.Adam(G.parameters(), lr=2e-4, betas=(0.5, 0.999))
    od = torch.optim.Adam(D.parameters(), lr=2e-4, betas=(0.5, 0.999))
    g = torch.Generator().manual_seed(12)
    with ctx.capture(G), ctx.capture(D):
        for _ in range(8):
            real = torch.randn(8, 8, generator=g)
            z = torch.randn(8, 4, generator=g)
            fake = G(z)
            d_loss = F.binary_cross_entropy_with_logits(D(real), torch.ones(8, 1)) + \
                F.binary_cross_entropy_with_logits(D(fake.detach()), torch.zeros(8, 1))  # fmt: skip
            od.zero_grad()
            d_loss.backward()
            od.step()
            g_loss = F.binary_cross_entropy_with_logits(D(fake), torch.ones(8, 1))
            og.zero_grad()
            g_loss.backward()
            og.step()
    return {"G": G, "D": D, "og": og, "od": od}


@scenario("capture")
def cap_different_batch_shapes(ctx):
    m = mobilenet()
    opt = sgd(m)
    g = torch.Generator().manual_seed(13)
    with ctx.capture(m):
        for i in range(12):
            b, hw = [4, 6, 4, 2][i % 4], [8, 8, 12, 8][i % 4]
            x, y = torch.randn(b, 3, hw, hw, generator=g), torch.randint(0, 5, (b,), generator=g)
            loss = ce(m, x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
    return {"m": m, "opt": opt}


@scenario("capture")
def cap_optimizer_state_reset(ctx):
    m, data = mlp(), vecs(10)
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
    with ctx.capture(m):
        for i, (x, y) in enumerate(data):
            if i == 5:  # restart: fresh momentum, as a warm-restart schedule does
                opt.state.clear()
            loss = ce(m, x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
    return {"m": m, "opt": opt}


# ======================================================================== rk.TrainStep


@scenario("step")
def step_resnet_tensor_lr_cosine_warmup_ema(ctx):
    m, data = TinyResNet(), images(12)
    opt = torch.optim.SGD(m.parameters(), lr=torch.tensor(0.1), momentum=0.9, nesterov=True,
                          weight_decay=5e-4, fused=True)  # fmt: skip
    warm = 3
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / 9)),
    )
    ema = ctx.ema(m, 0.99)
    step = ctx.step(m, lambda mm, x, y: F.cross_entropy(mm(x), y, label_smoothing=0.1), opt,
                    max_norm=1.0, ema=ema)  # fmt: skip
    losses = []
    for x, y in data:
        losses.append(step(x, y))
        sched.step()
    return {"m": m, "opt": opt, "ema": ema, "losses": losses}


@scenario("step")
def step_onecycle_float_lr_momentum(ctx):
    m, data = mlp(), vecs(12)
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.2, total_steps=12)
    step = ctx.step(m, ce, opt)
    losses = []
    for x, y in data:
        losses.append(step(x, y))
        sched.step()
    return {"m": m, "opt": opt, "losses": losses}


@scenario("step")
def step_onecycle_tensor_lr_adamw(ctx):
    m, data = mlp(), vecs(12)
    opt = torch.optim.AdamW(m.parameters(), lr=torch.tensor(1e-3), fused=True, capturable=True)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=12)
    step = ctx.step(m, ce, opt, max_norm=1.0)
    losses = [step(x, y) for x, y in data if sched.step() is None or True]
    return {"m": m, "opt": opt, "losses": losses}


@scenario("step")
def step_mixup_float_lambda_arg(ctx):
    m, data = TinyResNet(), images(10)
    opt = sgd(m, fused=True)

    def loss_fn(mm, x, y, y2, lam):
        out = mm(x)
        return lam * F.cross_entropy(out, y) + (1 - lam) * F.cross_entropy(out, y2)

    step = ctx.step(m, loss_fn, opt)
    losses = []
    for x, y in data:
        lam = float(np.random.beta(0.2, 0.2))
        p = torch.randperm(len(x))
        losses.append(step(lam * x + (1 - lam) * x[p], y, y[p], lam))
    return {"m": m, "opt": opt, "losses": losses}


@scenario("step")
def step_mixup_lambda_drawn_in_loss(ctx):
    m, data = mlp(), vecs(10)
    opt = sgd(m, fused=True)

    def loss_fn(mm, x, y):
        lam = np.random.beta(0.4, 0.4)
        p = torch.randperm(len(x))
        out = mm(lam * x + (1 - lam) * x[p])
        return lam * F.cross_entropy(out, y) + (1 - lam) * F.cross_entropy(out, y[p])

    step = ctx.step(m, loss_fn, opt)
    losses = [step(x, y) for x, y in data]
    return {"m": m, "opt": opt, "losses": losses}


@scenario("step")
def step_fp16_gradscaler_fused(ctx):
    m, data = mobilenet(), images(10)
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    step = ctx.step(m, ce, opt, scaler=scaler, precision="16-mixed", max_norm=2.0)
    losses = [step(x, y) for x, y in data]
    return {"m": m, "opt": opt, "scaler": scaler, "losses": losses}


@scenario("step")
def step_bf16_accum_partial_last_batch(ctx):
    m = TinyResNet()
    data = images(9)
    data[-1] = (data[-1][0][:3], data[-1][1][:3])
    opt = adamw(m.parameters())
    step = ctx.step(m, ce, opt, precision="bf16-mixed", accumulate=3, max_norm=1.0)
    losses = [step(x, y) for x, y in data]
    return {"m": m, "opt": opt, "losses": losses}


@scenario("step")
def step_ppo_epochs_minibatches(ctx):
    class AC(nn.Module):
        def __init__(self):
            super().__init__()
            self.pi = nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 3))
            self.v = nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 1))

    ac = AC()
    opt = torch.optim.Adam(
        ac.parameters(), lr=torch.tensor(3e-4), eps=1e-5, fused=True, capturable=True
    )
    g = torch.Generator().manual_seed(8)
    obs = torch.randn(32, 6, generator=g)
    with torch.no_grad():
        d = torch.distributions.Categorical(logits=ac.pi(obs))
        act = d.sample()
        old_logp = d.log_prob(act)
        old_v = ac.v(obs).squeeze(-1)
    ret = torch.randn(32, generator=g)
    adv = ret - old_v
    clip_coef, ent_coef, vf_coef = 0.2, 0.01, 0.5

    def loss_fn(m, o, a, olp, ad, rt, ov):
        d = torch.distributions.Categorical(logits=m.pi(o))
        logp = d.log_prob(a)
        ad = (ad - ad.mean()) / (ad.std() + 1e-8)
        ratio = (logp - olp).exp()
        pg = torch.max(-ad * ratio, -ad * ratio.clamp(1 - clip_coef, 1 + clip_coef)).mean()
        v = m.v(o).squeeze(-1)
        vc = ov + (v - ov).clamp(-clip_coef, clip_coef)
        vl = 0.5 * torch.max((v - rt) ** 2, (vc - rt) ** 2).mean()
        return pg - ent_coef * d.entropy().mean() + vf_coef * vl

    step = ctx.step(ac, loss_fn, opt, max_norm=0.5)
    losses = []
    for _epoch in range(3):
        perm = torch.from_numpy(np.random.permutation(32))
        for mb in range(0, 32, 8):
            i = perm[mb : mb + 8]
            losses.append(step(obs[i], act[i], old_logp[i], adv[i], ret[i], old_v[i]))
        ent_coef *= 0.5  # annealed entropy bonus, a closure cell
    return {"ac": ac, "opt": opt, "losses": losses}


@dataclass
class Cfg:
    gamma: float = 0.99
    huber: bool = True


@scenario("step")
def step_dqn_target_in_loss_hard_update(ctx):
    q = mlp(6, 16, 3)
    target = copy.deepcopy(q)
    opt = torch.optim.Adam(q.parameters(), lr=1e-3, fused=True, capturable=True)
    cfg = Cfg()
    rng = np.random.default_rng(0)
    S = torch.from_numpy(rng.standard_normal((64, 6)).astype(np.float32))
    A = torch.from_numpy(rng.integers(0, 3, 64))
    R = torch.from_numpy(rng.standard_normal(64).astype(np.float32))
    S2 = torch.from_numpy(rng.standard_normal((64, 6)).astype(np.float32))

    def loss_fn(m, s, a, r, s2):
        with torch.no_grad():
            tgt = r + cfg.gamma * target(s2).max(1).values
        qsa = m(s).gather(1, a[:, None]).squeeze(1)
        return F.smooth_l1_loss(qsa, tgt) if cfg.huber else F.mse_loss(qsa, tgt)

    step = ctx.step(q, loss_fn, opt, max_norm=10.0)
    losses = []
    for it in range(12):
        i = torch.from_numpy(rng.choice(64, 8, replace=False))
        losses.append(step(S[i], A[i], R[i], S2[i]))
        if it % 4 == 3:
            target.load_state_dict(q.state_dict())
        if it == 6:
            cfg.gamma = 0.9  # the user changes the discount mid-run
    return {"q": q, "target": target, "opt": opt, "losses": losses}


@scenario("step")
def step_dqn_target_deepcopy_rebound(ctx):
    q = mlp(6, 16, 3)
    state = {"target": copy.deepcopy(q)}
    opt = torch.optim.SGD(q.parameters(), lr=0.01, momentum=0.9, fused=True)
    g = torch.Generator().manual_seed(1)
    S, A, R, S2 = (
        torch.randn(64, 6, generator=g),
        torch.randint(0, 3, (64,), generator=g),
        torch.randn(64, generator=g),
        torch.randn(64, 6, generator=g),
    )

    def loss_fn(m, s, a, r, s2):
        with torch.no_grad():
            tgt = r + 0.99 * state["target"](s2).max(1).values
        return F.mse_loss(m(s).gather(1, a[:, None]).squeeze(1), tgt)

    step = ctx.step(q, loss_fn, opt)
    losses = []
    for it in range(12):
        i = torch.from_numpy(np.random.choice(64, 8, replace=False))
        losses.append(step(S[i], A[i], R[i], S2[i]))
        if it % 4 == 3:
            state["target"] = copy.deepcopy(q)  # a new target object, bound in a dict
    return {"q": q, "target": state["target"], "opt": opt, "losses": losses}


@scenario("step")
def step_sac_critic_actor_alpha_steps(ctx):
    actor = nn.Sequential(nn.Linear(5, 32), nn.ReLU(), nn.Linear(32, 4))
    critic = nn.ModuleDict({"q1": mlp(7, 32, 1), "q2": mlp(7, 32, 1)})
    critic_t = copy.deepcopy(critic)
    for p in critic_t.parameters():
        p.requires_grad_(False)
    log_alpha = torch.zeros((), requires_grad=True)
    a_opt = adamw(actor.parameters(), lr=3e-4, weight_decay=0.0)
    q_opt = adamw(critic.parameters(), lr=3e-4, weight_decay=0.0)
    al_opt = torch.optim.Adam([log_alpha], lr=3e-4)
    g = torch.Generator().manual_seed(9)
    S, S2, R = (
        torch.randn(64, 5, generator=g),
        torch.randn(64, 5, generator=g),
        torch.randn(64, generator=g),
    )
    Aa = torch.randn(64, 2, generator=g).tanh()

    def policy(s):
        mu, log_std = actor(s).chunk(2, -1)
        std = log_std.clamp(-5, 2).exp()
        u = mu + std * torch.randn_like(mu)
        a = u.tanh()
        return a, (
            torch.distributions.Normal(mu, std).log_prob(u) - torch.log(1 - a.pow(2) + 1e-6)
        ).sum(-1)

    def q_loss(c, s, a, r, s2):
        alpha = log_alpha.exp().detach()
        with torch.no_grad():
            a2, lp2 = policy(s2)
            sa2 = torch.cat([s2, a2], -1)
            y = r + 0.99 * (torch.min(critic_t.q1(sa2), critic_t.q2(sa2)).squeeze(-1) - alpha * lp2)
        sa = torch.cat([s, a], -1)
        return F.mse_loss(c.q1(sa).squeeze(-1), y) + F.mse_loss(c.q2(sa).squeeze(-1), y)

    def pi_loss(m, s):
        alpha = log_alpha.exp().detach()
        a, lp = policy(s)
        sa = torch.cat([s, a], -1)
        for p in critic.parameters():
            p.requires_grad_(False)
        qv = torch.min(critic.q1(sa), critic.q2(sa)).squeeze(-1)
        for p in critic.parameters():
            p.requires_grad_(True)
        return (alpha * lp - qv).mean()

    qs = ctx.step(critic, q_loss, q_opt)
    ps = ctx.step(actor, pi_loss, a_opt)
    losses = []
    for _ in range(8):
        i = torch.from_numpy(np.random.randint(0, 64, 16))
        losses.append(qs(S[i], Aa[i], R[i], S2[i]))
        losses.append(ps(S[i]))
        with torch.no_grad():
            _, lp = policy(S[i])
        al = -(log_alpha * (lp + 2.0)).mean()
        al_opt.zero_grad()
        al.backward()
        al_opt.step()
        with torch.no_grad():
            for t, s_ in zip(critic_t.parameters(), critic.parameters(), strict=False):
                t.lerp_(s_, 0.005)
    return {
        "actor": actor,
        "critic": critic,
        "ct": critic_t,
        "alpha": log_alpha,
        "opts": [a_opt, q_opt, al_opt],
        "losses": losses,
    }


@scenario("step")
def step_global_dict_coef_changed(ctx):
    m, data = mlp(), vecs(10)
    opt = sgd(m, fused=True)
    CFG = {"l2": 1e-3}
    globals()["_CFG_STEP"] = CFG

    def loss_fn(mm, x, y):
        reg = sum(p.pow(2).sum() for p in mm.parameters())
        return F.cross_entropy(mm(x), y) + _CFG_STEP["l2"] * reg  # noqa: F821

    step = ctx.step(m, loss_fn, opt)
    losses = []
    for i, (x, y) in enumerate(data):
        if i == 5:
            CFG["l2"] = 1e-1  # the dict is mutated, not rebound
        losses.append(step(x, y))
    return {"m": m, "opt": opt, "losses": losses}


@scenario("step")
def step_list_coef_closure_mutated(ctx):
    m, data = mlp(), vecs(10)
    opt = sgd(m, fused=True)
    weights = [1.0, 0.0]  # [ce, l1] mixed; the schedule writes into the list

    def loss_fn(mm, x, y):
        out = mm(x)
        return weights[0] * F.cross_entropy(out, y) + weights[1] * out.abs().mean()

    step = ctx.step(m, loss_fn, opt)
    losses = []
    for i, (x, y) in enumerate(data):
        weights[1] = 0.1 * i
        losses.append(step(x, y))
    return {"m": m, "opt": opt, "losses": losses}


@scenario("step")
def step_criterion_label_smoothing_changed(ctx):
    m, data = mlp(), vecs(10)
    opt = sgd(m, fused=True)
    crit = nn.CrossEntropyLoss(label_smoothing=0.0)
    step = ctx.step(m, lambda mm, x, y: crit(mm(x), y), opt)
    losses = []
    for i, (x, y) in enumerate(data):
        if i == 4:
            crit.label_smoothing = 0.2
        losses.append(step(x, y))
    return {"m": m, "opt": opt, "losses": losses}


@scenario("step")
def step_class_weights_tensor_updated(ctx):
    m, data = mlp(), vecs(10)
    opt = sgd(m, fused=True)
    crit = nn.CrossEntropyLoss(weight=torch.ones(4))
    step = ctx.step(m, lambda mm, x, y: crit(mm(x), y), opt)
    losses = []
    for i, (x, y) in enumerate(data):
        counts = torch.bincount(y, minlength=4).float() + 1
        if i % 2 == 0:
            crit.weight = counts.sum() / counts  # a new tensor assigned to the buffer
        else:
            crit.weight.mul_(0.9)
        losses.append(step(x, y))
    return {"m": m, "opt": opt, "losses": losses, "w": crit.weight}


@scenario("step")
def step_checkpoint_roundtrip_midrun(ctx):
    m, data = TinyResNet(), images(10)
    opt = adamw(m.parameters(), lr=torch.tensor(1e-3))
    sched = torch.optim.lr_scheduler.StepLR(opt, 3, 0.5)
    step = ctx.step(m, ce, opt, max_norm=1.0)
    losses = []
    for i, (x, y) in enumerate(data):
        losses.append(step(x, y))
        sched.step()
        if i == 4:
            buf = io.BytesIO()
            torch.save({"m": m.state_dict(), "o": opt.state_dict(), "s": sched.state_dict()}, buf)
            buf.seek(0)
            ck = torch.load(buf)
            m.load_state_dict(ck["m"])
            opt.load_state_dict(ck["o"])
            sched.load_state_dict(ck["s"])
    return {"m": m, "opt": opt, "losses": losses}


@scenario("step")
def step_lr_by_hand_float(ctx):
    m, data = mlp(), vecs(10)
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    step = ctx.step(m, ce, opt)
    losses = []
    for i, (x, y) in enumerate(data):
        if i in (3, 7):
            for g in opt.param_groups:
                g["lr"] = g["lr"] * 0.1
                g["weight_decay"] = 1e-4
        losses.append(step(x, y))
    return {"m": m, "opt": opt, "losses": losses}


@scenario("step")
def step_tensor_lr_replaced_by_float(ctx):
    m, data = mlp(), vecs(10)
    opt = torch.optim.SGD(m.parameters(), lr=torch.tensor(0.1), momentum=0.9, fused=True)
    step = ctx.step(m, ce, opt)
    losses = []
    for i, (x, y) in enumerate(data):
        if i == 5:
            opt.param_groups[0]["lr"] = 0.01  # the user overwrites the tensor with a float
        losses.append(step(x, y))
    return {"m": m, "opt": opt, "losses": losses}


@scenario("step")
def step_tensor_lr_rebound_new_tensor(ctx):
    m, data = mlp(), vecs(10)
    opt = torch.optim.SGD(m.parameters(), lr=torch.tensor(0.1), momentum=0.9, fused=True)
    step = ctx.step(m, ce, opt)
    losses = []
    for i, (x, y) in enumerate(data):
        if i >= 5:
            opt.param_groups[0]["lr"] = torch.tensor(0.1 / i)  # a new tensor per step
        losses.append(step(x, y))
    return {"m": m, "opt": opt, "losses": losses}


@scenario("step")
def step_add_param_group_midrun(ctx):
    m = nn.ModuleDict({"body": mlp(8, 16, 8), "head": nn.Linear(8, 4)})
    for p in m["head"].parameters():
        p.requires_grad_(False)
    opt = torch.optim.SGD(m["body"].parameters(), lr=0.05, momentum=0.9, fused=True)
    data = vecs(10)
    step = ctx.step(m, lambda mm, x, y: F.cross_entropy(mm["head"](mm["body"](x)), y), opt)
    losses = []
    for i, (x, y) in enumerate(data):
        if i == 5:
            for p in m["head"].parameters():
                p.requires_grad_(True)
            opt.add_param_group({"params": m["head"].parameters(), "lr": 0.01})
        losses.append(step(x, y))
    return {"m": m, "opt": opt, "losses": losses}


@scenario("step")
def step_freeze_layer_midrun_no_opt_change(ctx):
    m, data = TinyResNet(), images(10)
    opt = sgd(m, fused=True)
    step = ctx.step(m, ce, opt)
    losses = []
    for i, (x, y) in enumerate(data):
        if i == 4:
            m.stem.requires_grad_(False)
        if i == 8:
            m.stem.requires_grad_(True)
        losses.append(step(x, y))
    return {"m": m, "opt": opt, "losses": losses}


@scenario("step")
def step_eval_validation_between(ctx):
    m, data = mobilenet(), images(10)
    opt = sgd(m, fused=True)
    step = ctx.step(m, ce, opt)
    losses, vals = [], []
    for i, (x, y) in enumerate(data):
        m.train()
        losses.append(step(x, y))
        if i % 3 == 2:
            m.eval()
            vals.append(m(data[0][0]).detach())
            with torch.no_grad():
                vals.append(m(data[1][0]))
    return {"m": m, "opt": opt, "losses": losses, "vals": vals}


@scenario("step")
def step_forgot_train_after_eval(ctx):
    """Validation leaves the model in eval(); the user forgets model.train() for a while."""
    m, data = mobilenet(), images(10)
    opt = sgd(m, fused=True)
    step = ctx.step(m, ce, opt)
    losses = []
    for i, (x, y) in enumerate(data):
        if i == 4:
            m.eval()
        if i == 7:
            m.train()
        losses.append(step(x, y))
    return {"m": m, "opt": opt, "losses": losses}


@scenario("step")
def step_keep_loss_tensors_and_metrics(ctx):
    m, data = mlp(), vecs(10)
    opt = sgd(m, fused=True)
    step = ctx.step(m, ce, opt, accumulate=2)
    kept, running = [], torch.zeros(())
    for x, y in data:
        loss = step(x, y)
        kept.append(loss)  # no .item(), no clone: summed at epoch end
        running += loss
    return {"m": m, "opt": opt, "kept": kept, "running": running, "mean": torch.stack(kept).mean()}


@scenario("step")
def step_lstm_tbptt_hidden_through_closure(ctx):
    m = LSTMLM(cell=nn.GRU)
    opt = adamw(m.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(3)
    stream = torch.randint(0, 20, (4, 61), generator=g)
    state = {"h": torch.zeros(1, 4, 12)}

    def loss_fn(mm, x, y):
        out, h = mm(x, state["h"])
        state["h"] = h.detach()
        return F.cross_entropy(out.reshape(-1, 20), y.reshape(-1))

    step = ctx.step(m, loss_fn, opt, max_norm=0.5)
    losses = []
    for t in range(0, 60, 6):
        losses.append(step(stream[:, t : t + 6], stream[:, t + 1 : t + 7]))
    return {"m": m, "opt": opt, "losses": losses, "h": state["h"]}


@scenario("step")
def step_lstm_tbptt_hidden_as_argument(ctx):
    m = LSTMLM()
    opt = adamw(m.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(3)
    stream = torch.randint(0, 20, (4, 61), generator=g)
    h = (torch.zeros(1, 4, 12), torch.zeros(1, 4, 12))
    hs: list = []

    def loss_fn(mm, x, y, h0, c0):
        out, (h1, c1) = mm(x, (h0, c0))
        hs.clear()
        hs.extend([h1.detach(), c1.detach()])
        return F.cross_entropy(out.reshape(-1, 20), y.reshape(-1))

    step = ctx.step(m, loss_fn, opt, max_norm=0.5)
    losses = []
    for t in range(0, 60, 6):
        losses.append(step(stream[:, t : t + 6], stream[:, t + 1 : t + 7], *h))
        h = tuple(hs)
    return {"m": m, "opt": opt, "losses": losses, "h": list(h)}


@scenario("step")
def step_gpt_causal_padding_masks(ctx):
    m = TinyGPT()
    opt = adamw(m.parameters(), lr=torch.tensor(1e-3))
    g = torch.Generator().manual_seed(6)

    def loss_fn(mm, x, pad):
        logits = mm(x, pad)
        tgt = x[:, 1:].masked_fill(pad[:, 1:], -100)
        return F.cross_entropy(logits[:, :-1].reshape(-1, 24), tgt.reshape(-1), ignore_index=-100)

    step = ctx.step(m, loss_fn, opt, max_norm=1.0, accumulate=2)
    losses = []
    for i in range(12):
        x = torch.randint(0, 24, (3, 10), generator=g)
        pad = torch.zeros(3, 10, dtype=torch.bool)
        L = int(torch.randint(6, 11, (1,), generator=g))
        pad[i % 3, L:] = True
        losses.append(step(x, pad))
    return {"m": m, "opt": opt, "losses": losses}


@scenario("step")
def step_variable_microbatch_accum(ctx):
    m = mlp()
    opt = sgd(m, fused=True)
    g = torch.Generator().manual_seed(14)
    sizes = [8, 8, 8, 5, 8, 8, 8, 3, 8, 8, 8, 8]
    step = ctx.step(
        m, lambda mm, x, y: F.cross_entropy(mm(x), y, reduction="sum") / 32, opt, accumulate=4
    )
    losses = [
        step(torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g)) for n in sizes
    ]
    return {"m": m, "opt": opt, "losses": losses}


@scenario("step")
def step_teacher_forcing_flag_arg(ctx):
    class Dec(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(12, 8)
            self.cell = nn.GRUCell(8, 16)
            self.out = nn.Linear(16, 12)

    m = Dec()
    opt = sgd(m, fused=True)

    def loss_fn(mm, tgt, tf):
        h = torch.zeros(tgt.shape[0], 16)
        inp = tgt[:, 0]
        loss = 0.0
        for t in range(1, tgt.shape[1]):
            h = mm.cell(mm.emb(inp), h)
            o = mm.out(h)
            loss = loss + F.cross_entropy(o, tgt[:, t])
            inp = tgt[:, t] if tf else o.argmax(-1)
        return loss / (tgt.shape[1] - 1)

    step = ctx.step(m, loss_fn, opt)
    g = torch.Generator().manual_seed(15)
    losses = [
        step(torch.randint(0, 12, (4, 6), generator=g), random.random() < 0.5) for _ in range(10)
    ]
    return {"m": m, "opt": opt, "losses": losses}


@scenario("step")
def step_loss_logs_into_list(ctx):
    m, data = mlp(), vecs(10)
    opt = sgd(m, fused=True)
    log = []

    def loss_fn(mm, x, y):
        out = mm(x)
        loss = F.cross_entropy(out, y)
        log.append({"acc": (out.argmax(1) == y).float().mean().detach(), "loss": loss.detach()})
        return loss

    step = ctx.step(m, loss_fn, opt)
    losses = [step(x, y) for x, y in data]
    return {"m": m, "opt": opt, "losses": losses, "log": log}


@scenario("step")
def step_swa_averagedmodel_swalr(ctx):
    from torch.optim.swa_utils import SWALR, AveragedModel

    m, data = mlp(), vecs(12)
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, fused=True)
    swa = AveragedModel(m)
    swa_sched = SWALR(opt, swa_lr=0.01, anneal_epochs=3)
    step = ctx.step(m, ce, opt)
    losses = []
    for i, (x, y) in enumerate(data):
        losses.append(step(x, y))
        if i >= 6:
            swa.update_parameters(m)
            swa_sched.step()
    return {"m": m, "opt": opt, "swa": swa, "losses": losses}


@scenario("step")
def step_optimizer_state_reset(ctx):
    m, data = mlp(), vecs(10)
    opt = adamw(m.parameters())
    step = ctx.step(m, ce, opt)
    losses = []
    for i, (x, y) in enumerate(data):
        if i == 5:
            opt.state.clear()  # warm restart
        losses.append(step(x, y))
    return {"m": m, "opt": opt, "losses": losses}


@scenario("step")
def step_weight_reinit_inplace(ctx):
    """Re-initialise the head in place mid-run (a common fine-tuning trick)."""
    m, data = mlp(), vecs(10)
    opt = sgd(m, fused=True)
    step = ctx.step(m, ce, opt)
    losses = []
    for i, (x, y) in enumerate(data):
        if i == 5:
            nn.init.zeros_(m[2].weight)
            nn.init.zeros_(m[2].bias)
            m[2].reset_parameters()
        losses.append(step(x, y))
    return {"m": m, "opt": opt, "losses": losses}


# ========================================================= Lightning whole_step (manual opt.)


def _lightning_fit(ctx, module_cls, n=10, **trainer_kw):
    import lightning as L

    data = vecs(n)
    loader = torch.utils.data.DataLoader(
        list(zip(*[torch.cat(t) for t in zip(*data, strict=False)], strict=False)), batch_size=8
    )
    mod = module_cls(ctx)
    kw = {"accelerator": "cpu", "max_epochs": 1, "logger": False, "enable_checkpointing": False,
          "enable_progress_bar": False, "enable_model_summary": False, **trainer_kw}  # fmt: skip
    tr = L.Trainer(**kw)
    tr.fit(mod, loader, **({"val_dataloaders": loader} if hasattr(mod, "validation_step") else {}))
    if ctx.replay:
        ctx.entries.append(mod.step)
    return {"net": mod.net, "opt": mod.optimizers().optimizer, "losses": mod.losses,
            "gs": tr.global_step}  # fmt: skip


def _lmodule(**step_kw):
    import lightning as L

    class LM(L.LightningModule):
        def __init__(self, ctx):
            super().__init__()
            self.ctx = ctx
            self.automatic_optimization = False
            self.net = nn.Sequential(
                nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4)
            )
            self.losses = []

        def configure_optimizers(self):
            return torch.optim.SGD(self.net.parameters(), lr=0.05, momentum=0.9, fused=True)

        def on_train_start(self):
            if self.ctx.replay:
                from replaykit.lightning import whole_step

                self.step = whole_step(self, self.net, ce, backend="emulated", **step_kw)
            else:
                self.step = None

        def training_step(self, batch, idx):
            x, y = batch
            if self.step is not None:
                loss = self.step(x, y)
            else:
                opt = self.optimizers()
                loss = ce(self.net, x, y)
                acc = step_kw.get("accumulate", 1)
                self.manual_backward(loss / acc if acc > 1 else loss)
                if (idx + 1) % acc == 0:
                    if "max_norm" in step_kw:
                        nn.utils.clip_grad_norm_(
                            list(self.net.parameters()), step_kw["max_norm"], foreach=True
                        )
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                loss = loss.detach()
            self.losses.append(loss)
            self.log("train_loss", loss)

    return LM


@scenario("whole_step")
def ls_basic_clip(ctx):
    return _lightning_fit(ctx, _lmodule(max_norm=1.0))


@scenario("whole_step")
def ls_accumulate_2(ctx):
    return _lightning_fit(ctx, _lmodule(accumulate=2), n=12)


@scenario("whole_step")
def ls_with_validation_and_scheduler(ctx):
    base = _lmodule()

    class LM(base):
        def validation_step(self, batch, idx):
            x, y = batch
            self.log("val", ce(self.net, x, y))

        def configure_optimizers(self):
            opt = torch.optim.SGD(
                self.net.parameters(), lr=torch.tensor(0.05), momentum=0.9, fused=True
            )
            return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, 0.7)}

        def on_train_epoch_end(self):
            self.lr_schedulers().step()

    return _lightning_fit(ctx, LM, n=10, max_epochs=2, val_check_interval=5)


@scenario("whole_step")
def ls_unfreeze_in_hook(ctx):
    base = _lmodule()

    class LM(base):
        def configure_optimizers(self):  # fused SGD refuses a frozen parameter's None grad
            return torch.optim.SGD(self.net.parameters(), lr=0.05, momentum=0.9)

        def on_train_start(self):
            self.net[0].requires_grad_(False)
            super().on_train_start()

        def on_train_batch_start(self, batch, idx):
            if idx == 4:
                self.net[0].requires_grad_(True)

    return _lightning_fit(ctx, LM, n=10)


# ============================================================ batch 2: host state the code reads

TEMPERATURE = 1.0


class CfgObj:
    temperature = 1.0


CFG_OBJ = CfgObj()
CFG_DICT = {"temperature": 1.0}


class GlobalTempNet(nn.Module):
    """Distillation-style logits / T, T read from module-level config objects."""

    def __init__(self, how):
        super().__init__()
        self.how = how
        self.body = mlp()
        self.cfg = {"temperature": 1.0}
        self.cfg_obj = CfgObj()
        self.cfg_cls = CfgObj  # config-as-class, held by the module

    def forward(self, x):
        t = {
            "global": lambda: TEMPERATURE,
            "global_obj": lambda: CFG_OBJ.temperature,
            "global_dict": lambda: CFG_DICT["temperature"],
            "self_dict": lambda: self.cfg["temperature"],
            "self_obj": lambda: self.cfg_obj.temperature,
            "class_attr": lambda: type(self.cfg_obj).temperature,
            "class_via_instance": lambda: CFG_OBJ.temperature,
            "self_class_cfg": lambda: self.cfg_cls.temperature,
        }[self.how]()
        return self.body(x) / t


def _temp_loop(ctx, how, entry):
    global TEMPERATURE
    TEMPERATURE, CfgObj.temperature, CFG_DICT["temperature"] = 1.0, 1.0, 1.0
    vars(CFG_OBJ).pop("temperature", None)  # the eager run's instance attribute
    m, data = GlobalTempNet(how), vecs(10)
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, fused=True)

    def set_t(v):
        global TEMPERATURE
        if how == "global":
            TEMPERATURE = v
        elif how == "global_obj":
            CFG_OBJ.temperature = v
        elif how == "global_dict":
            CFG_DICT["temperature"] = v
        elif how == "self_dict":
            m.cfg["temperature"] = v
        elif how == "self_obj":
            m.cfg_obj.temperature = v
        elif how in ("class_attr", "class_via_instance", "self_class_cfg"):
            CfgObj.temperature = v

    losses = []
    if entry == "capture":
        with ctx.capture(m):
            for i, (x, y) in enumerate(data):
                if i == 5:
                    set_t(4.0)
                loss = ce(m, x, y)
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.detach())
    else:
        step = ctx.step(m, ce, opt)
        for i, (x, y) in enumerate(data):
            if i == 5:
                set_t(4.0)
            losses.append(step(x, y))
    return {"m": m, "opt": opt, "losses": losses}


for _how in ("global", "global_obj", "global_dict", "self_dict", "self_obj", "class_attr",
             "class_via_instance", "self_class_cfg"):  # fmt: skip
    for _entry in ("capture", "step"):

        def _fn(ctx, _h=_how, _e=_entry):
            return _temp_loop(ctx, _h, _e)

        _fn.__name__ = (
            f"{'cap' if _entry == 'capture' else 'step'}_forward_reads_{_how}_temperature"
        )
        scenario(_entry)(_fn)


@scenario("step")
def step_param_not_in_optimizer(ctx):
    """The user forgot to give the head to the optimizer: its .grad accumulates forever in eager."""
    m = nn.ModuleDict({"body": mlp(8, 16, 8), "head": nn.Linear(8, 4)})
    opt = torch.optim.SGD(m["body"].parameters(), lr=0.05, momentum=0.9, fused=True)
    step = ctx.step(
        m, lambda mm, x, y: F.cross_entropy(mm["head"](mm["body"](x)), y), opt, max_norm=1.0
    )
    losses = [step(x, y) for x, y in vecs(10)]
    return {"m": m, "opt": opt, "losses": losses}


@scenario("capture")
def cap_param_not_in_optimizer(ctx):
    m = nn.ModuleDict({"body": mlp(8, 16, 8), "head": nn.Linear(8, 4)})
    opt = torch.optim.SGD(m["body"].parameters(), lr=0.05, momentum=0.9)
    with ctx.capture(m):
        for x, y in vecs(10):
            loss = F.cross_entropy(m["head"](m["body"](x)), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
    return {"m": m, "opt": opt}


@scenario("capture")
def cap_fgsm_adversarial_training(ctx):
    m, data = TinyResNet(), images(8)
    opt = sgd(m)
    with ctx.capture(m):
        for x, y in data:
            x = x.clone().requires_grad_(True)
            loss = ce(m, x, y)
            (gx,) = torch.autograd.grad(loss, x)
            x_adv = (x + 0.03 * gx.sign()).detach()
            opt.zero_grad()
            loss2 = 0.5 * ce(m, x.detach(), y) + 0.5 * ce(m, x_adv, y)
            loss2.backward()
            opt.step()
    return {"m": m, "opt": opt}


@scenario("step")
def step_fgsm_inside_loss(ctx):
    m, data = mlp(), vecs(8)
    opt = sgd(m, fused=True)

    def loss_fn(mm, x, y):
        x = x.clone().requires_grad_(True)
        (gx,) = torch.autograd.grad(F.cross_entropy(mm(x), y), x)
        x_adv = (x + 0.05 * gx.sign()).detach()
        return F.cross_entropy(mm(x_adv), y)

    step = ctx.step(m, loss_fn, opt)
    losses = [step(x, y) for x, y in data]
    return {"m": m, "opt": opt, "losses": losses}


@scenario("capture")
def cap_backward_inputs_subset(ctx):
    """loss.backward(inputs=...) to update only the head (a linear probe over a frozen-ish body)."""
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    with ctx.capture(m):
        for i, (x, y) in enumerate(vecs(10)):
            loss = ce(m, x, y)
            loss.backward(inputs=list(m[2].parameters()) if i % 2 else None)
            opt.step()
            opt.zero_grad()
    return {"m": m, "opt": opt}


@scenario("capture")
def cap_rl_action_mask_inplace_on_logits(ctx):
    m = mlp(6, 16, 4)
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(21)
    with ctx.capture(m):
        for _ in range(10):
            s = torch.randn(8, 6, generator=g)
            mask = torch.rand(8, 4, generator=g) > 0.3
            mask[:, 0] = True
            logits = m(s)
            logits[~mask] = -1e9  # in place on the module's output
            a = torch.randint(0, 4, (8,), generator=g) * mask[:, 0]
            loss = F.cross_entropy(logits, a)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return {"m": m, "opt": opt}


@scenario("capture")
def cap_spectral_norm_discriminator(ctx):
    D = nn.Sequential(nn.utils.parametrizations.spectral_norm(nn.Linear(8, 16)), nn.LeakyReLU(0.2),
                      nn.utils.parametrizations.spectral_norm(nn.Linear(16, 1)))  # fmt: skip
    opt = torch.optim.Adam(D.parameters(), lr=2e-4, betas=(0.0, 0.9))
    g = torch.Generator().manual_seed(22)
    with ctx.capture(D):
        for _ in range(8):
            real, fake = torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)
            loss = F.relu(1 - D(real)).mean() + F.relu(1 + D(fake)).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    return {"D": D, "opt": opt}


@scenario("step")
def step_weight_norm_parametrization(ctx):
    m = nn.Sequential(
        nn.utils.parametrizations.weight_norm(nn.Linear(8, 16)), nn.ReLU(), nn.Linear(16, 4)
    )
    opt = sgd(m, fused=True)
    step = ctx.step(m, ce, opt)
    losses = [step(x, y) for x, y in vecs(10)]
    return {"m": m, "opt": opt, "losses": losses}


@scenario("capture")
def cap_bn_cumulative_momentum_none(ctx):
    m = nn.Sequential(
        nn.Linear(8, 16), nn.BatchNorm1d(16, momentum=None), nn.ReLU(), nn.Linear(16, 4)
    )
    opt = sgd(m)
    with ctx.capture(m):
        for x, y in vecs(10):
            loss = ce(m, x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
    return {"m": m, "opt": opt}


@scenario("capture")
def cap_reseed_each_epoch_dropout(ctx):
    m = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 4))
    opt = sgd(m)
    data = vecs(4)
    with ctx.capture(m):
        for epoch in range(3):
            torch.manual_seed(1234 + epoch)  # reproducible epochs
            for x, y in data:
                loss = ce(m, x, y)
                loss.backward()
                opt.step()
                opt.zero_grad()
    return {"m": m, "opt": opt, "rng": torch.get_rng_state()}


@scenario("step")
def step_reseed_and_fork_rng_dropout(ctx):
    m = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 4))
    opt = sgd(m, fused=True)
    step = ctx.step(m, ce, opt)
    losses = []
    for epoch in range(3):
        torch.manual_seed(1234 + epoch)
        for x, y in vecs(4):
            with torch.random.fork_rng():
                torch.manual_seed(7)
                noise = torch.randn(x.shape)
            losses.append(step(x + 0.01 * noise, y))
    return {"m": m, "opt": opt, "losses": losses, "rng": torch.get_rng_state()}


class ObsNorm(nn.Module):
    """RL observation normaliser updated in forward (running mean/var as buffers)."""

    def __init__(self, d):
        super().__init__()
        self.register_buffer("mean", torch.zeros(d))
        self.register_buffer("var", torch.ones(d))
        self.register_buffer("count", torch.tensor(1e-4))

    def forward(self, x):
        if self.training:
            with torch.no_grad():
                bm, bv, n = x.mean(0), x.var(0, unbiased=False), x.shape[0]
                tot = self.count + n
                delta = bm - self.mean
                self.mean += delta * n / tot
                self.var.copy_(
                    (self.var * self.count + bv * n + delta**2 * self.count * n / tot) / tot
                )
                self.count.copy_(tot)
        return ((x - self.mean) / (self.var + 1e-8).sqrt()).clamp(-5, 5)


@scenario("capture")
def cap_obs_normaliser_buffers(ctx):
    m = nn.Sequential(ObsNorm(6), mlp(6, 16, 3))
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(23)
    with ctx.capture(m):
        for _ in range(10):
            s = torch.randn(8, 6, generator=g) * 3 + 1
            loss = m(s).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    return {"m": m, "opt": opt}


@scenario("step")
def step_obs_normaliser_buffers(ctx):
    m = nn.Sequential(ObsNorm(6), mlp(6, 16, 3))
    opt = adamw(m.parameters())
    g = torch.Generator().manual_seed(23)
    step = ctx.step(m, lambda mm, s: mm(s).pow(2).mean(), opt)
    losses = [step(torch.randn(8, 6, generator=g) * 3 + 1) for _ in range(10)]
    return {"m": m, "opt": opt, "losses": losses}


@scenario("capture")
def cap_zero_grad_keep_and_accumulate(ctx):
    """Old-style zero_grad(set_to_none=False), a grad-norm logger holding p.grad between steps."""
    m = TinyResNet()
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
    held = []
    with ctx.capture(m):
        for i, (x, y) in enumerate(images(12)):
            loss = ce(m, x, y) / 3
            loss.backward()
            if i % 3 == 2:
                held.append(m.fc.weight.grad)  # kept by reference for a norm plot
                opt.step()
                opt.zero_grad(set_to_none=False)
    return {"m": m, "opt": opt, "held": [h.clone() for h in held]}


@scenario("capture")
def cap_wgan_weight_clipping_data(ctx):
    D = mlp(8, 16, 1)
    opt = torch.optim.RMSprop(D.parameters(), lr=5e-5)
    g = torch.Generator().manual_seed(24)
    with ctx.capture(D):
        for _ in range(10):
            real, fake = torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)
            loss = D(fake).mean() - D(real).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            for p in D.parameters():
                p.data.clamp_(-0.01, 0.01)
    return {"D": D, "opt": opt}


@scenario("capture")
def cap_model_to_double_midrun(ctx):
    m = mlp()
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    with ctx.capture(m):
        for i, (x, y) in enumerate(vecs(10)):
            if i == 5:
                m.double()
            loss = ce(m, x.to(next(m.parameters()).dtype), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
    return {"m": m, "opt": opt}


@scenario("step")
def step_closure_hparam_object_bound_method(ctx):
    class Learner:
        def __init__(self):
            self.ent_coef = 0.05
            self.aux = {"w": 0.5}

        def loss(self, m, x, y):
            out = m(x)
            p = out.softmax(-1)
            ent = -(p * p.clamp_min(1e-8).log()).sum(-1).mean()
            return F.cross_entropy(out, y) - self.ent_coef * ent + self.aux["w"] * out.pow(2).mean()

    m = mlp()
    opt = sgd(m, fused=True)
    L_ = Learner()
    step = ctx.step(m, L_.loss, opt)
    losses = []
    for i, (x, y) in enumerate(vecs(10)):
        if i == 4:
            L_.ent_coef = 0.01
        if i == 7:
            L_.aux["w"] = 0.0
        losses.append(step(x, y))
    return {"m": m, "opt": opt, "losses": losses}


@scenario("step")
def step_loss_helper_in_other_module_global(ctx):
    import types

    helpers = types.ModuleType("user_losses")
    exec(
        "import torch.nn.functional as F\nGAMMA = 2.0\n"
        "def focal(logits, y):\n"
        "    logp = F.log_softmax(logits, -1).gather(1, y[:, None]).squeeze(1)\n"
        "    return (-(1 - logp.exp()) ** GAMMA * logp).mean()\n",
        helpers.__dict__,
    )
    m = mlp()
    opt = sgd(m, fused=True)
    step = ctx.step(m, lambda mm, x, y: helpers.focal(mm(x), y), opt)
    losses = []
    for i, (x, y) in enumerate(vecs(10)):
        if i == 5:
            helpers.GAMMA = 0.0
        losses.append(step(x, y))
    return {"m": m, "opt": opt, "losses": losses}


@scenario("capture")
def cap_forward_step_counter_attr_from_loop(ctx):
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = mlp()
            self.warm = 4
            self.it = 0  # the loop sets it; forward reads it (a curriculum)

        def forward(self, x):
            out = self.body(x)
            return out * 0.5 if self.it < self.warm else out

    m = Net()
    opt = sgd(m)
    with ctx.capture(m):
        for i, (x, y) in enumerate(vecs(10)):
            m.it = i
            loss = ce(m, x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
    return {"m": m, "opt": opt}


@scenario("capture")
def cap_sliced_dataset_batches(ctx):
    """batch = X[i:i+bs] from a preloaded dataset tensor (the storage offset moves every step)."""
    m = mlp()
    opt = sgd(m)
    g = torch.Generator().manual_seed(25)
    X, Y = torch.randn(96, 8, generator=g), torch.randint(0, 4, (96,), generator=g)
    with ctx.capture(m):
        for i in range(0, 96, 8):
            loss = ce(m, X[i : i + 8], Y[i : i + 8])
            loss.backward()
            opt.step()
            opt.zero_grad()
    return {"m": m, "opt": opt}


# ==================================================== batch 3: AMP overflow, EMA warmup, checkpointing


@scenario("capture")
def cap_fp16_scaler_overflow_skips(ctx):
    m = mlp()
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40, growth_interval=2)
    losses = []
    with ctx.capture(m):
        for x, y in vecs(10):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = ce(m, x * 100, y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            losses.append(scaler.get_scale())
    return {"m": m, "opt": opt, "scaler": scaler, "scales": losses}


@scenario("step")
def step_fp16_scaler_overflow_skips(ctx):
    m = mlp()
    opt = adamw(
        m.parameters()
    )  # fused SGD skipping its first step keeps an uninitialised momentum buffer (torch)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40, growth_interval=2)
    step = ctx.step(
        m,
        lambda mm, x, y: ce(mm, x * 100, y),
        opt,
        scaler=scaler,
        precision="16-mixed",
        max_norm=1.0,
    )
    losses = [step(x, y) for x, y in vecs(10)]
    return {"m": m, "opt": opt, "scaler": scaler, "losses": losses}


@scenario("step")
def step_ema_decay_warmup_schedule(ctx):
    m, data = TinyResNet(), images(10)
    opt = sgd(m, fused=True)
    ema = ctx.ema(m, 0.0)
    step = ctx.step(m, ce, opt, ema=ema)
    losses = []
    for i, (x, y) in enumerate(data):
        ema.set_decay(min(0.999, (1 + i) / (10 + i)))  # timm-style EMA warmup
        losses.append(step(x, y))
    return {"m": m, "opt": opt, "ema": ema, "losses": losses}


@scenario("step")
def step_max_norm_changed_midrun(ctx):
    m, data = mlp(), vecs(10)
    opt = sgd(m, fused=True)
    step = ctx.step(m, ce, opt, max_norm=1.0)
    losses = []
    for i, (x, y) in enumerate(data):
        if i == 5:
            step.max_norm = 0.1
        losses.append(step(x, y))
    return {"m": m, "opt": opt, "losses": losses}


class CkptNet(nn.Module):
    def __init__(self, reentrant):
        super().__init__()
        self.reentrant = reentrant
        self.a = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Dropout(0.2), nn.Linear(32, 32))
        self.b = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Dropout(0.2))
        self.out = nn.Linear(32, 4)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        h = checkpoint(self.a, x, use_reentrant=self.reentrant)
        h = h + checkpoint(self.b, h, use_reentrant=self.reentrant)
        return self.out(h)


@scenario("capture")
def cap_activation_checkpoint_dropout(ctx):
    m = CkptNet(False)
    opt = sgd(m)
    with ctx.capture(m):
        for x, y in vecs(8):
            loss = ce(m, x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
    return {"m": m, "opt": opt, "rng": torch.get_rng_state()}


@scenario("step")
def step_activation_checkpoint_dropout(ctx):
    m = CkptNet(False)
    opt = sgd(m, fused=True)
    step = ctx.step(m, ce, opt)
    losses = [step(x, y) for x, y in vecs(8)]
    return {"m": m, "opt": opt, "losses": losses, "rng": torch.get_rng_state()}


class LazyRope(nn.Module):
    """An LLM-style rotary cache built lazily at the first forward (and grown for a longer one)."""

    def __init__(self, d=16):
        super().__init__()
        self.d = d
        self.cached = 0
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.q = nn.Linear(d, d)
        self.out = nn.Linear(d, 4)

    def forward(self, x):
        T = x.shape[1]
        if self.cached < T:
            inv = 1.0 / (10000 ** (torch.arange(0, self.d, 2).float() / self.d))
            ang = torch.outer(torch.arange(T).float(), inv)
            self.cos = torch.cat([ang.cos(), ang.cos()], -1)
            self.cached = T
        h = self.q(x) * self.cos[:T]
        return self.out(h.mean(1))


@scenario("capture")
def cap_lazy_rotary_cache(ctx):
    m = LazyRope()
    opt = sgd(m)
    g = torch.Generator().manual_seed(31)
    with ctx.capture(m):
        for i in range(10):
            T = 6 if i < 6 else 8
            x, y = torch.randn(4, T, 16, generator=g), torch.randint(0, 4, (4,), generator=g)
            loss = ce(m, x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
    return {"m": m, "opt": opt}


@scenario("step")
def step_lazy_rotary_cache(ctx):
    m = LazyRope()
    opt = sgd(m, fused=True)
    g = torch.Generator().manual_seed(31)
    step = ctx.step(m, ce, opt)
    losses = []
    for i in range(10):
        T = 6 if i < 6 else 8
        losses.append(
            step(torch.randn(4, T, 16, generator=g), torch.randint(0, 4, (4,), generator=g))
        )
    return {"m": m, "opt": opt, "losses": losses}


@scenario("capture")
def cap_inference_mode_validation(ctx):
    m = TinyResNet()
    opt = sgd(m)
    vals = []
    data = images(8)
    with ctx.capture(m):
        for i, (x, y) in enumerate(data):
            m.train()
            loss = ce(m, x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            if i % 2:
                m.eval()
                with torch.inference_mode():
                    vals.append(m(data[0][0]).clone())
    return {"m": m, "opt": opt, "vals": vals}


@scenario("capture")
def cap_input_augmented_inplace_before_backward(ctx):
    """The batch is reused: noise added in place after the forward, for a second (consistency) pass."""
    m = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    opt = sgd(m)
    with ctx.capture(m):
        for x, y in vecs(8):
            x = x.clone()
            a = m(x)
            with torch.no_grad():
                x.add_(0.1 * torch.randn_like(x))  # eager: Linear saved x, so backward raises
            b = m(x)
            loss = F.cross_entropy(a, y) + F.mse_loss(b, a.detach())
            loss.backward()
            opt.step()
            opt.zero_grad()
    return {"m": m, "opt": opt}


# ============================= batch 4: TrainStep with an optimizer step that runs eagerly (default Adam)


def _eager_opt_loop(
    ctx, opt_fn, *, steps=10, accumulate=1, scaler=False, ema=False, before=None, **kw
):
    m = TinyResNet()
    opt = opt_fn(m)
    sc = torch.amp.GradScaler("cpu", init_scale=2.0**8) if scaler else None
    e = ctx.ema(m, 0.9) if ema else None
    prec = "16-mixed" if scaler else kw.pop("precision", "32")
    step = ctx.step(m, ce, opt, accumulate=accumulate, scaler=sc, ema=e, precision=prec, **kw)
    losses = []
    for i, (x, y) in enumerate(images(steps * accumulate)):
        if before is not None:
            before(i, m, opt)
        losses.append(step(x, y))
    return {"m": m, "opt": opt, "losses": losses, "scaler": sc, "ema": e}


@scenario("step")
def step_default_adam_accum_clip(ctx):
    return _eager_opt_loop(
        ctx, lambda m: torch.optim.Adam(m.parameters(), lr=1e-3), accumulate=2, max_norm=1.0
    )


@scenario("step")
def step_default_adamw_nonfused_scaler_ema(ctx):
    return _eager_opt_loop(
        ctx,
        lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3),
        scaler=True,
        ema=True,
        max_norm=1.0,
    )


@scenario("step")
def step_rmsprop_cosine_float_lr(ctx):
    state = {}

    def opt_fn(m):
        o = torch.optim.RMSprop(m.parameters(), lr=1e-3, momentum=0.9)
        state["s"] = torch.optim.lr_scheduler.CosineAnnealingLR(o, 10)
        return o

    def before(i, m, opt):
        if i:
            state["s"].step()

    return _eager_opt_loop(ctx, opt_fn, before=before)


@scenario("step")
def step_default_adam_state_reset_and_group_added(ctx):
    extra = nn.Parameter(torch.zeros(5))

    def before(i, m, opt):
        if i == 4:
            opt.state.clear()
        if i == 6:
            m.fc.bias.requires_grad_(True)
            opt.param_groups[0]["lr"] = 5e-4

    return _eager_opt_loop(
        ctx, lambda m: torch.optim.Adam(m.parameters(), lr=1e-3, weight_decay=1e-4), before=before
    ) | {"extra": extra}


@scenario("step")
def step_default_adam_freeze_midrun(ctx):
    def before(i, m, opt):
        if i == 3:
            m.stem.requires_grad_(False)
        if i == 7:
            m.stem.requires_grad_(True)

    return _eager_opt_loop(ctx, lambda m: torch.optim.Adam(m.parameters(), lr=1e-3), before=before)


@scenario("step")
def step_default_adam_checkpoint_reload(ctx):
    def before(i, m, opt):
        if i == 5:
            buf = io.BytesIO()
            torch.save({"m": m.state_dict(), "o": opt.state_dict()}, buf)
            buf.seek(0)
            ck = torch.load(buf)
            m.load_state_dict(ck["m"])
            opt.load_state_dict(ck["o"])

    return _eager_opt_loop(
        ctx, lambda m: torch.optim.Adam(m.parameters(), lr=1e-3), before=before, max_norm=0.5
    )


@scenario("step")
def step_adagrad_bf16_accum4(ctx):
    return _eager_opt_loop(
        ctx,
        lambda m: torch.optim.Adagrad(m.parameters(), lr=1e-2),
        accumulate=4,
        steps=4,
        precision="bf16-mixed",
    )


@scenario("step")
def step_default_adam_keeps_grads_between(ctx):
    """A grad-norm logger reads p.grad between accumulation micro-batches."""
    norms = []

    def before(i, m, opt):
        g = m.fc.weight.grad
        norms.append(None if g is None else g.norm())

    out = _eager_opt_loop(
        ctx,
        lambda m: torch.optim.Adam(m.parameters(), lr=1e-3),
        accumulate=3,
        steps=4,
        before=before,
    )
    return out | {"norms": norms}


# ======================================= batch 5: parameters read outside the captured forward too


@scenario("capture")
def cap_tied_lm_plus_l2_outside(ctx):
    """Weight-tied LM (embedding read twice inside) plus an L2 term on the same weight outside."""
    m = LSTMLM(tie=True)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(41)
    losses = []
    with ctx.capture(m):
        for _ in range(8):
            x, y = (
                torch.randint(0, 20, (4, 6), generator=g),
                torch.randint(0, 20, (4, 6), generator=g),
            )
            out, _ = m(x)
            loss = F.cross_entropy(out.reshape(-1, 20), y.reshape(-1))
            loss = loss + 1e-3 * sum(p.pow(2).sum() for p in m.parameters())
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
    return {"m": m, "opt": opt, "losses": losses}


@scenario("capture")
def cap_param_used_outside_twice(ctx):
    """A projection head's weight used in forward, and twice outside (orthogonality + L1)."""
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
    with ctx.capture(m):
        for x, y in vecs(8):
            W = m[2].weight
            loss = (
                ce(m, x, y) + 1e-2 * (W @ W.t() - torch.eye(4)).pow(2).sum() + 1e-3 * W.abs().sum()
            )
            loss.backward()
            opt.step()
            opt.zero_grad()
    return {"m": m, "opt": opt}


@scenario("capture")
def cap_two_submodules_captured_separately_shared_param(ctx):
    """Encoder captured alone; the decoder (not captured) shares the encoder's embedding."""
    emb = nn.Embedding(20, 12)
    enc = nn.Sequential(emb, nn.Flatten(), nn.Linear(12 * 5, 16))
    dec = nn.Linear(16, 12)
    params = list(enc.parameters()) + list(dec.parameters())
    opt = torch.optim.SGD(params, lr=0.1)
    g = torch.Generator().manual_seed(42)
    with ctx.capture(enc):
        for _ in range(8):
            x = torch.randint(0, 20, (4, 5), generator=g)
            h = enc(x)
            logits = dec(h) @ emb.weight.t()  # the decoder reads the encoder's embedding too
            loss = F.cross_entropy(logits, x[:, 0])
            loss.backward()
            opt.step()
            opt.zero_grad()
    return {"enc": enc, "dec": dec, "opt": opt}
