"""Round 4: RL learners, recurrent nets, host-side data, optimisation details, model shapes.

Each ``fn(ctx) -> dict`` runs a user's loop; ``ctx.capture`` / ``ctx.step`` are round 1's
(``scripts/hostile/single/harness.py``): replaykit under replay, plain PyTorch in eager.
"""

from __future__ import annotations

import copy
import math
import random
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from harness import scenario
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

# ----------------------------------------------------------------------------- helpers


def qnet(obs=6, act=3, h=32):
    return nn.Sequential(
        nn.Linear(obs, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, act)
    )


def fused_sgd(params, lr=0.05, **kw):
    return torch.optim.SGD(params, lr=lr, momentum=0.9, fused=True, **kw)


def fused_adamw(params, lr=1e-3, **kw):
    return torch.optim.AdamW(params, lr=lr, fused=True, capturable=True, **kw)


class Replay:
    """A numpy ring buffer, as in most DQN/SAC code."""

    def __init__(self, n=256, obs=6):
        self.o = np.zeros((n, obs), np.float32)
        self.a = np.zeros(n, np.int64)
        self.r = np.zeros(n, np.float32)
        self.o2 = np.zeros((n, obs), np.float32)
        self.d = np.zeros(n, np.float32)
        self.i, self.full, self.n = 0, False, n

    def add(self, o, a, r, o2, d):
        self.o[self.i], self.a[self.i], self.r[self.i], self.o2[self.i], self.d[self.i] = (
            o, a, r, o2, d)  # fmt: skip
        self.i = (self.i + 1) % self.n
        self.full = self.full or self.i == 0

    def sample(self, b):
        idx = np.random.randint(0, self.n if self.full else self.i, size=b)
        return tuple(torch.from_numpy(x[idx]) for x in (self.o, self.a, self.r, self.o2, self.d))


def fill(buf, q, steps=64, eps=0.5):
    o = np.random.randn(6).astype(np.float32)
    for _ in range(steps):
        if random.random() < eps:
            a = random.randrange(3)
        else:
            with torch.no_grad():
                a = int(q(torch.from_numpy(o)).argmax())
        o2 = (o * 0.9 + np.random.randn(6) * 0.1).astype(np.float32)
        buf.add(o, a, float(o2[0] > 0), o2, float(random.random() < 0.05))
        o = o2


# ===================================================================== RL learners


@scenario("capture")
def cap_dqn_target_load_state_dict_every_k(ctx):
    q = qnet()
    tgt = copy.deepcopy(q)
    opt = torch.optim.Adam(q.parameters(), lr=1e-3)
    buf = Replay()
    fill(buf, q)
    losses = []
    with ctx.capture(q):
        for step in range(8):
            o, a, r, o2, d = buf.sample(16)
            with torch.no_grad():
                y = r + 0.99 * (1 - d) * tgt(o2).max(1).values
            qa = q(o).gather(1, a[:, None]).squeeze(1)
            loss = F.smooth_l1_loss(qa, y)
            opt.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(q.parameters(), 10.0)
            opt.step()
            losses.append(loss.detach())
            if step % 3 == 2:
                tgt.load_state_dict(q.state_dict())
            fill(buf, q, steps=4, eps=0.1)  # acting with the captured net, no_grad
    return {"q": q, "tgt": tgt, "opt": opt, "losses": losses}


@scenario("capture")
def cap_double_dqn_online_argmax_nograd(ctx):
    q = qnet()
    tgt = copy.deepcopy(q)
    opt = torch.optim.RMSprop(q.parameters(), lr=1e-3)
    buf = Replay()
    fill(buf, q)
    losses = []
    with ctx.capture(q):
        for step in range(8):
            o, a, r, o2, d = buf.sample(16)
            with torch.no_grad():
                a2 = q(o2).argmax(1, keepdim=True)
                y = r + 0.99 * (1 - d) * tgt(o2).gather(1, a2).squeeze(1)
            loss = F.mse_loss(q(o).gather(1, a[:, None]).squeeze(1), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(loss.item())
            if step % 2 == 1:
                for p, tp in zip(q.parameters(), tgt.parameters(), strict=True):
                    tp.data.copy_(p.data)
    return {"q": q, "tgt": tgt, "opt": opt, "losses": losses}


@scenario("step")
def step_dqn_target_copy_every_k(ctx):
    q = qnet()
    tgt = copy.deepcopy(q).requires_grad_(False)
    opt = fused_adamw(q.parameters())
    buf = Replay()
    fill(buf, q)

    def loss_fn(m, o, a, r, o2, d):
        with torch.no_grad():
            y = r + 0.99 * (1 - d) * tgt(o2).max(1).values
        return F.smooth_l1_loss(m(o).gather(1, a[:, None]).squeeze(1), y)

    step = ctx.step(q, loss_fn, opt, max_norm=10.0)
    losses = []
    for i in range(8):
        losses.append(step(*buf.sample(16)))
        if i % 3 == 2:
            with torch.no_grad():
                for p, tp in zip(q.parameters(), tgt.parameters(), strict=True):
                    tp.copy_(p)
    return {"q": q, "tgt": tgt, "opt": opt, "losses": losses}


@scenario("step")
def step_double_dqn_load_state_dict(ctx):
    q = qnet()
    tgt = qnet()
    tgt.load_state_dict(q.state_dict())
    opt = fused_sgd(q.parameters(), lr=0.01)
    buf = Replay()
    fill(buf, q)
    gamma = 0.99

    def loss_fn(m, o, a, r, o2, d):
        with torch.no_grad():
            a2 = m(o2).argmax(1, keepdim=True)
            y = r + gamma * (1 - d) * tgt(o2).gather(1, a2).squeeze(1)
        return F.mse_loss(m(o).gather(1, a[:, None]).squeeze(1), y)

    step = ctx.step(q, loss_fn, opt)
    losses = []
    for i in range(8):
        losses.append(step(*buf.sample(16)))
        if i % 2 == 1:
            tgt.load_state_dict(q.state_dict())
    return {"q": q, "tgt": tgt, "opt": opt, "losses": losses}


class ActorCritic(nn.Module):
    def __init__(self, obs=6, act=3):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(obs, 32), nn.Tanh())
        self.pi = nn.Linear(32, act)
        self.v = nn.Linear(32, 1)

    def forward(self, o):
        h = self.body(o)
        return self.pi(h), self.v(h).squeeze(-1)


def rollout(ac, n=32):
    g = torch.Generator().manual_seed(5)
    obs = torch.randn(n, 6, generator=g)
    with torch.no_grad():
        logits, v = ac(obs)
        dist = torch.distributions.Categorical(logits=logits)
        act = dist.sample()
        logp = dist.log_prob(act)
    ret = torch.randn(n, generator=g)
    return obs, act, logp, v, ret, ret - v


@scenario("step")
def step_ppo_randperm_value_clip_ent_anneal(ctx):
    ac = ActorCritic()
    opt = torch.optim.Adam(
        ac.parameters(), lr=torch.tensor(3e-4), eps=1e-5, fused=True, capturable=True
    )
    obs, act, logp, v0, ret, adv = rollout(ac)
    coef = {"ent": 0.01}

    def loss_fn(m, o, a, olp, ov, rt, ad):
        logits, v = m(o)
        d = torch.distributions.Categorical(logits=logits, validate_args=False)
        ad = (ad - ad.mean()) / (ad.std() + 1e-8)
        ratio = (d.log_prob(a) - olp).exp()
        pg = torch.max(-ad * ratio, -ad * ratio.clamp(0.8, 1.2)).mean()
        vc = ov + (v - ov).clamp(-0.2, 0.2)
        vl = 0.5 * torch.max((v - rt) ** 2, (vc - rt) ** 2).mean()
        return pg - coef["ent"] * d.entropy().mean() + 0.5 * vl

    step = ctx.step(ac, loss_fn, opt, max_norm=0.5)
    losses = []
    for epoch in range(3):
        perm = torch.randperm(32)
        for mb in range(0, 32, 16):
            i = perm[mb : mb + 16]
            losses.append(step(obs[i], act[i], logp[i], v0[i], ret[i], adv[i]))
        coef["ent"] = 0.01 * (1 - (epoch + 1) / 3)
    return {"ac": ac, "opt": opt, "losses": losses}


@scenario("capture")
def cap_ppo_numpy_shuffle_ent_anneal(ctx):
    ac = ActorCritic()
    opt = torch.optim.Adam(ac.parameters(), lr=3e-4, eps=1e-5)
    obs, act, logp, _v0, ret, adv = rollout(ac)
    ent_coef = 0.01
    losses = []
    with ctx.capture(ac):
        for _epoch in range(3):
            idx = np.arange(32)
            np.random.shuffle(idx)
            for mb in range(0, 32, 16):
                i = torch.as_tensor(idx[mb : mb + 16])
                logits, v = ac(obs[i])
                d = torch.distributions.Categorical(logits=logits)
                a_ = adv[i]
                a_ = (a_ - a_.mean()) / (a_.std() + 1e-8)
                ratio = (d.log_prob(act[i]) - logp[i]).exp()
                pg = torch.max(-a_ * ratio, -a_ * ratio.clamp(0.8, 1.2)).mean()
                loss = pg + 0.5 * F.mse_loss(v, ret[i]) - ent_coef * d.entropy().mean()
                opt.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(ac.parameters(), 0.5)
                opt.step()
                losses.append(loss.detach())
            ent_coef *= 0.5
    return {"ac": ac, "opt": opt, "losses": losses}


class GaussActor(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 32), nn.ReLU())
        self.mu = nn.Linear(32, 2)
        self.log_std = nn.Linear(32, 2)

    def forward(self, o):
        h = self.net(o)
        mu, ls = self.mu(h), self.log_std(h).clamp(-5, 2)
        eps = torch.randn_like(mu)
        u = mu + ls.exp() * eps
        a = torch.tanh(u)
        logp = (-0.5 * eps.pow(2) - ls - 0.5 * math.log(2 * math.pi)).sum(-1)
        logp = logp - torch.log(1 - a.pow(2) + 1e-6).sum(-1)
        return a, logp


class Critic(nn.Module):
    def __init__(self):
        super().__init__()
        self.q1 = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
        self.q2 = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, o, a):
        x = torch.cat([o, a], -1)
        return self.q1(x).squeeze(-1), self.q2(x).squeeze(-1)


def sac_data(n=8, b=16):
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(b, 6, generator=g), torch.rand(b, 2, generator=g) * 2 - 1,
             torch.randn(b, generator=g), torch.randn(b, 6, generator=g)) for _ in range(n)]  # fmt: skip


@scenario("capture")
def cap_sac_log_alpha_autotune(ctx):
    actor, critic = GaussActor(), Critic()
    tgt = copy.deepcopy(critic)
    log_alpha = torch.zeros(1, requires_grad=True)
    a_opt = torch.optim.Adam(actor.parameters(), lr=3e-4)
    c_opt = torch.optim.Adam(critic.parameters(), lr=3e-4)
    al_opt = torch.optim.Adam([log_alpha], lr=3e-4)
    target_ent = -2.0
    out = []
    with ctx.capture(actor), ctx.capture(critic):
        for o, a, r, o2 in sac_data():
            alpha = log_alpha.exp().detach()
            with torch.no_grad():
                a2, lp2 = actor(o2)
                t1, t2 = tgt(o2, a2)
                y = r + 0.99 * (torch.min(t1, t2) - alpha * lp2)
            q1, q2 = critic(o, a)
            c_loss = F.mse_loss(q1, y) + F.mse_loss(q2, y)
            c_opt.zero_grad()
            c_loss.backward()
            c_opt.step()
            pa, lp = actor(o)
            q1p, q2p = critic(o, pa)
            a_loss = (alpha * lp - torch.min(q1p, q2p)).mean()
            a_opt.zero_grad()
            a_loss.backward()
            a_opt.step()
            al_loss = -(log_alpha * (lp.detach() + target_ent)).mean()
            al_opt.zero_grad()
            al_loss.backward()
            al_opt.step()
            with torch.no_grad():
                for p, tp in zip(critic.parameters(), tgt.parameters(), strict=True):
                    tp.mul_(0.995).add_(p, alpha=0.005)
            out += [c_loss.detach(), a_loss.detach()]
    return {"actor": actor, "critic": critic, "tgt": tgt, "log_alpha": log_alpha,
            "opts": [a_opt, c_opt, al_opt], "out": out}  # fmt: skip


@scenario("step")
def step_sac_log_alpha_outside_model(ctx):
    actor, critic = GaussActor(), Critic()
    tgt = copy.deepcopy(critic)
    log_alpha = torch.zeros(1, requires_grad=True)
    a_opt = fused_adamw(actor.parameters(), lr=3e-4, weight_decay=0.0)
    c_opt = fused_adamw(critic.parameters(), lr=3e-4, weight_decay=0.0)
    al_opt = torch.optim.Adam([log_alpha], lr=3e-4)

    def critic_loss(m, o, a, r, o2):
        alpha = log_alpha.exp().detach()
        with torch.no_grad():
            a2, lp2 = actor(o2)
            t1, t2 = tgt(o2, a2)
            y = r + 0.99 * (torch.min(t1, t2) - alpha * lp2)
        q1, q2 = m(o, a)
        return F.mse_loss(q1, y) + F.mse_loss(q2, y)

    def actor_loss(m, o):
        pa, lp = m(o)
        q1, q2 = critic(o, pa)
        return (log_alpha.exp().detach() * lp - torch.min(q1, q2)).mean()

    c_step = ctx.step(critic, critic_loss, c_opt)
    a_step = ctx.step(actor, actor_loss, a_opt)
    out = []
    for o, a, r, o2 in sac_data():
        c_opt.zero_grad(set_to_none=True)  # the actor's backward left critic grads
        out.append(c_step(o, a, r, o2))
        out.append(a_step(o))
        with torch.no_grad():
            _, lp = actor(o)
        al_loss = -(log_alpha * (lp + -2.0)).mean()
        al_opt.zero_grad()
        al_loss.backward()
        al_opt.step()
        with torch.no_grad():
            for p, tp in zip(critic.parameters(), tgt.parameters(), strict=True):
                tp.lerp_(p, 0.005)
    return {"actor": actor, "critic": critic, "tgt": tgt, "log_alpha": log_alpha,
            "opts": [a_opt, c_opt, al_opt], "out": out}  # fmt: skip


# ===================================================================== recurrent


class WordLM(nn.Module):
    def __init__(self, v=30, d=16, layers=2):
        super().__init__()
        self.emb = nn.Embedding(v, d)
        self.rnn = nn.LSTM(d, d, layers, dropout=0.2)
        self.drop = nn.Dropout(0.2)
        self.dec = nn.Linear(d, v)

    def forward(self, x, hidden):
        y, hidden = self.rnn(self.drop(self.emb(x)), hidden)
        return self.dec(self.drop(y)), hidden


def corpus(n=7 * 5 + 1, b=4, v=30):
    g = torch.Generator().manual_seed(2)
    return torch.randint(0, v, (n, b), generator=g)


def repackage(h):
    return tuple(t.detach() for t in h) if isinstance(h, tuple) else h.detach()


@scenario("capture")
def cap_lstm_lm_tbptt_hidden_tuple_input(ctx):
    m = WordLM()
    data, bptt = corpus(), 5
    hidden = (torch.zeros(2, 4, 16), torch.zeros(2, 4, 16))
    losses = []
    with ctx.capture(m):
        for i in range(0, data.size(0) - 1, bptt):
            x, y = data[i : i + bptt], data[i + 1 : i + 1 + bptt]
            hidden = repackage(hidden)
            m.zero_grad()
            out, hidden = m(x, hidden)
            loss = F.cross_entropy(out.view(-1, 30), y.reshape(-1))
            loss.backward()
            nn.utils.clip_grad_norm_(m.parameters(), 0.25)
            for p in m.parameters():
                p.data.add_(p.grad, alpha=-0.5)
            losses.append(loss.item())
    return {"m": m, "losses": losses, "h": list(hidden)}


@scenario("step")
def step_lstm_lm_tbptt_hidden_detached_arg(ctx):
    m = WordLM()
    opt = fused_sgd(m.parameters(), lr=0.5)
    data, bptt = corpus(), 5

    def loss_fn(model, x, y, h):
        out, _ = model(x, h)
        return F.cross_entropy(out.view(-1, 30), y.reshape(-1))

    step = ctx.step(m, loss_fn, opt, max_norm=0.25)
    hidden = (torch.zeros(2, 4, 16), torch.zeros(2, 4, 16))
    losses = []
    for i in range(0, data.size(0) - 1, bptt):
        x, y = data[i : i + bptt], data[i + 1 : i + 1 + bptt]
        losses.append(step(x, y, hidden))
        with torch.no_grad():  # the carried state: a second, gradient-free pass
            _, hidden = m(x, hidden)
    return {"m": m, "opt": opt, "losses": losses}


def padded_batches(n=6, b=5, v=20, seed=4):
    """Variable-length sequences; the collate sorts by length (enforce_sorted=True)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        lens = torch.randint(2, 9, (b,), generator=g)
        seqs = [torch.randint(1, v, (int(k),), generator=g) for k in lens]
        y = torch.randint(0, 3, (b,), generator=g)
        order = sorted(range(b), key=lambda i: -len(seqs[i]))
        seqs, y = [seqs[i] for i in order], y[order]
        x = nn.utils.rnn.pad_sequence(seqs, batch_first=True)
        out.append((x, torch.tensor([len(s) for s in seqs]), y))
    return out


class GRUClassifier(nn.Module):
    def __init__(self, v=20, d=12):
        super().__init__()
        self.emb = nn.Embedding(v, d, padding_idx=0)
        self.gru = nn.GRU(d, d, batch_first=True, bidirectional=True)
        self.fc = nn.Linear(2 * d, 3)

    def forward(self, x, lengths):
        packed = pack_padded_sequence(self.emb(x), lengths, batch_first=True, enforce_sorted=True)
        out, h = self.gru(packed)
        out, _ = pad_packed_sequence(out, batch_first=True)
        return self.fc(torch.cat([h[0], h[1]], -1)) + 0 * out.sum()


@scenario("capture")
def cap_gru_packed_sorted_collate(ctx):
    m = GRUClassifier()
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)
    losses = []
    with ctx.capture(m):
        for x, lens, y in padded_batches():
            loss = F.cross_entropy(m(x, lens), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
    return {"m": m, "opt": opt, "losses": losses}


@scenario("step")
def step_gru_packed_sorted_collate(ctx):
    m = GRUClassifier()
    opt = fused_adamw(m.parameters())
    step = ctx.step(m, lambda mm, x, lens, y: F.cross_entropy(mm(x, lens), y), opt)
    losses = [step(x, lens, y) for x, lens, y in padded_batches()]
    return {"m": m, "opt": opt, "losses": losses}


class StatefulGRU(nn.Module):
    """Keeps its hidden state as an attribute between calls (a stateful RNN)."""

    def __init__(self, d=8):
        super().__init__()
        self.gru = nn.GRU(d, d, batch_first=True)
        self.fc = nn.Linear(d, 1)
        self.h = None

    def forward(self, x):
        out, h = self.gru(x, self.h)
        self.h = h.detach()
        return self.fc(out[:, -1]).squeeze(-1)


@scenario("capture")
def cap_gru_hidden_module_attribute(ctx):
    m = StatefulGRU()
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(6)
    losses = []
    with ctx.capture(m):
        for i in range(8):
            if i == 4:
                m.h = None  # a new episode
            x, y = torch.randn(4, 5, 8, generator=g), torch.randn(4, generator=g)
            loss = F.mse_loss(m(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
    return {"m": m, "opt": opt, "losses": losses, "h": m.h}


@scenario("step")
def step_gru_hidden_module_attribute(ctx):
    m = StatefulGRU()
    opt = fused_sgd(m.parameters())
    g = torch.Generator().manual_seed(6)
    step = ctx.step(m, lambda mm, x, y: F.mse_loss(mm(x), y), opt)
    losses = []
    for i in range(8):
        if i == 4:
            m.h = None
        losses.append(step(torch.randn(4, 5, 8, generator=g), torch.randn(4, generator=g)))
    return {"m": m, "opt": opt, "losses": losses, "h": m.h}


class Seq2Seq(nn.Module):
    def __init__(self, v=12, d=12):
        super().__init__()
        self.emb = nn.Embedding(v, d)
        self.enc = nn.GRU(d, d, batch_first=True)
        self.dec = nn.GRUCell(d, d)
        self.out = nn.Linear(d, v)
        self.tf_ratio = 0.5

    def forward(self, src, tgt):
        _, h = self.enc(self.emb(src))
        h = h[0]
        tok = tgt[:, 0]
        logits = []
        for t in range(1, tgt.size(1)):
            h = self.dec(self.emb(tok), h)
            lo = self.out(h)
            logits.append(lo)
            tok = tgt[:, t] if random.random() < self.tf_ratio else lo.argmax(-1)
        return torch.stack(logits, 1)


def seq_pairs(n=8, b=4, v=12):
    g = torch.Generator().manual_seed(7)
    return [(torch.randint(0, v, (b, 5), generator=g), torch.randint(0, v, (b, 4), generator=g))
            for _ in range(n)]  # fmt: skip


@scenario("capture")
def cap_seq2seq_teacher_forcing_random_in_forward(ctx):
    m = Seq2Seq()
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)
    losses = []
    with ctx.capture(m):
        for src, tgt in seq_pairs():
            lo = m(src, tgt)
            loss = F.cross_entropy(lo.reshape(-1, 12), tgt[:, 1:].reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
            m.tf_ratio *= 0.9
    return {"m": m, "opt": opt, "losses": losses}


@scenario("step")
def step_seq2seq_teacher_forcing_random(ctx):
    m = Seq2Seq()
    m.tf_ratio = 1.0  # always teacher forced ... but random.random() is still drawn
    opt = fused_adamw(m.parameters())

    def loss_fn(mm, src, tgt):
        return F.cross_entropy(mm(src, tgt).reshape(-1, 12), tgt[:, 1:].reshape(-1))

    step = ctx.step(m, loss_fn, opt)
    losses = [step(s, t) for s, t in seq_pairs()]
    return {"m": m, "opt": opt, "losses": losses, "py_rng": random.random()}


# ===================================================================== data on the host

DEVICE = "cpu"


@scenario("step")
def step_batch_to_device_inside_loss(ctx):
    m = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 4))
    opt = fused_adamw(m.parameters())

    def loss_fn(model, x, y):
        x = x.to(DEVICE, non_blocking=True)
        y = y.to(device=DEVICE, dtype=torch.long)
        return F.cross_entropy(model(x.float()), y)

    step = ctx.step(m, loss_fn, opt)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(7):
        x = torch.randn(8, 8, generator=g).double()
        y = torch.randint(0, 4, (8,), generator=g).int()
        losses.append(step(x, y))
    return {"m": m, "opt": opt, "losses": losses}


class MaskedMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 10))

    def forward(self, x, mask):
        return self.net(x * mask)


@scenario("capture")
def cap_numpy_mask_per_batch(ctx):
    m = MaskedMLP()
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(9)
    losses = []
    with ctx.capture(m):
        for _ in range(8):
            x = torch.randn(6, 10, generator=g)
            mask = (np.random.rand(6, 10) > 0.3).astype(np.float32)
            out = m(x.to(DEVICE), torch.from_numpy(mask))
            loss = ((out - x) ** 2 * torch.from_numpy(1 - mask)).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
    return {"m": m, "opt": opt, "losses": losses}


@scenario("step")
def step_numpy_mask_built_inside_loss(ctx):
    m = MaskedMLP()
    opt = fused_sgd(m.parameters())

    def loss_fn(model, x):
        mask = torch.from_numpy((np.random.rand(*x.shape) > 0.3).astype(np.float32))
        return ((model(x, mask) - x) ** 2 * (1 - mask)).mean()

    step = ctx.step(m, loss_fn, opt)
    g = torch.Generator().manual_seed(9)
    losses = [step(torch.randn(6, 10, generator=g)) for _ in range(8)]
    return {"m": m, "opt": opt, "losses": losses, "np_rng": float(np.random.rand())}


@scenario("step")
def step_label_smoothing_schedule_list(ctx):
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = fused_sgd(m.parameters())
    schedule = [0.0, 0.0, 0.05, 0.1, 0.1, 0.15, 0.2, 0.2]
    state = {"step": 0}

    def loss_fn(model, x, y):
        return F.cross_entropy(model(x), y, label_smoothing=schedule[state["step"]])

    step = ctx.step(m, loss_fn, opt)
    g = torch.Generator().manual_seed(1)
    losses = []
    for i in range(8):
        state["step"] = i
        losses.append(step(torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)))
    return {"m": m, "opt": opt, "losses": losses}


@scenario("step")
def step_label_smoothing_global_step_index(ctx):
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = fused_sgd(m.parameters())
    global _LS_STEP
    _LS_STEP = 0

    def loss_fn(model, x, y):
        return F.cross_entropy(model(x), y, label_smoothing=_LS_SCHEDULE[_LS_STEP])

    step = ctx.step(m, loss_fn, opt)
    g = torch.Generator().manual_seed(1)
    losses = []
    for i in range(8):
        _LS_STEP = i // 2
        losses.append(step(torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)))
    return {"m": m, "opt": opt, "losses": losses}


_LS_SCHEDULE = [0.0, 0.1, 0.2, 0.3]
_LS_STEP = 0


@scenario("step")
def step_class_weights_recomputed_per_epoch(ctx):
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = fused_adamw(m.parameters())
    crit = nn.CrossEntropyLoss()
    step = ctx.step(m, lambda mm, x, y: crit(mm(x), y), opt)
    g = torch.Generator().manual_seed(12)
    epochs = [[(torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g))
               for _ in range(3)] for _ in range(3)]  # fmt: skip
    losses = []
    for batches in epochs:
        counts = np.bincount(torch.cat([y for _, y in batches]).numpy(), minlength=4) + 1
        crit.weight = torch.tensor((counts.sum() / counts).tolist(), dtype=torch.float32)
        for x, y in batches:
            losses.append(step(x, y))
    return {"m": m, "opt": opt, "losses": losses}


@scenario("step")
def step_torch_tensor_python_list_in_loss(ctx):
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    opt = fused_sgd(m.parameters())
    cls_w = [1.0, 2.0, 0.5]

    def loss_fn(model, x, y):
        w = torch.tensor(cls_w)
        return F.cross_entropy(model(x), y, weight=w)

    step = ctx.step(m, loss_fn, opt)
    g = torch.Generator().manual_seed(3)
    losses = []
    for i in range(8):
        if i == 4:
            cls_w[1] = 3.0  # retuned in place
        losses.append(step(torch.randn(8, 8, generator=g), torch.randint(0, 3, (8,), generator=g)))
    return {"m": m, "opt": opt, "losses": losses}


class ScaledHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 3)
        self.scales = [1.0, 1.0, 1.0]

    def forward(self, x):
        return self.fc(x) * torch.tensor(self.scales)


@scenario("capture")
def cap_torch_tensor_list_attr_in_forward(ctx):
    m = ScaledHead()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(3)
    losses = []
    with ctx.capture(m):
        for i in range(8):
            if i in (3, 6):
                m.scales[i % 3] = 1.0 + 0.5 * i  # mutated in place, not rebound
            x, y = torch.randn(8, 8, generator=g), torch.randint(0, 3, (8,), generator=g)
            loss = F.cross_entropy(m(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
    return {"m": m, "opt": opt, "losses": losses}


@scenario("step")
def step_torch_tensor_list_attr_in_forward(ctx):
    m = ScaledHead()
    opt = fused_sgd(m.parameters(), lr=0.1)
    step = ctx.step(m, lambda mm, x, y: F.cross_entropy(mm(x), y), opt)
    g = torch.Generator().manual_seed(3)
    losses = []
    for i in range(8):
        if i in (3, 6):
            m.scales[i % 3] = 1.0 + 0.5 * i
        losses.append(step(torch.randn(8, 8, generator=g), torch.randint(0, 3, (8,), generator=g)))
    return {"m": m, "opt": opt, "losses": losses}


# ===================================================================== optimisation details


def vec_batches(n=8, b=8, f=8, c=4, seed=11):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(b, f, generator=g), torch.randint(0, c, (b,), generator=g))
            for _ in range(n)]  # fmt: skip


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(),
                                      nn.Linear(16, 16), nn.LayerNorm(16), nn.ReLU())  # fmt: skip
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.backbone(x))


@scenario("step")
def step_cosine_warm_restarts_fractional_epoch(ctx):
    m = Net()
    opt = fused_sgd(m.parameters(), lr=0.1, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(opt, T_0=1, T_mult=2)
    step = ctx.step(m, lambda mm, x, y: F.cross_entropy(mm(x), y), opt)
    data = vec_batches(8)
    losses = []
    for epoch in range(2):
        for i, (x, y) in enumerate(data[epoch * 4 : epoch * 4 + 4]):
            losses.append(step(x, y))
            sched.step(epoch + (i + 1) / 4)
    return {"m": m, "opt": opt, "losses": losses}


@scenario("capture")
def cap_onecycle_per_batch_three_phase(ctx):
    m = Net()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=8, three_phase=True)
    losses = []
    with ctx.capture(m):
        for x, y in vec_batches(8):
            loss = F.cross_entropy(m(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            losses.append(loss.detach())
    return {"m": m, "opt": opt, "losses": losses}


def no_decay_groups(m, lr, wd):
    decay = [p for n, p in m.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in m.named_parameters() if p.ndim < 2]
    return [{"params": decay, "weight_decay": wd, "lr": lr},
            {"params": no_decay, "weight_decay": 0.0, "lr": lr * 2}]  # fmt: skip


@scenario("step")
def step_param_groups_no_decay_onecycle_tensor_lr(ctx):
    m = Net()
    groups = no_decay_groups(m, 1e-3, 0.05)
    for gr in groups:
        gr["lr"] = torch.tensor(gr["lr"])
    opt = fused_adamw(groups)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=[1e-2, 2e-2], total_steps=8)
    step = ctx.step(m, lambda mm, x, y: F.cross_entropy(mm(x), y), opt, max_norm=1.0)
    losses = []
    for x, y in vec_batches(8):
        losses.append(step(x, y))
        sched.step()
    return {"m": m, "opt": opt, "losses": losses}


class TinyViT(nn.Module):
    """Patch embedding, a few pre-norm blocks with DropPath drawn per sample, a cls head."""

    def __init__(self, d=16, depth=3, heads=2, drop_path=0.2, p=0.1):
        super().__init__()
        self.patch = nn.Conv2d(3, d, 4, 4)
        self.cls = nn.Parameter(torch.zeros(1, 1, d))
        self.pos = nn.Parameter(torch.randn(1, 5, d) * 0.02)
        self.blocks = nn.ModuleList(ViTBlock(d, heads, drop_path * i / (depth - 1), p)
                                    for i in range(depth))  # fmt: skip
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, 5)

    def forward(self, x):
        x = self.patch(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.size(0), -1, -1), x], 1) + self.pos
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x)[:, 0])


def drop_path(x, p, training):
    if p == 0.0 or not training:
        return x
    keep = 1 - p
    mask = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep)
    return x * mask / keep


class ViTBlock(nn.Module):
    def __init__(self, d, heads, dp, p):
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, dropout=p, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Dropout(p), nn.Linear(2 * d, d))
        self.dp = dp

    def forward(self, x):
        h = self.n1(x)
        x = x + drop_path(self.attn(h, h, h, need_weights=False)[0], self.dp, self.training)
        r = torch.rand(x.shape[0], 1, 1) >= self.dp if self.training else None
        y = self.mlp(self.n2(x))
        return x + (y * r / (1 - self.dp) if r is not None and self.dp > 0 else y)


def img_batches(n=7, b=4, seed=13):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(b, 3, 8, 8, generator=g), torch.randint(0, 5, (b,), generator=g))
            for _ in range(n)]  # fmt: skip


def layer_decay_groups(m, base=1e-3, decay=0.7):
    n = len(m.blocks) + 1
    groups = {}
    for name, p in m.named_parameters():
        if name.startswith(("patch", "cls", "pos")):
            lid = 0
        elif name.startswith("blocks."):
            lid = int(name.split(".")[1]) + 1
        else:
            lid = n
        groups.setdefault(lid, []).append(p)
    return [{"params": ps, "lr": base * decay ** (n - lid), "weight_decay": 0.05 if lid else 0.0}
            for lid, ps in sorted(groups.items())]  # fmt: skip


@scenario("step")
def step_vit_layer_decay_lambda_float_lr(ctx):
    m = TinyViT()
    opt = torch.optim.AdamW(layer_decay_groups(m))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
    step = ctx.step(m, lambda mm, x, y: F.cross_entropy(mm(x), y, label_smoothing=0.1), opt,
                    max_norm=1.0)  # fmt: skip
    losses = []
    for x, y in img_batches():
        losses.append(step(x, y))
        sched.step()
    return {"m": m, "opt": opt, "losses": losses}


@scenario("capture")
def cap_vit_droppath_dropout_eval_between(ctx):
    m = TinyViT()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True)
    val = img_batches(2, seed=14)
    losses, accs = [], []
    with ctx.capture(m):
        for i, (x, y) in enumerate(img_batches()):
            m.train()
            loss = F.cross_entropy(m(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach())
            if i % 3 == 2:
                m.eval()
                with torch.no_grad():
                    accs += [(m(vx).argmax(1) == vy).float().mean() for vx, vy in val]
    return {"m": m, "opt": opt, "losses": losses, "accs": accs}


@scenario("step")
def step_vit_droppath_eval_val_with_grad_enabled(ctx):
    m = TinyViT()
    opt = fused_adamw(m.parameters())
    step = ctx.step(m, lambda mm, x, y: F.cross_entropy(mm(x), y), opt)
    val = img_batches(1, seed=14)
    losses, vl = [], []
    for i, (x, y) in enumerate(img_batches()):
        m.train()
        losses.append(step(x, y))
        if i % 3 == 2:
            m.eval()  # validation, forgetting no_grad
            vl += [F.cross_entropy(m(vx), vy).detach() for vx, vy in val]
    return {"m": m, "opt": opt, "losses": losses, "vl": vl}


@scenario("capture")
def cap_swa_update_parameters_update_bn(ctx):
    from torch.optim.swa_utils import SWALR, AveragedModel, update_bn

    m = Net()
    swa = AveragedModel(m)
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
    swa_sched = SWALR(opt, swa_lr=0.01, anneal_epochs=2)
    data = vec_batches(8)
    losses = []
    with ctx.capture(m):
        for i, (x, y) in enumerate(data):
            loss = F.cross_entropy(m(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
            if i >= 3:
                swa.update_parameters(m)
                swa_sched.step()
    update_bn([x for x, _ in data], swa)
    return {"m": m, "swa": swa, "opt": opt, "losses": losses}


@scenario("capture")
def cap_accum_varying_micro_count_per_step(ctx):
    m = Net()
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, nesterov=True)
    data = vec_batches(11, b=6)  # 11 micro-batches: steps of 4, 4 and a short 3
    losses = []
    with ctx.capture(m):
        i = 0
        while i < len(data):
            k = min(4, len(data) - i)
            for x, y in data[i : i + k]:
                loss = F.cross_entropy(m(x), y) / k
                loss.backward()
                losses.append(loss.detach())
            nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            i += k
    return {"m": m, "opt": opt, "losses": losses}


@scenario("capture")
def cap_clip_error_if_nonfinite_skip_bad_batch(ctx):
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)
    data = vec_batches(8)
    x5 = data[5][0].clone()
    x5[0, 0] = float("inf")
    data[5] = (x5, data[5][1])
    losses, skipped = [], []
    with ctx.capture(m):
        for i, (x, y) in enumerate(data):
            loss = F.cross_entropy(m(x), y)
            opt.zero_grad()
            loss.backward()
            try:
                nn.utils.clip_grad_norm_(m.parameters(), 1.0, error_if_nonfinite=True)
            except RuntimeError:
                skipped.append(i)
                opt.zero_grad()
                continue
            opt.step()
            losses.append(loss.detach())
    return {"m": m, "opt": opt, "losses": losses, "skipped": skipped}


@scenario("capture")
def cap_cpu_gradscaler_fp16_autocast(ctx):
    if not hasattr(torch.amp, "GradScaler"):
        return {"skipped": True}
    m = Net()
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    losses = []
    with ctx.capture(m):
        for x, y in vec_batches(8):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(m(x), y)
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            losses.append(loss.detach())
    return {"m": m, "opt": opt, "scaler": scaler, "losses": losses}


@scenario("step")
def step_cpu_gradscaler_fp16_fused_sgd(ctx):
    m = Net()
    opt = fused_sgd(m.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    step = ctx.step(m, lambda mm, x, y: F.cross_entropy(mm(x), y), opt, scaler=scaler,
                    precision="16-mixed", max_norm=1.0)  # fmt: skip
    losses = [step(x, y) for x, y in vec_batches(8)]
    return {"m": m, "opt": opt, "scaler": scaler, "losses": losses}


@scenario("step")
def step_frozen_backbone_then_unfreeze_add_group(ctx):
    m = Net()
    m.backbone.requires_grad_(False)
    opt = fused_adamw(m.head.parameters(), lr=1e-3)
    step = ctx.step(m, lambda mm, x, y: F.cross_entropy(mm(x), y), opt)
    losses = []
    for i, (x, y) in enumerate(vec_batches(8)):
        if i == 3:
            m.backbone.requires_grad_(True)
            opt.add_param_group({"params": list(m.backbone.parameters()), "lr": 1e-4})
        losses.append(step(x, y))
    return {"m": m, "opt": opt, "losses": losses}


@scenario("capture")
def cap_frozen_backbone_bn_eval_then_unfreeze(ctx):
    m = Net()
    m.backbone.requires_grad_(False)
    opt = torch.optim.SGD([{"params": m.head.parameters()}], lr=0.05, momentum=0.9)
    losses = []
    with ctx.capture(m):
        for i, (x, y) in enumerate(vec_batches(8)):
            m.train()
            if i < 4:
                m.backbone.eval()  # frozen BN statistics while the backbone is frozen
            elif i == 4:
                m.backbone.requires_grad_(True)
                opt.add_param_group({"params": m.backbone.parameters(), "lr": 0.005})
            loss = F.cross_entropy(m(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
    return {"m": m, "opt": opt, "losses": losses}


@scenario("step")
def step_unfreeze_backbone_without_touching_optimizer(ctx):
    m = Net()
    opt = fused_adamw(m.parameters())  # fused SGD+momentum raises in torch itself here
    for p in m.backbone.parameters():
        p.requires_grad = False
    step = ctx.step(m, lambda mm, x, y: F.cross_entropy(mm(x), y), opt, max_norm=1.0)
    losses = []
    for i, (x, y) in enumerate(vec_batches(8)):
        if i == 4:
            for p in m.backbone.parameters():
                p.requires_grad = True
        losses.append(step(x, y))
    return {"m": m, "opt": opt, "losses": losses}


# ===================================================================== model shapes


class ResBlock(nn.Module):
    def __init__(self, c, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(c if stride == 1 else c // 2, c, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)
        self.down = None
        if stride != 1:
            self.down = nn.Sequential(
                nn.Conv2d(c // 2, c, 1, stride, bias=False), nn.BatchNorm2d(c)
            )

    def forward(self, x):
        idt = x if self.down is None else self.down(x)
        out = F.relu(self.bn1(self.conv1(x)), inplace=True)
        return F.relu(self.bn2(self.conv2(out)) + idt, inplace=True)


class ResNetish(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 4, 3, 1, 1, bias=False), nn.BatchNorm2d(4),
                                  nn.ReLU(inplace=True))  # fmt: skip
        self.l1, self.l2 = ResBlock(4), ResBlock(8, stride=2)
        self.fc = nn.Linear(8, 5)

    def forward(self, x):
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(self.l2(self.l1(self.stem(x))), 1), 1))


@scenario("step")
def step_resnet_downsample_bn_val_in_train_mode_nograd(ctx):
    m = ResNetish()
    opt = fused_sgd(m.parameters(), lr=0.1, weight_decay=1e-4, nesterov=True)
    step = ctx.step(m, lambda mm, x, y: F.cross_entropy(mm(x), y), opt)
    val = img_batches(1, seed=15)
    losses, vals = [], []
    for i, (x, y) in enumerate(img_batches(8)):
        losses.append(step(x, y))
        if i % 4 == 3:
            with torch.no_grad():  # forgot eval(): BN updates running stats in no_grad
                vals += [m(vx).sum() for vx, _ in val]
    return {"m": m, "opt": opt, "losses": losses, "vals": vals}


class TiedLM(nn.Module):
    def __init__(self, v=25, d=16):
        super().__init__()
        self.wte = nn.Embedding(v, d)
        self.ln = nn.LayerNorm(d)
        self.mix = nn.Linear(d, d)
        self.lm_head = nn.Linear(d, v, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx):
        return self.lm_head(self.ln(F.gelu(self.mix(self.wte(idx)))))


def tokens(n=7, b=4, T=6, v=25, seed=16):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, v, (b, T + 1), generator=g) for _ in range(n)]


@scenario("step")
def step_tied_lm_head_z_loss_reads_embedding(ctx):
    m = TiedLM()
    opt = fused_adamw(m.parameters(), weight_decay=0.1)

    def loss_fn(model, t):
        logits = model(t[:, :-1])
        ce_ = F.cross_entropy(logits.reshape(-1, 25), t[:, 1:].reshape(-1))
        z = torch.logsumexp(logits, -1).pow(2).mean()
        return ce_ + 1e-4 * z + 1e-5 * model.wte.weight.pow(2).sum()

    step = ctx.step(m, loss_fn, opt, max_norm=1.0)
    losses = [step(t) for t in tokens()]
    return {"m": m, "opt": opt, "losses": losses}


@scenario("capture")
def cap_tied_lm_head_plain(ctx):
    m = TiedLM()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    losses = []
    with ctx.capture(m):
        for t in tokens():
            loss = F.cross_entropy(m(t[:, :-1]).reshape(-1, 25), t[:, 1:].reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
    return {"m": m, "opt": opt, "losses": losses}


class DictOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
        self.cls = nn.Linear(16, 4)
        self.reg = nn.Linear(16, 1)

    def forward(self, x):
        h = self.body(x)
        return {"logits": self.cls(h), "reg": self.reg(h).squeeze(-1), "feat": h}


@scenario("capture")
def cap_model_returns_dict(ctx):
    m = DictOut()
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(17)
    losses, feats = [], []
    with ctx.capture(m):
        for _ in range(7):
            x, y = torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)
            out = m(x)
            loss = F.cross_entropy(out["logits"], y) + 0.1 * out["reg"].pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
            feats.append(out["feat"].detach())
    return {"m": m, "opt": opt, "losses": losses, "feats": feats}


@dataclass
class Output:
    logits: torch.Tensor
    aux: torch.Tensor
    n_active: int


class DataclassOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        h = F.relu(self.fc1(x))
        return Output(self.fc2(h), h.abs().mean(), 16)


@scenario("capture")
def cap_model_returns_dataclass(ctx):
    m = DataclassOut()
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    losses = []
    with ctx.capture(m):
        for x, y in vec_batches(7):
            out = m(x)
            loss = F.cross_entropy(out.logits, y) + 0.01 * out.aux * out.n_active
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
    return {"m": m, "opt": opt, "losses": losses}


@scenario("step")
def step_model_returns_dataclass(ctx):
    m = DataclassOut()
    opt = fused_sgd(m.parameters())

    def loss_fn(model, x, y):
        out = model(x)
        return F.cross_entropy(out.logits, y) + 0.01 * out.aux

    step = ctx.step(m, loss_fn, opt)
    losses = [step(x, y) for x, y in vec_batches(7)]
    return {"m": m, "opt": opt, "losses": losses}


class SelfNorm(nn.Module):
    """Normalises its input by running statistics it keeps itself (updated in place)."""

    def __init__(self, d=8):
        super().__init__()
        self.register_buffer("mean", torch.zeros(d))
        self.register_buffer("var", torch.ones(d))
        self.register_buffer("count", torch.zeros((), dtype=torch.long))
        self.fc = nn.Sequential(nn.Linear(d, 16), nn.Tanh(), nn.Linear(16, 4))

    def forward(self, x):
        if self.training:
            with torch.no_grad():
                self.count += 1
                w = 1.0 / self.count.float()
                self.mean.lerp_(x.mean(0), w)
                self.var.lerp_(x.var(0), w)
        return self.fc((x - self.mean) / (self.var + 1e-5).sqrt())


@scenario("capture")
def cap_forward_updates_own_buffers_inplace(ctx):
    m = SelfNorm()
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)
    losses = []
    with ctx.capture(m):
        for i, (x, y) in enumerate(vec_batches(8)):
            loss = F.cross_entropy(m(x * (1 + i)), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
    return {"m": m, "opt": opt, "losses": losses}


@scenario("step")
def step_forward_updates_own_buffers_inplace(ctx):
    m = SelfNorm()
    opt = fused_adamw(m.parameters())
    step = ctx.step(m, lambda mm, x, y: F.cross_entropy(mm(x), y), opt)
    losses = [step(x * (1 + i), y) for i, (x, y) in enumerate(vec_batches(8))]
    return {"m": m, "opt": opt, "losses": losses}


class FDrop(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 32)
        self.fc2 = nn.Linear(32, 4)
        self.p = 0.3

    def forward(self, x):
        return self.fc2(F.dropout(F.relu(self.fc1(x)), self.p, training=self.training))


@scenario("capture")
def cap_functional_dropout_eval_validation_with_grad(ctx):
    m = FDrop()
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
    val = vec_batches(2, seed=30)
    losses, vl = [], []
    with ctx.capture(m):
        for i, (x, y) in enumerate(vec_batches(8)):
            m.train()
            loss = F.cross_entropy(m(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
            if i % 2 == 1:
                m.eval()  # validation without no_grad: graphs built, never backwarded
                vl += [F.cross_entropy(m(vx), vy).detach() for vx, vy in val]
    return {"m": m, "opt": opt, "losses": losses, "vl": vl}


@scenario("step")
def step_functional_dropout_eval_between(ctx):
    m = FDrop()
    opt = fused_sgd(m.parameters())
    step = ctx.step(m, lambda mm, x, y: F.cross_entropy(mm(x), y), opt)
    val = vec_batches(2, seed=30)
    losses, vl = [], []
    for i, (x, y) in enumerate(vec_batches(8)):
        m.train()
        losses.append(step(x, y))
        if i % 2 == 1:
            m.eval()
            with torch.no_grad():
                vl += [F.cross_entropy(m(vx), vy) for vx, vy in val]
    return {"m": m, "opt": opt, "losses": losses, "vl": vl}


@scenario("step")
def step_train_step_in_eval_mode_dropout_off(ctx):
    """A user who leaves the model in eval() for the first steps (dropout off), then train()."""
    m = FDrop()
    opt = fused_sgd(m.parameters())
    step = ctx.step(m, lambda mm, x, y: F.cross_entropy(mm(x), y), opt)
    m.eval()
    losses = []
    for i, (x, y) in enumerate(vec_batches(8)):
        if i == 4:
            m.train()
        losses.append(step(x, y))
    return {"m": m, "opt": opt, "losses": losses}


# ===================================================================== Lightning whole_step


@scenario("whole_step")
def ls_per_batch_scheduler_and_freeze_epoch(ctx):
    import lightning as L

    data = vec_batches(12)
    loader = torch.utils.data.DataLoader(
        list(zip(torch.cat([x for x, _ in data]), torch.cat([y for _, y in data]), strict=True)),
        batch_size=8,
    )

    class LM(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False
            self.net = Net()
            self.losses = []

        def configure_optimizers(self):
            opt = fused_adamw(self.net.parameters(), lr=torch.tensor(1e-3))
            sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=12)
            return [opt], [sched]

        def on_train_start(self):
            self.step = None
            if ctx.replay:
                from replaykit.lightning import whole_step

                self.step = whole_step(self, self.net, ce_loss, backend="emulated", max_norm=1.0)
                ctx.entries.append(self.step)

        def on_train_epoch_start(self):
            self.net.backbone.requires_grad_(self.current_epoch > 0)

        def training_step(self, batch, idx):
            x, y = batch
            if self.step is not None:
                loss = self.step(x, y)
            else:
                opt = self.optimizers()
                loss = ce_loss(self.net, x, y)
                self.manual_backward(loss)
                ps = [p for p in self.net.parameters() if p.requires_grad and p.grad is not None]
                nn.utils.clip_grad_norm_(ps, 1.0, foreach=True)
                opt.step()
                opt.zero_grad(set_to_none=True)
                loss = loss.detach()
            self.lr_schedulers().step()
            self.losses.append(loss)

    mod = LM()
    tr = L.Trainer(accelerator="cpu", max_epochs=2, logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    tr.fit(mod, loader)
    return {"net": mod.net, "opt": mod.optimizers().optimizer, "losses": mod.losses}


def ce_loss(m, x, y):
    return F.cross_entropy(m(x), y)


# ===================================================================== state the user rebinds


@scenario("capture")
def cap_param_data_rebound_pruning_mask(ctx):
    """Magnitude pruning the old way: ``p.data = p.data * mask`` (new storage, same Parameter)."""
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    losses = []
    with ctx.capture(m):
        for i, (x, y) in enumerate(vec_batches(8)):
            if i == 3:
                w = m[0].weight
                w.data = w.data * (w.data.abs() > w.data.abs().median()).float()
            loss = F.cross_entropy(m(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
    return {"m": m, "opt": opt, "losses": losses}


@scenario("step")
def step_param_data_rebound_pruning_mask(ctx):
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    step = ctx.step(m, lambda mm, x, y: F.cross_entropy(mm(x), y), opt)
    losses = []
    for i, (x, y) in enumerate(vec_batches(8)):
        if i == 3:
            w = m[0].weight
            w.data = w.data * (w.data.abs() > w.data.abs().median()).float()
        losses.append(step(x, y))
    return {"m": m, "opt": opt, "losses": losses}


@scenario("step")
def step_optimizer_state_tensor_rebound(ctx):
    """Resetting Adam's moments for a re-initialised head by assigning new tensors."""
    m = Net()
    opt = fused_adamw(m.parameters())
    step = ctx.step(m, lambda mm, x, y: F.cross_entropy(mm(x), y), opt)
    losses = []
    for i, (x, y) in enumerate(vec_batches(8)):
        if i == 4:
            nn.init.zeros_(m.head.weight)
            for p in m.head.parameters():
                st = opt.state[p]
                st["exp_avg"] = torch.zeros_like(p)
                st["exp_avg_sq"] = torch.zeros_like(p)
        losses.append(step(x, y))
    return {"m": m, "opt": opt, "losses": losses}


@scenario("capture")
def cap_bn_buffer_rebound(ctx):
    m = Net()
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    losses = []
    with ctx.capture(m):
        for i, (x, y) in enumerate(vec_batches(8)):
            if i == 4:
                m.backbone[1].running_mean = torch.zeros(16)
                m.backbone[1].running_var = torch.ones(16)
            loss = F.cross_entropy(m(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
    return {"m": m, "opt": opt, "losses": losses}


@scenario("step")
def step_bn_buffer_rebound(ctx):
    m = Net()
    opt = fused_sgd(m.parameters())
    step = ctx.step(m, lambda mm, x, y: F.cross_entropy(mm(x), y), opt)
    losses = []
    for i, (x, y) in enumerate(vec_batches(8)):
        if i == 4:
            m.backbone[1].running_mean = torch.zeros(16)
        losses.append(step(x, y))
    return {"m": m, "opt": opt, "losses": losses}


class TempHead(nn.Module):
    """A temperature kept as a plain tensor attribute (not a buffer)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)
        self.temp = torch.tensor(1.0)

    def forward(self, x):
        return self.fc(x) / self.temp


@scenario("capture")
def cap_plain_tensor_attr_inplace_and_rebound(ctx):
    m = TempHead()
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    losses = []
    with ctx.capture(m):
        for i, (x, y) in enumerate(vec_batches(8)):
            if i == 2:
                m.temp.fill_(2.0)
            if i == 5:
                m.temp = torch.tensor(0.5)
            loss = F.cross_entropy(m(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
    return {"m": m, "opt": opt, "losses": losses}


@scenario("step")
def step_plain_tensor_attr_inplace_and_rebound(ctx):
    m = TempHead()
    opt = fused_sgd(m.parameters())
    step = ctx.step(m, lambda mm, x, y: F.cross_entropy(mm(x), y), opt)
    losses = []
    for i, (x, y) in enumerate(vec_batches(8)):
        if i == 2:
            m.temp.fill_(2.0)
        if i == 5:
            m.temp = torch.tensor(0.5)
        losses.append(step(x, y))
    return {"m": m, "opt": opt, "losses": losses}


_MASK = torch.ones(8)


class GlobalMasked(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(x * _MASK)


@scenario("capture")
def cap_forward_reads_global_tensor_rebound(ctx):
    global _MASK
    _MASK = torch.ones(8)
    m = GlobalMasked()
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    losses = []
    with ctx.capture(m):
        for i, (x, y) in enumerate(vec_batches(8)):
            if i in (3, 6):
                _MASK = (torch.arange(8) % (i - 1) != 0).float()
            loss = F.cross_entropy(m(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
    return {"m": m, "opt": opt, "losses": losses}


@scenario("step")
def step_loss_reads_closure_tensor_inplace(ctx):
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = fused_sgd(m.parameters())
    w = torch.ones(4)

    def loss_fn(model, x, y):
        return F.cross_entropy(model(x), y, weight=w)

    step = ctx.step(m, loss_fn, opt)
    losses = []
    for i, (x, y) in enumerate(vec_batches(8)):
        if i == 3:
            w[2] = 4.0  # retuned in place
        if i == 5:
            w = torch.tensor([1.0, 0.5, 0.5, 2.0])  # rebound cell
        losses.append(step(x, y))
    return {"m": m, "opt": opt, "losses": losses}


# ===================================================================== RNG the user owns


class NoisyNet(nn.Module):
    """Gaussian noise from the module's own generator (reproducible exploration)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)
        self.gen = torch.Generator().manual_seed(123)

    def forward(self, x):
        h = F.relu(self.fc1(x))
        return self.fc2(h + 0.1 * torch.randn(h.shape, generator=self.gen))


@scenario("capture")
def cap_module_own_generator_noise(ctx):
    m = NoisyNet()
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    losses = []
    with ctx.capture(m):
        for x, y in vec_batches(8):
            loss = F.cross_entropy(m(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
    return {"m": m, "opt": opt, "losses": losses, "gen": m.gen.get_state()}


@scenario("step")
def step_module_own_generator_noise(ctx):
    m = NoisyNet()
    opt = fused_sgd(m.parameters())
    step = ctx.step(m, lambda mm, x, y: F.cross_entropy(mm(x), y), opt)
    losses = [step(x, y) for x, y in vec_batches(8)]
    return {"m": m, "opt": opt, "losses": losses, "gen": m.gen.get_state()}


@scenario("step")
def step_reseed_inside_loss_fn(ctx):
    m = FDrop()
    opt = fused_sgd(m.parameters())
    counter = {"i": 0}

    def loss_fn(model, x, y):
        torch.manual_seed(1000 + counter["i"])  # per-step reproducible dropout
        return F.cross_entropy(model(x), y)

    step = ctx.step(m, loss_fn, opt)
    losses = []
    for i, (x, y) in enumerate(vec_batches(8)):
        counter["i"] = i
        losses.append(step(x, y))
    return {"m": m, "opt": opt, "losses": losses, "rng": torch.get_rng_state()}


@scenario("step")
def step_seq2seq_teacher_forcing_half(ctx):
    m = Seq2Seq()
    opt = fused_adamw(m.parameters())

    def loss_fn(mm, src, tgt):
        return F.cross_entropy(mm(src, tgt).reshape(-1, 12), tgt[:, 1:].reshape(-1))

    step = ctx.step(m, loss_fn, opt)
    losses = [step(s, t) for s, t in seq_pairs()]
    return {"m": m, "opt": opt, "losses": losses, "py_rng": random.random()}


class NumpyCrop(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 4)

    def forward(self, x):
        s = np.random.randint(0, 3)  # a random crop offset drawn in forward
        return self.fc(x[:, s : s + 6])


@scenario("capture")
def cap_numpy_random_in_forward(ctx):
    m = NumpyCrop()
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    losses = []
    with ctx.capture(m):
        for x, y in vec_batches(8, f=8):
            loss = F.cross_entropy(m(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
    return {"m": m, "opt": opt, "losses": losses, "np": float(np.random.rand())}


# ===================================================================== autograd variations


@scenario("capture")
def cap_param_grad_hook_scale_changes(ctx):
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    scale = {"s": 1.0}
    m[0].weight.register_hook(lambda g: g * scale["s"])
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    losses = []
    with ctx.capture(m):
        for i, (x, y) in enumerate(vec_batches(8)):
            scale["s"] = 1.0 / (1 + i)
            loss = F.cross_entropy(m(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
    return {"m": m, "opt": opt, "losses": losses}


@scenario("step")
def step_param_grad_hook_scale_changes(ctx):
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    scale = {"s": 1.0}
    m[0].weight.register_hook(lambda g: g * scale["s"])
    opt = fused_sgd(m.parameters())
    step = ctx.step(m, lambda mm, x, y: F.cross_entropy(mm(x), y), opt)
    losses = []
    for i, (x, y) in enumerate(vec_batches(8)):
        scale["s"] = 1.0 / (1 + i)
        losses.append(step(x, y))
    return {"m": m, "opt": opt, "losses": losses}


@scenario("capture")
def cap_embedding_max_norm_renorms_inplace(ctx):
    m = nn.Sequential(nn.Embedding(20, 8, max_norm=1.0), nn.Flatten(), nn.Linear(24, 4))
    with torch.no_grad():
        m[0].weight.mul_(3)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(21)
    losses = []
    with ctx.capture(m):
        for _ in range(7):
            x, y = torch.randint(0, 20, (6, 3), generator=g), torch.randint(0, 4, (6,), generator=g)
            loss = F.cross_entropy(m(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
    return {"m": m, "opt": opt, "losses": losses}


@scenario("step")
def step_embedding_max_norm_renorms_inplace(ctx):
    m = nn.Sequential(nn.Embedding(20, 8, max_norm=1.0), nn.Flatten(), nn.Linear(24, 4))
    with torch.no_grad():
        m[0].weight.mul_(3)
    opt = fused_sgd(m.parameters(), lr=0.1)
    step = ctx.step(m, lambda mm, x, y: F.cross_entropy(mm(x), y), opt)
    g = torch.Generator().manual_seed(21)
    losses = [step(torch.randint(0, 20, (6, 3), generator=g), torch.randint(0, 4, (6,), generator=g))
              for _ in range(7)]  # fmt: skip
    return {"m": m, "opt": opt, "losses": losses}


@scenario("capture")
def cap_sparse_embedding_sparse_adam(ctx):
    emb = nn.Embedding(30, 8, sparse=True)
    m = nn.ModuleDict({"emb": emb, "fc": nn.Linear(8, 4)})

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.m = m

        def forward(self, x):
            return self.m["fc"](self.m["emb"](x).mean(1))

    model = Model()
    opt_s = torch.optim.SparseAdam(list(emb.parameters()), lr=1e-2)
    opt_d = torch.optim.Adam(m["fc"].parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(22)
    losses = []
    with ctx.capture(model):
        for _ in range(7):
            x, y = torch.randint(0, 30, (6, 4), generator=g), torch.randint(0, 4, (6,), generator=g)
            loss = F.cross_entropy(model(x), y)
            opt_s.zero_grad()
            opt_d.zero_grad()
            loss.backward()
            opt_s.step()
            opt_d.step()
            losses.append(loss.detach())
    emb.weight.grad = emb.weight.grad.to_dense()  # the harness compares dense tensors
    return {"m": model, "opts": [opt_s, opt_d], "losses": losses}


@scenario("capture")
def cap_multitask_two_backwards_retain_graph(ctx):
    m = DictOut()
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(23)
    losses = []
    with ctx.capture(m):
        for _ in range(7):
            x, y = torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)
            out = m(x)
            opt.zero_grad()
            F.cross_entropy(out["logits"], y).backward(retain_graph=True)
            (0.1 * out["reg"].pow(2).mean()).backward()
            opt.step()
            losses.append(out["logits"].detach())
    return {"m": m, "opt": opt, "losses": losses}


@scenario("capture")
def cap_wgan_gp_gradient_penalty(ctx):
    D = nn.Sequential(nn.Linear(4, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
    opt = torch.optim.Adam(D.parameters(), lr=1e-4, betas=(0.5, 0.9))
    g = torch.Generator().manual_seed(24)
    losses = []
    with ctx.capture(D):
        for _ in range(6):
            real, fake = torch.randn(8, 4, generator=g), torch.randn(8, 4, generator=g)
            eps = torch.rand(8, 1)
            xh = (eps * real + (1 - eps) * fake).requires_grad_(True)
            (gr,) = torch.autograd.grad(D(xh).sum(), xh, create_graph=True)
            gp = ((gr.norm(2, dim=1) - 1) ** 2).mean()
            loss = D(fake).mean() - D(real).mean() + 10 * gp
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
    return {"D": D, "opt": opt, "losses": losses}


@scenario("capture")
def cap_autograd_grad_functional_sgd(ctx):
    """Grads through torch.autograd.grad (a MAML-style inner loop), never .grad."""
    m = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    losses = []
    with ctx.capture(m):
        for x, y in vec_batches(7):
            loss = F.cross_entropy(m(x), y)
            grads = torch.autograd.grad(loss, list(m.parameters()))
            with torch.no_grad():
                for p, gr in zip(m.parameters(), grads, strict=True):
                    p.sub_(0.1 * gr)
            losses.append(loss.detach())
    return {"m": m, "losses": losses}


@scenario("capture")
def cap_saliency_input_grad(ctx):
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    sal = []
    with ctx.capture(m):
        for x, y in vec_batches(7):
            x = x.clone().requires_grad_(True)
            loss = F.cross_entropy(m(x), y)
            opt.zero_grad()
            loss.backward()
            sal.append(x.grad.abs().sum(0))
            opt.step()
    return {"m": m, "opt": opt, "sal": sal}


@scenario("capture")
def cap_prune_l1_twice(ctx):
    import torch.nn.utils.prune as prune

    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    losses = []
    with ctx.capture(m):
        for i, (x, y) in enumerate(vec_batches(8)):
            if i in (2, 5):
                prune.l1_unstructured(m[0], "weight", amount=0.2)
                opt = torch.optim.SGD(m.parameters(), lr=0.05)
            loss = F.cross_entropy(m(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
    return {"m": m, "opt": opt, "losses": losses}


@scenario("step")
def step_adamw_betas_and_wd_changed_by_hand(ctx):
    m = Net()
    opt = fused_adamw(m.parameters(), weight_decay=0.01)
    step = ctx.step(m, lambda mm, x, y: F.cross_entropy(mm(x), y), opt)
    losses = []
    for i, (x, y) in enumerate(vec_batches(8)):
        if i == 3:
            for gr in opt.param_groups:
                gr["betas"] = (0.8, 0.99)
        if i == 5:
            opt.param_groups[0]["weight_decay"] = 0.1
            opt.param_groups[0]["eps"] = 1e-6
        losses.append(step(x, y))
    return {"m": m, "opt": opt, "losses": losses}


# ===================================================================== what forward reads indirectly

_ACT = {"slope": 0.01}
_EPOCH = 0


def act(x):
    return F.leaky_relu(x, _ACT["slope"])


class HelperAct(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(act(self.fc1(x)))


def _helper_loop(ctx, entry):
    _ACT["slope"] = 0.01
    m = HelperAct()
    opt = fused_sgd(m.parameters())
    losses = []
    step = ctx.step(m, ce_loss, opt) if entry == "step" else None
    with ctx.capture(m) if entry == "capture" else _null():
        for i, (x, y) in enumerate(vec_batches(8)):
            if i in (3, 5):
                _ACT["slope"] = 0.1 * i
            if step is not None:
                losses.append(step(x, y))
                continue
            loss = ce_loss(m, x, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
    return {"m": m, "opt": opt, "losses": losses}


def _null():
    import contextlib

    return contextlib.nullcontext()


@scenario("capture")
def cap_forward_helper_fn_reads_global_dict(ctx):
    return _helper_loop(ctx, "capture")


@scenario("step")
def step_forward_helper_fn_reads_global_dict(ctx):
    return _helper_loop(ctx, "step")


class LambdaAct(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)
        self.act = lambda x: F.leaky_relu(x, cfg["slope"])

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


@scenario("capture")
def cap_lambda_attr_closure_mutated(ctx):
    cfg = {"slope": 0.01}
    m = LambdaAct(cfg)
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    losses = []
    with ctx.capture(m):
        for i, (x, y) in enumerate(vec_batches(8)):
            if i in (3, 5):
                cfg["slope"] = 0.1 * i
            loss = ce_loss(m, x, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
    return {"m": m, "opt": opt, "losses": losses}


@scenario("step")
def step_lambda_attr_closure_mutated(ctx):
    cfg = {"slope": 0.01}
    m = LambdaAct(cfg)
    opt = fused_sgd(m.parameters())
    step = ctx.step(m, ce_loss, opt)
    losses = []
    for i, (x, y) in enumerate(vec_batches(8)):
        if i in (3, 5):
            cfg["slope"] = 0.1 * i
        losses.append(step(x, y))
    return {"m": m, "opt": opt, "losses": losses}


class DropSchedule:
    """A schedule object whose value is a property of a global epoch counter."""

    @property
    def p(self):
        return min(0.5, 0.1 * _EPOCH)


class ScheduledDrop(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)
        self.sched = DropSchedule()

    def forward(self, x):
        return self.fc2(F.dropout(F.relu(self.fc1(x)), self.sched.p, self.training))


@scenario("capture")
def cap_property_reads_global_epoch(ctx):
    global _EPOCH
    _EPOCH = 0
    m = ScheduledDrop()
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    losses = []
    with ctx.capture(m):
        for i, (x, y) in enumerate(vec_batches(8)):
            _EPOCH = i // 3
            loss = ce_loss(m, x, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
    return {"m": m, "opt": opt, "losses": losses}


@scenario("step")
def step_property_reads_global_epoch(ctx):
    global _EPOCH
    _EPOCH = 0
    m = ScheduledDrop()
    opt = fused_sgd(m.parameters())
    step = ctx.step(m, ce_loss, opt)
    losses = []
    for i, (x, y) in enumerate(vec_batches(8)):
        _EPOCH = i // 3
        losses.append(step(x, y))
    return {"m": m, "opt": opt, "losses": losses}


class Student(nn.Module):
    """Distillation inside forward; the teacher hidden in a list so it is not a submodule."""

    def __init__(self, teacher):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        self._teacher = [teacher]

    def forward(self, x):
        with torch.no_grad():
            t = self._teacher[0](x)
        s = self.net(x)
        return s, F.kl_div(F.log_softmax(s, -1), F.softmax(t / 2, -1), reduction="batchmean")


def teacher_net():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 4))


@scenario("capture")
def cap_hidden_teacher_mode_toggled_and_ema(ctx):
    teacher = teacher_net().eval()
    m = Student(teacher)
    opt = torch.optim.SGD(m.net.parameters(), lr=0.05)
    losses = []
    with ctx.capture(m):
        for i, (x, y) in enumerate(vec_batches(8)):
            if i == 3:
                teacher.train()  # noisy teacher from now on
            if i == 5:
                teacher[2].p = 0.1
            s, kd = m(x)
            loss = F.cross_entropy(s, y) + kd
            opt.zero_grad()
            loss.backward()
            opt.step()
            with torch.no_grad():
                for tp, sp in zip(teacher.parameters(), m.net.parameters(), strict=True):
                    tp.lerp_(sp, 0.1)
            losses.append(loss.detach())
    return {"m": m, "teacher": teacher, "opt": opt, "losses": losses}


@scenario("step")
def step_distill_teacher_mode_toggled(ctx):
    teacher = teacher_net().eval()
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = fused_sgd(m.parameters())

    def loss_fn(model, x, y):
        with torch.no_grad():
            t = teacher(x)
        s = model(x)
        kd = F.kl_div(F.log_softmax(s, -1), F.softmax(t / 2, -1), reduction="batchmean")
        return F.cross_entropy(s, y) + kd

    step = ctx.step(m, loss_fn, opt)
    losses = []
    for i, (x, y) in enumerate(vec_batches(8)):
        if i == 3:
            teacher.train()
        if i == 5:
            teacher[2].p = 0.1
        losses.append(step(x, y))
    return {"m": m, "teacher": teacher, "opt": opt, "losses": losses}


@scenario("capture")
def cap_head_replaced_new_task(ctx):
    m = Net()
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
    losses = []
    with ctx.capture(m):
        for i, (x, y) in enumerate(vec_batches(8)):
            if i == 4:
                m.head = nn.Linear(16, 4)
                opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
            loss = ce_loss(m, x, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
    return {"m": m, "opt": opt, "losses": losses}


class DictIn(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, batch, mask=None):
        h = F.relu(self.fc1(batch["x"]))
        if mask is not None:
            h = h * mask
        return self.fc2(h) * batch["scale"]


@scenario("capture")
def cap_dict_batch_input_optional_mask(ctx):
    m = DictIn()
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    losses = []
    with ctx.capture(m):
        for i, (x, y) in enumerate(vec_batches(8)):
            batch = {"x": x, "scale": 1.0 + 0.5 * (i % 2)}
            mask = (torch.rand(8, 16) > 0.2).float() if i % 3 == 0 else None
            loss = F.cross_entropy(m(batch, mask=mask), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
    return {"m": m, "opt": opt, "losses": losses}


@scenario("capture")
def cap_simclr_two_views_one_backward(ctx):
    enc = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 8))
    opt = torch.optim.SGD(enc.parameters(), lr=0.05, momentum=0.9)
    losses = []
    with ctx.capture(enc):
        for x, _ in vec_batches(7):
            v1 = x + 0.1 * torch.randn_like(x)
            v2 = x * (torch.rand_like(x) > 0.2)
            z1, z2 = F.normalize(enc(v1), dim=1), F.normalize(enc(v2), dim=1)
            logits = z1 @ z2.T / 0.5
            loss = F.cross_entropy(logits, torch.arange(8))
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
    return {"enc": enc, "opt": opt, "losses": losses}


@scenario("capture")
def cap_prev_output_kept_data_and_view(ctx):
    """Temporal consistency: this step's prediction against the last one (kept by .data)."""
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    prev, prev_col, losses = None, None, []
    g = torch.Generator().manual_seed(31)
    x = torch.randn(8, 8, generator=g)
    with ctx.capture(m):
        for _ in range(7):
            out = m(x + 0.05 * torch.randn(8, 8, generator=g))
            loss = out.pow(2).mean()
            if prev is not None:
                loss = loss + F.mse_loss(out, prev) + F.mse_loss(out[:, 0], prev_col)
            opt.zero_grad()
            loss.backward()
            opt.step()
            prev, prev_col = out.data, out.detach()[:, 0]
            losses.append(loss.detach())
    return {"m": m, "opt": opt, "losses": losses, "prev": prev, "prev_col": prev_col}


@scenario("capture")
def cap_grad_view_kept_across_steps(ctx):
    """Gradient noise estimate: cosine between this step's and the previous step's grad."""
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    prev, cos = None, []
    with ctx.capture(m):
        for x, y in vec_batches(7):
            loss = ce_loss(m, x, y)
            opt.zero_grad(set_to_none=False)
            loss.backward()
            g = m[0].weight.grad.view(-1)
            if prev is not None:
                cos.append(F.cosine_similarity(g, prev, dim=0))
            opt.step()
            prev = g.detach().clone() if False else g.data
    return {"m": m, "opt": opt, "cos": cos}


class MethodSchedule:
    def p(self):
        return min(0.5, 0.1 * _EPOCH)


class MethodDrop(ScheduledDrop):
    """The schedule read through a plain method of a held object."""

    def __init__(self):
        super().__init__()
        self.sched = MethodSchedule()

    def forward(self, x):
        return self.fc2(F.dropout(F.relu(self.fc1(x)), self.sched.p(), self.training))


class OwnMethodDrop(ScheduledDrop):
    """The schedule read through a method of the model's own class."""

    def drop_p(self):
        return min(0.5, 0.1 * _EPOCH)

    def forward(self, x):
        return self.fc2(F.dropout(F.relu(self.fc1(x)), self.drop_p(), self.training))


def _epoch_loop(ctx, entry, cls):
    global _EPOCH
    _EPOCH = 0
    m = cls()
    opt = fused_sgd(m.parameters())
    step = ctx.step(m, ce_loss, opt) if entry == "step" else None
    losses = []
    with ctx.capture(m) if entry == "capture" else _null():
        for i, (x, y) in enumerate(vec_batches(8)):
            _EPOCH = i // 3
            if step is not None:
                losses.append(step(x, y))
                continue
            loss = ce_loss(m, x, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
    return {"m": m, "opt": opt, "losses": losses}


@scenario("capture")
def cap_held_object_method_reads_global(ctx):
    return _epoch_loop(ctx, "capture", MethodDrop)


@scenario("step")
def step_held_object_method_reads_global(ctx):
    return _epoch_loop(ctx, "step", MethodDrop)


@scenario("capture")
def cap_model_own_method_reads_global(ctx):
    return _epoch_loop(ctx, "capture", OwnMethodDrop)


@scenario("step")
def step_model_own_method_reads_global(ctx):
    return _epoch_loop(ctx, "step", OwnMethodDrop)


class Gate(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def rate(self):
        return 0.1 * _EPOCH

    def forward(self, x):
        return self.fc(x)


class SubMethodNet(nn.Module):
    """forward calls a submodule's non-forward method (``self.gate.rate()``)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.gate, self.fc2 = nn.Linear(8, 16), Gate(), nn.Linear(16, 4)

    def forward(self, x):
        h = F.relu(self.fc1(x))
        return self.fc2(h + self.gate(h) * self.gate.rate())


class StaticNet(ScheduledDrop):
    """A staticmethod of the model's class reading the global."""

    @staticmethod
    def drop_p():
        return min(0.5, 0.1 * _EPOCH)

    def forward(self, x):
        return self.fc2(F.dropout(F.relu(self.fc1(x)), self.drop_p(), self.training))


@torch.no_grad()
def noise_level():
    return 0.2 * _EPOCH


class DecoratedHelperNet(ScheduledDrop):
    """A module-level helper decorated with ``@torch.no_grad()`` reading the global."""

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)) * (1 + noise_level()))


@scenario("capture")
def cap_submodule_method_reads_global(ctx):
    return _epoch_loop(ctx, "capture", SubMethodNet)


@scenario("step")
def step_submodule_method_reads_global(ctx):
    return _epoch_loop(ctx, "step", SubMethodNet)


@scenario("capture")
def cap_staticmethod_reads_global(ctx):
    return _epoch_loop(ctx, "capture", StaticNet)


@scenario("capture")
def cap_nograd_decorated_helper_reads_global(ctx):
    return _epoch_loop(ctx, "capture", DecoratedHelperNet)


@scenario("step")
def step_nograd_decorated_helper_reads_global(ctx):
    return _epoch_loop(ctx, "step", DecoratedHelperNet)


@torch.no_grad()
def _label_noise():
    return 0.05 * _EPOCH


@scenario("step")
def step_loss_calls_decorated_helper_reading_global(ctx):
    global _EPOCH
    _EPOCH = 0
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = fused_sgd(m.parameters())

    def loss_fn(model, x, y):
        return F.cross_entropy(model(x), y, label_smoothing=_label_noise())

    step = ctx.step(m, loss_fn, opt)
    losses = []
    for i, (x, y) in enumerate(vec_batches(8)):
        _EPOCH = i // 3
        losses.append(step(x, y))
    return {"m": m, "opt": opt, "losses": losses}


# ===================================================================== private RNGs and host arrays


class MaskedAE(nn.Module):
    """MAE-style random masking drawn from the module's own numpy Generator."""

    def __init__(self, kind="default_rng"):
        super().__init__()
        self.enc, self.dec = nn.Linear(8, 16), nn.Linear(16, 8)
        self.rng = np.random.default_rng(7) if kind == "default_rng" else random.Random(7)

    def forward(self, x):
        if isinstance(self.rng, random.Random):
            keep = [i for i in range(8) if self.rng.random() > 0.3]
        else:
            keep = np.flatnonzero(self.rng.random(8) > 0.3).tolist()
        mask = torch.zeros(8)
        mask[keep] = 1.0
        return self.dec(F.relu(self.enc(x * mask)))


def _ae_loop(ctx, entry, kind):
    m = MaskedAE(kind)
    opt = fused_sgd(m.parameters())
    loss_fn = lambda mm, x: F.mse_loss(mm(x), x)  # noqa: E731
    step = ctx.step(m, loss_fn, opt) if entry == "step" else None
    losses = []
    with ctx.capture(m) if entry == "capture" else _null():
        for x, _ in vec_batches(8):
            if step is not None:
                losses.append(step(x))
                continue
            loss = loss_fn(m, x)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
    return {"m": m, "opt": opt, "losses": losses}


@scenario("capture")
def cap_module_numpy_generator_masking(ctx):
    return _ae_loop(ctx, "capture", "default_rng")


@scenario("step")
def step_module_numpy_generator_masking(ctx):
    return _ae_loop(ctx, "step", "default_rng")


@scenario("capture")
def cap_module_python_random_instance(ctx):
    return _ae_loop(ctx, "capture", "Random")


@scenario("step")
def step_module_python_random_instance(ctx):
    return _ae_loop(ctx, "step", "Random")


_NP_SCALES = np.ones(4, np.float32)
_CFG_NESTED = {"model": {"drop": [0.0, 0.1]}}


class HostArrayNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        h = F.dropout(F.relu(self.fc1(x)), _CFG_NESTED["model"]["drop"][1], self.training)
        return self.fc2(h) * float(_NP_SCALES[1])


def _host_array_loop(ctx, entry):
    _NP_SCALES[:] = 1.0
    _CFG_NESTED["model"]["drop"][1] = 0.1
    m = HostArrayNet()
    opt = fused_sgd(m.parameters())
    step = ctx.step(m, ce_loss, opt) if entry == "step" else None
    losses = []
    with ctx.capture(m) if entry == "capture" else _null():
        for i, (x, y) in enumerate(vec_batches(8)):
            if i == 3:
                _NP_SCALES[1] = 2.0  # a numpy array edited in place
            if i == 5:
                _CFG_NESTED["model"]["drop"][1] = 0.4  # a nested config edited in place
            if step is not None:
                losses.append(step(x, y))
                continue
            loss = ce_loss(m, x, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
    return {"m": m, "opt": opt, "losses": losses}


@scenario("capture")
def cap_global_numpy_array_and_nested_cfg_inplace(ctx):
    return _host_array_loop(ctx, "capture")


@scenario("step")
def step_global_numpy_array_and_nested_cfg_inplace(ctx):
    return _host_array_loop(ctx, "step")


# ===================================================================== host side effects and loss-side RNGs


@scenario("step")
def step_mixup_lambda_from_closure_default_rng(ctx):
    """Modern numpy: mixup's lambda from a Generator the script made (not the global RNG)."""
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = fused_sgd(m.parameters())
    rng = np.random.default_rng(0)

    def loss_fn(model, x, y):
        lam = float(rng.beta(0.4, 0.4))
        idx = torch.arange(x.size(0)).flip(0)
        out = model(lam * x + (1 - lam) * x[idx])
        return lam * F.cross_entropy(out, y) + (1 - lam) * F.cross_entropy(out, y[idx])

    step = ctx.step(m, loss_fn, opt)
    losses = [step(x, y) for x, y in vec_batches(8)]
    return {"m": m, "opt": opt, "losses": losses, "rng": float(rng.random())}


@scenario("step")
def step_task_choice_from_closure_random_instance(ctx):
    m = DictOut()
    opt = fused_adamw(m.parameters())  # a branch leaves grads None: fused SGD+momentum raises
    rng = random.Random(0)

    def loss_fn(model, x, y):
        out = model(x)
        if rng.random() < 0.5:
            return F.cross_entropy(out["logits"], y)
        return out["reg"].pow(2).mean()

    step = ctx.step(m, loss_fn, opt)
    losses = [step(x, y) for x, y in vec_batches(8)]
    return {"m": m, "opt": opt, "losses": losses, "rng": rng.random()}


class Annealer:
    def coef(self):
        return 0.01 * (1 + _EPOCH)


@scenario("step")
def step_loss_calls_held_object_method_reading_global(ctx):
    global _EPOCH
    _EPOCH = 0
    m = ActorCritic()
    opt = fused_adamw(m.parameters())
    ann = Annealer()
    obs, act, _logp, _v0, ret, _adv = rollout(m)

    def loss_fn(model, o, a, r):
        logits, v = model(o)
        d = torch.distributions.Categorical(logits=logits, validate_args=False)
        return -(d.log_prob(a) * r).mean() - ann.coef() * d.entropy().mean() + F.mse_loss(v, r)

    step = ctx.step(m, loss_fn, opt)
    losses = []
    for i in range(8):
        _EPOCH = i // 3
        j = slice(4 * i, 4 * i + 4)
        losses.append(step(obs[j], act[j], ret[j]))
    return {"m": m, "opt": opt, "losses": losses}


_AUX_LOG: list = []


class LoggingNet(nn.Module):
    """Forward keeps auxiliary values for logging: a list attribute, a dict attribute, a global."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)
        self.norms: list = []
        self.stats: dict = {}

    def forward(self, x):
        h = F.relu(self.fc1(x))
        self.norms.append(h.detach().norm())
        self.stats["sparsity"] = (h == 0).float().mean().detach()
        _AUX_LOG.append(h.detach().mean())
        return self.fc2(h)


def _logging_loop(ctx, entry):
    _AUX_LOG.clear()
    m = LoggingNet()
    opt = fused_sgd(m.parameters())
    step = ctx.step(m, ce_loss, opt) if entry == "step" else None
    losses, sparsity = [], []
    with ctx.capture(m) if entry == "capture" else _null():
        for x, y in vec_batches(7):
            if step is not None:
                losses.append(step(x, y))
            else:
                loss = ce_loss(m, x, y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(loss.detach())
            sparsity.append(m.stats["sparsity"])
    return {"m": m, "opt": opt, "losses": losses, "norms": list(m.norms), "sparsity": sparsity,
            "aux": list(_AUX_LOG), "n": [len(m.norms), len(_AUX_LOG)]}  # fmt: skip


@scenario("capture")
def cap_forward_logs_into_list_dict_global(ctx):
    return _logging_loop(ctx, "capture")


@scenario("step")
def step_forward_logs_into_list_dict_global(ctx):
    return _logging_loop(ctx, "step")


_CALLS = 0


class CountingNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        global _CALLS
        _CALLS += 1
        return self.fc(x)


@scenario("capture")
def cap_forward_counts_calls_in_global(ctx):
    global _CALLS
    _CALLS = 0
    m = CountingNet()
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    losses = []
    with ctx.capture(m):
        for x, y in vec_batches(7):
            loss = ce_loss(m, x, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
    return {"m": m, "opt": opt, "losses": losses, "calls": _CALLS}


# ===================================================================== contiguous gradient buffers


def _contiguous_grads(m):
    """Megatron/Apex style: every ``p.grad`` a view into one flat buffer (zeroed, not freed)."""
    flat = torch.zeros(sum(p.numel() for p in m.parameters()))
    i = 0
    for p in m.parameters():
        p.grad = flat[i : i + p.numel()].view_as(p)
        i += p.numel()
    return flat


@scenario("capture")
def cap_contiguous_grad_buffer_flat_clip(ctx):
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    flat = _contiguous_grads(m)
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
    losses, norms = [], []
    with ctx.capture(m):
        for x, y in vec_batches(7):
            flat.zero_()
            loss = ce_loss(m, x, y)
            loss.backward()
            n = flat.norm()
            flat.mul_(torch.clamp(1.0 / (n + 1e-6), max=1.0))  # clip on the flat buffer
            norms.append(n)
            opt.step()
            losses.append(loss.detach())
    return {"m": m, "opt": opt, "losses": losses, "norms": norms, "flat": flat}


@scenario("capture")
def cap_flat_param_and_grad_buffers(ctx):
    """Parameters and gradients both views of flat buffers; the optimizer steps the flat one."""
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    with torch.no_grad():
        flat_p = nn.Parameter(torch.cat([p.detach().reshape(-1) for p in m.parameters()]))
    flat_g = torch.zeros_like(flat_p)
    i = 0
    for p in m.parameters():
        p.data = flat_p.data[i : i + p.numel()].view_as(p)
        p.grad = flat_g[i : i + p.numel()].view_as(p)
        i += p.numel()
    flat_p.grad = flat_g
    opt = torch.optim.SGD([flat_p], lr=0.05, momentum=0.9)
    losses = []
    with ctx.capture(m):
        for x, y in vec_batches(7):
            flat_g.zero_()
            loss = ce_loss(m, x, y)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
    return {"m": m, "flat_p": flat_p.detach(), "flat_g": flat_g, "opt": opt, "losses": losses}


class LinearSchedule:
    """A schedule object the loop steps; ``value()`` reads only its own attributes."""

    def __init__(self, start, end, n):
        self.start, self.end, self.n, self.t = start, end, n, 0

    def step(self):
        self.t += 1

    def value(self):
        return self.start + (self.end - self.start) * min(1.0, self.t / self.n)


_DROP_SCHED = LinearSchedule(0.0, 0.5, 6)


class GlobalSchedDrop(ScheduledDrop):
    def forward(self, x):
        return self.fc2(F.dropout(F.relu(self.fc1(x)), _DROP_SCHED.value(), self.training))


@scenario("capture")
def cap_global_schedule_object_method(ctx):
    _DROP_SCHED.t = 0
    m = GlobalSchedDrop()
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    losses = []
    with ctx.capture(m):
        for x, y in vec_batches(8):
            loss = ce_loss(m, x, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            _DROP_SCHED.step()
            losses.append(loss.detach())
    return {"m": m, "opt": opt, "losses": losses}


@scenario("step")
def step_closure_schedule_object_method_ppo_entropy(ctx):
    m = ActorCritic()
    opt = fused_adamw(m.parameters())
    ent = LinearSchedule(0.05, 0.0, 6)
    obs, act, _logp, _v0, ret, _adv = rollout(m)

    def loss_fn(model, o, a, r):
        logits, v = model(o)
        d = torch.distributions.Categorical(logits=logits, validate_args=False)
        return -(d.log_prob(a) * r).mean() - ent.value() * d.entropy().mean() + F.mse_loss(v, r)

    step = ctx.step(m, loss_fn, opt)
    losses = []
    for i in range(8):
        j = slice(4 * i, 4 * i + 4)
        losses.append(step(obs[j], act[j], ret[j]))
        ent.step()
    return {"m": m, "opt": opt, "losses": losses}


class SelfSchedNet(ScheduledDrop):
    """The schedule object held by the model, stepped by the loop."""

    def __init__(self):
        super().__init__()
        self.sched = LinearSchedule(0.0, 0.5, 6)

    def forward(self, x):
        return self.fc2(F.dropout(F.relu(self.fc1(x)), self.sched.value(), self.training))


@scenario("capture")
def cap_held_schedule_object_stepped(ctx):
    m = SelfSchedNet()
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    losses = []
    with ctx.capture(m):
        for x, y in vec_batches(8):
            loss = ce_loss(m, x, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            m.sched.step()
            losses.append(loss.detach())
    return {"m": m, "opt": opt, "losses": losses}
