"""Round 10 hostile patterns: the tape's unfilled-read refusal (d2a2496), the critic stand-ins'
data_ptr key (c76b30a), input-derived fills (f1bc229, 354203f). Run:

  OMP_NUM_THREADS=1 PYTHONPATH=. python scripts/hostile/round10/patterns.py [name-prefix ...]

The harness is scripts/hostile/harness.py (round 9's profile).
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence, pad_sequence

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from harness import Patterns, data, run_table

PATTERNS = Patterns()
reg = PATTERNS.reg
STEPS = 6


# ============================================================ (a) forward bodies, one model each
def body_cat_out(self, x):
    h1, h2 = self.a(x), self.b(x)
    buf = torch.empty(x.shape[0], 16)
    with torch.no_grad():
        torch.cat([h1.detach(), h2.detach()], dim=1, out=buf)
    return self.head(torch.cat([h1, h2], 1) * buf.sigmoid())


def body_stack_out(self, x):
    h1, h2 = self.a(x), self.b(x)
    buf = torch.empty(2, x.shape[0], 8)
    torch.stack([h1.detach(), h2.detach()], out=buf)
    w = buf.softmax(0)
    return self.head(torch.cat([h1 * w[0], h2 * w[1]], 1))


def body_empty_slice_copy(self, x):
    h1, h2 = self.a(x), self.b(x)
    buf = x.new_empty(x.shape[0], 16)
    buf[:, :8].copy_(h1)
    buf[:, 8:].copy_(h2)
    return self.head(buf)


def body_empty_view_fill(self, x):
    h = self.a(x)
    scale = torch.empty(x.shape[0], 8)
    scale.view(-1).fill_(0.5)
    return self.head(torch.cat([h * scale, self.b(x)], 1))


def body_empty_index_put_perm(self, x):
    h = self.a(x)
    perm = torch.tensor([3, 0, 2, 1, 4])
    inv = torch.empty(5, dtype=torch.long)
    inv[perm] = torch.arange(5)
    return self.head(torch.cat([h[perm][inv], self.b(x)], 1))


def body_empty_scatter_(self, x):
    h = self.a(x)
    order = torch.argsort(h.detach()[:, 0])
    inv = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel()))
    return self.head(torch.cat([h[order][inv], self.b(x)], 1))


def body_addmm_out(self, x):
    with torch.no_grad():
        gate = torch.empty(x.shape[0], 8)
        torch.addmm(self.b.bias, x, self.b.weight.t(), out=gate)
    return self.head(torch.cat([self.a(x) * gate.sigmoid(), self.b(x)], 1))


def body_where_out(self, x):
    h = self.a(x)
    m = torch.empty(h.shape)
    torch.where(h.detach() > 0, torch.ones(()), torch.zeros(()), out=m)
    return self.head(torch.cat([h * m, self.b(x)], 1))


def body_unused_empty(self, x):
    # a placeholder made only for its shape (code that later changed), then ordinary ops reuse
    # that memory after it is freed
    h = self.a(x)
    tmp = torch.empty_like(h)
    z = torch.zeros(tmp.shape)
    del tmp
    h2 = self.b(x) + z
    y = torch.cat([h * 2, h2], 1)
    return self.head(y)


def body_placeholder_reassigned(self, x):
    out = torch.empty(x.shape[0], 8)  # overwritten by a new binding (never written)
    out = self.a(x).relu()
    o2 = torch.empty(x.shape[0], 8)
    o2 = self.b(x).tanh()
    return self.head(torch.cat([out, o2], 1))


def body_index_add(self, x):
    h = self.a(x)
    seg = torch.tensor([0, 1, 0, 2, 1])
    pooled = torch.empty(3, 8).zero_().index_add_(0, seg, h)
    return self.head(torch.cat([pooled[seg], self.b(x)], 1))


def body_topk_out(self, x):
    h = self.a(x)
    v, i = torch.empty(x.shape[0], 2), torch.empty(x.shape[0], 2, dtype=torch.long)
    torch.topk(h.detach(), 2, dim=1, out=(v, i))
    mask = torch.zeros_like(h).scatter_(1, i, 1.0)
    return self.head(torch.cat([h * mask, self.b(x)], 1))


def body_sort_out(self, x):
    h = self.a(x)
    v, i = torch.empty_like(h), torch.empty(h.shape, dtype=torch.long)
    torch.sort(h.detach(), dim=1, out=(v, i))
    return self.head(torch.cat([torch.gather(h, 1, i), self.b(x)], 1))


def body_gumbel(self, x):
    return self.head(torch.cat([F.gumbel_softmax(self.a(x), tau=0.5, hard=True), self.b(x)], 1))


def body_manual_dropout(self, x):
    h = self.a(x)
    m = torch.empty_like(h).bernoulli_(0.7) / 0.7
    return self.head(torch.cat([h * m, self.b(x)], 1))


def body_trunc_normal_noise(self, x):
    h = self.a(x)
    noise = nn.init.trunc_normal_(torch.empty_like(h), std=0.1)
    return self.head(torch.cat([h + noise, self.b(x)], 1))


def body_embedding_bag(self, x):
    ids = (x.detach().abs() * 3).long().clamp(max=9)
    e = (
        self.bag(ids[:, :3], mode="mean")
        if False
        else F.embedding_bag(ids[:, :3], self.emb.weight, mode="mean")
    )
    return self.head(torch.cat([e, self.b(x)], 1))


def body_embedding_bag_offsets(self, x):
    ids = (x.detach().abs() * 3).long().clamp(max=9).flatten()
    offsets = torch.arange(0, ids.numel(), 6)
    e = F.embedding_bag(ids, self.emb.weight, offsets, mode="sum")
    return self.head(torch.cat([e, self.b(x)], 1))


def body_embedding_max_norm(self, x):
    ids = (x.detach().abs() * 3).long().clamp(max=9)[:, 0]
    return self.head(torch.cat([F.embedding(ids, self.emb.weight, max_norm=1.0), self.b(x)], 1))


def body_interp_grid(self, x):
    img = self.a(x).view(-1, 2, 2, 2)
    up = F.interpolate(img, scale_factor=2, mode="bilinear", align_corners=False)
    nn_ = F.interpolate(img, size=(3, 3), mode="nearest")
    theta = torch.tensor([[[0.9, 0.1, 0.0], [-0.1, 0.9, 0.05]]]).expand(img.shape[0], 2, 3)
    grid = F.affine_grid(theta, (img.shape[0], 2, 4, 4), align_corners=False)
    gs = F.grid_sample(up, grid, align_corners=False)
    feats = torch.cat([gs.flatten(1)[:, :4], nn_.flatten(1)[:, :4]], 1)
    return self.head(torch.cat([feats, self.b(x)], 1))


def body_pad_unfold_fold(self, x):
    img = self.a(x).view(-1, 2, 2, 2)
    p = torch.cat(
        [F.pad(img, (1, 1, 1, 1), mode=m) for m in ("reflect", "replicate", "circular")], 1
    )
    cols = F.unfold(p, kernel_size=2)
    back = F.fold(cols, output_size=(4, 4), kernel_size=2)
    pooled, idx = F.max_pool2d(back, 2, return_indices=True)
    un = F.max_unpool2d(pooled, idx, 2)
    return self.head(torch.cat([un.flatten(1)[:, :8], self.b(x)], 1))


def body_cdist_mha(self, x):
    h = self.a(x)
    d = torch.cdist(h, h)
    q = h.unsqueeze(0)
    att, _ = self.mha(q, q, q)
    return self.head(torch.cat([att[0] + d[:, :8], self.b(x)], 1))


MODELS_A = {k[5:]: v for k, v in dict(globals()).items() if k.startswith("body_")}


class Net(nn.Module):
    def __init__(self, body):
        super().__init__()
        self.a, self.b, self.head = nn.Linear(6, 8), nn.Linear(6, 8), nn.Linear(16, 3)
        self.emb = nn.Embedding(10, 8)
        self.mha = nn.MultiheadAttention(8, 2)
        self.body = body

    def forward(self, x):
        return self.body(self, x)


def forward_model(run, *, body, api):
    torch.manual_seed(0)
    m = Net(body)
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    lf = lambda mod, x, y: F.cross_entropy(mod(x), y)  # noqa: E731
    step = run.step(m, lf, opt) if api == "step" else run.wrap(m)
    for i in range(STEPS):
        (x,) = data(10 + i, (5, 6))
        y = torch.tensor([0, 1, 2, 1, 0])
        if api == "step":
            loss = step(x, y)
        else:
            loss = lf(m, x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            loss = loss.detach()
        run.snap([m], [opt], loss=loss)


for _n, _b in MODELS_A.items():
    reg(f"a_{_n}_step", forward_model, body=_b, api="step")
    reg(f"a_{_n}_cap", forward_model, body=_b, api="cap")


# -------------------------------------------------- (a) losses that allocate internally
class Seq(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.GRU(4, 6, batch_first=True)
        self.out = nn.Linear(6, 5)

    def forward(self, x, lengths):
        pk = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        o, _ = self.rnn(pk)
        o, L = pad_packed_sequence(o, batch_first=True, total_length=x.shape[1])
        return self.out(o), L


def seq_loss(kind, mod, x, lengths, tgt):
    o, L = mod(x, lengths)
    if kind == "ctc":
        lp = o.log_softmax(-1).transpose(0, 1)
        return F.ctc_loss(lp, tgt, L, torch.full_like(L, 2), zero_infinity=True)
    if kind == "ctc_intlist":
        lp = o.log_softmax(-1).transpose(0, 1)
        return F.ctc_loss(lp, tgt, lengths.tolist(), [2] * len(L), zero_infinity=True)
    if kind == "masked_mean":
        mask = torch.arange(o.shape[1])[None] < L[:, None]
        return (o.pow(2).sum(-1) * mask).sum() / L.sum()
    if kind == "pad_sequence":
        parts = [o[b, : lengths[b]] for b in range(o.shape[0])]
        p = pad_sequence(parts, batch_first=True, padding_value=0.0)
        return p.pow(2).mean()
    raise ValueError(kind)


def seq_model(run, *, kind, api):
    torch.manual_seed(0)
    m = Seq()
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    lf = functools.partial(seq_loss, kind)
    step = run.step(m, lf, opt) if api == "step" else None
    if api == "cap":
        run.wrap(m)
    for i in range(STEPS):
        (x,) = data(40 + i, (3, 5, 4))
        lengths = torch.tensor([5, 3, 4]) if i % 2 == 0 else torch.tensor([4, 5, 2])
        tgt = torch.tensor([[1, 2], [3, 1], [2, 4]])
        if step is not None:
            loss = step(x, lengths, tgt)
        else:
            loss = lf(m, x, lengths, tgt)
            loss.backward()
            opt.step()
            opt.zero_grad()
            loss = loss.detach()
        run.snap([m], [opt], loss=loss)


for _k in ("ctc", "masked_mean", "pad_sequence"):
    reg(f"a_seq_{_k}_step", seq_model, kind=_k, api="step")
    reg(f"a_seq_{_k}_cap", seq_model, kind=_k, api="cap")


class Seg(nn.Module):
    def __init__(self):
        super().__init__()
        self.c = nn.Conv2d(2, 4, 3, padding=1)

    def forward(self, x):
        return F.interpolate(self.c(x), scale_factor=2, mode="bilinear", align_corners=True)


def seg_model(run, *, api):
    torch.manual_seed(0)
    m = Seg()
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)

    def lf(mod, x, y):
        o = mod(x)
        return F.nll_loss(o.log_softmax(1), y, ignore_index=3) + F.cross_entropy(
            o, y, weight=torch.tensor([1.0, 2.0, 1.0, 0.5])
        )

    step = run.step(m, lf, opt) if api == "step" else run.wrap(m)
    for i in range(STEPS):
        (x,) = data(60 + i, (2, 2, 4, 4))
        y = (torch.arange(2 * 64).view(2, 8, 8) * (i + 1)) % 4
        if api == "step":
            loss = step(x, y)
        else:
            loss = lf(m, x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            loss = loss.detach()
        run.snap([m], [opt], loss=loss)


reg("a_nll_loss2d_interp_step", seg_model, api="step")
reg("a_nll_loss2d_interp_cap", seg_model, api="cap")


# ============================================================ (b) critic stand-ins
def make_g():
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 6))


def make_d():
    return nn.Sequential(
        nn.Linear(6, 8), nn.LeakyReLU(0.2), nn.Linear(8, 8), nn.LeakyReLU(0.2), nn.Linear(8, 1)
    )


def bce(logits, target):
    return F.binary_cross_entropy_with_logits(logits, torch.full_like(logits, target))


def gan(run, *, midway=None, steps=STEPS, d_opt_kind="sgd"):
    torch.manual_seed(0)
    G, D = make_g(), make_d()
    ctx = {"G": G, "D": D}
    g_opt = torch.optim.SGD(G.parameters(), lr=0.05, momentum=0.9)
    ctx["d_opt"] = torch.optim.SGD(D.parameters(), lr=0.05, momentum=0.9)
    ctx["g_opt"] = g_opt
    gstep = run.step(G, lambda g, z: bce(ctx["D"](g(z)), 1.0), g_opt)
    for i in range(steps):
        D, d_opt = ctx["D"], ctx["d_opt"]
        z, real, z2 = data(100 + i, (5, 4), (5, 6), (5, 4))
        d_opt.zero_grad(set_to_none=True)
        d_loss = bce(D(real + 1), 1.0) + bce(D(G(z).detach()), 0.0)
        d_loss.backward()
        d_opt.step()
        if midway is not None:
            midway(i, ctx)
        gl = gstep(z2)
        run.snap([G, ctx["D"]], [g_opt, ctx["d_opt"]], gl=gl, dl=d_loss.detach())


def _rebind_every_step(i, ctx):
    for p in ctx["D"].parameters():
        p.data = p.data.clamp(-0.3, 0.3)


def _swap_with_shadow(i, ctx):
    # EMA-style swap: the critic's weights trade memory with a shadow copy every step
    D = ctx["D"]
    sh = ctx.setdefault("shadow", [p.detach().clone() * 0.9 for p in D.parameters()])
    for k, p in enumerate(D.parameters()):
        p.data, sh[k] = sh[k], p.data


def _swap_same_shape(i, ctx):
    D = ctx["D"]
    if i % 2 == 1:
        a, b = D[2].weight, nn.Parameter(D[2].weight.detach().t().clone())
        a.data, b.data = b.data, a.data


def _assign_load_no_new_opt(i, ctx):
    if i in (2, 4):
        D = ctx["D"]
        D.load_state_dict({k: v.clone() * 0.9 for k, v in D.state_dict().items()}, assign=True)


def _assign_load_from_snapshot(i, ctx):
    D = ctx["D"]
    if i == 1:
        ctx["snap"] = {k: v.clone() for k, v in D.state_dict().items()}
    if i in (3, 5):  # restore a checkpoint repeatedly (assign: the snapshot's own tensors)
        D.load_state_dict(ctx["snap"], assign=True)
        ctx["d_opt"] = torch.optim.SGD(D.parameters(), lr=0.05, momentum=0.9)


def _half_and_back(i, ctx):
    ctx["D"].half().float()


def _d_into_g_opt(i, ctx):
    if i == 2:
        ctx["g_opt"].add_param_group({"params": list(ctx["D"][4].parameters()), "lr": 0.01})


def _d_set_storage(i, ctx):
    if i in (2, 3):
        p = ctx["D"][0].weight
        with torch.no_grad():
            p.set_(p.detach().clone() * 0.5)


def _d_share_memory(i, ctx):
    if i == 2:
        ctx["D"].share_memory()


def _d_grad_rebound(i, ctx):
    for p in ctx["D"].parameters():
        p.grad = torch.full_like(p, 0.01)


for _n, _f in {
    "rebind_every_step": _rebind_every_step,
    "swap_with_shadow": _swap_with_shadow,
    "swap_same_shape": _swap_same_shape,
    "load_assign_no_new_opt": _assign_load_no_new_opt,
    "load_assign_snapshot_repeat": _assign_load_from_snapshot,
    "half_and_back": _half_and_back,
    "d_head_into_g_opt": _d_into_g_opt,
    "param_set_": _d_set_storage,
    "share_memory": _d_share_memory,
    "grad_rebound": _d_grad_rebound,
}.items():
    reg(f"b_gan_{_n}", gan, midway=_f)
reg("b_gan_rebind_every_step_long", gan, midway=_rebind_every_step, steps=24)


def distill(run, *, how, steps=STEPS):
    torch.manual_seed(0)
    S, T = nn.Linear(6, 3), nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    T.requires_grad_(False)
    opt = torch.optim.SGD(S.parameters(), lr=0.1)
    ctx = {"T": T}

    def lf(s, x):
        return F.kl_div(s(x).log_softmax(-1), ctx["T"](x).softmax(-1), reduction="batchmean")

    step = run.step(S, lf, opt)
    for i in range(steps):
        (x,) = data(500 + i, (5, 6))
        if how == "teacher_data_rebind":
            for p in ctx["T"].parameters():
                p.data = p.data * 0.9
        elif how == "teacher_load_assign":
            ctx["T"].load_state_dict(
                {k: v * 0.9 for k, v in ctx["T"].state_dict().items()}, assign=True
            )
        elif how == "teacher_param_reassigned":
            ctx["T"][0].weight = nn.Parameter(ctx["T"][0].weight * 0.9, requires_grad=False)
        elif how == "teacher_ema_of_student_rebind":
            ctx["T"][2].weight = nn.Parameter(torch.randn(3, 8) * 0.1, requires_grad=False)
        run.snap([S, ctx["T"]], [opt], loss=step(x))


for _h in (
    "teacher_data_rebind",
    "teacher_load_assign",
    "teacher_param_reassigned",
    "teacher_ema_of_student_rebind",
):
    reg(f"b_distill_{_h}", distill, how=_h)


# ============================================================ (c) input-derived fills
class Reader(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.fc = nn.Linear(6, 4)
        self.how = how

    def forward(self, x, idx):
        h = self.how
        if h == "index_put":
            c = torch.empty_like(idx)
            c[torch.tensor([3, 2, 1, 0])] = idx
            k = int(c[0])
        elif h == "scatter":
            c = torch.empty_like(idx).scatter_(0, torch.tensor([1, 0, 3, 2]), idx)
            k = int(c[0])
        elif h == "copy_view":
            c = torch.empty(2, 2, dtype=torch.long)
            c.view(-1).copy_(idx)
            k = int(c[0, 0])
        elif h == "partial_views":
            c = torch.empty(4, dtype=torch.long)
            c[:2].copy_(idx[:2])
            c[2:].copy_(idx[2:])
            k = int(c[0])
        elif h == "fill_then_masked":
            c = torch.empty_like(idx).fill_(1).masked_fill_(idx > 1, 2)
            k = int(c.sum()) - 3
        elif h == "zero_index_fill":
            c = torch.empty_like(idx).zero_().index_fill_(0, idx[:1].clamp(0, 3), 5)
            k = int(c.argmax()) + 1
        elif h == "fill_tensor_scalar":
            c = torch.empty(1, dtype=torch.long).fill_(idx[0])
            k = c.item()
        elif h == "copy_random":
            c = torch.empty(1, dtype=torch.long).copy_(torch.randint(1, 4, (1,)))
            k = c.item()
        elif h == "fill_random_scalar":
            c = torch.empty(1, dtype=torch.long).fill_(torch.randint(1, 4, ()))
            k = int(c)
        elif h == "masked_scatter":
            c = torch.empty_like(idx).zero_().masked_scatter_(idx > -1, idx.flip(0))
            k = int(c[0])
        elif h == "copy_from_param_stat":
            c = torch.empty(1).copy_(self.fc.weight.detach().abs().sum().unsqueeze(0))
            k = 1 + int(c.item() * 10) % 3
        elif h == "out_then_fill":
            c = torch.empty_like(idx)
            torch.add(idx, 0, out=c)
            c.index_fill_(0, torch.tensor([3]), 0)
            k = int(c[0])
        else:
            raise ValueError(h)
        return self.fc(x) * max(k, 1)


def reader(run, *, how, api):
    torch.manual_seed(0)
    m = Reader(how)
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    lf = lambda mod, x, idx, y: F.cross_entropy(mod(x, idx), y)  # noqa: E731
    step = run.step(m, lf, opt) if api == "step" else run.wrap(m)
    for i in range(STEPS):
        (x,) = data(700 + i, (4, 6))
        idx = torch.tensor([[1, 2, 3, 0], [3, 1, 0, 2], [2, 3, 1, 0]][i % 3])
        y = torch.tensor([0, 1, 2, 1])
        if api == "step":
            loss = step(x, idx, y)
        else:
            loss = lf(m, x, idx, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            loss = loss.detach()
        run.snap([m], [opt], loss=loss)


for _h in (
    "index_put",
    "scatter",
    "copy_view",
    "partial_views",
    "fill_then_masked",
    "zero_index_fill",
    "fill_tensor_scalar",
    "copy_random",
    "fill_random_scalar",
    "masked_scatter",
    "copy_from_param_stat",
    "out_then_fill",
):
    reg(f"c_{_h}_cap", reader, how=_h, api="cap")
    reg(f"c_{_h}_step", reader, how=_h, api="step")


def main(argv):
    return run_table(PATTERNS, argv)


if __name__ == "__main__":
    main(sys.argv[1:])
