"""Hostile patterns for rk.TrainStep: tensors a forward (or loss_fn) assigns to attributes, states
read and re-bound, held dicts/objects, plus ordinary loops as controls.

Run: OMP_NUM_THREADS=1 PYTHONPATH=. python scripts/hostile/round7/patterns.py [prefix...]
Prefixes: c_ control, m_ MoE aux loss, s_ state (centre/running stats), d_ held dict/object,
a_ attention/logging, x_ odd writes (identity, views, None, Python values), l_ loop edits.
The harness is scripts/hostile/harness.py (profile ROUND7: a plain hand loop, TrainStep's eager
twin and the replay, compared after every call).
"""

from __future__ import annotations

import copy
import sys
import types
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import replaykit as rk

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from harness import ROUND7, run_pattern, select

STEPS = 8
D = 8
C = 4


def batches(n=STEPS, b=4, d=D, seed=1, sizes=None, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        bb = sizes[i % len(sizes)] if sizes else b
        out.append(
            (torch.randn(bb, d, generator=g, dtype=dtype), torch.randint(0, C, (bb,), generator=g))
        )
    return out


def seq_batches(lens, b=2, d=D, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(b, t, d, generator=g), torch.randint(0, C, (b,), generator=g)) for t in lens
    ]


def mlp(d=D, h=16, o=C):
    return nn.Sequential(nn.Linear(d, h), nn.ReLU(), nn.Linear(h, o))


def sgd(m, **kw):
    return torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, fused=True, **kw)


def adamw(m):
    return torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True, capturable=True)


def ce(m, x, y):
    return F.cross_entropy(m(x), y)


def train(r, model, loss_fn, opt, data, keep=None, between=None, ema=None, **kw):
    """The loop every pattern shares: call the step, snapshot what the user sees."""
    step = r.step(model, loss_fn, opt, ema=ema, **kw)
    for i, b in enumerate(data):
        if between is not None:
            between(i, model, step)
        loss = step(*b)
        extras = keep(i, model) if keep is not None else {}
        r.snap(model, opt, ema, loss=loss, **extras)
    return step


# ============================================================================ controls
def c_mlp_sgd(r):
    torch.manual_seed(0)
    m = mlp()
    train(r, m, ce, torch.optim.SGD(m.parameters(), lr=0.1), batches())


def c_mlp_sgd_fused_momentum(r):
    torch.manual_seed(0)
    m = mlp()
    train(r, m, ce, sgd(m), batches())


def c_mlp_adamw_fused_capturable(r):
    torch.manual_seed(0)
    m = mlp()
    train(r, m, ce, adamw(m), batches())


def c_adam_default_eager_step(r):
    torch.manual_seed(0)
    m = mlp()
    train(r, m, ce, torch.optim.Adam(m.parameters(), lr=1e-2), batches())


def c_max_norm(r):
    torch.manual_seed(0)
    m = mlp()
    train(r, m, ce, sgd(m), batches(), max_norm=0.5)


def c_accumulate2(r):
    torch.manual_seed(0)
    m = mlp()
    train(r, m, ce, sgd(m), batches(), accumulate=2)


def c_accumulate4_adamw(r):
    torch.manual_seed(0)
    m = mlp()
    train(r, m, ce, adamw(m), batches(), accumulate=4)


def c_bf16_mixed(r):
    torch.manual_seed(0)
    m = mlp()
    train(r, m, ce, sgd(m), batches(), precision="bf16-mixed")


def c_ema(r):
    torch.manual_seed(0)
    m = mlp()
    train(r, m, ce, sgd(m), batches(), ema=rk.EMA(m, 0.9), max_norm=1.0)


def c_tensor_lr_scheduler(r):
    torch.manual_seed(0)
    m = mlp()
    opt = torch.optim.SGD(m.parameters(), lr=torch.tensor(0.1), momentum=0.9, fused=True)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    train(r, m, ce, opt, batches(), between=lambda i, mm, s: sched.step() if i else None)


def c_dropout(r):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(D, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, C))
    train(r, m, ce, sgd(m), batches())


def c_batchnorm(r):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(D, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, C))
    train(r, m, ce, sgd(m), batches())


def c_transformer_block(r):
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = nn.TransformerEncoderLayer(D, 2, 16, dropout=0.0, batch_first=True)
            self.head = nn.Linear(D, C)

        def forward(self, x):
            return self.head(self.block(x).mean(1))

    m = Net()
    train(r, m, ce, adamw(m), seq_batches([6] * 6))


def c_cnn(r):
    torch.manual_seed(0)
    m = nn.Sequential(
        nn.Conv2d(1, 4, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, C)
    )
    g = torch.Generator().manual_seed(3)
    data = [
        (torch.randn(2, 1, 6, 6, generator=g), torch.randint(0, C, (2,), generator=g))
        for _ in range(6)
    ]
    train(r, m, ce, sgd(m), data)


def c_partial_last_batch(r):
    torch.manual_seed(0)
    m = mlp()
    train(r, m, ce, sgd(m), batches(sizes=[4, 4, 4, 3]))


def c_frozen_layer(r):
    torch.manual_seed(0)
    m = mlp()
    m[0].weight.requires_grad_(False)
    train(r, m, ce, sgd(m), batches())


def c_kwargs_label_smoothing(r):
    torch.manual_seed(0)
    m = mlp()

    def loss_fn(mm, x, y, w=None):
        return F.cross_entropy(mm(x), y, label_smoothing=0.1) * w

    step = r.step(m, loss_fn, sgd(m))
    for x, y in batches():
        loss = step(x, y, w=torch.tensor(0.5))
        r.snap(m, None, loss=loss)


def c_weight_tying(r):
    torch.manual_seed(0)

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, D)
            self.mid = nn.Linear(D, D)
            self.out = nn.Linear(D, 10, bias=False)
            self.out.weight = self.emb.weight

        def forward(self, t):
            return self.out(torch.tanh(self.mid(self.emb(t))))

    m = LM()
    g = torch.Generator().manual_seed(2)
    data = [(torch.randint(0, 10, (3, 5), generator=g),) for _ in range(6)]
    train(
        r,
        m,
        lambda mm, t: F.cross_entropy(mm(t[:, :-1]).flatten(0, 1), t[:, 1:].flatten()),
        sgd(m),
        data,
    )


def c_lstm(r):
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = nn.GRU(D, 8, batch_first=True)
            self.head = nn.Linear(8, C)

        def forward(self, x):
            return self.head(self.rnn(x)[0][:, -1])

    m = Net()
    train(r, m, ce, sgd(m), seq_batches([5] * 6))


def c_linear_probe_encoder_not_in_optimizer(r):
    # the optimizer trains only the head; the encoder still requires grad (its .grad accumulates)
    torch.manual_seed(0)
    m = mlp()
    train(r, m, ce, torch.optim.SGD(m[2].parameters(), lr=0.1), batches())


def c_probe_loop_zero_grad_logs_encoder_grad(r):
    torch.manual_seed(0)
    m = mlp()
    train(
        r,
        m,
        ce,
        torch.optim.SGD(m[2].parameters(), lr=0.1),
        batches(),
        between=lambda i, mm, s: mm.zero_grad(),
    )


def c_probe_not_in_optimizer_accumulate2(r):
    torch.manual_seed(0)
    m = mlp()
    train(
        r,
        m,
        ce,
        torch.optim.SGD(m[2].parameters(), lr=0.1, momentum=0.9, fused=True),
        batches(),
        accumulate=2,
    )


# ============================================================================ MoE
class MoE(nn.Module):
    """Top-2 gated mixture with a Switch-style load-balancing loss kept on self.aux_loss."""

    def __init__(self, d=D, e=4, mode="always"):
        super().__init__()
        self.gate = nn.Linear(d, e)
        self.experts = nn.ModuleList(nn.Linear(d, d) for _ in range(e))
        self.e = e
        self.mode = mode
        self.aux_loss = None
        self.use_aux = True

    def forward(self, x):
        probs = self.gate(x).softmax(-1)
        _topv, topi = probs.topk(2, dim=-1)
        mask = torch.zeros_like(probs).scatter_(-1, topi, 1.0)  # one_hot reads max() on the host
        w = probs * mask
        out = sum(w[:, i : i + 1] * ex(x) for i, ex in enumerate(self.experts))
        aux = self.e * (mask.mean(0) * probs.mean(0)).sum()
        if self.mode == "always":
            self.aux_loss = aux
        elif self.mode == "training":
            if self.training and self.use_aux:
                self.aux_loss = aux
        elif self.mode == "none_on_small":
            self.aux_loss = aux if x.shape[0] > 4 else None
        elif self.mode == "accumulate":  # Switch-style: summed over calls inside one forward
            self.aux_loss = aux if self.aux_loss is None else self.aux_loss + aux
        elif self.mode == "counts":
            self.aux_loss = aux
            flat = topi.flatten()
            self.tokens_per_expert = torch.zeros(self.e, dtype=torch.long).scatter_add_(
                0, flat, torch.ones_like(flat)
            )
        return x + out


class MoENet(nn.Module):
    def __init__(self, layers=1, mode="always"):
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.moes = nn.ModuleList(MoE(mode=mode) for _ in range(layers))
        self.head = nn.Linear(D, C)

    def forward(self, x):
        h = torch.relu(self.inp(x))
        for moe in self.moes:
            h = moe(h)
        return self.head(h)


def moe_loss(m, x, y):
    loss = F.cross_entropy(m(x), y)
    for mod in m.modules():
        if isinstance(mod, MoE) and mod.aux_loss is not None:
            loss = loss + 0.01 * mod.aux_loss
    return loss


def keep_aux(i, m):
    return {f"aux{j}": moe.aux_loss for j, moe in enumerate(m.moes)}


def m_single_aux(r):
    torch.manual_seed(0)
    m = MoENet(1)
    train(r, m, moe_loss, sgd(m), batches(), keep=keep_aux)


def m_stack3_sum_over_modules(r):
    torch.manual_seed(0)
    m = MoENet(3)
    train(r, m, moe_loss, sgd(m), batches(), keep=keep_aux)


def m_aux_logged_in_list(r):
    torch.manual_seed(0)
    m = MoENet(2)
    log = []

    def keep(i, mm):
        log.append(mm.moes[0].aux_loss)
        log.append(mm.moes[1].aux_loss.item())
        return {"log": list(log)}

    train(r, m, moe_loss, sgd(m), batches(), keep=keep)


def m_accumulate2(r):
    torch.manual_seed(0)
    m = MoENet(2)
    train(r, m, moe_loss, sgd(m), batches(), keep=keep_aux, accumulate=2)


def m_accumulate4_adamw(r):
    torch.manual_seed(0)
    m = MoENet(2)
    train(r, m, moe_loss, adamw(m), batches(12), keep=keep_aux, accumulate=4)


def m_bf16_mixed(r):
    torch.manual_seed(0)
    m = MoENet(2)
    train(r, m, moe_loss, sgd(m), batches(), keep=keep_aux, precision="bf16-mixed")


def m_bf16_accumulate2_max_norm_ema(r):
    torch.manual_seed(0)
    m = MoENet(2)
    ema = rk.EMA(m, 0.9)
    train(
        r,
        m,
        moe_loss,
        adamw(m),
        batches(),
        keep=keep_aux,
        precision="bf16-mixed",
        accumulate=2,
        max_norm=0.5,
        ema=ema,
    )


def m_adam_default_eager_optimizer(r):
    torch.manual_seed(0)
    m = MoENet(2)
    train(r, m, moe_loss, torch.optim.Adam(m.parameters(), lr=1e-2), batches(), keep=keep_aux)


def m_conditional_flag_toggled(r):
    # the loop switches the aux loss off after warm-up phase (a curriculum); stale aux stays on module
    torch.manual_seed(0)
    m = MoENet(2, mode="training")

    def between(i, mm, s):
        if i == 4:
            for moe in mm.moes:
                moe.use_aux = False

    def loss_fn(mm, x, y):
        loss = F.cross_entropy(mm(x), y)
        if mm.moes[0].use_aux:
            loss = loss + 0.01 * sum(moe.aux_loss for moe in mm.moes)
        return loss

    train(r, m, loss_fn, sgd(m), batches(), keep=keep_aux, between=between)


def m_none_on_small_batches(r):
    torch.manual_seed(0)
    m = MoENet(2, mode="none_on_small")
    train(r, m, moe_loss, sgd(m), batches(sizes=[6, 4, 6, 6, 4, 4, 6, 4]), keep=keep_aux)


def m_loop_sets_aux_none(r):
    torch.manual_seed(0)
    m = MoENet(2)
    log = []

    def keep(i, mm):
        log.append(mm.moes[1].aux_loss.detach())
        for moe in mm.moes:
            moe.aux_loss = None
        return {"log": list(log)}

    train(r, m, moe_loss, sgd(m), batches(), keep=keep)


def m_aux_summed_within_forward(r):
    # the model resets aux to None at the start of forward and one MoE layer is called twice
    torch.manual_seed(0)

    class Net(MoENet):
        def forward(self, x):
            for moe in self.moes:
                moe.aux_loss = None
            h = torch.relu(self.inp(x))
            h = self.moes[0](h)
            h = self.moes[0](h)
            return self.head(h)

    m = Net(1, mode="accumulate")
    train(r, m, moe_loss, sgd(m), batches(), keep=keep_aux)


def m_aux_reset_zeros_tensor(r):
    # reset to a fresh zero tensor each forward, then accumulated
    torch.manual_seed(0)

    class Net(MoENet):
        def forward(self, x):
            for moe in self.moes:
                moe.aux_loss = torch.zeros(())
            h = torch.relu(self.inp(x))
            h = self.moes[0](h)
            h = self.moes[0](h)
            return self.head(h)

    m = Net(1, mode="accumulate")
    train(r, m, moe_loss, sgd(m), batches(), keep=keep_aux)


def m_token_counts_int64(r):
    torch.manual_seed(0)
    m = MoENet(2, mode="counts")

    def keep(i, mm):
        return {"aux": mm.moes[0].aux_loss, "counts": [moe.tokens_per_expert for moe in mm.moes]}

    train(r, m, moe_loss, sgd(m), batches(), keep=keep)


def m_aux_in_stats_dict(r):
    torch.manual_seed(0)

    class M2(MoE):
        def forward(self, x):
            y = super().forward(x)
            self.stats = getattr(self, "stats", {})
            self.stats["aux"] = self.aux_loss
            self.stats["load"] = self.gate(x).softmax(-1).mean(0).detach()
            return y

    m = MoENet(1)
    m.moes[0] = M2()
    train(r, m, moe_loss, sgd(m), batches(), keep=lambda i, mm: {"stats": dict(mm.moes[0].stats)})


def m_on_optimizer_step_reads_aux(r):
    torch.manual_seed(0)
    m = MoENet(2)
    seen = []
    step = r.step(
        m,
        moe_loss,
        sgd(m),
        accumulate=2,
        **(
            {"on_optimizer_step": lambda: seen.append(m.moes[0].aux_loss.detach().clone())}
            if r.mode != "plain"
            else {}
        ),
    )
    for i, b in enumerate(batches()):
        loss = step(*b)
        if r.mode == "plain" and i % 2 == 1:
            seen.append(m.moes[0].aux_loss.detach().clone())
        r.snap(m, None, loss=loss, seen=list(seen))


def m_aux_variable_seq_len(r):
    torch.manual_seed(0)

    class SeqMoE(nn.Module):
        def __init__(self):
            super().__init__()
            self.moe = MoE()
            self.head = nn.Linear(D, C)

        def forward(self, x):
            b, t, d = x.shape
            h = self.moe(x.reshape(b * t, d)).reshape(b, t, d)
            self.moe.router_probs = (
                self.moe.gate(x).softmax(-1).detach()
            )  # (b, t, e): shape follows t
            return self.head(h.mean(1))

    m = SeqMoE()

    def loss_fn(mm, x, y):
        return F.cross_entropy(mm(x), y) + 0.01 * mm.moe.aux_loss

    train(
        r,
        m,
        loss_fn,
        sgd(m),
        seq_batches([4, 6, 4, 6, 8, 4, 8, 6]),
        keep=lambda i, mm: {"aux": mm.moe.aux_loss, "rp": mm.moe.router_probs},
    )


# ============================================================================ states
class Centre(nn.Module):
    def __init__(self, buffer=True, dtype=torch.float32, momentum=0.9, where="attr"):
        super().__init__()
        self.net = mlp()
        self.momentum = momentum
        self.where = where
        c = torch.zeros(C, dtype=dtype)
        if where == "dict":
            self.stats = {"center": c}
        elif where == "ns":
            self.state = types.SimpleNamespace(center=c)
        elif buffer:
            self.register_buffer("center", c)
        else:
            self.center = c

    def get(self):
        if self.where == "dict":
            return self.stats["center"]
        if self.where == "ns":
            return self.state.center
        return self.center

    def put(self, v):
        if self.where == "dict":
            self.stats["center"] = v
        elif self.where == "ns":
            self.state.center = v
        else:
            self.center = v

    def forward(self, x):
        out = self.net(x)
        c = self.get()
        centred = out - c.to(out.dtype)
        self.put(self.momentum * c + (1 - self.momentum) * out.detach().mean(0).to(c.dtype))
        return centred


def keep_center(i, m):
    return {"center": m.get()}


def s_dino_center_buffer(r):
    torch.manual_seed(0)
    m = Centre(True)
    train(r, m, ce, sgd(m), batches(), keep=keep_center)


def s_center_plain_attr(r):
    torch.manual_seed(0)
    m = Centre(False)
    train(r, m, ce, sgd(m), batches(), keep=keep_center)


def s_center_in_dict(r):
    torch.manual_seed(0)
    m = Centre(where="dict")
    train(r, m, ce, sgd(m), batches(), keep=keep_center)


def s_center_in_namespace(r):
    torch.manual_seed(0)
    m = Centre(where="ns")
    train(r, m, ce, sgd(m), batches(), keep=keep_center)


def s_center_bf16_buffer(r):
    torch.manual_seed(0)
    m = Centre(True, dtype=torch.bfloat16)
    train(r, m, ce, sgd(m), batches(), keep=keep_center)


def s_center_bf16_mixed_precision(r):
    torch.manual_seed(0)
    m = Centre(True)
    train(r, m, ce, sgd(m), batches(), keep=keep_center, precision="bf16-mixed")


def s_center_accumulate2(r):
    torch.manual_seed(0)
    m = Centre(False)
    train(r, m, ce, sgd(m), batches(), keep=keep_center, accumulate=2)


def s_center_accumulate4_ema_max_norm(r):
    torch.manual_seed(0)
    m = Centre(True)
    train(
        r,
        m,
        ce,
        adamw(m),
        batches(12),
        keep=keep_center,
        accumulate=4,
        ema=rk.EMA(m, 0.8),
        max_norm=0.3,
    )


def s_center_user_keeps_history(r):
    torch.manual_seed(0)
    m = Centre(False)
    hist = []

    def keep(i, mm):
        hist.append(mm.center)
        return {"hist": list(hist), "distinct": len({id(t) for t in hist})}

    train(r, m, ce, sgd(m), batches(), keep=keep)


def s_center_requires_grad_state(r):
    # a learnable-looking initial centre: the re-bound state carries a graph across calls
    torch.manual_seed(0)

    # (a prompt-like tensor: read with grad, re-bound to a fresh leaf; the loop logs each old leaf's grad)
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = mlp()
            self.center = torch.zeros(C, requires_grad=True)

        def forward(self, x):
            out = self.net(x) - self.center
            self.center = (0.9 * self.center + 0.1 * out.mean(0)).detach().requires_grad_()
            return out

    m = Net()
    olds = []

    def between(i, mm, s):
        olds.append(mm.center)

    train(
        r,
        m,
        ce,
        sgd(m),
        batches(),
        between=between,
        keep=lambda i, mm: {"c": mm.center, "g": [o.grad for o in olds]},
    )


def s_running_mean_var_whitening(r):
    torch.manual_seed(0)

    class Whiten(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = mlp(o=C)
            self.mean = torch.zeros(C)
            self.var = torch.ones(C)

        def forward(self, x):
            h = self.net(x)
            if self.training:
                bm, bv = h.detach().mean(0), h.detach().var(0)
                self.mean = 0.9 * self.mean + 0.1 * bm
                self.var = 0.9 * self.var + 0.1 * bv
            return (h - self.mean) / (self.var + 1e-5).sqrt()

    m = Whiten()
    train(r, m, ce, sgd(m), batches(), keep=lambda i, mm: {"mean": mm.mean, "var": mm.var})


def s_ema_activation_inplace(r):
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = mlp()
            self.act_ema = torch.zeros(C)

        def forward(self, x):
            out = self.net(x)
            self.act_ema.mul_(0.9).add_(out.detach().abs().mean(0), alpha=0.1)
            return out

    m = Net()
    train(r, m, ce, sgd(m), batches(), keep=lambda i, mm: {"e": mm.act_ema})


def s_step_counter_tensor_rebound(r):
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = mlp()
            self.register_buffer("steps", torch.zeros((), dtype=torch.long))

        def forward(self, x):
            self.steps = self.steps + 1
            warm = torch.clamp(self.steps.float() / 4, max=1.0)
            return self.net(x) * warm

    m = Net()
    train(r, m, ce, sgd(m), batches(), keep=lambda i, mm: {"steps": mm.steps})


def s_center_momentum_schedule_python(r):
    torch.manual_seed(0)
    m = Centre(True)

    def between(i, mm, s):
        mm.momentum = 0.9 if i < 4 else 0.99

    train(r, m, ce, sgd(m), batches(), keep=keep_center, between=between)


def _teacher_centre(r, buffer: bool):
    """DINO: the teacher (held by loss_fn, not the trained model) keeps its centre, a buffer or a
    plain attribute."""
    torch.manual_seed(0)
    student = mlp()
    teacher = Centre(buffer)
    teacher.net.load_state_dict(student.state_dict())
    teacher.requires_grad_(False)

    def loss_fn(s, x, y):
        with torch.no_grad():
            t = teacher(x).softmax(-1)
        return -(t * F.log_softmax(s(x), -1)).sum(-1).mean()

    train(r, student, loss_fn, sgd(student), batches(), keep=lambda i, mm: {"tc": teacher.center})


def s_teacher_center_in_loss_fn(r):
    _teacher_centre(r, buffer=True)


def s_teacher_stats_written_in_loss_fn(r):
    torch.manual_seed(0)
    student = mlp()
    teacher = copy.deepcopy(student).requires_grad_(False)
    teacher.last_logits = None
    teacher.center = torch.zeros(C)

    def loss_fn(s, x, y):
        with torch.no_grad():
            tl = teacher(x)
            teacher.last_logits = tl
            t = ((tl - teacher.center) / 0.5).softmax(-1)
            teacher.center = 0.9 * teacher.center + 0.1 * tl.mean(0)
        return -(t * F.log_softmax(s(x), -1)).sum(-1).mean()

    train(
        r,
        student,
        loss_fn,
        sgd(student),
        batches(),
        keep=lambda i, mm: {"tl": teacher.last_logits, "tc": teacher.center},
    )


def s_center_updated_in_loss_fn_on_model(r):
    # the loss (not the forward) keeps the centre on the model
    torch.manual_seed(0)
    m = mlp()
    m.center = torch.zeros(C)

    def loss_fn(mm, x, y):
        out = mm(x)
        loss = F.cross_entropy(out - mm.center, y)
        mm.center = 0.9 * mm.center + 0.1 * out.detach().mean(0)
        return loss

    train(r, m, loss_fn, sgd(m), batches(), keep=lambda i, mm: {"c": mm.center})


class DINOLoss(nn.Module):
    def __init__(self, inplace):
        super().__init__()
        self.inplace = inplace
        self.register_buffer("center", torch.zeros(1, C))

    def forward(self, s_out, t_out):
        t = ((t_out - self.center) / 0.5).softmax(-1)
        loss = -(t * F.log_softmax(s_out / 0.1, -1)).sum(-1).mean()
        bc = t_out.detach().mean(0, keepdim=True)
        if self.inplace:
            self.center.mul_(0.9).add_(bc, alpha=0.1)
        else:
            self.center = self.center * 0.9 + bc * 0.1
        return loss


def _dino_loss_module(r, inplace):
    torch.manual_seed(0)
    student = mlp()
    teacher = copy.deepcopy(student).requires_grad_(False)
    crit = DINOLoss(inplace)

    def loss_fn(s, x, y):
        with torch.no_grad():
            t = teacher(x)
        return crit(s(x), t)

    train(r, student, loss_fn, sgd(student), batches(), keep=lambda i, mm: {"c": crit.center})


def s_dino_loss_module_rebind(r):
    _dino_loss_module(r, False)


def s_dino_loss_module_inplace(r):
    _dino_loss_module(r, True)


def s_loss_closure_dict_state(r):
    torch.manual_seed(0)
    m = mlp()
    state = {"center": torch.zeros(C)}

    def loss_fn(mm, x, y):
        out = mm(x)
        loss = F.cross_entropy(out - state["center"], y)
        state["center"] = 0.9 * state["center"] + 0.1 * out.detach().mean(0)
        return loss

    train(r, m, loss_fn, sgd(m), batches(), keep=lambda i, mm: {"c": state["center"]})


def s_teacher_written_only_in_loss_fn(r):
    torch.manual_seed(0)
    student = mlp()
    teacher = copy.deepcopy(student).requires_grad_(False)

    def loss_fn(s, x, y):
        with torch.no_grad():
            teacher.last = teacher(x)
        return F.cross_entropy(s(x), y) + F.mse_loss(s(x), teacher.last)

    def between(i, mm, st):
        if i == 4:
            with torch.no_grad():
                teacher[0].weight.mul_(0.5)  # the loop refreshes the teacher (an EMA update)

    train(
        r,
        student,
        loss_fn,
        sgd(student),
        batches(),
        keep=lambda i, mm: {"t": teacher.last},
        between=between,
    )


def s_teacher_ema_updated_by_loop(r):
    # BYOL/DINO: the loop lerps the teacher towards the student after each step; loss_fn reads it
    torch.manual_seed(0)
    student = mlp()
    teacher = copy.deepcopy(student).requires_grad_(False)

    def loss_fn(s, x, y):
        with torch.no_grad():
            t = teacher(x).softmax(-1)
        return -(t * F.log_softmax(s(x), -1)).sum(-1).mean()

    def keep(i, mm):
        with torch.no_grad():
            for pt, ps in zip(teacher.parameters(), mm.parameters(), strict=False):
                pt.lerp_(ps, 0.1)
        return {"t0": teacher[0].weight}

    train(r, student, loss_fn, sgd(student), batches(), keep=keep)


def s_center_multicrop_two_forwards(r):
    # DINO multi-crop: loss_fn runs the model on two views; the centre moves twice per step
    torch.manual_seed(0)
    m = Centre(True)

    def loss_fn(mm, x, y):
        return ce(mm, x, y) + ce(mm, x.flip(0) * 0.5, y.flip(0))

    train(r, m, loss_fn, sgd(m), batches(), keep=keep_center)


def m_aux_multicrop_summed(r):
    torch.manual_seed(0)
    m = MoENet(2)

    def loss_fn(mm, x, y):
        total = 0
        for view in (x, x * 0.5):
            total = total + moe_loss(mm, view, y)
        return total

    train(r, m, loss_fn, sgd(m), batches(), keep=keep_aux)


def s_center_shared_by_two_layers(r):
    # two heads start from one centre tensor (the same object); each re-binds its own
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = Centre(False), Centre(False)
            self.b.center = self.a.center

        def forward(self, x):
            return self.a(x) + self.b(x * 2)

    m = Net()
    train(
        r,
        m,
        ce,
        sgd(m),
        batches(),
        keep=lambda i, mm: {"a": mm.a.center, "b": mm.b.center, "same": mm.a.center is mm.b.center},
    )


def s_center_inplace_then_rebind(r):
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = mlp()
            self.center = torch.zeros(C)

        def forward(self, x):
            out = self.net(x)
            self.center.mul_(0.9)
            self.center = self.center + 0.1 * out.detach().mean(0)
            return out - self.center

    m = Net()
    train(r, m, ce, sgd(m), batches(), keep=lambda i, mm: {"c": mm.center})


def l_moe_checkpoint_reload(r):
    torch.manual_seed(0)
    m = MoENet(2)
    opt = sgd(m)
    saved = {}

    def between(i, mm, s):
        if i == 2:
            saved["m"] = copy.deepcopy(mm.state_dict())
            saved["o"] = copy.deepcopy(opt.state_dict())
        if i == 5:
            mm.load_state_dict(saved["m"])
            opt.load_state_dict(saved["o"])

    train(r, m, moe_loss, opt, batches(), keep=keep_aux, between=between)


def s_rope_cache_dict_by_len(r):
    torch.manual_seed(0)

    class Rope(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(D, D)
            self.head = nn.Linear(D, C)
            self.cache = {}

        def forward(self, x):
            t = x.shape[1]
            if t not in self.cache:
                pos = torch.arange(t, dtype=torch.float32)[:, None]
                freq = torch.arange(D // 2, dtype=torch.float32)[None] + 1
                self.cache[t] = (torch.cos(pos / freq), torch.sin(pos / freq))
            cos, sin = self.cache[t]
            h = self.proj(x)
            a, b = h[..., : D // 2], h[..., D // 2 :]
            h = torch.cat([a * cos - b * sin, a * sin + b * cos], -1)
            return self.head(h.mean(1))

    m = Rope()
    train(
        r,
        m,
        ce,
        sgd(m),
        seq_batches([4, 4, 6, 4, 6, 8, 4, 8, 6, 4, 8, 6]),
        keep=lambda i, mm: {"cache": dict(mm.cache)},
    )


def s_rope_cache_extended(r):
    torch.manual_seed(0)

    class Rope(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(D, D)
            self.head = nn.Linear(D, C)
            self.cos = None
            self.sin = None

        def forward(self, x):
            t = x.shape[1]
            if self.cos is None or self.cos.shape[0] < t:
                pos = torch.arange(t, dtype=torch.float32)[:, None]
                freq = torch.arange(D // 2, dtype=torch.float32)[None] + 1
                self.cos, self.sin = torch.cos(pos / freq), torch.sin(pos / freq)
            cos, sin = self.cos[:t], self.sin[:t]
            h = self.proj(x)
            a, b = h[..., : D // 2], h[..., D // 2 :]
            h = torch.cat([a * cos - b * sin, a * sin + b * cos], -1)
            return self.head(h.mean(1))

    m = Rope()
    train(
        r,
        m,
        ce,
        sgd(m),
        seq_batches([4, 4, 6, 4, 6, 8, 4, 8, 6, 4, 8, 6]),
        keep=lambda i, mm: {"cos": mm.cos, "sin": mm.sin},
    )


def s_prev_batch_residual_shape_branch(r, sizes=(4, 4, 6, 4, 6, 6, 4, 6)):
    # online smoothing: add the previous batch's features when the batch size matches
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = mlp(o=D)
            self.head = nn.Linear(D, C)
            self.prev = None

        def forward(self, x):
            h = self.net(x)
            if self.prev is not None and self.prev.shape == h.shape:
                h = h + 0.5 * self.prev
            self.prev = h.detach()
            return self.head(h)

    m = Net()
    train(
        r,
        m,
        ce,
        sgd(m),
        batches(sizes=list(sizes)),
        keep=lambda i, mm: {"prev": mm.prev},
    )


def s_prev_batch_residual_branch_documented(r):
    # the same model, sizes where the replay keeps the recording call's branch (documented limit)
    torch.manual_seed(0)
    s_prev_batch_residual_shape_branch(r, sizes=[4, 6, 4, 4, 4, 4, 4, 6])


def s_memory_bank_queue(r):
    # MoCo-style queue: a state re-bound by cat + slice each call
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.enc = mlp(o=D)
            self.head = nn.Linear(D, C)
            self.register_buffer("queue", torch.zeros(12, D))

        def forward(self, x):
            z = F.normalize(self.enc(x), dim=-1)
            neg = (z @ self.queue.t()).logsumexp(-1, keepdim=True)
            self.queue = torch.cat([z.detach(), self.queue])[:12]
            return self.head(z) - 0.1 * neg

    m = Net()
    train(r, m, ce, sgd(m), batches(), keep=lambda i, mm: {"q": mm.queue})


# ============================================================================ held dict / object
def d_feats_dict_feature_matching(r):
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.l1 = nn.Linear(D, 16)
            self.l2 = nn.Linear(16, C)
            self.feats = {}

        def forward(self, x):
            h = torch.relu(self.l1(x))
            self.feats["h"] = h
            return self.l2(h)

    m = Net()

    def loss_fn(mm, x, y):
        return F.cross_entropy(mm(x), y) + 0.1 * mm.feats["h"].pow(2).mean()

    train(r, m, loss_fn, sgd(m), batches(), keep=lambda i, mm: {"feats": dict(mm.feats)})


def d_feats_dict_cleared_by_loop(r):
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.l1 = nn.Linear(D, 16)
            self.l2 = nn.Linear(16, C)
            self.feats = {}

        def forward(self, x):
            h = torch.relu(self.l1(x))
            self.feats["h"] = h.detach()
            return self.l2(h)

    m = Net()

    def keep(i, mm):
        snap = dict(mm.feats)
        mm.feats.clear()
        return {"feats": snap}

    train(r, m, ce, sgd(m), batches(), keep=keep)


def d_feats_dict_replaced_by_loop(r):
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.l1 = nn.Linear(D, 16)
            self.l2 = nn.Linear(16, C)
            self.feats = {}

        def forward(self, x):
            h = torch.relu(self.l1(x))
            self.feats["h"] = h.detach()
            return self.l2(h)

    m = Net()
    kept = []

    def keep(i, mm):
        kept.append(mm.feats)
        mm.feats = {}
        return {"kept": [dict(k) for k in kept]}

    train(r, m, ce, sgd(m), batches(), keep=keep)


def d_per_layer_feats_loop(r):
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(D, D) for _ in range(3))
            self.head = nn.Linear(D, C)
            self.acts = {}

        def forward(self, x):
            for j, layer in enumerate(self.layers):
                x = torch.tanh(layer(x))
                self.acts[f"layer{j}"] = x.detach()
            return self.head(x)

    m = Net()
    train(r, m, ce, sgd(m), batches(), keep=lambda i, mm: {"acts": dict(mm.acts)})


def d_namespace_last_out(r):
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = mlp()
            self.log = types.SimpleNamespace(last=None, norm=None)

        def forward(self, x):
            out = self.net(x)
            self.log.last = out.detach()
            self.log.norm = out.detach().norm()
            return out

    m = Net()
    train(
        r, m, ce, sgd(m), batches(), keep=lambda i, mm: {"last": mm.log.last, "norm": mm.log.norm}
    )


def d_dict_held_by_loss_closure(r):
    torch.manual_seed(0)
    m = mlp()
    metrics = {}

    def loss_fn(mm, x, y):
        logits = mm(x)
        loss = F.cross_entropy(logits, y)
        metrics["ce"] = loss.detach()
        metrics["acc"] = (logits.argmax(-1) == y).float().mean()
        return loss

    train(r, m, loss_fn, sgd(m), batches(), keep=lambda i, mm: {"metrics": dict(metrics)})


def d_logger_object_in_loss_closure(r):
    torch.manual_seed(0)
    m = mlp()
    logger = types.SimpleNamespace(last=None, history=[])

    def loss_fn(mm, x, y):
        loss = F.cross_entropy(mm(x), y)
        logger.last = loss.detach()
        return loss

    def keep(i, mm):
        logger.history.append(logger.last)
        return {"hist": list(logger.history)}

    train(r, m, loss_fn, sgd(m), batches(), keep=keep)


def d_loss_fn_writes_model_attr(r):
    torch.manual_seed(0)
    m = mlp()

    def loss_fn(mm, x, y):
        logits = mm(x)
        mm.last_logits = logits.detach()
        return F.cross_entropy(logits, y)

    train(r, m, loss_fn, sgd(m), batches(), keep=lambda i, mm: {"ll": mm.last_logits})


# ============================================================================ attention / logging
class Attn(nn.Module):
    def __init__(self, keep="detach"):
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)
        self.head = nn.Linear(D, C)
        self.keep = keep
        self.last_attn = None

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        attn = (q @ k.transpose(-1, -2) / D**0.5).softmax(-1)
        if self.keep == "detach":
            self.last_attn = attn.detach()
        elif self.keep == "graph":
            self.last_attn = attn
        elif self.keep == "list":
            self.maps = [attn.detach(), attn.detach().mean(0)]
        elif self.keep == "tuple":
            self.kv = (k.detach(), v.detach())
        return self.head((attn @ v).mean(1))


def a_attn_kept_across_steps(r):
    torch.manual_seed(0)
    m = Attn()
    maps = []

    def keep(i, mm):
        maps.append(mm.last_attn)
        return {"maps": list(maps)}

    train(r, m, ce, sgd(m), seq_batches([5] * 8), keep=keep)


def a_attn_variable_len(r):
    torch.manual_seed(0)
    m = Attn()
    maps = []

    def keep(i, mm):
        maps.append(mm.last_attn)
        return {"maps": list(maps)}

    train(r, m, ce, sgd(m), seq_batches([5, 7, 5, 7, 9, 5, 9, 7]), keep=keep)


def a_attn_entropy_reg_in_loss(r):
    torch.manual_seed(0)
    m = Attn(keep="graph")

    def loss_fn(mm, x, y):
        out = mm(x)
        ent = -(mm.last_attn * mm.last_attn.clamp_min(1e-9).log()).sum(-1).mean()
        return F.cross_entropy(out, y) - 0.01 * ent

    train(r, m, loss_fn, sgd(m), seq_batches([5] * 8), keep=lambda i, mm: {"a": mm.last_attn})


def a_attn_maps_list_attr(r):
    torch.manual_seed(0)
    m = Attn(keep="list")
    train(r, m, ce, sgd(m), seq_batches([5] * 8), keep=lambda i, mm: {"maps": list(mm.maps)})


def a_kv_tuple_attr(r):
    torch.manual_seed(0)
    m = Attn(keep="tuple")
    train(r, m, ce, sgd(m), seq_batches([5] * 8), keep=lambda i, mm: {"kv": mm.kv})


def a_attn_accumulate2_logged(r):
    torch.manual_seed(0)
    m = Attn()
    maps = []

    def keep(i, mm):
        maps.append(mm.last_attn)
        return {"maps": list(maps)}

    train(r, m, ce, sgd(m), seq_batches([5] * 8), keep=keep, accumulate=2)


def a_attn_bf16_mixed(r):
    torch.manual_seed(0)
    m = Attn()
    train(
        r,
        m,
        ce,
        sgd(m),
        seq_batches([5] * 8),
        keep=lambda i, mm: {"a": mm.last_attn},
        precision="bf16-mixed",
    )


# ============================================================================ odd writes
def x_same_tensor_two_attrs(r):
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = mlp()

        def forward(self, x):
            out = self.net(x)
            self.last = out.detach()
            self.for_logging = self.last
            return out

    m = Net()
    train(
        r,
        m,
        ce,
        sgd(m),
        batches(),
        keep=lambda i, mm: {"a": mm.last, "b": mm.for_logging, "same": mm.last is mm.for_logging},
    )


def x_attr_and_dict_same_tensor(r):
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = mlp()
            self.feats = {}

        def forward(self, x):
            out = self.net(x)
            h = out.detach()
            self.last = h
            self.feats["out"] = h
            return out

    m = Net()

    def keep(i, mm):
        mm.last.mul_(0)  # the user edits one; eager's other name sees it
        return {"a": mm.last, "b": mm.feats["out"], "same": mm.last is mm.feats["out"]}

    train(r, m, ce, sgd(m), batches(), keep=keep)


def x_attr_is_input_slice(r):
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = mlp()

        def forward(self, x):
            self.first_row = x[0]
            return self.net(x)

    m = Net()
    buf = torch.zeros(4, D)
    kept = []

    def between(i, mm, s):
        pass

    step = r.step(m, lambda mm, x, y: F.cross_entropy(mm(x), y), sgd(m))
    for x, y in batches():
        buf.copy_(x)  # a pinned staging buffer the loader refills
        loss = step(buf, y)
        kept.append(m.first_row)
        r.snap(m, None, loss=loss, kept=list(kept), views_input=m.first_row._base is buf)


def x_attr_is_weight_view(r):
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(D, C)

        def forward(self, x):
            self.w_row0 = self.lin.weight[0].detach()
            return self.lin(x)

    m = Net()
    train(r, m, ce, sgd(m), batches(), keep=lambda i, mm: {"w0": mm.w_row0, "w": mm.lin.weight})


def x_attr_is_weight_detach(r):
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(D, C)

        def forward(self, x):
            self.w_seen = self.lin.weight.detach()
            return self.lin(x)

    m = Net()
    kept = []

    def keep(i, mm):
        kept.append(mm.w_seen)
        return {"kept": list(kept)}

    train(r, m, ce, sgd(m), batches(), keep=keep)


def x_attr_is_param_itself_plain(r):
    # keeps a reference to a weight under another plain container (no registration)
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(D, C)
            self.refs = {}

        def forward(self, x):
            self.refs["w"] = self.lin.weight
            return self.lin(x)

    m = Net()
    train(
        r,
        m,
        ce,
        sgd(m),
        batches(),
        keep=lambda i, mm: {"w": mm.refs["w"], "is_param": mm.refs["w"] is mm.lin.weight},
    )


def x_attr_is_buffer_alias(r):
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(D, 16), nn.BatchNorm1d(16), nn.Linear(16, C))

        def forward(self, x):
            out = self.net(x)
            self.rm = self.net[1].running_mean  # an alias to a buffer updated in place
            return out

    m = Net()
    kept = []

    def keep(i, mm):
        kept.append(mm.rm)
        return {"kept": list(kept), "alias": mm.rm is mm.net[1].running_mean}

    train(r, m, ce, sgd(m), batches(), keep=keep)


def x_attr_is_output_identity(r):
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = mlp()

        def forward(self, x):
            out = self.net(x)
            self.last_out = out
            return out

    m = Net()
    train(r, m, ce, sgd(m), batches(), keep=lambda i, mm: {"o": mm.last_out})


def x_python_value_beside_tensor(r):
    torch.manual_seed(0)

    class Net(MoENet):
        def forward(self, x):
            self.batch_size = x.shape[0]
            self.dtype_seen = str(x.dtype)
            return super().forward(x)

    m = Net(1)
    train(
        r,
        m,
        moe_loss,
        sgd(m),
        batches(sizes=[4, 6]),
        keep=lambda i, mm: {"bs": mm.batch_size, "aux": mm.moes[0].aux_loss},
    )


def x_python_counter_beside_tensor(r):
    torch.manual_seed(0)

    class Net(MoENet):
        calls = 0

        def forward(self, x):
            self.ncalls = getattr(self, "ncalls", 0) + 1
            return super().forward(x)

    m = Net(1)
    train(
        r,
        m,
        moe_loss,
        sgd(m),
        batches(),
        keep=lambda i, mm: {"n": mm.ncalls, "aux": mm.moes[0].aux_loss},
    )


def x_attr_tensor_then_none_by_len(r):
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = mlp()
            self.extra = None

        def forward(self, x):
            out = self.net(x)
            self.extra = out.detach().max(0).values if x.shape[0] % 2 == 0 else None
            return out

    m = Net()
    train(
        r,
        m,
        ce,
        sgd(m),
        batches(sizes=[4, 3, 4, 4, 3, 3, 4, 3]),
        keep=lambda i, mm: {"e": mm.extra},
    )


def x_state_dtype_changes(r):
    # a state whose dtype follows the input dtype (float then double input)
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = mlp()
            self.center = torch.zeros(C)

        def forward(self, x):
            out = self.net(x)
            c = self.center
            self.center = 0.9 * c + 0.1 * out.detach().mean(0).to(c.dtype)
            return out - c

    m = Net()

    def between(i, mm, s):
        if i == 4:
            mm.center = mm.center.to(torch.bfloat16)

    train(r, m, ce, sgd(m), batches(), keep=lambda i, mm: {"c": mm.center}, between=between)


def x_attr_set_under_no_grad(r):
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = mlp()

        def forward(self, x):
            out = self.net(x)
            with torch.no_grad():
                self.conf = out.softmax(-1).max(-1).values
            return out

    m = Net()
    train(r, m, ce, sgd(m), batches(), keep=lambda i, mm: {"conf": mm.conf})


def x_grad_of_attr_used(r):
    # the user reads the attribute's .grad after the step (retain_grad on an activation)
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.l1 = nn.Linear(D, 16)
            self.l2 = nn.Linear(16, C)

        def forward(self, x):
            h = torch.relu(self.l1(x))
            h.retain_grad()
            self.h = h
            return self.l2(h)

    m = Net()
    train(r, m, ce, sgd(m), batches(), keep=lambda i, mm: {"h": mm.h, "hgrad": mm.h.grad})


def x_dropout_mask_kept(r):
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = mlp(o=16)
            self.head = nn.Linear(16, C)

        def forward(self, x):
            h = self.net(x)
            self.mask = (torch.rand_like(h) > 0.3).to(h.dtype)
            return self.head(h * self.mask / 0.7)

    m = Net()
    train(r, m, ce, sgd(m), batches(), keep=lambda i, mm: {"mask": mm.mask})


def x_two_models_share_encoder(r):
    torch.manual_seed(0)

    class Enc(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = nn.Linear(D, D)
            self.last_h = None

        def forward(self, x):
            h = torch.tanh(self.l(x))
            self.last_h = h.detach()
            return h

    enc = Enc()
    a = nn.Sequential(enc, nn.Linear(D, C))
    b = nn.Sequential(enc, nn.Linear(D, 2))
    sa = r.step(a, ce, torch.optim.SGD(a.parameters(), lr=0.1))
    sb = r.step(
        b, lambda m, x, y: F.cross_entropy(m(x), y % 2), torch.optim.SGD(b[1].parameters(), lr=0.1)
    )
    for i, (x, y) in enumerate(batches(12)):
        loss = (sa if i % 2 == 0 else sb)(x, y)
        r.snap(a, None, loss=loss, h=enc.last_h, bhead=b[1].weight)


def x_two_models_share_moe(r):
    torch.manual_seed(0)
    moe = MoE()
    a = nn.Sequential(nn.Linear(D, D), moe, nn.Linear(D, C))
    b = nn.Sequential(nn.Linear(D, D), moe, nn.Linear(D, C))

    def lf(m, x, y):
        return F.cross_entropy(m(x), y) + 0.01 * moe.aux_loss

    sa = r.step(a, lf, torch.optim.SGD(a.parameters(), lr=0.1))
    sb = r.step(b, lf, torch.optim.SGD(b.parameters(), lr=0.1))
    for i, (x, y) in enumerate(batches()):
        loss = (sa if i % 3 else sb)(x, y)
        r.snap(a, None, loss=loss, aux=moe.aux_loss, bw=b[0].weight)


# ============================================================================ loop edits
def l_center_zero_inplace_every3(r):
    torch.manual_seed(0)
    m = Centre(False)

    def between(i, mm, s):
        if i and i % 3 == 0:
            mm.center.zero_()

    train(r, m, ce, sgd(m), batches(), keep=keep_center, between=between)


def l_center_rebind_zeros_every3(r):
    torch.manual_seed(0)
    m = Centre(True)

    def between(i, mm, s):
        if i and i % 3 == 0:
            mm.center = torch.zeros(C)

    train(r, m, ce, sgd(m), batches(), keep=keep_center, between=between)


def l_center_load_state_dict_midrun(r):
    torch.manual_seed(0)
    m = Centre(True)
    opt = sgd(m)
    saved = {}

    def between(i, mm, s):
        if i == 2:
            saved["m"] = copy.deepcopy(mm.state_dict())
            saved["o"] = copy.deepcopy(opt.state_dict())
        if i == 5:
            mm.load_state_dict(saved["m"])
            opt.load_state_dict(saved["o"])

    train(r, m, ce, opt, batches(), keep=keep_center, between=between)


def l_center_dict_entry_reset(r):
    torch.manual_seed(0)
    m = Centre(where="dict")

    def between(i, mm, s):
        if i == 4:
            mm.stats["center"] = torch.full((C,), 0.25)

    train(r, m, ce, sgd(m), batches(), keep=keep_center, between=between)


def l_center_ns_reset_inplace(r):
    torch.manual_seed(0)
    m = Centre(where="ns")

    def between(i, mm, s):
        if i in (3, 6):
            mm.state.center.fill_(1.0)

    train(r, m, ce, sgd(m), batches(), keep=keep_center, between=between)


def l_delete_aux_midrun(r):
    torch.manual_seed(0)
    m = MoENet(1)

    def between(i, mm, s):
        if i == 4:
            del mm.moes[0].aux_loss

    train(r, m, moe_loss, sgd(m), batches(), keep=keep_aux, between=between)


def l_delete_center_attr_then_reinit(r):
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = mlp()

        def forward(self, x):
            out = self.net(x)
            c = getattr(self, "center", None)
            if c is None:
                c = out.detach().mean(0)
            self.center = 0.9 * c + 0.1 * out.detach().mean(0)
            return out - c

    m = Net()

    def between(i, mm, s):
        if i == 5:
            del mm.center

    train(r, m, ce, sgd(m), batches(), keep=lambda i, mm: {"c": mm.center}, between=between)


def l_user_edits_aux_inplace(r):
    # the loop scales the logged aux in place for display: must not leak into training
    torch.manual_seed(0)
    m = MoENet(1)
    log = []

    def keep(i, mm):
        a = mm.moes[0].aux_loss
        a.data.mul_(100)
        log.append(a)
        return {"log": list(log)}

    train(r, m, moe_loss, sgd(m), batches(), keep=keep)


def l_center_reset_other_shape(r):
    torch.manual_seed(0)
    m = Centre(False)

    def between(i, mm, s):
        if i == 4:
            mm.center = torch.zeros(1)  # broadcasts

    train(r, m, ce, sgd(m), batches(), keep=keep_center, between=between)


def l_center_replaced_by_view(r):
    # the loop binds the state to a view into a bigger tensor it keeps (e.g. a per-task centre table)
    torch.manual_seed(0)
    m = Centre(False)
    table = torch.zeros(3, C)

    def between(i, mm, s):
        if i == 3:
            mm.center = table[1]

    train(
        r,
        m,
        ce,
        sgd(m),
        batches(),
        keep=lambda i, mm: {"c": mm.center, "table": table},
        between=between,
    )


def l_model_eval_then_train(r):
    # a validation pass between steps with the same model writes the attributes eagerly
    torch.manual_seed(0)
    m = MoENet(2)

    def between(i, mm, s):
        if i in (3, 6):
            mm.eval()
            with torch.no_grad():
                mm(torch.ones(5, D))
            mm.train()

    train(r, m, moe_loss, sgd(m), batches(), keep=keep_aux, between=between)


def l_validation_updates_center(r):
    torch.manual_seed(0)
    m = Centre(True)

    def between(i, mm, s):
        if i in (3, 6):
            with torch.no_grad():
                mm(torch.ones(5, D))

    train(r, m, ce, sgd(m), batches(), keep=keep_center, between=between)


def l_max_norm_changes(r):
    torch.manual_seed(0)
    m = MoENet(1)

    def between(i, mm, s):
        if i == 4:
            s.max_norm = 0.1

    train(r, m, moe_loss, sgd(m), batches(), keep=keep_aux, max_norm=1.0, between=between)


def l_param_replaced_state_kept(r):
    # re-initialising the head mid-run (a new task) while the centre state continues
    torch.manual_seed(0)
    m = Centre(True)
    opt = sgd(m)

    def between(i, mm, s):
        if i == 4:
            with torch.no_grad():
                mm.net[2].weight.normal_()

    train(r, m, ce, opt, batches(), keep=keep_center, between=between)


def x_state_on_unregistered_module_in_list(r):
    # a teacher kept in a list so it is not a submodule (no parameters, no state_dict): its centre
    # is read and re-bound in the model's forward
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = mlp()
            self._teacher = [Centre(False).requires_grad_(False)]

        def forward(self, x):
            with torch.no_grad():
                t = self._teacher[0](x).softmax(-1)
            return self.net(x) - t

    m = Net()
    train(r, m, ce, sgd(m), batches(), keep=lambda i, mm: {"tc": mm._teacher[0].center})


def x_state_rebound_noncontiguous_by_loop(r):
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = mlp()
            self.center = torch.zeros(2, C)

        def forward(self, x):
            out = self.net(x)
            c = self.center
            self.center = 0.9 * c + 0.1 * torch.stack([out.detach().mean(0), out.detach().std(0)])
            return out - c[0] * c[1]

    m = Net()

    def between(i, mm, s):
        if i == 4:
            mm.center = torch.ones(C, 2).t()  # strides (1, 2)

    train(r, m, ce, sgd(m), batches(), keep=lambda i, mm: {"c": mm.center}, between=between)


def m_aux_under_activation_checkpoint(r):
    torch.manual_seed(0)
    from torch.utils.checkpoint import checkpoint

    class Net(MoENet):
        def forward(self, x):
            h = torch.relu(self.inp(x))
            for moe in self.moes:
                h = checkpoint(moe, h, use_reentrant=False)
            return self.head(h)

    m = Net(2)
    train(r, m, moe_loss, sgd(m), batches(), keep=keep_aux)


def s_center_to_then_inplace(r):
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = mlp()
            self.center = torch.zeros(C)

        def forward(self, x):
            out = self.net(x)
            c = self.center.to(out.dtype)  # the same tensor when the dtype matches
            y = out - c
            c.mul_(0.9).add_(out.detach().mean(0), alpha=0.1)
            self.center = c
            return y

    m = Net()
    train(r, m, ce, sgd(m), batches(), keep=lambda i, mm: {"c": mm.center})


def x_aux_float_zero_or_tensor(r):
    torch.manual_seed(0)

    class M(MoE):
        def forward(self, x):
            y = super().forward(x)
            if x.shape[0] <= 4:
                self.aux_loss = 0.0
            return y

    m = MoENet(1)
    m.moes[0] = M()
    train(r, m, moe_loss, sgd(m), batches(sizes=[6, 4, 6, 6, 4, 4, 6, 4]), keep=keep_aux)


def _reg_only_net(r, use):
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = mlp()
            self.extra = nn.Linear(C, C)

        def forward(self, x):
            out = self.net(x)
            self.reg = self.extra(out.detach()).pow(2).mean()  # a parameter reached only through it
            return out

    m = Net()

    def loss_fn(mm, x, y):
        loss = ce(mm, x, y)
        return loss + 0.1 * mm.reg if use else loss

    train(r, m, loss_fn, sgd(m), batches(), keep=lambda i, mm: {"reg": mm.reg})


def x_param_reached_only_through_attr(r):
    _reg_only_net(r, True)


def x_param_behind_unused_attr_grad_none(r):
    _reg_only_net(r, False)


def l_two_trainsteps_same_model_phases(r):
    torch.manual_seed(0)
    m = Centre(True)
    opt = sgd(m)
    s1 = r.step(m, ce, opt)
    s2 = r.step(m, lambda mm, x, y: ce(mm, x, y) + 0.1 * mm.center.pow(2).sum(), opt, max_norm=1.0)
    for i, b in enumerate(batches(10)):
        if i == 5 and hasattr(s1, "release"):
            s1.release()
        loss = (s1 if i < 5 else s2)(*b)
        r.snap(m, opt, loss=loss, c=m.center)


def l_loop_rebinds_tensor_setting_each_step(r):
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = mlp()
            self.temperature = torch.tensor(1.0)

        def forward(self, x):
            return self.net(x) / self.temperature

    m = Net()

    def between(i, mm, s):
        mm.temperature = torch.tensor(1.0 + 0.1 * i)

    train(r, m, ce, sgd(m), batches(), between=between)


def l_loop_fills_tensor_setting_each_step(r):
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = mlp()
            self.temperature = torch.tensor(1.0)
            self.last_scaled = None

        def forward(self, x):
            out = self.net(x) / self.temperature
            self.last_scaled = out.detach()
            return out

    m = Net()

    def between(i, mm, s):
        mm.temperature.fill_(1.0 + 0.1 * i)

    train(r, m, ce, sgd(m), batches(), between=between, keep=lambda i, mm: {"ls": mm.last_scaled})


def s_teacher_forward_plain_center(r):
    _teacher_centre(r, buffer=False)


def s_dino_loss_module_plain_attr(r):
    torch.manual_seed(0)

    class Loss(DINOLoss):
        def __init__(self):
            super().__init__(False)
            del self.center
            self.center = torch.zeros(1, C)

    student = mlp()
    teacher = copy.deepcopy(student).requires_grad_(False)
    crit = Loss()

    def loss_fn(s, x, y):
        with torch.no_grad():
            t = teacher(x)
        return crit(s(x), t)

    train(r, student, loss_fn, sgd(student), batches(), keep=lambda i, mm: {"c": crit.center})


def c_probe_acc2_loop_zero_grad(r):
    torch.manual_seed(0)
    m = mlp()
    opt = torch.optim.SGD(m[2].parameters(), lr=0.1, momentum=0.9, fused=True)
    train(
        r,
        m,
        ce,
        opt,
        batches(),
        accumulate=2,
        between=lambda i, mm, s: mm.zero_grad() if i % 2 == 0 else None,
    )


def _gan(r, feat):
    torch.manual_seed(0)

    class Disc(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Linear(D, 16)
            self.out = nn.Linear(16, 1)

        def forward(self, x):
            h = torch.relu(self.body(x))
            if feat:
                self.feat = h
            return self.out(h)

    gen, disc = mlp(o=D), Disc()
    og = torch.optim.SGD(gen.parameters(), lr=0.05, momentum=0.5, fused=True)
    od = torch.optim.SGD(disc.parameters(), lr=0.05, momentum=0.5, fused=True)

    def g_loss(g, z, real):
        fake = g(z)
        adv = F.softplus(-disc(fake)).mean()
        if feat:
            ff = disc.feat.mean(0)
            disc(real)
            return adv + F.mse_loss(ff, disc.feat.mean(0).detach())
        return adv

    def d_loss(d, real, fake):
        return F.softplus(-d(real)).mean() + F.softplus(d(fake)).mean()

    sg, sd = r.step(gen, g_loss, og), r.step(disc, d_loss, od)
    g = torch.Generator().manual_seed(5)
    for _ in range(7):
        z, real = torch.randn(4, D, generator=g), torch.randn(4, D, generator=g) + 1
        with torch.no_grad():
            fake = gen(z)
        ld = sd(real, fake)
        lg = sg(z, real)
        r.snap(
            gen,
            og,
            ld=ld,
            lg=lg,
            **{"d:" + n: p for n, p in disc.named_parameters()},
            **{"dgrad:" + n: p.grad for n, p in disc.named_parameters()},
            f=getattr(disc, "feat", None),
        )


def x_gan_two_steps(r):
    _gan(r, False)


def x_gan_feature_matching_attr(r):
    _gan(r, True)


def _aux_prev_read(r, acc):
    # a consistency term against the previous call's aux loss, read in loss_fn before the forward
    torch.manual_seed(0)
    m = MoENet(1)

    def loss_fn(mm, x, y):
        prev = mm.moes[0].aux_loss
        loss = moe_loss(mm, x, y)
        if prev is not None:
            loss = loss + 0.1 * (mm.moes[0].aux_loss - prev.detach()).pow(2)
        return loss

    train(r, m, loss_fn, sgd(m), batches(), keep=keep_aux, accumulate=acc)


def m_aux_prev_read_in_loss_fn(r):
    _aux_prev_read(r, 1)


def m_aux_prev_read_in_loss_fn_acc2(r):
    _aux_prev_read(r, 2)


def l_center_inplace_between_microbatches(r):
    torch.manual_seed(0)
    m = Centre(False)

    def between(i, mm, s):
        if i % 2 == 1:
            mm.center.mul_(0.5)

    train(r, m, ce, sgd(m), batches(), keep=keep_center, between=between, accumulate=2)


def x_bool_seen_state(r):
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = mlp()
            self.seen = torch.zeros(C, dtype=torch.bool)

        def forward(self, x):
            out = self.net(x)
            bonus = (~self.seen).to(out.dtype) * 0.1
            self.seen = self.seen | (out.detach().argmax(-1)[:, None] == torch.arange(C)).any(0)
            return out + bonus

    m = Net()
    train(r, m, ce, sgd(m), batches(), keep=lambda i, mm: {"seen": mm.seen})


def x_best_loss_state_in_loss_fn(r):
    torch.manual_seed(0)
    m = mlp()
    m.best = torch.tensor(float("inf"))

    def loss_fn(mm, x, y):
        loss = ce(mm, x, y)
        mm.best = torch.minimum(mm.best, loss.detach())
        return loss + 0.01 * (loss - mm.best)

    train(r, m, loss_fn, sgd(m), batches(), keep=lambda i, mm: {"best": mm.best})


def x_parent_writes_child_attr(r):
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Linear(D, 16)
            self.head = nn.Linear(16, C)

        def forward(self, x):
            h = torch.relu(self.body(x))
            self.head.last_in = h.detach()
            self.body.stats = {"mean": h.detach().mean()}
            return self.head(h)

    m = Net()
    train(
        r, m, ce, sgd(m), batches(), keep=lambda i, mm: {"li": mm.head.last_in, "st": mm.body.stats}
    )


def s_center_from_first_batch(r):
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = mlp()
            self.center = None

        def forward(self, x):
            out = self.net(x)
            bm = out.detach().mean(0)
            self.center = bm if self.center is None else 0.9 * self.center + 0.1 * bm
            return out - self.center

    m = Net()
    train(r, m, ce, sgd(m), batches(), keep=lambda i, mm: {"c": mm.center})


def m_aux_flag_kwarg_alternating(r):
    torch.manual_seed(0)
    m = MoENet(2)

    def loss_fn(mm, x, y, use_aux=True):
        loss = F.cross_entropy(mm(x), y)
        return loss + 0.01 * sum(moe.aux_loss for moe in mm.moes) if use_aux else loss

    step = r.step(m, loss_fn, sgd(m))
    for i, b in enumerate(batches(10)):
        loss = step(*b, use_aux=i % 2 == 0)
        r.snap(m, None, loss=loss, **keep_aux(i, m))


def l_state_dict_kept_each_step(r):
    torch.manual_seed(0)
    m = Centre(True)
    sds = []

    def keep(i, mm):
        sds.append(mm.state_dict())
        return {"sds": [dict(sd) for sd in sds]}

    train(r, m, ce, sgd(m), batches(), keep=keep)


def l_on_optimizer_step_resets_center(r):
    torch.manual_seed(0)
    m = Centre(False)
    kw = {}  # the plain arm resets after its own optimizer step, in the loop

    def reset():
        m.center = m.center * 0.5

    opt = sgd(m)
    if r.mode != "plain":
        kw["on_optimizer_step"] = reset
    step = r.step(m, ce, opt, accumulate=2, **kw)
    for i, b in enumerate(batches()):
        loss = step(*b)
        if r.mode == "plain" and i % 2 == 1:
            reset()
        r.snap(m, opt, loss=loss, c=m.center)


def _shared_encoder(r, acc_a=1, acc_b=1, heads=2, n=16, b_trains_encoder=False):
    # several heads share an encoder; each head's own step; some optimizers leave the encoder out
    torch.manual_seed(0)
    enc = nn.Sequential(nn.Linear(D, D), nn.Tanh())
    models = [nn.Sequential(enc, nn.Linear(D, C)) for _ in range(heads)]
    steps = []
    for k, m in enumerate(models):
        params = m.parameters() if k == 0 or b_trains_encoder else m[1].parameters()
        opt = torch.optim.SGD(params, lr=0.1, momentum=0.9, fused=True)
        steps.append(r.step(m, ce, opt, accumulate=acc_a if k == 0 else acc_b))
    order = [k for k in range(heads) for _ in range(acc_a if k == 0 else acc_b)]
    for i, b in enumerate(batches(n)):
        loss = steps[order[i % len(order)]](*b)
        r.snap(models[0], None, loss=loss, **{f"h{k}": m[1].weight for k, m in enumerate(models)})


def x_shared_encoder_a_acc2(r):
    _shared_encoder(r, acc_a=2)


def x_shared_encoder_b_acc2(r):
    _shared_encoder(r, acc_b=2)


def x_shared_encoder_three_heads(r):
    _shared_encoder(r, heads=3, n=18)


def x_shared_encoder_both_train_it(r):
    _shared_encoder(r, b_trains_encoder=True)


PATTERNS = {
    k: v
    for k, v in list(globals().items())
    if k[:2] in ("c_", "m_", "s_", "d_", "a_", "x_", "l_") and callable(v)
}


def main(names):
    rows = []
    for name in select(PATTERNS, names):
        row = (name, *run_pattern(name, PATTERNS[name], ROUND7))
        rows.append(row)
        print(f"{row[0]:38s} | {row[1]:22s} | {row[2]:3d} | {row[3]}", flush=True)
    print()
    print(len(rows), Counter(r[1] for r in rows))


if __name__ == "__main__":
    main(sys.argv[1:])
