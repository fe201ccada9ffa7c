"""Round 13 hostile patterns: realistic training recipes that change over a run (schedulers,
param groups, freezing, train/eval, accumulation, AMP, SWA/EMA, parametrizations, RNNs,
attention masks, mixup, curriculum, GANs, LBFGS, ...). Run:

  cd /work/main && OMP_NUM_THREADS=1 PYTHONPATH=/work/main timeout 1500 \
      .venv/bin/python scripts/hostile/round13/recipes.py [name-prefix ...]

The shared harness (scripts/hostile/harness.py, round 9's profile): each pattern runs the same
loop twice from one seed (eager, then replaykit, backend="emulated") and compares every
parameter, grad (None pattern), buffer, optimizer state and whatever the loop snaps, after every
step.
"""

from __future__ import annotations

import copy
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrizations as P
from torch.optim import lr_scheduler as LS

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from harness import run_pattern

import replaykit as rk

PATTERNS: dict[str, object] = {}
TIMEOUTS: dict[str, int] = {}
STEPS = 8


def pat(fn=None, *, timeout=120):
    def deco(f):
        PATTERNS[f.__name__] = f
        TIMEOUTS[f.__name__] = timeout
        return f

    return deco(fn) if fn is not None else deco


def seed(s=0):
    torch.manual_seed(s)
    np.random.seed(s)
    random.seed(s)


def data(s, *shapes):
    g = torch.Generator().manual_seed(s)
    return [torch.randn(*sh, generator=g) for sh in shapes]


def cls_batch(i, n=8, d=6, k=3):
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randn(n, d, generator=g), torch.randint(0, k, (n,), generator=g)


class MLP(nn.Module):
    def __init__(self, drop=0.0, bn=False, d=6, h=16, k=3):
        super().__init__()
        self.fc1 = nn.Linear(d, h)
        self.bn = nn.BatchNorm1d(h) if bn else nn.Identity()
        self.drop = nn.Dropout(drop)
        self.fc2 = nn.Linear(h, h)
        self.head = nn.Linear(h, k)

    def forward(self, x):
        h = self.drop(self.bn(self.fc1(x)).relu())
        return self.head(self.fc2(h).relu())


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.c2 = nn.Conv2d(8, 8, 3, padding=1)
        self.fc = nn.Linear(8, 3)

    def forward(self, x):
        h = self.bn(self.c1(x)).relu()
        h = self.c2(h).relu().mean((2, 3))
        return self.fc(h)


def ce(m, x, y):
    return F.cross_entropy(m(x), y)


def lrs(opt):
    return [g["lr"] for g in opt.param_groups]


def hyper(opt):
    out = []
    for g in opt.param_groups:
        out.append({k: v for k, v in g.items() if k != "params"})
    return out


def cap_loop(
    run,
    M,
    opt,
    *,
    steps=STEPS,
    batch=cls_batch,
    lossf=ce,
    pre=None,
    post=None,
    after=None,
    extra=(),
    wrap_kw=None,
):
    run.wrap(M, **(wrap_kw or {}))
    for i in range(steps):
        if pre:
            pre(i)
        x, y = batch(i)
        loss = lossf(M, x, y)
        loss.backward()
        if post:
            post(i)
        opt.step()
        opt.zero_grad()
        if after:
            after(i, loss.detach())
        run.snap([M, *extra], [opt], loss=loss.detach(), hp=hyper(opt))


def step_loop(
    run, M, opt, *, steps=STEPS, batch=cls_batch, lossf=ce, pre=None, after=None, extra=(), **kw
):
    step = run.step(M, lossf, opt, **kw)
    for i in range(steps):
        if pre:
            pre(i)
        x, y = batch(i)
        loss = step(x, y)
        if after:
            after(i, loss)
        run.snap([M, *extra], [opt], loss=loss, hp=hyper(opt))


def sgd(M, lr=0.1, **kw):
    kw.setdefault("momentum", 0.9)
    kw.setdefault("fused", True)
    return torch.optim.SGD(M.parameters(), lr=lr, **kw)


def adamw(M, lr=1e-2, **kw):
    return torch.optim.AdamW(M.parameters(), lr=lr, fused=True, capturable=True, **kw)


# ============================================================ LR schedules
@pat
def S_onecycle_sgd_float(run):
    seed()
    M = MLP()
    opt = sgd(M)
    sch = LS.OneCycleLR(opt, max_lr=0.2, total_steps=STEPS + 1)  # also cycles momentum
    step_loop(run, M, opt, after=lambda i, loss: sch.step())


@pat
def S_onecycle_sgd_tensor_lr(run):
    seed()
    M = MLP()
    opt = sgd(M, lr=torch.tensor(0.1))
    sch = LS.OneCycleLR(opt, max_lr=0.2, total_steps=STEPS + 1)
    step_loop(run, M, opt, after=lambda i, loss: sch.step())


@pat
def S_onecycle_adamw_tensor_lr(run):  # cycles betas (a float tuple) every step
    seed()
    M = MLP()
    opt = adamw(M, lr=torch.tensor(1e-2))
    sch = LS.OneCycleLR(opt, max_lr=2e-2, total_steps=STEPS + 1)
    step_loop(run, M, opt, after=lambda i, loss: sch.step())


@pat
def C_onecycle_adamw(run):
    seed()
    M = MLP(drop=0.1)
    opt = adamw(M)
    sch = LS.OneCycleLR(opt, max_lr=2e-2, total_steps=STEPS + 1)
    cap_loop(run, M, opt, after=lambda i, loss: sch.step())


@pat
def S_lambdalr_closure_state(run):
    seed()
    M = MLP()
    opt = sgd(M, lr=torch.tensor(0.1))
    cfg = {"warm": 3}
    sch = LS.LambdaLR(opt, lambda s: min(1.0, (s + 1) / cfg["warm"]))

    def after(i, loss):
        if i == 4:
            cfg["warm"] = 10  # re-warm
        sch.step()

    step_loop(run, M, opt, after=after)


@pat
def S_sequentiallr_tensor(run):
    seed()
    M = MLP()
    opt = adamw(M, lr=torch.tensor(1e-2))
    sch = LS.SequentialLR(
        opt,
        [LS.LinearLR(opt, 0.1, 1.0, total_iters=3), LS.CosineAnnealingLR(opt, T_max=5)],
        milestones=[3],
    )
    step_loop(run, M, opt, after=lambda i, loss: sch.step())


@pat
def C_plateau_float(run):
    seed()
    M = MLP()
    opt = torch.optim.SGD(M.parameters(), lr=0.5, momentum=0.9)
    sch = LS.ReduceLROnPlateau(opt, factor=0.5, patience=0, threshold=0.5)
    cap_loop(run, M, opt, after=lambda i, loss: sch.step(loss.item()))


@pat
def S_plateau_tensor_lr(run):
    seed()
    M = MLP()
    opt = sgd(M, lr=torch.tensor(0.5))
    sch = LS.ReduceLROnPlateau(opt, factor=0.5, patience=0, threshold=0.5)
    step_loop(run, M, opt, after=lambda i, loss: sch.step(loss))


@pat
def S_plateau_float(run):
    seed()
    M = MLP()
    opt = sgd(M, lr=0.5)
    sch = LS.ReduceLROnPlateau(opt, factor=0.5, patience=0, threshold=0.5)
    step_loop(run, M, opt, after=lambda i, loss: sch.step(float(loss)))


@pat
def S_warmup_by_hand_float(run):
    seed()
    M = MLP()
    opt = sgd(M, lr=0.0)

    def pre(i):
        for g in opt.param_groups:
            g["lr"] = 0.2 * min(1.0, (i + 1) / 4)

    step_loop(run, M, opt, pre=pre)


@pat
def S_warmup_by_hand_tensor_fill(run):
    seed()
    M = MLP()
    opt = adamw(M, lr=torch.tensor(0.0))

    def pre(i):
        for g in opt.param_groups:
            g["lr"].fill_(1e-2 * min(1.0, (i + 1) / 4))

    step_loop(run, M, opt, pre=pre)


@pat
def S_lr_tensor_rebound(run):  # a new tensor each step instead of fill_
    seed()
    M = MLP()
    opt = sgd(M, lr=torch.tensor(0.1))

    def pre(i):
        for g in opt.param_groups:
            g["lr"] = torch.tensor(0.1 / (1 + i))

    step_loop(run, M, opt, pre=pre)


@pat
def S_lr_tensor_then_float(run):
    seed()
    M = MLP()
    opt = sgd(M, lr=torch.tensor(0.1))

    def pre(i):
        if i == 4:
            opt.param_groups[0]["lr"] = 0.02

    step_loop(run, M, opt, pre=pre)


@pat
def S_lr_tensor_inplace_mul(run):  # g['lr'] *= 0.5 on a tensor lr: in place
    seed()
    M = MLP()
    opt = adamw(M, lr=torch.tensor(1e-2))

    def pre(i):
        if i in (3, 5):
            for g in opt.param_groups:
                g["lr"] *= 0.5

    step_loop(run, M, opt, pre=pre)


@pat
def S_cosine_restarts_adamw_float(run):
    seed()
    M = MLP()
    opt = adamw(M, lr=1e-2)
    sch = LS.CosineAnnealingWarmRestarts(opt, T_0=3)
    step_loop(run, M, opt, after=lambda i, loss: sch.step())


@pat
def S_layerwise_groups_multistep(run):
    seed()
    M = MLP()
    opt = torch.optim.SGD(
        [
            {"params": M.fc1.parameters(), "lr": torch.tensor(0.01)},
            {"params": [*M.fc2.parameters(), *M.head.parameters()]},
        ],
        lr=torch.tensor(0.1),
        momentum=0.9,
        fused=True,
    )
    sch = LS.MultiStepLR(opt, milestones=[2, 5], gamma=0.3)
    step_loop(run, M, opt, after=lambda i, loss: sch.step())


@pat
def C_tensor_lr_steplr(run):
    seed()
    M = MLP(bn=True)
    opt = sgd(M, lr=torch.tensor(0.1))
    sch = LS.StepLR(opt, 2, 0.5)
    cap_loop(run, M, opt, after=lambda i, loss: sch.step())


# ============================================================ other hyperparameters mid-run
@pat
def S_weight_decay_change_sgd(run):
    seed()
    M = MLP()
    opt = sgd(M)

    def pre(i):
        if i == 3:
            opt.param_groups[0]["weight_decay"] = 0.05

    step_loop(run, M, opt, pre=pre)


@pat
def S_weight_decay_change_adamw(run):
    seed()
    M = MLP()
    opt = adamw(M, lr=torch.tensor(1e-2), weight_decay=0.0)

    def pre(i):
        if i >= 3:
            opt.param_groups[0]["weight_decay"] = 0.01 * i

    step_loop(run, M, opt, pre=pre)


@pat
def S_momentum_change(run):
    seed()
    M = MLP()
    opt = sgd(M)

    def pre(i):
        if i == 4:
            opt.param_groups[0]["momentum"] = 0.5
            opt.param_groups[0]["nesterov"] = True

    step_loop(run, M, opt, pre=pre)


@pat
def S_adam_betas_tensor_fill(run):  # betas as tensors updated in place
    seed()
    M = MLP()
    opt = torch.optim.AdamW(
        M.parameters(),
        lr=torch.tensor(1e-2),
        betas=(torch.tensor(0.9), torch.tensor(0.99)),
        fused=True,
        capturable=True,
    )

    def pre(i):
        if i >= 3:
            opt.param_groups[0]["betas"][0].fill_(0.9 - 0.05 * i)

    step_loop(run, M, opt, pre=pre)


# ============================================================ param groups / freezing
@pat
def S_add_param_group(run):
    seed()
    M = MLP()
    M.head.requires_grad_(False)
    opt = torch.optim.SGD(
        [*M.fc1.parameters(), *M.fc2.parameters()], lr=0.1, momentum=0.9, fused=True
    )

    def pre(i):
        if i == 3:
            M.head.requires_grad_(True)
            opt.add_param_group({"params": M.head.parameters(), "lr": 0.01})

    step_loop(run, M, opt, pre=pre)


@pat
def C_add_param_group(run):
    seed()
    M = MLP()
    M.head.requires_grad_(False)
    opt = torch.optim.AdamW([*M.fc1.parameters(), *M.fc2.parameters()], lr=1e-2)

    def pre(i):
        if i == 3:
            M.head.requires_grad_(True)
            opt.add_param_group({"params": M.head.parameters(), "lr": 1e-3})

    cap_loop(run, M, opt, pre=pre)


@pat
def S_freeze_then_unfreeze(run):
    seed()
    M = MLP(bn=True)
    opt = sgd(M)

    def pre(i):
        if i == 2:
            M.fc1.requires_grad_(False)
            M.bn.requires_grad_(False)
        if i == 5:
            M.fc1.requires_grad_(True)
            M.bn.requires_grad_(True)

    step_loop(run, M, opt, pre=pre)


@pat
def C_freeze_then_unfreeze(run):
    seed()
    M = MLP(drop=0.2)
    opt = torch.optim.SGD(M.parameters(), lr=0.1, momentum=0.9)

    def pre(i):
        if i == 2:
            for p in M.fc2.parameters():
                p.requires_grad = False
        if i == 5:
            for p in M.fc2.parameters():
                p.requires_grad = True

    cap_loop(run, M, opt, pre=pre)


@pat
def S_freeze_head_zero_lr_group(run):  # freezing via a param group lr of 0 (tensor)
    seed()
    M = MLP()
    opt = torch.optim.AdamW(
        [
            {"params": M.head.parameters(), "lr": torch.tensor(1e-2)},
            {"params": [*M.fc1.parameters(), *M.fc2.parameters()], "lr": torch.tensor(1e-2)},
        ],
        fused=True,
        capturable=True,
    )

    def pre(i):
        opt.param_groups[1]["lr"].fill_(0.0 if i < 4 else 1e-2)

    step_loop(run, M, opt, pre=pre)


# ============================================================ train / eval / dropout
@pat
def S_train_eval_toggle(run):
    seed()
    M = MLP(drop=0.3, bn=True)
    opt = sgd(M)

    def pre(i):
        M.train(i not in (3, 4))

    step_loop(run, M, opt, pre=pre)


@pat
def C_validation_between_steps(run):
    seed()
    M = MLP(drop=0.3, bn=True)
    opt = sgd(M)
    vals = []

    def after(i, loss):
        M.eval()
        with torch.no_grad():
            vals.append(M(data(77, (4, 6))[0]))
        M.train()

    cap_loop(run, M, opt, after=after)
    run.snap([M], [opt], vals=vals)


@pat
def C_eval_forward_with_grad(run):  # eval() but grads still computed (finetune frozen BN)
    seed()
    M = MLP(drop=0.3, bn=True)
    opt = sgd(M)

    def pre(i):
        if i >= 3:
            M.eval()

    cap_loop(run, M, opt, pre=pre)


@pat
def S_dropout_p_change(run):
    seed()
    M = MLP(drop=0.1)
    opt = sgd(M)

    def pre(i):
        if i in (3, 6):
            M.drop.p = 0.1 + 0.1 * i

    step_loop(run, M, opt, pre=pre)


class FDrop(MLP):
    def __init__(self):
        super().__init__()
        self.p = 0.1

    def forward(self, x):
        h = F.dropout(self.fc1(x).relu(), self.p, self.training)
        return self.head(self.fc2(h).relu())


@pat
def C_functional_dropout_p_schedule(run):
    seed()
    M = FDrop()
    opt = sgd(M)

    def pre(i):
        M.p = 0.05 * i

    cap_loop(run, M, opt, pre=pre)


@pat
def S_bn_momentum_and_reset(run):
    seed()
    M = MLP(bn=True)
    opt = sgd(M)

    def pre(i):
        if i == 3:
            M.bn.momentum = 0.01
        if i == 5:
            M.bn.reset_running_stats()

    step_loop(run, M, opt, pre=pre)


# ============================================================ clipping, accumulation, zero_grad
@pat
def C_clip_norm_and_value_changing(run):
    seed()
    M = MLP()
    opt = sgd(M)
    norms = []

    def post(i):
        norms.append(nn.utils.clip_grad_norm_(M.parameters(), 1.0 / (1 + i)))
        nn.utils.clip_grad_value_(M.parameters(), 0.05 + 0.01 * i)

    cap_loop(run, M, opt, post=post)
    run.snap([M], [opt], norms=norms)


@pat
def S_max_norm_accumulate3(run):
    seed()
    M = MLP(drop=0.1)
    opt = sgd(M)
    step_loop(run, M, opt, steps=9, max_norm=0.5, accumulate=3)


@pat
def C_accum_varying(run):
    seed()
    M = MLP(bn=True)
    opt = sgd(M)
    run.wrap(M)
    k = 0
    for _i, acc in enumerate([1, 2, 3, 1, 2, 4]):
        for _j in range(acc):
            x, y = cls_batch(k)
            k += 1
            loss = ce(M, x, y) / acc
            loss.backward()
            run.snap([M], [opt], loss=loss.detach())
        opt.step()
        opt.zero_grad()
        run.snap([M], [opt])


@pat
def C_zero_grad_keep(run):
    seed()
    M = MLP()
    opt = torch.optim.SGD(M.parameters(), lr=0.1, momentum=0.9)
    run.wrap(M)
    for i in range(STEPS):
        x, y = cls_batch(i)
        loss = ce(M, x, y)
        loss.backward()
        if i % 2 == 1:
            opt.step()
            opt.zero_grad(set_to_none=False)
        run.snap([M], [opt], loss=loss.detach())


@pat
def S_accumulate_rebuilt_bigger(run):  # progressive batch: a new TrainStep with accumulate=4
    seed()
    M = MLP()
    opt = sgd(M)
    a = run.step(M, ce, opt, accumulate=2)
    b = run.step(M, ce, opt, accumulate=4)
    for i in range(12):
        x, y = cls_batch(i)
        loss = (a if i < 4 else b)(x, y)
        run.snap([M], [opt], loss=loss)


# ============================================================ batch shape / layout / dtype
def ragged(i):
    n = 5 if i % 3 == 2 else 8
    return cls_batch(i, n=n)


@pat
def S_last_batch_smaller(run):
    seed()
    M = MLP(bn=True, drop=0.1)
    opt = sgd(M)
    step_loop(run, M, opt, batch=ragged)


@pat
def C_last_batch_smaller(run):
    seed()
    M = MLP(bn=True, drop=0.1)
    opt = sgd(M)
    cap_loop(run, M, opt, batch=ragged)


def img_batch(i, n=4, cl=False):
    g = torch.Generator().manual_seed(2000 + i)
    x = torch.randn(n, 3, 6, 6, generator=g)
    if cl:
        x = x.contiguous(memory_format=torch.channels_last)
    return x, torch.randint(0, 3, (n,), generator=g)


@pat
def C_channels_last_switch(run):
    seed()
    M = CNN()
    opt = sgd(M)

    def pre(i):
        if i == 3:
            M.to(memory_format=torch.channels_last)

    cap_loop(run, M, opt, pre=pre, batch=lambda i: img_batch(i, cl=i >= 3))


@pat
def S_channels_last_inputs_alternate(run):
    seed()
    M = CNN()
    opt = sgd(M)
    step_loop(run, M, opt, batch=lambda i: img_batch(i, cl=i % 2 == 1))


@pat
def C_double_phase(run):  # precision phase: model.double() mid-run, inputs follow
    seed()
    M = MLP()
    opt = torch.optim.SGD(M.parameters(), lr=0.1)

    def pre(i):
        if i == 3:
            M.double()

    cap_loop(
        run,
        M,
        opt,
        pre=pre,
        batch=lambda i: (lambda x, y: (x.double() if i >= 3 else x, y))(*cls_batch(i)),
    )


# ============================================================ SWA / EMA
@pat
def C_swa(run):
    seed()
    M = MLP(bn=True)
    opt = torch.optim.SGD(M.parameters(), lr=0.1, momentum=0.9)
    swa = torch.optim.swa_utils.AveragedModel(M)
    swa_sched = torch.optim.swa_utils.SWALR(opt, swa_lr=0.05, anneal_epochs=2)

    def after(i, loss):
        if i >= 3:
            swa.update_parameters(M)
            swa_sched.step()

    cap_loop(run, M, opt, after=after, extra=[swa])
    torch.optim.swa_utils.update_bn([cls_batch(50 + k)[0] for k in range(3)], swa)
    run.snap([M, swa], [opt])


@pat
def S_swa_ema(run):
    seed()
    M = MLP(bn=True)
    opt = sgd(M, lr=torch.tensor(0.1))
    swa = torch.optim.swa_utils.AveragedModel(
        M, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9), use_buffers=True
    )
    swa_sched = torch.optim.swa_utils.SWALR(opt, swa_lr=0.05, anneal_epochs=2)

    def after(i, loss):
        swa.update_parameters(M)
        if i >= 3:
            swa_sched.step()

    step_loop(run, M, opt, after=after, extra=[swa])


@pat
def S_ema_by_hand(run):
    seed()
    M = MLP(drop=0.1)
    opt = adamw(M)
    ema = copy.deepcopy(M).requires_grad_(False)

    def after(i, loss):
        d = min(0.99, (1 + i) / (10 + i))
        with torch.no_grad():
            for e, p in zip(ema.parameters(), M.parameters(), strict=False):
                e.mul_(d).add_(p, alpha=1 - d)

    step_loop(run, M, opt, after=after, extra=[ema])


@pat
def S_rk_ema_decay_change(run):
    seed()
    M = MLP()
    opt = sgd(M)
    ema = rk.EMA(M, 0.9)

    def pre(i):
        if i == 4:
            ema.set_decay(0.5)

    step_loop(run, M, opt, pre=pre, ema=ema)
    run.snap([M], [opt], ema=list(ema.params))


@pat
def S_ema_teacher_in_loss(run):  # mean-teacher consistency: EMA model read by loss_fn
    seed()
    M = MLP(drop=0.2)
    opt = sgd(M)
    T = copy.deepcopy(M).requires_grad_(False)

    def lf(m, x, y):
        out = m(x)
        with torch.no_grad():
            t = T(x + 0.05)
        return F.cross_entropy(out, y) + 0.5 * F.mse_loss(out.softmax(-1), t.softmax(-1))

    def after(i, loss):
        with torch.no_grad():
            for e, p in zip(T.parameters(), M.parameters(), strict=False):
                e.lerp_(p, 0.2)

    step_loop(run, M, opt, lossf=lf, after=after, extra=[T])


# ============================================================ parametrizations, checkpoint
@pat
def C_weight_norm(run):
    seed()
    M = MLP()
    P.weight_norm(M.fc2)
    opt = sgd(M)
    cap_loop(run, M, opt)


@pat
def S_spectral_norm(run):
    seed()
    M = MLP()
    P.spectral_norm(M.fc2)
    opt = sgd(M)
    step_loop(run, M, opt)


@pat
def S_spectral_norm_eval_toggle(run):
    seed()
    M = MLP()
    P.spectral_norm(M.fc2, n_power_iterations=2)
    opt = adamw(M)
    step_loop(run, M, opt, pre=lambda i: M.train(i % 3 != 2))


@pat
def C_orthogonal(run):
    seed()
    M = MLP()
    P.orthogonal(M.fc2)
    opt = torch.optim.SGD(M.parameters(), lr=0.05)
    cap_loop(run, M, opt)


@pat
def C_parametrization_cached(run):  # parametrize.cached() around the step
    from torch.nn.utils import parametrize

    seed()
    M = MLP()
    P.weight_norm(M.fc1)
    opt = sgd(M)
    run.wrap(M)
    for i in range(STEPS):
        x, y = cls_batch(i)
        with parametrize.cached():
            loss = ce(M, x, y)
            loss.backward()
        opt.step()
        opt.zero_grad()
        run.snap([M], [opt], loss=loss.detach())


class Ckpt(MLP):
    def __init__(self, reentrant):
        super().__init__(drop=0.3)
        self.reentrant = reentrant

    def block(self, x):
        return self.drop(self.fc1(x).relu())

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        h = checkpoint(self.block, x, use_reentrant=self.reentrant)
        return self.head(self.fc2(h).relu())


@pat
def C_checkpoint_dropout(run):
    seed()
    M = Ckpt(False)
    opt = sgd(M)
    cap_loop(run, M, opt)


@pat
def S_checkpoint_dropout_reentrant(run):
    seed()
    M = Ckpt(True)
    opt = sgd(M)
    step_loop(run, M, opt)


@pat
def S_checkpoint_toggle(run):  # gradient checkpointing turned on mid-run (memory pressure)
    seed()
    M = Ckpt(False)
    opt = sgd(M)

    def pre(i):
        if i == 4:
            M.reentrant = True

    step_loop(run, M, opt, pre=pre)


# ============================================================ attention / sequence models
class Enc(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 16, padding_idx=0)
        self.layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.1, batch_first=True)
        self.head = nn.Linear(16, 3)

    def forward(self, ids, pad, causal=None):
        h = self.layer(self.emb(ids), src_mask=causal, src_key_padding_mask=pad)
        h = h.masked_fill(pad[..., None], 0.0).sum(1)
        return self.head(h)


def seq_batch(i, n=4, T=7):
    g = torch.Generator().manual_seed(3000 + i)
    lens = torch.randint(2, T + 1, (n,), generator=g)
    lens[0] = T
    ids = torch.randint(1, 20, (n, T), generator=g)
    pad = torch.arange(T)[None] >= lens[:, None]
    ids = ids.masked_fill(pad, 0)
    return ids, pad, lens, torch.randint(0, 3, (n,), generator=g)


@pat
def S_transformer_padding_mask_changes(run):
    seed()
    M = Enc()
    opt = adamw(M)
    step = run.step(M, lambda m, ids, pad, y: F.cross_entropy(m(ids, pad), y), opt)
    for i in range(STEPS):
        ids, pad, _, y = seq_batch(i)
        loss = step(ids, pad, y)
        run.snap([M], [opt], loss=loss)


@pat
def C_transformer_causal_and_pad(run):
    seed()
    M = Enc()
    opt = sgd(M)
    run.wrap(M)
    for i in range(STEPS):
        ids, pad, _, y = seq_batch(i, T=5 + i % 3)
        T = ids.shape[1]
        causal = nn.Transformer.generate_square_subsequent_mask(T)
        loss = F.cross_entropy(M(ids, pad, causal), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        run.snap([M], [opt], loss=loss.detach())


@pat
def C_transformer_train_then_eval_fastpath(run):  # eval+no_grad hits the fused fast path
    seed()
    M = Enc()
    opt = sgd(M)
    run.wrap(M)
    outs = []
    for i in range(STEPS):
        ids, pad, _, y = seq_batch(i)
        loss = F.cross_entropy(M(ids, pad), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if i % 3 == 2:
            M.eval()
            with torch.inference_mode():
                outs.append(M(ids, pad).clone())
            M.train()
        run.snap([M], [opt], loss=loss.detach())
    run.snap([M], [opt], outs=outs)


class MHA(nn.Module):
    def __init__(self):
        super().__init__()
        self.att = nn.MultiheadAttention(8, 2, dropout=0.1, batch_first=True)
        self.out = nn.Linear(8, 1)

    def forward(self, x, kpm):
        a, w = self.att(x, x, x, key_padding_mask=kpm, need_weights=True)
        self.last_w = w.detach()
        return self.out(a).mean()


@pat
def S_mha_weights_kept_mask_changes(run):
    seed()
    M = MHA()
    opt = sgd(M)
    step = run.step(M, lambda m, x, k: m(x, k) ** 2, opt)
    ws = []
    for i in range(STEPS):
        _, pad, _, _ = seq_batch(i, T=6)
        (x,) = data(4000 + i, (4, 6, 8))
        loss = step(x, pad)
        ws.append(M.last_w.clone())
        run.snap([M], [opt], loss=loss, w=ws[-1])


class GRUNet(nn.Module):
    def __init__(self, kind="gru", layers=1, drop=0.0):
        super().__init__()
        self.emb = nn.Embedding(20, 8, padding_idx=0)
        self.rnn = (nn.GRU if kind == "gru" else nn.LSTM)(
            8, 12, num_layers=layers, dropout=drop, batch_first=True
        )
        self.head = nn.Linear(12, 3)

    def forward(self, ids, lens):
        packed = nn.utils.rnn.pack_padded_sequence(
            self.emb(ids), lens, batch_first=True, enforce_sorted=False
        )
        _out, h = self.rnn(packed)
        if isinstance(h, tuple):
            h = h[0]
        return self.head(h[-1])


@pat
def C_gru_packed_varying_lengths(run):
    seed()
    M = GRUNet()
    opt = sgd(M)
    run.wrap(M)
    for i in range(STEPS):
        ids, _, lens, y = seq_batch(i)
        loss = F.cross_entropy(M(ids, lens), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        run.snap([M], [opt], loss=loss.detach())


@pat
def S_lstm_packed_dropout(run):
    seed()
    M = GRUNet("lstm", 2, 0.2)
    opt = adamw(M)
    step = run.step(M, lambda m, ids, lens, y: F.cross_entropy(m(ids, lens), y), opt, max_norm=1.0)
    for i in range(STEPS):
        ids, _, lens, y = seq_batch(i)
        loss = step(ids, lens, y)
        run.snap([M], [opt], loss=loss)


@pat
def C_lstm_tbptt_detached_state(run):  # truncated BPTT: hidden state carried, detached
    seed()
    rnn = nn.LSTM(4, 8, batch_first=True)
    head = nn.Linear(8, 1)
    M = nn.ModuleDict({"rnn": rnn, "head": head})

    class Wrap(nn.Module):
        def __init__(self):
            super().__init__()
            self.m = M

        def forward(self, x, h, c):
            o, (h, c) = self.m["rnn"](x, (h, c))
            return self.m["head"](o), h, c

    W = Wrap()
    opt = sgd(W)
    run.wrap(W)
    h = torch.zeros(1, 3, 8)
    c = torch.zeros(1, 3, 8)
    for i in range(STEPS):
        (x, y) = data(5000 + i, (3, 5, 4), (3, 5, 1))
        out, h, c = W(x, h, c)
        loss = F.mse_loss(out, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        h, c = h.detach(), c.detach()
        run.snap([W], [opt], loss=loss.detach(), h=h, c=c)


# ============================================================ loss recipes
@pat
def S_label_smoothing_change(run):
    seed()
    M = MLP()
    opt = sgd(M)
    crit = nn.CrossEntropyLoss(label_smoothing=0.0)

    def pre(i):
        if i == 3:
            crit.label_smoothing = 0.1

    step_loop(run, M, opt, lossf=lambda m, x, y: crit(m(x), y), pre=pre)


@pat
def S_mixup_torch_beta(run):
    seed()
    M = MLP()
    opt = sgd(M)
    beta = torch.distributions.Beta(torch.tensor(0.4), torch.tensor(0.4))

    def lf(m, x, y):
        lam = beta.sample()
        perm = torch.randperm(x.shape[0])
        out = m(lam * x + (1 - lam) * x[perm])
        return lam * F.cross_entropy(out, y) + (1 - lam) * F.cross_entropy(out, y[perm])

    step_loop(run, M, opt, lossf=lf)


@pat
def S_mixup_numpy(run):
    seed()
    M = MLP()
    opt = sgd(M)

    def lf(m, x, y):
        lam = float(np.random.beta(0.4, 0.4))
        perm = torch.randperm(x.shape[0])
        out = m(lam * x + (1 - lam) * x[perm])
        return lam * F.cross_entropy(out, y) + (1 - lam) * F.cross_entropy(out, y[perm])

    step_loop(run, M, opt, lossf=lf)


@pat
def C_mixup_random_in_loop(run):
    seed()
    M = MLP(bn=True)
    opt = sgd(M)

    def lf(m, x, y):
        lam = random.betavariate(0.4, 0.4)
        perm = torch.randperm(x.shape[0])
        out = m(lam * x + (1 - lam) * x[perm])
        return lam * F.cross_entropy(out, y) + (1 - lam) * F.cross_entropy(out, y[perm])

    cap_loop(run, M, opt, lossf=lf)


@pat
def S_mixup_random_gate_torch_lam(run):  # documented to replay: random.random() < p
    seed()
    M = MLP()
    opt = sgd(M)

    def lf(m, x, y):
        if random.random() < 0.5:
            lam = torch.rand(()) * 0.5 + 0.5
            perm = torch.randperm(x.shape[0])
            out = m(lam * x + (1 - lam) * x[perm])
            return lam * F.cross_entropy(out, y) + (1 - lam) * F.cross_entropy(out, y[perm])
        return ce(m, x, y)

    step_loop(run, M, opt, lossf=lf, steps=10)


@pat
def S_cutmix_numpy_box(run):
    seed()
    M = CNN()
    opt = sgd(M)

    def lf(m, x, y):
        cut = np.random.randint(1, 5)
        cx, cy = np.random.randint(0, 6 - cut, size=2)
        perm = torch.randperm(x.shape[0])
        x2 = x.clone()
        x2[:, :, cy : cy + cut, cx : cx + cut] = x[perm, :, cy : cy + cut, cx : cx + cut]
        lam = 1 - cut * cut / 36
        out = m(x2)
        return lam * F.cross_entropy(out, y) + (1 - lam) * F.cross_entropy(out, y[perm])

    step_loop(run, M, opt, lossf=lf, batch=img_batch)


@pat
def S_curriculum_closure_dict(run):
    seed()
    M = MLP()
    opt = sgd(M)
    state = {"step": 0}

    def lf(m, x, y):
        out = m(x)
        w = min(1.0, state["step"] / 4)
        return F.cross_entropy(out, y) + w * out.pow(2).mean()

    def after(i, loss):
        state["step"] += 1

    step_loop(run, M, opt, lossf=lf, after=after)


def make_curriculum():
    k = 0

    def weight():
        return min(1.0, k / 4)

    def tick():
        nonlocal k
        k += 1

    return weight, tick


@pat
def S_curriculum_nonlocal_helper(run):
    seed()
    M = MLP()
    opt = sgd(M)
    weight, tick = make_curriculum()

    def lf(m, x, y):
        out = m(x)
        return F.cross_entropy(out, y) + weight() * out.pow(2).mean()

    step_loop(run, M, opt, lossf=lf, after=lambda i, loss: tick())


class Sched:
    def __init__(self):
        self.t = 0

    def w(self):
        return min(1.0, self.t / 4)


@pat
def S_curriculum_object_method(run):
    seed()
    M = MLP()
    opt = sgd(M)
    sc = Sched()

    def lf(m, x, y):
        out = m(x)
        return F.cross_entropy(out, y) + sc.w() * out.pow(2).mean()

    def after(i, loss):
        sc.t += 1

    step_loop(run, M, opt, lossf=lf, after=after)


@pat
def C_curriculum_model_attr(run):
    class Cur(MLP):
        def forward(self, x):
            return super().forward(x) * (1 + self.progress)

    seed()
    M = Cur()
    M.progress = 0.0
    opt = sgd(M)

    def pre(i):
        M.progress = i / STEPS

    cap_loop(run, M, opt, pre=pre)


@pat
def S_curriculum_model_attr_in_loss(run):
    seed()
    M = MLP()
    M.epoch = 0
    opt = sgd(M)

    def lf(m, x, y):
        out = m(x)
        return F.cross_entropy(out, y) + (0.1 * m.epoch) * out.pow(2).mean()

    def pre(i):
        M.epoch = i // 2

    step_loop(run, M, opt, lossf=lf, pre=pre)


@pat
def S_curriculum_tensor_weight_fill(run):  # a weight tensor held by the closure, filled in place
    seed()
    M = MLP()
    opt = sgd(M)
    w = torch.tensor(0.0)

    def lf(m, x, y):
        out = m(x)
        return F.cross_entropy(out, y) + w * out.pow(2).mean()

    step_loop(run, M, opt, lossf=lf, pre=lambda i: w.fill_(min(1.0, i / 4)))


@pat
def S_curriculum_seq_len(run):  # seq length grows with a counter (shape buckets)
    seed()
    M = Enc()
    opt = adamw(M)
    step = run.step(M, lambda m, ids, pad, y: F.cross_entropy(m(ids, pad), y), opt)
    for i in range(10):
        ids, pad, _, y = seq_batch(i, T=3 + min(i, 6))
        loss = step(ids, pad, y)
        run.snap([M], [opt], loss=loss)


@pat
def S_loss_counter_in_lossfn(run):  # the loss_fn keeps its own step count (documented retire)
    seed()
    M = MLP()
    opt = sgd(M)
    st = {"n": 0}

    def lf(m, x, y):
        st["n"] += 1
        out = m(x)
        return F.cross_entropy(out, y) * (1.0 + 0.1 * st["n"])

    step_loop(run, M, opt, lossf=lf)
    run.snap([M], [opt], n=st["n"])


@pat
def S_focal_gamma_schedule(run):  # criterion object with a float the loop anneals
    class Focal(nn.Module):
        def __init__(self):
            super().__init__()
            self.gamma = 0.0

        def forward(self, logits, y):
            lp = F.log_softmax(logits, -1).gather(1, y[:, None]).squeeze(1)
            return (-((1 - lp.exp()) ** self.gamma) * lp).mean()

    seed()
    M = MLP()
    opt = sgd(M)
    crit = Focal()
    step_loop(
        run,
        M,
        opt,
        lossf=lambda m, x, y: crit(m(x), y),
        pre=lambda i: setattr(crit, "gamma", 0.5 * (i // 2)),
    )


# ============================================================ gradient penalty, GAN, LBFGS
@pat
def S_gradient_penalty_create_graph(run):
    seed()
    M = MLP()
    opt = adamw(M)

    def lf(m, x, y):
        x = x.requires_grad_(True)
        out = m(x)
        (g,) = torch.autograd.grad(out.sum(), x, create_graph=True)
        return F.cross_entropy(out, y) + 0.1 * g.pow(2).sum(1).mean()

    step_loop(run, M, opt, lossf=lf)


@pat
def C_gradient_penalty_paused(run):  # the documented way: rec.paused() for create_graph
    seed()
    M = MLP()
    opt = sgd(M)
    run.wrap(M)
    rec = rk.recorder_of(M) if run.rk else None
    for i in range(STEPS):
        x, y = cls_batch(i)
        if i % 2 == 0:
            import contextlib

            with rec.paused() if rec else contextlib.nullcontext():
                x = x.requires_grad_(True)
                out = M(x)
                (g,) = torch.autograd.grad(out.sum(), x, create_graph=True)
                loss = F.cross_entropy(out, y) + 0.1 * g.pow(2).sum(1).mean()
                loss.backward()
        else:
            loss = ce(M, x, y)
            loss.backward()
        opt.step()
        opt.zero_grad()
        run.snap([M], [opt], loss=loss.detach())


class G(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 6))

    def forward(self, z):
        return self.net(z)


class D(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(6, 16), nn.LeakyReLU(0.2), nn.Dropout(0.1), nn.Linear(16, 1)
        )

    def forward(self, x):
        return self.net(x)


@pat
def C_gan_two_optimizers(run):
    seed()
    g, d = G(), D()
    og = torch.optim.Adam(g.parameters(), lr=1e-3, betas=(0.5, 0.999))
    od = torch.optim.Adam(d.parameters(), lr=1e-3, betas=(0.5, 0.999))
    run.wrap(g)
    run.wrap(d)
    for i in range(STEPS):
        (real, z) = data(6000 + i, (8, 6), (8, 4))
        fake = g(z)
        ld = F.softplus(-d(real)).mean() + F.softplus(d(fake.detach())).mean()
        od.zero_grad()
        ld.backward()
        od.step()
        lg = F.softplus(-d(fake)).mean()
        og.zero_grad()
        lg.backward()
        og.step()
        run.snap([g, d], [og, od], ld=ld.detach(), lg=lg.detach())


@pat
def S_gan_two_trainsteps(run):
    seed()
    g, d = G(), D()
    og = torch.optim.AdamW(g.parameters(), lr=1e-3, betas=(0.5, 0.999), fused=True, capturable=True)
    od = torch.optim.AdamW(d.parameters(), lr=1e-3, betas=(0.5, 0.999), fused=True, capturable=True)

    def dl(dm, real, z):
        with torch.no_grad():
            fake = g(z)
        return F.softplus(-dm(real)).mean() + F.softplus(dm(fake)).mean()

    def gl(gm, z):
        return F.softplus(-d(gm(z))).mean()

    sd, sg = run.step(d, dl, od), run.step(g, gl, og)
    for i in range(STEPS):
        (real, z) = data(6000 + i, (8, 6), (8, 4))
        ld = sd(real, z)
        lg = sg(z)  # leaves gradients in d (eager does too); next D step accumulates on them
        run.snap([g, d], [og, od], ld=ld, lg=lg)


@pat
def S_gan_trainsteps_zero_d(run):  # as above but d's grads cleared by hand after the G step
    seed()
    g, d = G(), D()
    og = torch.optim.SGD(g.parameters(), lr=1e-2, momentum=0.5, fused=True)
    od = torch.optim.SGD(d.parameters(), lr=1e-2, momentum=0.5, fused=True)

    def dl(dm, real, z):
        return F.softplus(-dm(real)).mean() + F.softplus(dm(g(z).detach())).mean()

    def gl(gm, z):
        return F.softplus(-d(gm(z))).mean()

    sd, sg = run.step(d, dl, od), run.step(g, gl, og)
    for i in range(STEPS):
        (real, z) = data(6000 + i, (8, 6), (8, 4))
        ld = sd(real, z)
        lg = sg(z)
        od.zero_grad()
        run.snap([g, d], [og, od], ld=ld, lg=lg)


@pat
def C_lbfgs_closure(run):
    seed()
    M = MLP()
    opt = torch.optim.LBFGS(M.parameters(), lr=0.5, max_iter=4, history_size=5)
    run.wrap(M)
    for i in range(4):
        x, y = cls_batch(i)

        def closure():
            opt.zero_grad()
            loss = ce(M, x, y)  # noqa: B023 (called by opt.step in this iteration)
            loss.backward()
            return loss

        loss = opt.step(closure)
        run.snap([M], [opt], loss=loss.detach())


# ============================================================ AMP
@pat
def S_bf16_mixed(run):
    seed()
    M = MLP(bn=True, drop=0.1)
    opt = adamw(M)
    step_loop(run, M, opt, precision="bf16-mixed", max_norm=1.0)


@pat
def C_autocast_scaler_disabled(run):
    seed()
    M = MLP(drop=0.1)
    opt = torch.optim.AdamW(M.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    run.wrap(M)
    for i in range(STEPS):
        x, y = cls_batch(i)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = ce(M, x, y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        nn.utils.clip_grad_norm_(M.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        run.snap([M], [opt], loss=loss.detach())


@pat
def C_autocast_switched_off_midrun(run):  # bf16 instabilities: fall back to fp32 at step 4
    seed()
    M = CNN()
    opt = sgd(M)
    run.wrap(M)
    for i in range(STEPS):
        x, y = img_batch(i)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=i < 4):
            loss = ce(M, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        run.snap([M], [opt], loss=loss.detach())


@pat
def S_scaler_fused_sgd(run):
    seed()
    M = MLP()
    opt = sgd(M)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2)
    if run.rk:
        step = rk.TrainStep(M, ce, opt, scaler=scaler, backend="emulated")
        run.entries.append(step)
    else:

        def step(x, y):
            loss = ce(M, x, y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            return loss.detach()

    for i in range(STEPS):
        x, y = cls_batch(i)
        loss = step(x, y)
        run.snap([M], [opt], loss=loss, scale=scaler.get_scale())


# ============================================================ checkpoint resume / optimizer swap
@pat
def S_rewind_from_checkpoint(run):  # loss spike: reload model+opt saved at step 2
    seed()
    M = MLP(bn=True)
    opt = adamw(M, lr=torch.tensor(1e-2))
    ck = {}

    def after(i, loss):
        if i == 2:
            ck["m"] = copy.deepcopy(M.state_dict())
            ck["o"] = copy.deepcopy(opt.state_dict())
        if i == 4:
            M.load_state_dict(ck["m"])
            opt.load_state_dict(ck["o"])
            opt.param_groups[0]["lr"].fill_(5e-3)

    step_loop(run, M, opt, after=after)


@pat
def C_rewind_from_checkpoint(run):
    seed()
    M = MLP(bn=True)
    opt = torch.optim.SGD(M.parameters(), lr=0.1, momentum=0.9)
    ck = {}

    def after(i, loss):
        if i == 2:
            ck["m"] = copy.deepcopy(M.state_dict())
            ck["o"] = copy.deepcopy(opt.state_dict())
        if i == 4:
            M.load_state_dict(ck["m"])
            opt.load_state_dict(ck["o"])

    cap_loop(run, M, opt, after=after)


@pat
def S_optimizer_phase_switch(run):  # Adam for warm-up, SGD afterwards: a new TrainStep
    seed()
    M = MLP()
    o1 = adamw(M)
    o2 = torch.optim.SGD(M.parameters(), lr=torch.tensor(0.05), momentum=0.9, fused=True)
    a = run.step(M, ce, o1)
    b = run.step(M, ce, o2)
    for i in range(STEPS):
        x, y = cls_batch(i)
        loss = (a if i < 4 else b)(x, y)
        run.snap([M], [o1, o2], loss=loss)


@pat
def S_model_reinit_head(run):  # re-initialise the head mid-run (reset_parameters in place)
    seed()
    M = MLP()
    opt = sgd(M)

    def pre(i):
        if i == 4:
            torch.manual_seed(99)
            M.head.reset_parameters()
            opt.state.clear()

    step_loop(run, M, opt, pre=pre)


@pat
def C_new_head_replaced(run):  # new task head module assigned, optimizer rebuilt
    seed()
    M = MLP()
    opts = [torch.optim.SGD(M.parameters(), lr=0.1)]
    run.wrap(M)
    for i in range(STEPS):
        if i == 4:
            torch.manual_seed(5)
            M.head = nn.Linear(16, 3)
            opts[0] = torch.optim.SGD(M.parameters(), lr=0.05)
        x, y = cls_batch(i)
        loss = ce(M, x, y)
        loss.backward()
        opts[0].step()
        opts[0].zero_grad()
        run.snap([M], opts, loss=loss.detach())


# ============================================================ misc layers
class EmbMax(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 8, max_norm=1.0)
        self.head = nn.Linear(8, 3)

    def forward(self, ids):
        return self.head(self.emb(ids).mean(1))


@pat
def C_embedding_max_norm(run):
    seed()
    M = EmbMax()
    opt = sgd(M)
    cap_loop(run, M, opt, batch=lambda i: (seq_batch(i)[0], seq_batch(i)[3]))


@pat
def S_embedding_max_norm(run):
    seed()
    M = EmbMax()
    opt = sgd(M)
    step_loop(run, M, opt, batch=lambda i: (seq_batch(i)[0], seq_batch(i)[3]))


class StochDepth(MLP):
    def __init__(self):
        super().__init__()
        self.p = 0.5

    def forward(self, x):
        h = self.fc1(x).relu()
        if self.training:
            keep = torch.empty(x.shape[0], 1).bernoulli_(1 - self.p) / (1 - self.p)
            h = h + self.fc2(h).relu() * keep
        else:
            h = h + self.fc2(h).relu()
        return self.head(h)


@pat
def S_stochastic_depth_p_schedule(run):
    seed()
    M = StochDepth()
    opt = sgd(M)
    step_loop(run, M, opt, pre=lambda i: setattr(M, "p", 0.1 + 0.05 * (i // 3)))


@pat
def C_bn_momentum_none(run):  # cumulative BN: documented to stay eager
    seed()
    M = MLP(bn=True)
    M.bn.momentum = None
    opt = sgd(M)
    cap_loop(run, M, opt)


@pat
def C_sparse_embedding_sgd(run):
    class SE(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(20, 8, sparse=True)
            self.head = nn.Linear(8, 3)

        def forward(self, ids):
            return self.head(self.emb(ids).mean(1))

    seed()
    M = SE()
    opt = torch.optim.SGD(M.parameters(), lr=0.1)
    cap_loop(run, M, opt, batch=lambda i: (seq_batch(i)[0], seq_batch(i)[3]))


# ============================================================ round B: more hostile recipes
@pat
def S_lbfgs_closure(run):  # LBFGS via TrainStep: documented ReplayError
    seed()
    M = MLP()
    opt = torch.optim.LBFGS(M.parameters(), lr=0.5, max_iter=2)
    if run.rk:
        step = run.step(M, ce, opt)
    else:

        def step(x, y):
            def closure():
                opt.zero_grad()
                loss = ce(M, x, y)
                loss.backward()
                return loss

            return opt.step(closure).detach()

    for i in range(3):
        x, y = cls_batch(i)
        run.snap([M], [opt], loss=step(x, y))


@pat
def S_params_list_extend_unfreeze(run):  # unfreeze by extending the group's params list
    seed()
    M = MLP()
    M.head.requires_grad_(False)
    opt = torch.optim.SGD([*M.fc1.parameters(), *M.fc2.parameters()], lr=0.1, momentum=0.9)

    def pre(i):
        if i == 3:
            M.head.requires_grad_(True)
            opt.param_groups[0]["params"].extend(M.head.parameters())

    step_loop(run, M, opt, pre=pre)


def mom_state(M, opt):
    return [opt.state.get(p, {}).get("momentum_buffer") for p in M.parameters()]


@pat
def S_params_list_filtered(run):  # stop updating fc1 by dropping it from the optimizer
    seed()
    M = MLP()
    opt = sgd(M, fused=False)
    step = run.step(M, ce, opt)
    for i in range(STEPS):
        if i == 3:
            g = opt.param_groups[0]
            drop = {id(p) for p in M.fc1.parameters()}
            g["params"] = [p for p in g["params"] if id(p) not in drop]
        x, y = cls_batch(i)
        loss = step(x, y)
        run.snap([M], [], loss=loss, mom=mom_state(M, opt))


@pat
def S_params_list_remove_inplace(run):
    seed()
    M = MLP()
    opt = sgd(M, fused=False)
    step = run.step(M, ce, opt)
    for i in range(STEPS):
        if i == 3:
            ps = opt.param_groups[0]["params"]
            del ps[[id(p) for p in ps].index(id(M.fc2.weight))]
        x, y = cls_batch(i)
        loss = step(x, y)
        run.snap([M], [], loss=loss, mom=mom_state(M, opt))


@pat
def C_params_list_extend_unfreeze(run):
    seed()
    M = MLP()
    M.head.requires_grad_(False)
    opt = torch.optim.SGD([*M.fc1.parameters(), *M.fc2.parameters()], lr=0.1, momentum=0.9)

    def pre(i):
        if i == 3:
            M.head.requires_grad_(True)
            opt.param_groups[0]["params"].extend(M.head.parameters())

    cap_loop(run, M, opt, pre=pre)


@pat
def S_opt_state_reset_defaultdict(run):
    from collections import defaultdict

    seed()
    M = MLP()
    opt = sgd(M)

    def pre(i):
        if i == 4:
            opt.state = defaultdict(dict)

    step_loop(run, M, opt, pre=pre)


@pat
def S_momentum_buffer_none(run):  # reset momentum by setting the buffers to None
    seed()
    M = MLP()
    opt = sgd(M)

    def pre(i):
        if i == 4:
            for s in opt.state.values():
                s["momentum_buffer"] = None

    step_loop(run, M, opt, pre=pre)


@pat
def S_momentum_buffer_zero_inplace(run):
    seed()
    M = MLP()
    opt = sgd(M)

    def pre(i):
        if i == 4:
            for s in opt.state.values():
                s["momentum_buffer"].zero_()

    step_loop(run, M, opt, pre=pre)


@pat
def S_adam_state_reset_inplace(run):
    seed()
    M = MLP()
    opt = adamw(M, lr=torch.tensor(1e-2))

    def pre(i):
        if i == 4:
            for s in opt.state.values():
                s["step"].zero_()
                s["exp_avg"].zero_()
                s["exp_avg_sq"].zero_()

    step_loop(run, M, opt, pre=pre)


class UncW(nn.Module):
    def __init__(self):
        super().__init__()
        self.log_vars = nn.Parameter(torch.zeros(2))

    def forward(self, l1, l2):
        return (
            torch.exp(-self.log_vars[0]) * l1
            + self.log_vars[0]
            + torch.exp(-self.log_vars[1]) * l2
            + self.log_vars[1]
        )


@pat
def S_uncertainty_weighting_module(run):
    seed()
    M = MLP()
    W = UncW()
    opt = torch.optim.SGD([*M.parameters(), *W.parameters()], lr=0.05, momentum=0.9, fused=True)

    def lf(m, x, y):
        out = m(x)
        return W(F.cross_entropy(out, y), out.pow(2).mean())

    step_loop(run, M, opt, lossf=lf, extra=[W])


@pat
def S_learnable_temperature_bare(run):  # a bare Parameter in the closure (documented retire)
    seed()
    M = MLP()
    t = nn.Parameter(torch.tensor(1.0))
    opt = torch.optim.SGD([*M.parameters(), t], lr=0.05, fused=True)
    step_loop(run, M, opt, lossf=lambda m, x, y: F.cross_entropy(m(x) * t, y))
    run.snap([M], [opt], t=t)


@pat
def S_class_weights_rebound_on_criterion(run):
    seed()
    M = MLP()
    opt = sgd(M)
    crit = nn.CrossEntropyLoss(weight=torch.ones(3))

    def pre(i):
        if i in (3, 5):
            crit.weight = torch.tensor([1.0, 2.0 + i, 0.5])

    step_loop(run, M, opt, lossf=lambda m, x, y: crit(m(x), y), pre=pre)


@pat
def S_class_weights_closure_rebound(run):
    seed()
    M = MLP()
    opt = sgd(M)
    ctx = {"w": torch.ones(3)}

    def pre(i):
        if i in (3, 5):
            ctx["w"] = torch.tensor([1.0, 2.0 + i, 0.5])

    step_loop(run, M, opt, lossf=lambda m, x, y: F.cross_entropy(m(x), y, weight=ctx["w"]), pre=pre)


@pat
def S_class_weights_global_rebound(run):
    seed()
    M = MLP()
    opt = sgd(M)
    global CLASS_W
    CLASS_W = torch.ones(3)

    def pre(i):
        global CLASS_W
        if i in (3, 5):
            CLASS_W = torch.tensor([1.0, 2.0 + i, 0.5])

    step_loop(run, M, opt, lossf=weighted_ce_global, pre=pre)


CLASS_W = torch.ones(3)


def weighted_ce_global(m, x, y):
    return F.cross_entropy(m(x), y, weight=CLASS_W)


@pat
def S_pos_weight_inplace(run):
    seed()
    M = MLP(k=1)
    opt = sgd(M)
    crit = nn.BCEWithLogitsLoss(pos_weight=torch.tensor([1.0]))

    def pre(i):
        crit.pos_weight.copy_(torch.tensor([1.0 + 0.5 * i]))

    step_loop(run, M, opt, lossf=lambda m, x, y: crit(m(x).squeeze(1), (y > 0).float()), pre=pre)


class TempNet(MLP):
    def __init__(self):
        super().__init__()
        self.register_buffer("temp", torch.tensor(1.0))

    def forward(self, x):
        return super().forward(x) / self.temp


@pat
def C_buffer_rebound_temperature(run):
    seed()
    M = TempNet()
    opt = sgd(M)
    cap_loop(run, M, opt, pre=lambda i: setattr(M, "temp", torch.tensor(1.0 + 0.25 * i)))


@pat
def C_buffer_data_rebound(run):
    seed()
    M = TempNet()
    opt = sgd(M)

    def pre(i):
        M.temp.data = torch.tensor(1.0 + 0.25 * i)

    cap_loop(run, M, opt, pre=pre)


@pat
def S_buffer_data_rebound(run):
    seed()
    M = TempNet()
    opt = sgd(M)

    def pre(i):
        M.temp.data = torch.tensor(1.0 + 0.25 * i)

    step_loop(run, M, opt, pre=pre)


@pat
def S_buffer_fill(run):
    seed()
    M = TempNet()
    opt = sgd(M)
    step_loop(run, M, opt, pre=lambda i: M.temp.fill_(1.0 + 0.25 * i))


@pat
def C_param_data_load_from_loop(run):  # p.data = pretrained tensor mid-run
    seed()
    M = MLP()
    opt = torch.optim.SGD(M.parameters(), lr=0.1, momentum=0.9)
    torch.manual_seed(7)
    pre_w = torch.randn(16, 16) * 0.1

    def pre(i):
        if i == 3:
            M.fc2.weight.data = pre_w.clone()

    cap_loop(run, M, opt, pre=pre)


@pat
def S_param_data_load_from_loop(run):
    seed()
    M = MLP()
    opt = sgd(M)
    torch.manual_seed(7)
    pre_w = torch.randn(16, 16) * 0.1

    def pre(i):
        if i == 3:
            M.fc2.weight.data = pre_w.clone()

    step_loop(run, M, opt, pre=pre)


@pat
def S_wgan_clip_inplace(run):
    seed()
    M = MLP()
    opt = torch.optim.RMSprop(M.parameters(), lr=5e-3)

    def after(i, loss):
        for p in M.parameters():
            p.data.clamp_(-0.05, 0.05)

    step_loop(run, M, opt, after=after)


@pat
def S_wgan_clip_rebind(run):
    seed()
    M = MLP()
    opt = sgd(M, momentum=0.0)

    def after(i, loss):
        for p in M.parameters():
            p.data = p.data.clamp(-0.05, 0.05)

    step_loop(run, M, opt, after=after)


@pat
def C_wgan_clip_rebind(run):
    seed()
    M = MLP()
    opt = torch.optim.RMSprop(M.parameters(), lr=5e-3)

    def after(i, loss):
        for p in M.parameters():
            p.data = p.data.clamp(-0.05, 0.05)

    cap_loop(run, M, opt, after=after)


@pat
def S_reseed_each_epoch(run):
    seed()
    M = MLP(drop=0.3)
    opt = sgd(M)

    def pre(i):
        if i % 2 == 0:
            torch.manual_seed(100 + i)

    step_loop(run, M, opt, pre=pre)


@pat
def C_reseed_each_step(run):
    seed()
    M = MLP(drop=0.3)
    opt = sgd(M)
    cap_loop(run, M, opt, pre=lambda i: torch.manual_seed(100 + i // 2))


@pat
def C_rng_state_restored_after_mc_val(run):
    seed()
    M = MLP(drop=0.3)
    opt = sgd(M)
    vals = []

    def after(i, loss):
        st = torch.get_rng_state()
        with torch.no_grad():
            vals.append(M(data(9, (4, 6))[0]))  # MC dropout: train mode
        torch.set_rng_state(st)

    cap_loop(run, M, opt, after=after)
    run.snap([M], [opt], vals=vals)


@pat
def S_rng_state_rewind_each_step(run):  # same dropout masks every step (set_rng_state)
    seed()
    M = MLP(drop=0.3)
    opt = sgd(M)
    st = torch.get_rng_state()
    step_loop(run, M, opt, pre=lambda i: torch.set_rng_state(st))


@pat
def S_fork_rng_noise(run):
    seed()
    M = MLP()
    opt = sgd(M)

    def lf(m, x, y):
        with torch.random.fork_rng():
            torch.manual_seed(3)
            noise = torch.randn_like(x) * 0.1
        return ce(m, x + noise + torch.randn_like(x) * 0.01, y)

    step_loop(run, M, opt, lossf=lf)


@pat
def S_private_torch_generator_reseeded(run):
    seed()
    M = MLP()
    opt = sgd(M)
    gen = torch.Generator().manual_seed(0)

    def lf(m, x, y):
        return ce(m, x + 0.1 * torch.randn(x.shape, generator=gen), y)

    def pre(i):
        if i % 3 == 0:
            gen.manual_seed(50 + i)

    step_loop(run, M, opt, lossf=lf, pre=pre)


@pat
def C_private_torch_generator_in_forward(run):
    class NoisyNet(MLP):
        def __init__(self):
            super().__init__()
            self.gen = torch.Generator().manual_seed(0)

        def forward(self, x):
            return super().forward(x + 0.1 * torch.randn(x.shape, generator=self.gen))

    seed()
    M = NoisyNet()
    opt = sgd(M)

    def pre(i):
        if i % 3 == 0:
            M.gen.manual_seed(50 + i)

    cap_loop(run, M, opt, pre=pre)


GRL = {"alpha": 0.0}
GRL_ALPHA = 0.0


class GradReverse(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return -GRL_ALPHA * g


class DANN(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.feat = nn.Linear(6, 16)
        self.cls = nn.Linear(16, 3)
        self.dom = nn.Linear(16, 1)
        self.how = how

    def forward(self, x):
        f = self.feat(x).relu()
        if self.how == "global":
            r = GradReverse.apply(f)
        else:
            r = f * 1.0
            r.register_hook(lambda g: -GRL["alpha"] * g)
        return self.cls(f), self.dom(r)


def dann_loss(m, x, y):
    c, d = m(x)
    return F.cross_entropy(c, y) + F.binary_cross_entropy_with_logits(d.squeeze(1), (y > 0).float())


def set_grl(i):
    global GRL_ALPHA
    GRL_ALPHA = 0.1 * i
    GRL["alpha"] = 0.1 * i


@pat
def C_grl_global_in_backward(run):
    seed()
    M = DANN("global")
    opt = sgd(M)
    cap_loop(run, M, opt, lossf=dann_loss, pre=set_grl)


@pat
def S_grl_global_in_backward(run):
    seed()
    M = DANN("global")
    opt = sgd(M)
    step_loop(run, M, opt, lossf=dann_loss, pre=set_grl)


@pat
def C_grl_tensor_hook_global_dict(run):
    seed()
    M = DANN("hook")
    opt = sgd(M)
    cap_loop(run, M, opt, lossf=dann_loss, pre=set_grl)


@pat
def S_grl_tensor_hook_global_dict(run):
    seed()
    M = DANN("hook")
    opt = sgd(M)
    step_loop(run, M, opt, lossf=dann_loss, pre=set_grl)


@pat
def C_prune_iterative(run):
    from torch.nn.utils import prune

    seed()
    M = MLP()
    opt = torch.optim.SGD(M.parameters(), lr=0.1, momentum=0.9)

    def pre(i):
        if i in (2, 4):
            prune.l1_unstructured(M.fc2, "weight", amount=0.2)

    cap_loop(run, M, opt, pre=pre)


@pat
def S_prune_iterative(run):
    from torch.nn.utils import prune

    seed()
    M = MLP()
    opt = sgd(M)

    def pre(i):
        if i in (2, 4):
            prune.l1_unstructured(M.fc2, "weight", amount=0.2)

    step_loop(run, M, opt, pre=pre)


@pat
def C_pruned_before_capture_mask_rewritten(run):  # mask buffer updated in place by the loop
    from torch.nn.utils import prune

    seed()
    M = MLP()
    prune.identity(M.fc2, "weight")
    opt = torch.optim.SGD(M.parameters(), lr=0.1, momentum=0.9)

    def pre(i):
        if i in (2, 4):
            with torch.no_grad():
                w = M.fc2.weight_orig.abs()
                M.fc2.weight_mask.copy_((w > w.flatten().kthvalue(40 * i).values).float())

    cap_loop(run, M, opt, pre=pre)


@pat
def C_multitask_two_backwards(run):
    seed()
    M = MLP()
    opt = sgd(M)
    run.wrap(M)
    for i in range(STEPS):
        x, y = cls_batch(i)
        out = M(x)
        l1 = F.cross_entropy(out, y)
        l2 = out.pow(2).mean()
        l1.backward(retain_graph=True)
        l2.backward()
        opt.step()
        opt.zero_grad()
        run.snap([M], [opt], l1=l1.detach(), l2=l2.detach())


@pat
def C_siamese_two_views_bn(run):
    seed()
    M = MLP(bn=True, drop=0.2)
    opt = sgd(M)
    run.wrap(M)
    for i in range(STEPS):
        x, y = cls_batch(i)
        v1 = x + 0.1 * torch.randn_like(x)
        v2 = x * 0.9
        a, b = M(v1), M(v2)
        loss = F.cross_entropy(a, y) + F.mse_loss(a.softmax(-1), b.softmax(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        run.snap([M], [opt], loss=loss.detach())


@pat
def C_backward_inputs_subset(run):  # alternate: only the head, or everything
    seed()
    M = MLP()
    opt = torch.optim.SGD(M.parameters(), lr=0.1)
    run.wrap(M)
    for i in range(STEPS):
        x, y = cls_batch(i)
        loss = ce(M, x, y)
        if i % 2:
            loss.backward(inputs=list(M.head.parameters()))
        else:
            loss.backward()
        opt.step()
        opt.zero_grad()
        run.snap([M], [opt], loss=loss.detach())


@pat
def C_retain_grad_output_logging(run):
    seed()
    M = MLP()
    opt = sgd(M)
    run.wrap(M)
    for i in range(STEPS):
        x, y = cls_batch(i)
        out = M(x)
        out.retain_grad()
        loss = F.cross_entropy(out, y)
        loss.backward()
        g = out.grad.clone()
        opt.step()
        opt.zero_grad()
        run.snap([M], [opt], loss=loss.detach(), g=g)


@pat
def S_accum_epoch_start_zero_grad(run):  # 3 batches/epoch, accumulate=2, zero_grad per epoch
    seed()
    M = MLP()
    opt = sgd(M)
    step = run.step(M, ce, opt, accumulate=2)
    for i in range(12):
        if i % 3 == 0:
            opt.zero_grad()
        x, y = cls_batch(i)
        loss = step(x, y)
        run.snap([M], [opt], loss=loss)


@pat
def S_accum_log_grad_norm_midcycle(run):
    seed()
    M = MLP()
    opt = sgd(M)
    step = run.step(M, ce, opt, accumulate=2)
    norms = []
    for i in range(10):
        x, y = cls_batch(i)
        loss = step(x, y)
        gs = [p.grad for p in M.parameters() if p.grad is not None]
        norms.append(torch.stack([g.norm() for g in gs]).norm() if gs else torch.tensor(-1.0))
        run.snap([M], [opt], loss=loss, n=norms[-1])


@pat
def S_accum_lr_change_midcycle(run):
    seed()
    M = MLP()
    opt = sgd(M)
    step = run.step(M, ce, opt, accumulate=2)
    for i in range(10):
        opt.param_groups[0]["lr"] = 0.1 / (1 + i)
        x, y = cls_batch(i)
        loss = step(x, y)
        run.snap([M], [opt], loss=loss)


@pat
def S_accum_freeze_midcycle(run):
    seed()
    M = MLP()
    opt = sgd(M)
    step = run.step(M, ce, opt, accumulate=2)
    for i in range(10):
        M.fc1.requires_grad_(i % 4 != 1)
        x, y = cls_batch(i)
        loss = step(x, y)
        run.snap([M], [opt], loss=loss)


@pat
def S_accum_grad_scaled_by_hand_midcycle(run):  # user rescales partial grads (rare but legal)
    seed()
    M = MLP()
    opt = sgd(M)
    step = run.step(M, ce, opt, accumulate=2)
    for i in range(10):
        x, y = cls_batch(i)
        loss = step(x, y)
        if i % 2 == 0:
            with torch.no_grad():
                for p in M.parameters():
                    if p.grad is not None:
                        p.grad.mul_(0.5)
        run.snap([M], [opt], loss=loss)


@pat
def S_accum_eval_midcycle(run):
    seed()
    M = MLP(bn=True, drop=0.2)
    opt = sgd(M)
    step = run.step(M, ce, opt, accumulate=2)
    for i in range(10):
        M.train(i % 4 != 1)
        x, y = cls_batch(i)
        loss = step(x, y)
        run.snap([M], [opt], loss=loss)


@pat
def C_sub_bn_eval_freeze_stats(run):
    seed()
    M = MLP(bn=True)
    opt = sgd(M)

    def pre(i):
        if i >= 3:
            M.bn.eval()

    cap_loop(run, M, opt, pre=pre)


@pat
def S_bn_track_running_stats_off(run):
    seed()
    M = MLP(bn=True)
    opt = sgd(M)

    def pre(i):
        if i == 3:
            M.bn.track_running_stats = False

    step_loop(run, M, opt, pre=pre)


@pat
def S_mc_dropout_eval_root(run):
    seed()
    M = MLP(bn=True, drop=0.3)
    opt = sgd(M)

    def pre(i):
        if i >= 3:
            M.eval()
            M.drop.train()

    step_loop(run, M, opt, pre=pre)


class LayerDropNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.out = nn.Linear(8, 3)
        self.n_active = 1

    def forward(self, x):
        h = self.inp(x).relu()
        for b in self.blocks[: self.n_active]:
            h = h + b(h).relu()
        return self.out(h)


@pat
def S_progressive_growing_int_attr(run):
    seed()
    M = LayerDropNet()
    opt = sgd(M, fused=False)
    step_loop(run, M, opt, pre=lambda i: setattr(M, "n_active", 1 + i // 2))


@pat
def C_progressive_growing_int_attr(run):
    seed()
    M = LayerDropNet()
    opt = sgd(M, fused=False)
    cap_loop(run, M, opt, pre=lambda i: setattr(M, "n_active", 1 + i // 2))


@pat
def C_forward_pre_hook_noise_sigma(run):  # hook registered before capture, closure dict sigma
    seed()
    M = MLP()
    opt = sgd(M)
    cfg = {"sigma": 0.0}
    M.fc2.register_forward_pre_hook(lambda mod, a: (a[0] + cfg["sigma"] * torch.randn_like(a[0]),))

    def pre(i):
        cfg["sigma"] = 0.05 * i

    cap_loop(run, M, opt, pre=pre)


@pat
def S_forward_pre_hook_noise_sigma(run):
    seed()
    M = MLP()
    opt = sgd(M)
    cfg = {"sigma": 0.0}
    M.fc2.register_forward_pre_hook(lambda mod, a: (a[0] + cfg["sigma"] * torch.randn_like(a[0]),))

    def pre(i):
        cfg["sigma"] = 0.05 * i

    step_loop(run, M, opt, pre=pre)


@pat
def C_forward_hook_feature_kept(run):  # feature-extraction hook appending to a list
    seed()
    M = MLP()
    opt = sgd(M)
    feats = []
    M.fc2.register_forward_hook(lambda mod, a, o: feats.append(o.detach()))
    cap_loop(run, M, opt)
    run.snap([M], [opt], feats=feats)


@pat
def S_maximize_toggle(run):
    seed()
    M = MLP()
    opt = sgd(M)

    def pre(i):
        opt.param_groups[0]["maximize"] = i in (3, 4)

    step_loop(run, M, opt, pre=pre)


@pat
def S_mixed_tensor_float_groups(run):
    seed()
    M = MLP()
    opt = torch.optim.SGD(
        [
            {"params": M.fc1.parameters(), "lr": torch.tensor(0.05)},
            {"params": [*M.fc2.parameters(), *M.head.parameters()], "lr": 0.1},
        ],
        momentum=0.9,
        fused=True,
    )
    sch = LS.ExponentialLR(opt, 0.9)
    step_loop(run, M, opt, after=lambda i, loss: sch.step())


@pat
def C_sam_two_passes(run):  # sharpness-aware minimisation
    seed()
    M = MLP(bn=True)
    opt = torch.optim.SGD(M.parameters(), lr=0.1, momentum=0.9)
    run.wrap(M)
    rho = 0.05
    for i in range(STEPS):
        x, y = cls_batch(i)
        loss = ce(M, x, y)
        loss.backward()
        with torch.no_grad():
            gn = torch.norm(torch.stack([p.grad.norm() for p in M.parameters()]))
            eps = [rho * p.grad / (gn + 1e-12) for p in M.parameters()]
            for p, e in zip(M.parameters(), eps, strict=False):
                p.add_(e)
        opt.zero_grad()
        ce(M, x, y).backward()
        with torch.no_grad():
            for p, e in zip(M.parameters(), eps, strict=False):
                p.sub_(e)
        opt.step()
        opt.zero_grad()
        run.snap([M], [opt], loss=loss.detach())


@pat
def C_lookahead_by_hand(run):
    seed()
    M = MLP()
    opt = torch.optim.AdamW(M.parameters(), lr=1e-2)
    slow = [p.detach().clone() for p in M.parameters()]

    def after(i, loss):
        if i % 3 == 2:
            with torch.no_grad():
                for s, p in zip(slow, M.parameters(), strict=False):
                    s.add_(p - s, alpha=0.5)
                    p.copy_(s)

    cap_loop(run, M, opt, after=after)


@pat
def S_two_lossfns_alternating(run):  # round-robin multi-task on one model and optimizer
    seed()
    M = MLP()
    opt = sgd(M)
    a = run.step(M, ce, opt)
    b = run.step(M, lambda m, x, y: m(x).pow(2).mean() + 0.1 * ce(m, x, y), opt)
    for i in range(10):
        x, y = cls_batch(i)
        loss = (a if i % 2 else b)(x, y)
        run.snap([M], [opt], loss=loss)


@pat
def S_interleaved_manual_eager_steps(run):  # a hand-written step between TrainStep calls
    seed()
    M = MLP()
    opt = sgd(M)
    step = run.step(M, ce, opt)
    for i in range(10):
        x, y = cls_batch(i)
        if i % 3 == 2:
            loss = ce(M, x, y) * 2.0
            loss.backward()
            opt.step()
            opt.zero_grad()
            loss = loss.detach()
        else:
            loss = step(x, y)
        run.snap([M], [opt], loss=loss)


@pat
def S_trainstep_after_eager_epoch_first_state(run):  # momentum state created only later
    seed()
    M = MLP()
    opt = sgd(M)
    step = run.step(M, ce, opt)
    for i in range(8):
        x, y = cls_batch(i)
        if i < 2:  # forward/backward only, no step (warm BN... and grads accumulate!)
            ce(M, x, y).backward()
            loss = torch.tensor(0.0)
        else:
            loss = step(x, y)
        run.snap([M], [opt], loss=loss)


@pat
def S_dqn_target_sync(run):
    seed()
    M = MLP()
    opt = sgd(M)
    tgt = {"net": copy.deepcopy(M).requires_grad_(False)}

    def lf(m, x, y):
        with torch.no_grad():
            t = tgt["net"](x).max(1).values
        return F.smooth_l1_loss(m(x).gather(1, y[:, None]).squeeze(1), 0.5 + 0.9 * t)

    def after(i, loss):
        if i % 3 == 2:
            tgt["net"].load_state_dict(M.state_dict())

    step_loop(run, M, opt, lossf=lf, after=after, extra=[tgt["net"]])


@pat
def S_sched_after_accumulate_tensor_lr(
    run,
):  # scheduler stepped every micro-batch (a bug, but legal)
    seed()
    M = MLP()
    opt = sgd(M, lr=torch.tensor(0.1))
    sch = LS.LinearLR(opt, 0.1, 1.0, total_iters=6)
    step_loop(run, M, opt, steps=10, accumulate=2, after=lambda i, loss: sch.step())


@pat
def S_noise_injection_grad(run):  # capture loop analogue is trivial; TrainStep cannot touch grads
    seed()
    M = MLP()
    opt = sgd(M)
    run.wrap(M)
    for i in range(STEPS):
        x, y = cls_batch(i)
        loss = ce(M, x, y)
        loss.backward()
        with torch.no_grad():
            for p in M.parameters():
                p.grad.add_(torch.randn_like(p.grad) * 0.01 / (1 + i) ** 0.55)
        opt.step()
        opt.zero_grad()
        run.snap([M], [opt], loss=loss.detach())


# ============================================================ round C: accumulation x freezing, reseeds
def accum_toggle(run, *, period, off, fused=True, adam=False, acc=2, steps=14, what="fc1"):
    seed()
    M = MLP(drop=0.1)
    opt = adamw(M) if adam else sgd(M, fused=fused)
    step = run.step(M, ce, opt, accumulate=acc)
    for i in range(steps):
        getattr(M, what).requires_grad_(i % period != off)
        x, y = cls_batch(i)
        loss = step(x, y)
        run.snap([M], [opt], loss=loss)


for _p, _o in ((4, 0), (4, 1), (3, 1), (6, 3)):
    PATTERNS[f"S_accum_freeze_p{_p}o{_o}"] = (
        lambda p, o: lambda run: accum_toggle(run, period=p, off=o)
    )(_p, _o)
    TIMEOUTS[f"S_accum_freeze_p{_p}o{_o}"] = 120
PATTERNS["S_accum_freeze_adamw"] = lambda run: accum_toggle(run, period=4, off=1, adam=True)
PATTERNS["S_accum_freeze_sgd_foreach"] = lambda run: accum_toggle(run, period=4, off=1, fused=False)
PATTERNS["S_accum3_freeze_head"] = lambda run: accum_toggle(
    run, period=3, off=2, acc=3, what="head", steps=15
)
for _n in ("S_accum_freeze_adamw", "S_accum_freeze_sgd_foreach", "S_accum3_freeze_head"):
    TIMEOUTS[_n] = 120


@pat
def S_accum_freeze_per_epoch_odd_len(
    run,
):  # the realistic form: freeze on odd epochs, 3 batches/epoch
    seed()
    M = MLP(bn=True)
    opt = sgd(M)
    step = run.step(M, ce, opt, accumulate=2, max_norm=1.0)
    k = 0
    for epoch in range(5):
        M.fc1.requires_grad_(epoch % 2 == 0)
        M.bn.requires_grad_(epoch % 2 == 0)
        for _b in range(3):
            x, y = cls_batch(k)
            k += 1
            loss = step(x, y)
            run.snap([M], [opt], loss=loss)


@pat
def S_accum_grad_none_midcycle(run):  # drop a layer's partial gradient between micro-batches
    seed()
    M = MLP()
    opt = sgd(M)
    step = run.step(M, ce, opt, accumulate=2)
    for i in range(12):
        x, y = cls_batch(i)
        loss = step(x, y)
        if i % 4 == 0:
            M.fc1.weight.grad = None
        run.snap([M], [opt], loss=loss)


@pat
def S_accum_zero_grad_keep_midcycle(run):  # epoch-start zero_grad(set_to_none=False), odd epochs
    seed()
    M = MLP()
    opt = sgd(M)
    step = run.step(M, ce, opt, accumulate=2)
    for i in range(12):
        if i % 3 == 0:
            opt.zero_grad(set_to_none=False)
        x, y = cls_batch(i)
        loss = step(x, y)
        run.snap([M], [opt], loss=loss)


@pat
def S_accum_add_param_group_midcycle(run):
    seed()
    M = MLP()
    M.head.requires_grad_(False)
    opt = torch.optim.SGD([*M.fc1.parameters(), *M.fc2.parameters()], lr=0.1, momentum=0.9)
    step = run.step(M, ce, opt, accumulate=2)
    for i in range(10):
        if i == 5:
            M.head.requires_grad_(True)
            opt.add_param_group({"params": list(M.head.parameters()), "lr": 0.01})
        x, y = cls_batch(i)
        loss = step(x, y)
        run.snap([M], [opt], loss=loss)


@pat
def C_accum_freeze_midcycle(run):  # the same freeze schedule through rk.capture
    seed()
    M = MLP(drop=0.1)
    opt = sgd(M)
    run.wrap(M)
    for i in range(14):
        M.fc1.requires_grad_(i % 4 != 1)
        x, y = cls_batch(i)
        (ce(M, x, y) / 2).backward()
        if i % 2 == 1:
            opt.step()
            opt.zero_grad()
        run.snap([M], [opt])


@pat
def S_manual_seed_in_loss(run):
    seed()
    M = MLP()
    opt = sgd(M)

    def lf(m, x, y):
        torch.manual_seed(3)
        return ce(m, x + 0.1 * torch.randn_like(x), y)

    step_loop(run, M, opt, lossf=lf)


@pat
def S_manual_seed_in_forward(run):
    class Seeded(MLP):
        def forward(self, x):
            with torch.random.fork_rng():
                torch.manual_seed(11)
                x = x + 0.1 * torch.randn_like(x)
            return super().forward(x)

    seed()
    M = Seeded(drop=0.2)
    opt = sgd(M)
    step_loop(run, M, opt)


@pat
def C_manual_seed_in_forward(run):  # documented: routed diverged
    class Seeded(MLP):
        def forward(self, x):
            with torch.random.fork_rng():
                torch.manual_seed(11)
                x = x + 0.1 * torch.randn_like(x)
            return super().forward(x)

    seed()
    M = Seeded(drop=0.2)
    opt = sgd(M)
    cap_loop(run, M, opt)


@pat
def S_per_step_seed_from_counter_in_loss(run):  # seed = step counter read from a dict
    seed()
    M = MLP()
    opt = sgd(M)
    st = {"i": 0}

    def lf(m, x, y):
        g = torch.Generator().manual_seed(st["i"])
        return ce(m, x + 0.1 * torch.randn(x.shape, generator=g), y)

    step_loop(run, M, opt, lossf=lf, pre=lambda i: st.__setitem__("i", i % 3))


@pat
def S_random_seed_in_loss_gate(run):
    seed()
    M = MLP()
    opt = sgd(M)

    def lf(m, x, y):
        random.seed(5)
        if random.random() < 0.5:
            x = x.flip(1)
        return ce(m, x, y)

    step_loop(run, M, opt, lossf=lf)


@pat
def S_np_seed_in_loss_gate(run):
    seed()
    M = MLP()
    opt = sgd(M)

    def lf(m, x, y):
        np.random.seed(4)
        if np.random.rand() < 0.5:
            x = x.flip(1)
        return ce(m, x, y)

    step_loop(run, M, opt, lossf=lf)


@pat
def S_random_gate_reseeded_outside(run):  # LayerDrop with random.seed(epoch) in the loop
    class LD(MLP):
        def forward(self, x):
            h = self.fc1(x).relu()
            if not self.training or random.random() > 0.5:
                h = h + self.fc2(h).relu()
            return self.head(h)

    seed()
    M = LD()
    opt = sgd(M)
    step_loop(run, M, opt, steps=12, pre=lambda i: random.seed(i // 3) if i % 3 == 0 else None)


@pat
def C_random_gate_reseeded_outside(run):
    class LD(MLP):
        def forward(self, x):
            h = self.fc1(x).relu()
            if not self.training or random.random() > 0.5:
                h = h + self.fc2(h).relu()
            return self.head(h)

    seed()
    M = LD()
    opt = sgd(M)
    cap_loop(run, M, opt, steps=12, pre=lambda i: random.seed(i // 3) if i % 3 == 0 else None)


@pat
def S_torch_seed_via_default_generator(run):
    seed()
    M = MLP(drop=0.3)
    opt = sgd(M)

    def lf(m, x, y):
        torch.default_generator.manual_seed(21)
        return ce(m, x, y)

    step_loop(run, M, opt, lossf=lf)


@pat
def S_set_rng_state_in_loss(run):  # fixed dropout masks: same state restored each step
    seed()
    M = MLP(drop=0.3)
    opt = sgd(M)
    fixed = torch.get_rng_state()

    def lf(m, x, y):
        torch.set_rng_state(fixed)
        return ce(m, x, y)

    step_loop(run, M, opt, lossf=lf)


# ============================================================ round D: param-group membership, host values read by loss
@pat
def S_param_moved_between_groups(run):
    seed()
    M = MLP()
    opt = torch.optim.SGD(
        [{"params": list(M.parameters()), "lr": 0.01}, {"params": [], "lr": 0.1}], momentum=0.9
    )
    step = run.step(M, ce, opt)
    for i in range(STEPS):
        if i == 3:
            slow, fast = opt.param_groups[0]["params"], opt.param_groups[1]["params"]
            for p in M.head.parameters():
                del slow[[id(q) for q in slow].index(id(p))]
                fast.append(p)
        x, y = cls_batch(i)
        loss = step(x, y)
        run.snap([M], [], loss=loss, mom=mom_state(M, opt))


@pat
def S_probe_then_finetune_extend(run):  # linear probe: optimizer holds only the head; then extend
    seed()
    M = MLP()
    opt = torch.optim.SGD(list(M.head.parameters()), lr=0.05, momentum=0.9)
    step = run.step(M, ce, opt)
    for i in range(STEPS):
        if i == 3:
            M.zero_grad(set_to_none=True)
            opt.param_groups[0]["params"].extend([*M.fc1.parameters(), *M.fc2.parameters()])
        x, y = cls_batch(i)
        loss = step(x, y)
        run.snap([M], [], loss=loss, mom=mom_state(M, opt))


@pat
def S_loss_reads_float_lr(run):  # decoupled L2 scaled by the current lr, written in the loss
    seed()
    M = MLP()
    opt = sgd(M)
    sch = LS.StepLR(opt, 2, 0.5)

    def lf(m, x, y):
        lr = opt.param_groups[0]["lr"]
        return ce(m, x, y) + lr * 1e-2 * sum(p.pow(2).sum() for p in m.parameters())

    step_loop(run, M, opt, lossf=lf, after=lambda i, loss: sch.step())


@pat
def S_loss_reads_scheduler_last_lr(run):
    seed()
    M = MLP()
    opt = sgd(M, lr=torch.tensor(0.1))
    sch = LS.StepLR(opt, 2, 0.5)

    def lf(m, x, y):
        return ce(m, x, y) * (1.0 + sch.get_last_lr()[0])

    step_loop(run, M, opt, lossf=lf, after=lambda i, loss: sch.step())


@pat
def S_loss_reads_scheduler_epoch(run):
    seed()
    M = MLP()
    opt = sgd(M, lr=torch.tensor(0.1))
    sch = LS.StepLR(opt, 2, 0.5)

    def lf(m, x, y):
        out = m(x)
        return ce(m, x, y) + min(1.0, sch.last_epoch / 4) * out.pow(2).mean()

    step_loop(run, M, opt, lossf=lf, after=lambda i, loss: sch.step())


@pat
def S_loss_reads_len_history(run):
    seed()
    M = MLP()
    opt = sgd(M)
    hist = []

    def lf(m, x, y):
        out = m(x)
        return F.cross_entropy(out, y) + min(1.0, len(hist) / 4) * out.pow(2).mean()

    step_loop(run, M, opt, lossf=lf, after=lambda i, loss: hist.append(float(loss)))


@pat
def S_numpy_class_weights_inplace(run):
    seed()
    M = MLP()
    opt = sgd(M)
    w = np.ones(3, dtype=np.float32)

    def lf(m, x, y):
        return F.cross_entropy(m(x), y, weight=torch.from_numpy(w))

    def pre(i):
        if i in (3, 5):
            w[:] = [1.0, 2.0 + i, 0.5]

    step_loop(run, M, opt, lossf=lf, pre=pre)


@pat
def S_numpy_class_weights_tensor_copy(run):
    seed()
    M = MLP()
    opt = sgd(M)
    w = np.ones(3, dtype=np.float32)

    def lf(m, x, y):
        return F.cross_entropy(m(x), y, weight=torch.tensor(w))

    def pre(i):
        if i in (3, 5):
            w[:] = [1.0, 2.0 + i, 0.5]

    step_loop(run, M, opt, lossf=lf, pre=pre)


@pat
def S_list_class_weights_inplace(run):
    seed()
    M = MLP()
    opt = sgd(M)
    w = [1.0, 1.0, 1.0]

    def lf(m, x, y):
        return F.cross_entropy(m(x), y, weight=torch.tensor(w))

    def pre(i):
        if i in (3, 5):
            w[1] = 2.0 + i

    step_loop(run, M, opt, lossf=lf, pre=pre)


@pat
def S_numpy_scalar_weight(run):  # a numpy float64 schedule value held in a dict
    seed()
    M = MLP()
    opt = sgd(M)
    st = {"w": np.float64(0.0)}

    def lf(m, x, y):
        out = m(x)
        return F.cross_entropy(out, y) + float(st["w"]) * out.pow(2).mean()

    step_loop(run, M, opt, lossf=lf, pre=lambda i: st.__setitem__("w", np.float64(i // 2) / 4))


@pat
def S_numpy_array_weight_inplace_item(run):  # np array of schedule weights, indexed in the loss
    seed()
    M = MLP()
    opt = sgd(M)
    ws = np.zeros(2)

    def lf(m, x, y):
        out = m(x)
        return F.cross_entropy(out, y) * ws[0] + (1 - ws[0]) * out.pow(2).mean() + ws[1]

    def pre(i):
        ws[0] = min(1.0, i / 4)

    step_loop(run, M, opt, lossf=lf, pre=pre)


class NpW(MLP):
    def __init__(self):
        super().__init__()
        self.class_w = np.ones(3, dtype=np.float32)

    def forward(self, x):
        return super().forward(x) * torch.from_numpy(self.class_w)


@pat
def C_numpy_attr_inplace_in_forward(run):
    seed()
    M = NpW()
    opt = sgd(M)

    def pre(i):
        if i in (3, 5):
            M.class_w[:] = [1.0, 2.0 + i, 0.5]

    cap_loop(run, M, opt, pre=pre)


@pat
def S_numpy_attr_inplace_in_forward(run):
    seed()
    M = NpW()
    opt = sgd(M)

    def pre(i):
        if i in (3, 5):
            M.class_w[:] = [1.0, 2.0 + i, 0.5]

    step_loop(run, M, opt, pre=pre)


class ListW(MLP):
    def __init__(self):
        super().__init__()
        self.loss_w = [1.0, 0.0]

    def forward(self, x):
        out = super().forward(x)
        return out * self.loss_w[0] + self.loss_w[1]


@pat
def C_list_attr_inplace_in_forward(run):
    seed()
    M = ListW()
    opt = sgd(M)

    def pre(i):
        M.loss_w[1] = 0.1 * (i // 2)

    cap_loop(run, M, opt, pre=pre)


@pat
def S_kwarg_float_schedule(run):
    seed()
    M = MLP()
    opt = sgd(M)
    step = run.step(M, lambda m, x, y, alpha=0.0: ce(m, x, y) + alpha * m(x).pow(2).mean(), opt)
    for i in range(STEPS):
        x, y = cls_batch(i)
        loss = step(x, y, alpha=0.1 * (i // 2))
        run.snap([M], [opt], loss=loss)


# ============================================================ round E
class SchedNet(MLP):
    def forward(self, x):
        out = super().forward(x)
        return out * (1.0 + min(1.0, self.sched.last_epoch / 4))


@pat
def C_forward_reads_scheduler_epoch(run):
    seed()
    M = SchedNet()
    opt = sgd(M, lr=torch.tensor(0.1))
    M.sched = LS.StepLR(opt, 2, 0.5)
    cap_loop(run, M, opt, after=lambda i, loss: M.sched.step())


@pat
def S_forward_reads_scheduler_epoch(run):
    seed()
    M = SchedNet()
    opt = sgd(M, lr=torch.tensor(0.1))
    M.sched = LS.StepLR(opt, 2, 0.5)
    step_loop(run, M, opt, after=lambda i, loss: M.sched.step())


@pat
def S_loss_reads_tensor_lr(run):  # the same L2-by-lr with a tensor lr: read by the graph
    seed()
    M = MLP()
    opt = sgd(M, lr=torch.tensor(0.1))
    sch = LS.StepLR(opt, 2, 0.5)

    def lf(m, x, y):
        return ce(m, x, y) + opt.param_groups[0]["lr"] * 1e-2 * sum(
            p.pow(2).sum() for p in m.parameters()
        )

    step_loop(run, M, opt, lossf=lf, after=lambda i, loss: sch.step())


@pat
def S_loss_reads_float_wd_group(run):  # weight decay written in the loss from a group value
    seed()
    M = MLP()
    opt = sgd(M)

    def lf(m, x, y):
        wd = opt.param_groups[0]["weight_decay"]
        return ce(m, x, y) + wd * sum(p.pow(2).sum() for p in m.parameters())

    def pre(i):
        opt.param_groups[0]["weight_decay"] = 0.0 if i < 5 else 1e-2
        opt.param_groups[0]["lr"] = 0.1 / (1 + i)  # a float schedule too

    step_loop(run, M, opt, lossf=lf, pre=pre)


@pat
def S_cyclegan_requires_grad_toggle(run):
    seed()
    g, d = G(), D()
    og = torch.optim.AdamW(g.parameters(), lr=1e-3, betas=(0.5, 0.999), fused=True, capturable=True)
    od = torch.optim.AdamW(d.parameters(), lr=1e-3, betas=(0.5, 0.999), fused=True, capturable=True)

    def gl(gm, z, real):
        fake = gm(z)
        return F.softplus(-d(fake)).mean() + 0.1 * F.l1_loss(fake, real)

    def dl(dm, real, z):
        with torch.no_grad():
            fake = g(z)
        return 0.5 * (F.softplus(-dm(real)).mean() + F.softplus(dm(fake)).mean())

    sg, sd = run.step(g, gl, og), run.step(d, dl, od)
    for i in range(STEPS):
        (real, z) = data(6000 + i, (8, 6), (8, 4))
        d.requires_grad_(False)
        lg = sg(z, real)
        d.requires_grad_(True)
        ld = sd(real, z)
        run.snap([g, d], [og, od], ld=ld, lg=lg)


@pat
def S_gan_accum_d_leftover_grads(
    run,
):  # G step leaves grads on D; D step accumulates (accumulate=2)
    seed()
    g, d = G(), D()
    og = torch.optim.SGD(g.parameters(), lr=1e-2, momentum=0.5, fused=True)
    od = torch.optim.SGD(d.parameters(), lr=1e-2, momentum=0.5, fused=True)

    def dl(dm, real, z):
        return F.softplus(-dm(real)).mean() + F.softplus(dm(g(z).detach())).mean()

    def gl(gm, z):
        return F.softplus(-d(gm(z))).mean()

    sd, sg = run.step(d, dl, od, accumulate=2), run.step(g, gl, og)
    for i in range(10):
        (real, z) = data(6000 + i, (8, 6), (8, 4))
        ld = sd(real, z)
        lg = sg(z)
        run.snap([g, d], [og, od], ld=ld, lg=lg)


@pat
def S_freeze_with_leftover_grad_aux_backward(
    run,
):  # eager aux backward leaves .grad; fc1 frozen on odd steps
    seed()
    M = MLP()
    opt = sgd(M)
    step = run.step(M, ce, opt)
    for i in range(10):
        x, y = cls_batch(i)
        if i % 2 == 1:
            M(x).pow(2).mean().mul(0.1).backward()  # an auxiliary eager backward first
            M.fc1.requires_grad_(False)
        else:
            M.fc1.requires_grad_(True)
        loss = step(x, y)
        run.snap([M], [opt], loss=loss)


# ============================================================ round F
@pat
def S_max_norm_reassigned(run):  # adaptive clipping threshold set on the step mid-run
    seed()
    M = MLP()
    opt = sgd(M)
    mn = {"v": 1.0}
    if run.rk:
        step = rk.TrainStep(M, ce, opt, max_norm=1.0, backend="emulated")
        run.entries.append(step)
    else:

        def step(x, y):
            loss = ce(M, x, y)
            loss.backward()
            nn.utils.clip_grad_norm_(
                [p for p in M.parameters() if p.grad is not None], mn["v"], foreach=True
            )
            opt.step()
            opt.zero_grad()
            return loss.detach()

    for i in range(STEPS):
        if i == 4:
            mn["v"] = 0.3
            if run.rk:
                step.max_norm = 0.3
        x, y = cls_batch(i)
        loss = step(x, y)
        run.snap([M], [opt], loss=loss)


@pat
def S_remove_weight_norm_new_step(run):  # bake weight_norm mid-run; new optimizer and TrainStep
    from torch.nn.utils import parametrize

    seed()
    M = MLP()
    P.weight_norm(M.fc2)
    o1 = sgd(M)
    a = run.step(M, ce, o1)
    o2 = b = None
    for i in range(STEPS):
        if i == 4:
            parametrize.remove_parametrizations(M.fc2, "weight")
            o2 = sgd(M, lr=0.05)
            b = run.step(M, ce, o2)
        x, y = cls_batch(i)
        loss = (a if i < 4 else b)(x, y)
        run.snap([M], [o1] + ([o2] if o2 else []), loss=loss)


@pat
def S_channels_last_model_switch(run):
    seed()
    M = CNN()
    opt = sgd(M)

    def pre(i):
        if i == 3:
            M.to(memory_format=torch.channels_last)

    step_loop(run, M, opt, batch=lambda i: img_batch(i, cl=i >= 3))


@pat
def S_ema_reset_params(run):  # rk.EMA re-initialised from the model mid-run
    seed()
    M = MLP()
    opt = sgd(M)
    ema = rk.EMA(M, 0.9)

    def pre(i):
        if i == 4:
            ema.params = [p.detach().clone() for p in M.parameters()]

    step_loop(run, M, opt, pre=pre, ema=ema)
    run.snap([M], [opt], ema=list(ema.params))


def main(argv):
    sel = [n for n in PATTERNS if not argv or any(n.startswith(a) for a in argv)]
    counts = {}
    t0 = time.time()
    for name in sel:
        t = time.time()
        verdict, n, detail = run_pattern(name, PATTERNS[name], timeout=TIMEOUTS[name])
        counts[verdict] = counts.get(verdict, 0) + 1
        print(
            f"{name:40s} | {verdict:16s} | {n:3d} | {time.time() - t:5.1f}s | {detail[:400]}",
            flush=True,
        )
    print(f"\nSUMMARY {len(sel)} patterns in {time.time() - t0:.0f}s: {counts}")


if __name__ == "__main__":
    main(sys.argv[1:])
