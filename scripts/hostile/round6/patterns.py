"""Hostile patterns for rk.capture: tensor attribute outputs/states, held containers, gradient hooks.

Run: OMP_NUM_THREADS=1 PYTHONPATH=. python scripts/hostile/round6/patterns.py [names...]
The harness is scripts/hostile/harness.py (profile ROUND6).
"""

from __future__ import annotations

import sys
import types
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from harness import ROUND6, run_pattern

STEPS = 8
D = 8


def data(n=STEPS, b=4, d=D, seed=1, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, d, generator=g, dtype=dtype) for _ in range(n)]


def mlp(d=D, h=16, o=4):
    return nn.Sequential(nn.Linear(d, h), nn.ReLU(), nn.Linear(h, o))


# ----------------------------------------------------------------------------- 1. states
class Centre(nn.Module):
    def __init__(self, buffer=True):
        super().__init__()
        self.net = mlp()
        if buffer:
            self.register_buffer("center", torch.zeros(4))
        else:
            self.center = torch.zeros(4)

    def forward(self, x):
        out = self.net(x)
        centred = out - self.center
        self.center = 0.9 * self.center + 0.1 * out.detach().mean(0)
        return centred


def _centre_loop(r, buffer=True, between=None, hold=False, dtype=None):
    torch.manual_seed(0)
    model = r.wrap(Centre(buffer))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    olds = []
    for i, x in enumerate(data()):
        if between is not None:
            between(i, model)
        if dtype is not None and i >= 4:
            x = x.to(dtype)
        if hold:
            olds.append(model.center)
        out = model(x)
        loss = out.pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        r.snap(model, out=out, center=model.center, olds=list(olds))


def s_dino_centre_buffer(r):
    _centre_loop(r, buffer=True)


def s_centre_plain_attr(r):
    _centre_loop(r, buffer=False)


def s_centre_user_holds_old(r):
    _centre_loop(r, buffer=False, hold=True)


def s_centre_buffer_user_holds_old(r):
    _centre_loop(r, buffer=True, hold=True)


def s_centre_user_reset_rebind(r):
    def between(i, m):
        if i == 5:
            m.center = torch.zeros(4)

    _centre_loop(r, buffer=False, between=between)


def s_centre_user_reset_inplace(r):
    def between(i, m):
        if i == 5:
            m.center.zero_()

    _centre_loop(r, buffer=False, between=between)


def s_centre_buffer_user_fill_inplace(r):
    def between(i, m):
        if i in (4, 6):
            with torch.no_grad():
                m.center.fill_(0.5)

    _centre_loop(r, buffer=True, between=between)


def s_centre_state_dict_reload(r):
    saved = {}

    def between(i, m):
        if i == 2:
            saved["sd"] = {k: v.clone() for k, v in m.state_dict().items()}
        if i == 5:
            m.load_state_dict(saved["sd"])

    _centre_loop(r, buffer=True, between=between)


def s_centre_plain_attr_set_other_shape(r):
    # user resizes the centre between calls (e.g. a new head): replay must follow the new shape
    class C(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = mlp(o=4)
            self.center = torch.zeros(4)

        def forward(self, x):
            out = self.net(x)
            c = (
                self.center[: out.shape[1]]
                if self.center.shape[0] >= 4
                else F.pad(self.center, (0, 4 - self.center.shape[0]))
            )
            self.center = 0.9 * c + 0.1 * out.detach().mean(0)
            return out - c

    torch.manual_seed(0)
    model = r.wrap(C())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i, x in enumerate(data()):
        if i == 4:
            model.center = torch.ones(6)
        out = model(x)
        out.pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        r.snap(model, out=out, center=model.center)


def s_model_to_double_midrun(r):
    torch.manual_seed(0)
    model = r.wrap(Centre(buffer=False))
    opt = None
    for i, x in enumerate(data()):
        if i == 4:
            model.double()
        if i >= 4:
            x = x.double()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        out = model(x)
        out.pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        r.snap(model, out=out, center=model.center)


def s_buffer_model_to_double_midrun(r):
    torch.manual_seed(0)
    model = r.wrap(Centre(buffer=True))
    for i, x in enumerate(data()):
        if i == 4:
            model.double()
        if i >= 4:
            x = x.double()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        out = model(x)
        out.pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        r.snap(model, out=out, center=model.center)


def s_state_dtype_follows_input(r):
    class C(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(D, 4)
            self.center = torch.zeros(4)

        def forward(self, x):
            out = self.lin(x.float())
            m = out.detach().mean(0).to(x.dtype)
            self.center = 0.9 * self.center.to(x.dtype) + 0.1 * m
            return out - self.center.float()

    torch.manual_seed(0)
    model = r.wrap(C())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i, x in enumerate(data()):
        x = x.double() if i % 3 == 2 else x
        out = model(x)
        out.pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        r.snap(model, out=out, center=model.center)


def s_state_inplace_and_rebind(r):
    class C(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(D, 4)
            self.c = torch.zeros(4)

        def forward(self, x):
            out = self.lin(x)
            self.c.mul_(0.9)
            self.c = self.c + 0.1 * out.detach().mean(0)
            return out * self.c

    torch.manual_seed(0)
    model = r.wrap(C())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    held = []
    for x in data():
        held.append(model.c)
        out = model(x)
        out.pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        r.snap(model, out=out, c=model.c, held=list(held))


def s_queue_grows_then_fixed(r):
    # MoCo-style queue rebound by cat, grows until K rows
    class Q(nn.Module):
        def __init__(self):
            super().__init__()
            self.enc = nn.Linear(D, 6)
            self.queue = None

        def forward(self, x):
            f = F.normalize(self.enc(x), dim=1)
            if self.queue is None:
                logits = f @ f.detach().t()
                self.queue = f.detach()
            else:
                logits = f @ self.queue.t()
                self.queue = torch.cat([f.detach(), self.queue])[:12]
            return logits

    torch.manual_seed(0)
    model = r.wrap(Q())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x in data():
        out = model(x)
        out.logsumexp(1).mean().backward()
        opt.step()
        opt.zero_grad()
        r.snap(model, out=out, queue=model.queue)


class Rope(nn.Module):
    def __init__(self, dict_cache=False):
        super().__init__()
        self.q = nn.Linear(D, D)
        self.dict_cache = dict_cache
        self.cos = None
        self.sin = None
        self.cache = {}

    def tables(self, n, ref):
        inv = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
        t = torch.arange(n, dtype=torch.float32)
        fr = torch.outer(t, inv)
        emb = torch.cat([fr, fr], -1)
        return emb.cos().to(ref.dtype), emb.sin().to(ref.dtype)

    def forward(self, x):  # x: (b, n, D)
        n = x.shape[1]
        if self.dict_cache:
            if n not in self.cache:
                self.cache[n] = self.tables(n, x)
            cos, sin = self.cache[n]
        else:
            if self.cos is None or self.cos.shape[0] < n:
                self.cos, self.sin = self.tables(n, x)
            cos, sin = self.cos[:n], self.sin[:n]
        q = self.q(x)
        q1, q2 = q.chunk(2, -1)
        rot = torch.cat([-q2, q1], -1)
        return q * cos + rot * sin


def _rope_loop(r, dict_cache, lengths):
    torch.manual_seed(0)
    model = r.wrap(Rope(dict_cache))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(3)
    for n in lengths:
        x = torch.randn(2, n, D, generator=g)
        out = model(x)
        out.pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        extra = {"cos": model.cos} if not dict_cache else {"cache": dict(model.cache)}
        r.snap(model, out=out, **extra)


def s_rope_cache_rebuilt_longer(r):
    _rope_loop(r, False, [4, 4, 4, 6, 6, 4, 8, 4])


def s_rope_cache_dict_by_len(r):
    _rope_loop(r, True, [4, 4, 4, 6, 6, 4, 6, 4])


def s_two_dependent_states(r):
    class C(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(D, 4)
            self.m1 = torch.zeros(4)
            self.m2 = torch.ones(4)

        def forward(self, x):
            out = self.lin(x)
            self.m1 = 0.9 * self.m1 + 0.1 * out.detach().mean(0)
            self.m2 = 0.9 * self.m2 + 0.1 * (out.detach() - self.m1).pow(2).mean(0)
            return (out - self.m1) / (self.m2 + 1e-5).sqrt()

    torch.manual_seed(0)
    model = r.wrap(C())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x in data():
        out = model(x)
        out.pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        r.snap(model, out=out, m1=model.m1, m2=model.m2)


def s_prev_cur_swap(r):
    # temporal consistency: loss against the previous batch's features; states shift by rebinding
    class C(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(D, 4)
            self.prev = torch.zeros(4, 4)
            self.cur = torch.zeros(4, 4)

        def forward(self, x):
            out = self.lin(x)
            loss_t = (out - self.prev).pow(2).mean()
            self.prev = self.cur
            self.cur = out.detach()
            return out, loss_t

    torch.manual_seed(0)
    model = r.wrap(C())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x in data():
        out, lt = model(x)
        (out.pow(2).mean() + lt).backward()
        opt.step()
        opt.zero_grad()
        r.snap(model, out=out, lt=lt, prev=model.prev, cur=model.cur)


def s_state_swap_pair(r):
    class C(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(D, 4)
            self.a = torch.zeros(4)
            self.b = torch.ones(4)

        def forward(self, x):
            out = self.lin(x)
            self.a, self.b = self.b, self.a + out.detach().mean(0)
            return out * self.a

    torch.manual_seed(0)
    model = r.wrap(C())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x in data():
        out = model(x)
        out.pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        r.snap(model, out=out, a=model.a, b=model.b)


def s_state_deep_submodule(r):
    class Leaf(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(D, D)
            self.register_buffer("center", torch.zeros(D))

        def forward(self, x):
            h = self.lin(x)
            y = h - self.center
            self.center = 0.8 * self.center + 0.2 * h.detach().mean(0)
            return torch.relu(y)

    model_ = nn.Sequential(nn.Sequential(nn.Sequential(Leaf(), Leaf())), nn.Linear(D, 2))
    torch.manual_seed(0)
    for p in model_.parameters():
        nn.init.normal_(p, std=0.3)
    model = r.wrap(model_)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x in data():
        out = model(x)
        out.pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        r.snap(model, out=out)


def s_state_under_autocast(r):
    torch.manual_seed(0)
    model = r.wrap(Centre(buffer=False))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x in data():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
            loss = out.float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        r.snap(model, out=out, center=model.center)


def s_state_in_dict(r):
    class C(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(D, 4)
            self.stats = {"center": torch.zeros(4)}

        def forward(self, x):
            out = self.lin(x)
            y = out - self.stats["center"]
            self.stats["center"] = 0.9 * self.stats["center"] + 0.1 * out.detach().mean(0)
            return y

    torch.manual_seed(0)
    model = r.wrap(C())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x in data():
        out = model(x)
        out.pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        r.snap(model, out=out, center=model.stats["center"])


def s_state_in_namespace(r):
    class C(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(D, 4)
            self.state = types.SimpleNamespace(center=torch.zeros(4), last=None)

        def forward(self, x):
            out = self.lin(x)
            y = out - self.state.center
            self.state.center = 0.9 * self.state.center + 0.1 * out.detach().mean(0)
            self.state.last = y.detach()
            return y

    torch.manual_seed(0)
    model = r.wrap(C())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x in data():
        out = model(x)
        out.pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        r.snap(model, out=out, center=model.state.center, last=model.state.last)


def s_read_only_attr_user_rebinds(r):
    # class-balancing weights recomputed by the loop each step, read by forward
    class C(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(D, 4)
            self.scale = torch.ones(4)

        def forward(self, x):
            return self.lin(x) * self.scale

    torch.manual_seed(0)
    model = r.wrap(C())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i, x in enumerate(data()):
        model.scale = torch.full((4,), 1.0 + 0.1 * i)
        out = model(x)
        out.pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        r.snap(model, out=out)


def s_read_only_dict_entry_user_rebinds(r):
    class C(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(D, 4)
            self.cfg = {"scale": torch.ones(4)}

        def forward(self, x):
            return self.lin(x) * self.cfg["scale"]

    torch.manual_seed(0)
    model = r.wrap(C())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i, x in enumerate(data()):
        model.cfg["scale"] = torch.full((4,), 1.0 + 0.1 * i)
        out = model(x)
        out.pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        r.snap(model, out=out)


def s_dino_student_teacher(r):
    # student captured; EMA teacher updated in place in the loop; centre buffer on the teacher head
    torch.manual_seed(0)
    student = mlp(o=6)
    teacher = Centre(buffer=True)
    teacher.net = mlp(o=6)
    teacher.center = torch.zeros(6)
    teacher.load_state_dict(
        {**{"net." + k: v for k, v in student.state_dict().items()}, "center": torch.zeros(6)}
    )
    for p in teacher.parameters():
        p.requires_grad_(False)
    s = r.wrap(student)
    opt = torch.optim.SGD(s.parameters(), lr=0.1)
    for x in data():
        with torch.no_grad():
            t = teacher(x + 0.1)
        out = s(x)
        loss = -(F.softmax(t / 0.04, -1) * F.log_softmax(out / 0.1, -1)).sum(-1).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for pt, ps in zip(teacher.net.parameters(), s.parameters(), strict=False):
                pt.mul_(0.99).add_(ps, alpha=0.01)
        r.snap(s, out=out, loss=loss, center=teacher.center)


def s_dino_teacher_centre_captured(r):
    # the teacher (with its rebinding centre) is the captured module, called under no_grad -> eager
    # and a captured student with a centre of its own under grad
    torch.manual_seed(0)
    student = Centre(buffer=True)
    s = r.wrap(student)
    opt = torch.optim.SGD(s.parameters(), lr=0.1)
    for i, x in enumerate(data()):
        if i % 2 == 1:
            with torch.no_grad():
                _ = s(x * 2)
        out = s(x)
        loss = out.pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        r.snap(s, out=out)


# ----------------------------------------------------------------------------- written-only, containers
class MoE(nn.Module):
    def __init__(self, e=4):
        super().__init__()
        self.router = nn.Linear(D, e)
        self.experts = nn.ModuleList(nn.Linear(D, D) for _ in range(e))
        self.aux_loss = None

    def forward(self, x):
        probs = self.router(x).softmax(-1)
        out = sum(probs[:, i : i + 1] * ex(x) for i, ex in enumerate(self.experts))
        self.aux_loss = (probs.mean(0) ** 2).sum() * probs.shape[1]
        return out


def w_moe_aux_loss(r):
    torch.manual_seed(0)
    model = r.wrap(nn.Sequential(MoE(), nn.ReLU(), MoE()))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x in data():
        out = model(x)
        aux = model[0].aux_loss + model[2].aux_loss
        loss = out.pow(2).mean() + 0.01 * aux
        loss.backward()
        opt.step()
        opt.zero_grad()
        r.snap(model, out=out, aux=aux)


def w_moe_aux_loss_sometimes_unused(r):
    torch.manual_seed(0)
    model = r.wrap(MoE())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i, x in enumerate(data()):
        out = model(x)
        loss = out.pow(2).mean() + (0.01 * model.aux_loss if i % 2 else 0)
        loss.backward()
        opt.step()
        opt.zero_grad()
        r.snap(model, out=out, aux=model.aux_loss)


def w_last_attn_logged(r):
    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(D, 3 * D)
            self.last_attn = None

        def forward(self, x):
            q, k, v = self.qkv(x).chunk(3, -1)
            a = (q @ k.transpose(-1, -2) / D**0.5).softmax(-1)
            self.last_attn = a.detach()
            return a @ v

    torch.manual_seed(0)
    model = r.wrap(Attn())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kept = []
    g = torch.Generator().manual_seed(5)
    for _ in range(STEPS):
        x = torch.randn(2, 5, D, generator=g)
        out = model(x)
        kept.append(model.last_attn)
        out.pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        r.snap(model, out=out, kept=list(kept))


class FeatD(nn.Module):
    """A discriminator keeping its intermediate features for a feature-matching loss."""

    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(D, 16)
        self.l2 = nn.Linear(16, 16)
        self.head = nn.Linear(16, 1)
        self.feats = {}

    def forward(self, x):
        h1 = F.leaky_relu(self.l1(x), 0.2)
        self.feats["h1"] = h1
        h2 = F.leaky_relu(self.l2(h1), 0.2)
        self.feats["h2"] = h2
        return self.head(h2)


def w_feature_matching_gan(r):
    torch.manual_seed(0)
    G = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, D))
    Dn = r.wrap(FeatD())
    og = torch.optim.SGD(G.parameters(), lr=0.05)
    od = torch.optim.SGD(Dn.parameters(), lr=0.05)
    gz = torch.Generator().manual_seed(9)
    for x in data():
        z = torch.randn(4, 4, generator=gz)
        fake = G(z)
        # D step
        ld = F.softplus(-Dn(x)).mean() + F.softplus(Dn(fake.detach())).mean()
        od.zero_grad()
        ld.backward()
        od.step()
        # G step: feature matching on real feats
        Dn(x)
        real = {k: v.detach() for k, v in Dn.feats.items()}
        Dn(fake)
        lg = sum((Dn.feats[k].mean(0) - real[k].mean(0)).pow(2).mean() for k in real)
        og.zero_grad()
        lg.backward()
        og.step()
        r.snap(Dn, ld=ld, lg=lg, gp=[p.detach() for p in G.parameters()])


def w_feats_dict_single_call(r):
    torch.manual_seed(0)
    Dn = r.wrap(FeatD())
    opt = torch.optim.SGD(Dn.parameters(), lr=0.05)
    for x in data():
        out = Dn(x)
        loss = out.pow(2).mean() + 0.1 * Dn.feats["h1"].pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        r.snap(Dn, out=out, feats=dict(Dn.feats))


def w_feats_dict_user_replaces_dict(r):
    torch.manual_seed(0)
    Dn = r.wrap(FeatD())
    opt = torch.optim.SGD(Dn.parameters(), lr=0.05)
    for x in data():
        Dn.feats = {}  # reset each step (a common "clear the cache" idiom)
        out = Dn(x)
        loss = out.pow(2).mean() + 0.1 * Dn.feats["h2"].pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        r.snap(Dn, out=out, feats=dict(Dn.feats))


def w_feats_dict_user_clears(r):
    torch.manual_seed(0)
    Dn = r.wrap(FeatD())
    opt = torch.optim.SGD(Dn.parameters(), lr=0.05)
    for i, x in enumerate(data()):
        if i % 2:
            del Dn.feats["h1"]
        else:
            Dn.feats.clear()
        out = Dn(x)
        loss = out.pow(2).mean() + 0.1 * Dn.feats["h2"].pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        r.snap(Dn, out=out, feats=dict(Dn.feats))


def w_feats_user_modifies_inplace(r):
    class C(FeatD):
        def forward(self, x):
            h1 = F.leaky_relu(self.l1(x), 0.2)
            self.feats["h1"] = h1.detach().clone()
            return self.head(F.leaky_relu(self.l2(h1), 0.2))

    torch.manual_seed(0)
    Dn = r.wrap(C())
    opt = torch.optim.SGD(Dn.parameters(), lr=0.05)
    kept = []
    for x in data():
        out = Dn(x)
        f = Dn.feats["h1"]
        f.sub_(f.mean(0)).div_(f.std(0) + 1e-5)  # normalise the logged feature in place
        kept.append(f)
        out.pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        r.snap(Dn, out=out, kept=list(kept))


def w_feats_key_from_argument(r):
    class C(FeatD):
        def forward(self, x, tag="real"):
            h1 = F.leaky_relu(self.l1(x), 0.2)
            self.feats[tag] = h1
            return self.head(F.leaky_relu(self.l2(h1), 0.2))

    torch.manual_seed(0)
    Dn = r.wrap(C())
    opt = torch.optim.SGD(Dn.parameters(), lr=0.05)
    for i, x in enumerate(data()):
        tag = ["real", "fake", "aug"][i % 3]
        out = Dn(x, tag=tag)
        loss = out.pow(2).mean() + 0.1 * Dn.feats[tag].pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        r.snap(Dn, out=out, feats=dict(Dn.feats))


def w_namespace_last_out(r):
    class C(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = mlp()
            self.state = types.SimpleNamespace(last=None)

        def forward(self, x):
            out = self.net(x)
            self.state.last = out
            return out

    torch.manual_seed(0)
    model = r.wrap(C())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x in data():
        out = model(x)
        same_obj = model.state.last is out
        out.pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        r.snap(model, out=out, last=model.state.last, same=same_obj)


def w_namespace_user_replaces(r):
    class C(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = mlp()
            self.state = types.SimpleNamespace(last=None)

        def forward(self, x):
            out = self.net(x)
            self.state.last = out.detach()
            return out

    torch.manual_seed(0)
    model = r.wrap(C())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x in data():
        model.state = types.SimpleNamespace(last=None)
        out = model(x)
        out.pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        r.snap(model, out=out, last=model.state.last)


def w_list_slot_assign(r):
    class C(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = mlp()
            self.acts = [None, None]

        def forward(self, x):
            h = self.net[0](x)
            self.acts[0] = h.detach()
            out = self.net[2](self.net[1](h))
            self.acts[1] = out.detach()
            return out

    torch.manual_seed(0)
    model = r.wrap(C())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x in data():
        out = model(x)
        out.pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        r.snap(model, out=out, acts=list(model.acts))


def w_attr_output_partial_batch(r):
    # last batch is smaller; aux loss attribute and a kept attention per batch size
    torch.manual_seed(0)
    model = r.wrap(MoE())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    xs = data(b=4)
    xs[3] = xs[3][:3]
    xs[6] = xs[6][:3]
    for x in xs:
        out = model(x)
        loss = out.pow(2).mean() + 0.01 * model.aux_loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        r.snap(model, out=out, aux=model.aux_loss)


def w_aux_loss_user_sets_none(r):
    torch.manual_seed(0)
    model = r.wrap(MoE())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x in data():
        out = model(x)
        loss = out.pow(2).mean() + 0.01 * model.aux_loss
        model.aux_loss = None  # consumed: cleared by the loop
        loss.backward()
        opt.step()
        opt.zero_grad()
        r.snap(model, out=out, aux=model.aux_loss)


def w_aux_accumulated_in_forward(r):
    # the aux loss is accumulated across layers onto the root: self.aux = self.aux + layer_aux (reads it)
    class C(nn.Module):
        def __init__(self):
            super().__init__()
            self.l1 = MoE()
            self.l2 = MoE()
            self.total_aux = None

        def forward(self, x):
            h = self.l1(x)
            self.total_aux = self.l1.aux_loss
            h = self.l2(torch.relu(h))
            self.total_aux = self.total_aux + self.l2.aux_loss
            return h

    torch.manual_seed(0)
    model = r.wrap(C())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x in data():
        out = model(x)
        loss = out.pow(2).mean() + 0.01 * model.total_aux
        loss.backward()
        opt.step()
        opt.zero_grad()
        r.snap(model, out=out, aux=model.total_aux)


# ----------------------------------------------------------------------------- 3. gradient hooks
def _hook_loop(
    r,
    register,
    model_fn=None,
    steps=STEPS,
    set_to_none=True,
    accumulate=1,
    autocast=False,
    reg_at=0,
    remove_at=None,
    opt_fn=None,
    capture_fn=None,
    extra_loss=None,
):
    torch.manual_seed(0)
    model = (
        model_fn()
        if model_fn
        else nn.Sequential(
            nn.Linear(D, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)
        )
    )
    target = capture_fn(model) if capture_fn else model
    r.wrap(target)
    params = [p for p in model.parameters()]
    opt = (
        opt_fn(params)
        if opt_fn
        else torch.optim.SGD([p for p in params if p.requires_grad], lr=0.05)
    )
    log = []
    handles = []
    xs = data(n=steps * accumulate)
    for i in range(steps):
        if i == reg_at:
            handles = register(model, params, log, opt)
        if remove_at is not None and i == remove_at:
            for h in handles:
                h.remove()
        for j in range(accumulate):
            x = xs[i * accumulate + j]
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                out = model(x)
                loss = out.float().pow(2).mean()
                if extra_loss:
                    loss = loss + extra_loss(model)
            (loss / accumulate).backward()
        if opt is not None:
            opt.step()
            opt.zero_grad(set_to_none=set_to_none)
        r.snap(model, out=out, loss=loss, log=list(log))


def _log_norm(log, i):
    return lambda p: log.append((i, p.grad.norm().item()))


def h_post_accumulate_all(r):
    def reg(model, params, log, opt):
        return [
            p.register_post_accumulate_grad_hook(_log_norm(log, i)) for i, p in enumerate(params)
        ]

    _hook_loop(r, reg)


def h_weights_only_peek_all(r):
    # hooks on the weight matrices only; each logs which params already hold a gradient
    def reg(model, params, log, opt):
        hs = []
        for i, p in enumerate(params):
            if p.dim() > 1:
                hs.append(
                    p.register_post_accumulate_grad_hook(
                        lambda _p, i=i: log.append((i, tuple(q.grad is not None for q in params)))
                    )
                )
        return hs

    _hook_loop(r, reg)


def h_single_hook_end_of_backward(r):
    # one hook on the first layer's weight (the last gradient eager computes): "backward finished",
    # computes the total grad norm of every parameter for logging
    def reg(model, params, log, opt):
        def hook(_p):
            log.append(
                torch.stack([q.grad.norm() for q in params if q.grad is not None]).norm().item()
            )
            log.append(sum(q.grad is not None for q in params))

        return [params[0].register_post_accumulate_grad_hook(hook)]

    _hook_loop(r, reg)


def h_single_hook_clip_all(r):
    # one hook at the first layer's weight clips all gradients (end-of-backward clip)
    def reg(model, params, log, opt):
        def hook(_p):
            n = torch.nn.utils.clip_grad_norm_([q for q in params if q.grad is not None], 0.05)
            log.append(n.item())

        return [params[0].register_post_accumulate_grad_hook(hook)]

    _hook_loop(r, reg)


def h_single_tensor_hook_reads_other_grad(r):
    def reg(model, params, log, opt):
        def hook(g):
            other = params[-1].grad
            log.append(None if other is None else other.sum().item())
            return g

        return [params[0].register_hook(hook)]

    _hook_loop(r, reg, set_to_none=False)


def h_weights_only_grad_norm_so_far(r):
    def reg(model, params, log, opt):
        hs = []
        for i, p in enumerate(params):
            if p.dim() > 1:
                hs.append(
                    p.register_post_accumulate_grad_hook(
                        lambda _p, i=i: log.append(
                            (
                                i,
                                sum(
                                    q.grad.pow(2).sum() for q in params if q.grad is not None
                                ).item(),
                            )
                        )
                    )
                )
        return hs

    _hook_loop(r, reg, set_to_none=True)


def h_tensor_hooks_clamp(r):
    def reg(model, params, log, opt):
        def mk(i):
            def hook(g):
                log.append(i)
                return g.clamp(-0.01, 0.01)

            return hook

        return [p.register_hook(mk(i)) for i, p in enumerate(params)]

    _hook_loop(r, reg)


def h_post_hooks_modify_grad_inplace(r):
    def reg(model, params, log, opt):
        def mk(i):
            def hook(p):
                p.grad.mul_(0.5).clamp_(-0.02, 0.02)
                log.append(i)

            return hook

        return [p.register_post_accumulate_grad_hook(mk(i)) for i, p in enumerate(params)]

    _hook_loop(r, reg)


def h_register_late_remove_later(r):
    def reg(model, params, log, opt):
        return [
            p.register_post_accumulate_grad_hook(_log_norm(log, i)) for i, p in enumerate(params)
        ]

    _hook_loop(r, reg, reg_at=3, remove_at=6)


def h_remove_one_handle_midrun(r):
    state = {}

    def reg(model, params, log, opt):
        hs = [p.register_post_accumulate_grad_hook(_log_norm(log, i)) for i, p in enumerate(params)]
        state["hs"] = hs
        return hs[:1]  # only the first removed at step 5

    _hook_loop(r, reg, remove_at=5)


def h_zero_grad_keep_peek_values(r):
    def reg(model, params, log, opt):
        return [
            p.register_post_accumulate_grad_hook(
                lambda _p, i=i: log.append(
                    (i, [(-1.0 if q.grad is None else q.grad.abs().sum().item()) for q in params])
                )
            )
            for i, p in enumerate(params)
        ]

    _hook_loop(r, reg, set_to_none=False)


def h_grad_accumulation_hooks(r):
    def reg(model, params, log, opt):
        return [
            p.register_post_accumulate_grad_hook(_log_norm(log, i)) for i, p in enumerate(params)
        ]

    _hook_loop(r, reg, steps=4, accumulate=2)


def h_grad_accumulation_hooks_keep(r):
    def reg(model, params, log, opt):
        return [
            p.register_post_accumulate_grad_hook(_log_norm(log, i)) for i, p in enumerate(params)
        ]

    _hook_loop(r, reg, steps=4, accumulate=2, set_to_none=False)


def h_hooks_autocast(r):
    def reg(model, params, log, opt):
        return [
            p.register_post_accumulate_grad_hook(_log_norm(log, i)) for i, p in enumerate(params)
        ]

    _hook_loop(r, reg, autocast=True)


def _opt_in_backward(kind):
    def reg(model, params, log, opt):
        if kind == "adamw":
            opts = {p: torch.optim.AdamW([p], lr=0.01, weight_decay=0.1) for p in params}
        else:
            opts = {p: torch.optim.SGD([p], lr=0.05, momentum=0.9, nesterov=True) for p in params}

        def mk(i):
            def hook(p):
                log.append((i, p.grad.norm().item()))
                opts[p].step()
                opts[p].zero_grad(set_to_none=True)

            return hook

        return [p.register_post_accumulate_grad_hook(mk(i)) for i, p in enumerate(params)]

    return reg


def h_optimizer_in_backward_adamw(r):
    _hook_loop(r, _opt_in_backward("adamw"), opt_fn=lambda ps: None)


def h_optimizer_in_backward_sgd_momentum(r):
    _hook_loop(r, _opt_in_backward("sgd"), opt_fn=lambda ps: None)


class TinyLM(nn.Module):
    def __init__(self, v=12):
        super().__init__()
        self.emb = nn.Embedding(v, D)
        self.mid = nn.Linear(D, D)
        self.head = nn.Linear(D, v, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(torch.tanh(self.mid(self.emb(ids))))


def h_tied_weights_hooks(r):
    torch.manual_seed(0)
    model = r.wrap(TinyLM())
    params = list(model.parameters())
    log = []
    for i, p in enumerate(params):
        p.register_post_accumulate_grad_hook(_log_norm(log, i))
    opt = torch.optim.SGD(params, lr=0.1)
    g = torch.Generator().manual_seed(2)
    for _ in range(STEPS):
        ids = torch.randint(0, 12, (2, 5), generator=g)
        out = model(ids)
        loss = F.cross_entropy(out.reshape(-1, 12), ids.roll(-1, 1).reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        r.snap(model, out=out, log=list(log))


def h_tied_weights_opt_in_backward(r):
    torch.manual_seed(0)
    model = r.wrap(TinyLM())
    params = list(model.parameters())
    log = []
    opts = {p: torch.optim.SGD([p], lr=0.1, momentum=0.9) for p in params}

    def mk(i):
        def hook(p):
            log.append(i)
            opts[p].step()
            opts[p].zero_grad()

        return hook

    for i, p in enumerate(params):
        p.register_post_accumulate_grad_hook(mk(i))
    g = torch.Generator().manual_seed(2)
    for _ in range(STEPS):
        ids = torch.randint(0, 12, (2, 5), generator=g)
        out = model(ids)
        F.cross_entropy(out.reshape(-1, 12), ids.roll(-1, 1).reshape(-1)).backward()
        r.snap(model, out=out, log=list(log))


def h_frozen_among_hooked(r):
    def mf():
        m = nn.Sequential(
            nn.Linear(D, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)
        )
        m[2].weight.requires_grad_(False)
        return m

    def reg(model, params, log, opt):
        hs = []
        for i, p in enumerate(params):
            if p.requires_grad:
                hs.append(
                    p.register_post_accumulate_grad_hook(
                        lambda _p, i=i: log.append((i, tuple(q.grad is not None for q in params)))
                    )
                )
        return hs

    _hook_loop(r, reg, model_fn=mf)


def h_unfreeze_midrun_with_hooks(r):
    def mf():
        m = nn.Sequential(
            nn.Linear(D, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)
        )
        m[0].weight.requires_grad_(False)
        m[0].bias.requires_grad_(False)
        return m

    state = {}

    def reg(model, params, log, opt):
        state["m"] = model
        return [
            p.register_post_accumulate_grad_hook(_log_norm(log, i))
            for i, p in enumerate(params)
            if p.requires_grad
        ]

    def extra(model):
        # unfreezing at the loss: the 4th call of the loss (step 4) flips it
        state["n"] = state.get("n", 0) + 1
        if state["n"] == 4:
            model[0].weight.requires_grad_(True)
            model[0].bias.requires_grad_(True)
        return 0.0

    _hook_loop(
        r, reg, model_fn=mf, extra_loss=extra, opt_fn=lambda ps: torch.optim.SGD(ps, lr=0.05)
    )


class EncHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(D, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU())
        self.head = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4))

    def forward(self, x):
        return self.head(self.encoder(x))


def h_captured_encoder_hooks_everywhere(r):
    def reg(model, params, log, opt):
        return [
            p.register_post_accumulate_grad_hook(
                lambda _p, i=i: log.append(
                    (i, tuple(q.grad is not None for q in params), _p.grad.norm().item())
                )
            )
            for i, p in enumerate(params)
        ]

    _hook_loop(r, reg, model_fn=EncHead, capture_fn=lambda m: m.encoder)


def h_captured_encoder_hooks_head_only(r):
    def reg(model, params, log, opt):
        hs = []
        for i, (n, p) in enumerate(model.named_parameters()):
            if n.startswith("head"):
                hs.append(
                    p.register_post_accumulate_grad_hook(
                        lambda _p, i=i: log.append((i, tuple(q.grad is not None for q in params)))
                    )
                )
        return hs

    _hook_loop(r, reg, model_fn=EncHead, capture_fn=lambda m: m.encoder)


def h_captured_encoder_l2_outside(r):
    # weight decay term on encoder weights added to the loss outside the capture, hooks on all
    def reg(model, params, log, opt):
        return [
            p.register_post_accumulate_grad_hook(_log_norm(log, i)) for i, p in enumerate(params)
        ]

    _hook_loop(
        r,
        reg,
        model_fn=EncHead,
        capture_fn=lambda m: m.encoder,
        extra_loss=lambda m: 1e-2 * sum(p.pow(2).sum() for p in m.encoder.parameters()),
    )


def h_several_outputs(r):
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.trunk = nn.Linear(D, 16)
            self.a = nn.Linear(16, 4)
            self.b = nn.Linear(16, 2)

        def forward(self, x):
            h = torch.relu(self.trunk(x))
            return self.a(h), self.b(h)

    torch.manual_seed(0)
    model = r.wrap(Two())
    params = list(model.parameters())
    log = []
    for i, p in enumerate(params):
        p.register_post_accumulate_grad_hook(_log_norm(log, i))
    opt = torch.optim.SGD(params, lr=0.1)
    for x in data():
        a, b = model(x)
        loss = a.pow(2).mean() + b.abs().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        r.snap(model, a=a, b=b, log=list(log))


def h_moe_aux_attr_with_hooks(r):
    # one returned output, plus a differentiable attribute output (aux loss): effectively two outputs
    torch.manual_seed(0)
    model = r.wrap(nn.Sequential(MoE(), nn.ReLU(), nn.Linear(D, 4)))
    params = list(model.parameters())
    log = []
    for i, p in enumerate(params):
        p.register_post_accumulate_grad_hook(
            lambda _p, i=i: log.append((i, tuple(q.grad is not None for q in params)))
        )
    opt = torch.optim.SGD(params, lr=0.1)
    for x in data():
        out = model(x)
        # aux scaled by a computation after the head: its gradient reaches the router late
        loss = out.pow(2).mean() + 0.01 * model[0].aux_loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        r.snap(model, out=out, log=list(log))


def h_moe_aux_attr_hooks_loss_first(r):
    torch.manual_seed(0)
    model = r.wrap(nn.Sequential(MoE(), nn.ReLU(), nn.Linear(D, 4)))
    params = list(model.parameters())
    log = []
    for i, p in enumerate(params):
        p.register_post_accumulate_grad_hook(
            lambda _p, i=i: log.append((i, tuple(q.grad is not None for q in params)))
        )
    opt = torch.optim.SGD(params, lr=0.1)
    for x in data():
        out = model(x)
        aux = model[0].aux_loss
        # separate backward calls: aux first, then the main loss (two backwards per step)
        (0.01 * aux).backward(retain_graph=True)
        out.pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        r.snap(model, out=out, log=list(log))


def h_hook_in_forward_on_activation(r):
    class C(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = mlp()
            self.grad_log = []

        def forward(self, x):
            h = self.net[0](x)
            if h.requires_grad:
                h.register_hook(lambda g: self.grad_log.append(g.norm().item()))
            return self.net[2](self.net[1](h))

    torch.manual_seed(0)
    model = r.wrap(C())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x in data():
        out = model(x)
        out.pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        r.snap(model, out=out, glog=list(model.grad_log))


def h_layerwise_scale_reads_other(r):
    # hook on each weight scales its grad by the ratio to the previously finished layer's grad norm
    def reg(model, params, log, opt):
        ws = [p for p in params if p.dim() > 1]
        done = []

        def mk(p):
            def hook(g):
                s = 1.0
                if done and done[-1].grad is not None:
                    s = (done[-1].grad.norm() / (g.norm() + 1e-6)).clamp(max=2.0)
                log.append(float(s))
                return g * s

            return hook

        def fin(p):
            done.append(p)
            log.append(len(done))

        hs = []
        for p in ws:
            hs.append(p.register_hook(mk(p)))
            hs.append(p.register_post_accumulate_grad_hook(fin))
        return hs

    _hook_loop(r, reg)


def h_clip_in_last_hook(r):
    # every param hooked; the last hook to fire (a counter) clips all gradients
    def reg(model, params, log, opt):
        seen = []
        n = len(params)

        def hook(p):
            seen.append(p)
            if len(seen) == n:
                tn = torch.nn.utils.clip_grad_norm_(params, 0.05)
                log.append(tn.item())
                seen.clear()

        return [p.register_post_accumulate_grad_hook(hook) for p in params]

    _hook_loop(r, reg)


def h_hooks_plus_state(r):
    # DINO-like head with a rebinding centre + per-param hooks
    def mf():
        return Centre(buffer=True)

    def reg(model, params, log, opt):
        return [
            p.register_post_accumulate_grad_hook(_log_norm(log, i)) for i, p in enumerate(params)
        ]

    _hook_loop(r, reg, model_fn=mf)


def h_bn_model_hooks_eval_switch(r):
    def mf():
        return nn.Sequential(nn.Linear(D, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))

    state = {}

    def reg(model, params, log, opt):
        state["m"] = model
        return [
            p.register_post_accumulate_grad_hook(_log_norm(log, i)) for i, p in enumerate(params)
        ]

    _hook_loop(r, reg, model_fn=mf)


# ----------------------------------------------------------------------------- round 2 additions
def h_single_hook_last_layer_reads_others(r):
    # one hook on the LAST layer's weight (eager reaches it first): logs which grads exist then
    def reg(model, params, log, opt):
        return [
            params[-2].register_post_accumulate_grad_hook(
                lambda _p: log.append(tuple(q.grad is not None for q in params))
            )
        ]

    _hook_loop(r, reg)


def h_single_hook_own_grad_only(r):
    # control: one hook touching only its own gradient
    def reg(model, params, log, opt):
        def hook(p):
            p.grad.clamp_(-0.01, 0.01)
            log.append(p.grad.norm().item())

        return [params[0].register_post_accumulate_grad_hook(hook)]

    _hook_loop(r, reg)


def h_single_hook_zero_grad_keep(r):
    # set_to_none=False: the other grads exist as zeros; a single hook reads their norm (sees stale zeros?)
    def reg(model, params, log, opt):
        return [
            params[0].register_post_accumulate_grad_hook(
                lambda _p: log.append(sum(q.grad.abs().sum() for q in params).item())
            )
        ]

    _hook_loop(r, reg, set_to_none=False)


def h_encoder_single_hook_reads_encoder(r):
    # capture only the encoder; one hook on its first weight (last reached) reads all grads
    def reg(model, params, log, opt):
        return [
            model.encoder[0].weight.register_post_accumulate_grad_hook(
                lambda _p: log.append(tuple(q.grad is not None for q in params))
            )
        ]

    _hook_loop(r, reg, model_fn=EncHead, capture_fn=lambda m: m.encoder)


def h_tied_lm_single_hook_on_embedding(r):
    # hook on the (tied) embedding weight: "backward done", grad norm of all params
    torch.manual_seed(0)
    model = r.wrap(TinyLM())
    params = list(model.parameters())
    log = []
    model.emb.weight.register_post_accumulate_grad_hook(
        lambda _p: log.append(
            torch.stack([q.grad.norm() for q in params if q.grad is not None]).norm().item()
        )
    )
    opt = torch.optim.SGD(params, lr=0.1)
    g = torch.Generator().manual_seed(2)
    for _ in range(STEPS):
        ids = torch.randint(0, 12, (2, 5), generator=g)
        out = model(ids)
        F.cross_entropy(out.reshape(-1, 12), ids.roll(-1, 1).reshape(-1)).backward()
        opt.step()
        opt.zero_grad()
        r.snap(model, out=out, log=list(log))


def h_multi_grad_hook(r):
    # torch.autograd.graph.register_multi_grad_hook over every parameter (FSDP2-style "all grads ready")
    def reg(model, params, log, opt):
        def fn(grads):
            log.append(tuple(g is None for g in grads))
            log.append(tuple(q.grad is not None for q in params))

        return [torch.autograd.graph.register_multi_grad_hook(params, fn)]

    _hook_loop(r, reg)


def h_hook_reassigns_grad(r):
    def reg(model, params, log, opt):
        def mk(i):
            def hook(p):
                p.grad = p.grad.clone() * 0.5
                log.append(i)

            return hook

        return [p.register_post_accumulate_grad_hook(mk(i)) for i, p in enumerate(params)]

    _hook_loop(r, reg, set_to_none=False)


def h_partial_backward_inputs(r):
    def reg(model, params, log, opt):
        return [
            p.register_post_accumulate_grad_hook(
                lambda _p, i=i: log.append((i, tuple(q.grad is not None for q in params)))
            )
            for i, p in enumerate(params)
        ]

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, 16), nn.ReLU(), nn.Linear(16, 4))
    r.wrap(model)
    params = list(model.parameters())
    log = []
    reg(model, params, log, None)
    opt = torch.optim.SGD(params, lr=0.05)
    for i, x in enumerate(data()):
        out = model(x)
        loss = out.pow(2).mean()
        if i % 2:
            loss.backward(inputs=params[2:])
        else:
            loss.backward()
        opt.step()
        opt.zero_grad()
        r.snap(model, out=out, log=list(log))


def h_opt_in_backward_with_sched(r):
    # optimizer in backward with an lr schedule changed by the loop (hooks are Python: read live)
    def reg(model, params, log, opt):
        opts = {p: torch.optim.SGD([p], lr=0.05, momentum=0.9) for p in params}
        scheds = [torch.optim.lr_scheduler.StepLR(o, 2, 0.5) for o in opts.values()]
        model._scheds = scheds

        def hook(p):
            opts[p].step()
            opts[p].zero_grad()

        return [p.register_post_accumulate_grad_hook(hook) for p in params]

    def extra(model):
        for s in getattr(model, "_scheds", []):
            s.step()
        return 0.0

    _hook_loop(r, reg, opt_fn=lambda ps: None, extra_loss=extra)


def s_float_then_tensor_centre(r):
    class C(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(D, 4)
            self.center = 0.0

        def forward(self, x):
            out = self.lin(x)
            y = out - self.center
            self.center = 0.9 * self.center + 0.1 * out.detach().mean(0)
            return y

    torch.manual_seed(0)
    model = r.wrap(C())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x in data():
        out = model(x)
        out.pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        r.snap(model, out=out, center=model.center)


def s_centre_check_every(r):
    torch.manual_seed(0)
    model = r.wrap(Centre(buffer=True), check_every=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x in data():
        out = model(x)
        out.pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        r.snap(model, out=out)


def s_centre_eval_interleaved(r):
    class C(Centre):
        def forward(self, x):
            out = self.net(x)
            centred = out - self.center
            if self.training:
                self.center = 0.9 * self.center + 0.1 * out.detach().mean(0)
            return centred

    torch.manual_seed(0)
    model = r.wrap(C(buffer=True))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i, x in enumerate(data()):
        out = model(x)
        out.pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        if i % 3 == 2:
            model.eval()
            with torch.no_grad():
                v = model(x + 1)
            model.train()
        else:
            v = torch.zeros(1)
        r.snap(model, out=out, v=v)


def s_deepcopy_teacher_midrun(r):
    import copy

    torch.manual_seed(0)
    student = r.wrap(Centre(buffer=True))
    opt = torch.optim.SGD(student.parameters(), lr=0.1)
    teacher = None
    for i, x in enumerate(data()):
        out = student(x)
        out.pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        if i == 3:
            teacher = copy.deepcopy(student)
            for p in teacher.parameters():
                p.requires_grad_(False)
        t = torch.zeros(1)
        if teacher is not None:
            with torch.no_grad():
                t = teacher(x)
        r.snap(
            student, out=out, t=t, tc=(teacher.center if teacher is not None else torch.zeros(1))
        )


def w_last_attn_read_when_flag(r):
    # the written-only attribute is read by a later call with another argument (attention reuse)
    class A(nn.Module):
        def __init__(self):
            super().__init__()
            self.qk = nn.Linear(D, 2 * D)
            self.v = nn.Linear(D, D)
            self.last_attn = None

        def forward(self, x, reuse=False):
            if reuse and self.last_attn is not None:
                a = self.last_attn
            else:
                q, k = self.qk(x).chunk(2, -1)
                a = (q @ k.transpose(-1, -2)).softmax(-1)
                self.last_attn = a.detach()
            return a @ self.v(x)

    torch.manual_seed(0)
    model = r.wrap(A())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(5)
    for i in range(STEPS):
        x = torch.randn(2, 5, D, generator=g)
        out = model(x, reuse=(i % 2 == 1))
        out.pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        r.snap(model, out=out, a=model.last_attn)


def w_feats_kept_across_steps(r):
    torch.manual_seed(0)
    Dn = r.wrap(FeatD())
    opt = torch.optim.SGD(Dn.parameters(), lr=0.05)
    kept = []
    for x in data():
        out = Dn(x)
        kept.append(Dn.feats["h2"].detach())
        loss = out.pow(2).mean() + 0.1 * Dn.feats["h1"].pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        r.snap(Dn, out=out, kept=list(kept))


def w_feats_same_object_as_output(r):
    class C(FeatD):
        def forward(self, x):
            out = FeatD.forward(self, x)
            self.feats["logits"] = out
            return out

    torch.manual_seed(0)
    Dn = r.wrap(C())
    opt = torch.optim.SGD(Dn.parameters(), lr=0.05)
    for x in data():
        out = Dn(x)
        same_obj = Dn.feats["logits"] is out
        out.pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        r.snap(Dn, out=out, same=same_obj)


def w_perceptual_loss_frozen_vgg_feats(r):
    # perceptual loss: a frozen feature net (captured) stores per-layer features in a dict; called on
    # prediction (grad) and target (no_grad) each step
    class Feat(nn.Module):
        def __init__(self):
            super().__init__()
            self.l1 = nn.Linear(D, 16)
            self.l2 = nn.Linear(16, 16)
            self.store = {}
            for p in self.parameters():
                p.requires_grad_(False)

        def forward(self, x):
            h1 = torch.relu(self.l1(x))
            self.store["relu1"] = h1
            h2 = torch.relu(self.l2(h1))
            self.store["relu2"] = h2
            return h2

    torch.manual_seed(0)
    gen = nn.Linear(D, D)
    feat = r.wrap(Feat())
    opt = torch.optim.SGD(gen.parameters(), lr=0.05)
    for x in data():
        with torch.no_grad():
            feat(x)
            tgt = dict(feat.store)
        feat(gen(x))
        loss = sum(F.mse_loss(feat.store[k], tgt[k]) for k in tgt)
        loss.backward()
        opt.step()
        opt.zero_grad()
        r.snap(gen, loss=loss)


def s_prev_input_kept(r):
    # temporal smoothness against the previous batch's input (an input stored, read at the next call)
    class C(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(D, 4)
            self.prev_x = torch.zeros(4, D)

        def forward(self, x):
            out = self.lin(x)
            smooth = (out - self.lin(self.prev_x)).pow(2).mean()
            self.prev_x = x
            return out, smooth

    torch.manual_seed(0)
    model = r.wrap(C())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x in data():
        out, sm = model(x)
        (out.pow(2).mean() + sm).backward()
        opt.step()
        opt.zero_grad()
        r.snap(model, out=out, sm=sm, px=model.prev_x)


def s_state_dict_reference_held(r):
    # a checkpoint dict taken mid-run holds the buffer tensors by reference (state_dict detaches)
    torch.manual_seed(0)
    model = r.wrap(Centre(buffer=True))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sds = []
    for _i, x in enumerate(data()):
        out = model(x)
        out.pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        sds.append(model.state_dict()["center"])
        r.snap(model, out=out, sds=list(sds))


def w_attr_is_weight_snapshot(r):
    class C(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(D, 4)
            self.w_seen = None

        def forward(self, x):
            self.w_seen = self.lin.weight.detach()
            return self.lin(x)

    torch.manual_seed(0)
    model = r.wrap(C())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kept = []
    for x in data():
        out = model(x)
        kept.append(model.w_seen)
        out.pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        r.snap(model, out=out, kept=list(kept))


PATTERNS = {k: v for k, v in list(globals().items()) if k[:2] in ("s_", "w_", "h_") and callable(v)}


def main(names):
    rows = []
    for name, fn in PATTERNS.items():
        if names and name not in names:
            continue
        row = (name, *run_pattern(name, fn, ROUND6))
        rows.append(row)
        print(f"{row[0]:40s} | {row[1]:24s} | {row[2]:3d} | {row[3]}", flush=True)
    print()
    print(Counter(r[1] for r in rows))


if __name__ == "__main__":
    main(sys.argv[1:])
