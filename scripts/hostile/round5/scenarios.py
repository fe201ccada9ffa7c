"""Round 5: AMP, accumulation, clipping, schedules, EMA, parametrizations, checkpointing, custom
Functions, hooks, torchvision models, embeddings, losses, modes, resumes, compile, Lightning,
and the shapes/kinds of inputs.

Each ``fn(ctx) -> dict`` runs a user's loop; ``ctx.capture`` / ``ctx.step`` are round 1's
(``scripts/hostile/single/harness.py``): replaykit under replay, plain PyTorch in eager. Written
against the public API only (README, docs/); entries ``callback`` (``ReplayCallback``) and
``optstep`` (``rk.OptimizerStep``) are adapted here to the harness's counts.
"""

from __future__ import annotations

import contextlib
import copy
import io
import math
import os
import sys
import types
from collections import Counter

import numpy as np
import torch
import torch.nn.functional as F
from harness import scenario
from torch import nn
from torch.nn.utils import parametrize
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

# ----------------------------------------------------------------------------- helpers


def vecs(n=8, b=8, f=8, c=4, seed=11):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(b, f, generator=g), torch.randint(0, c, (b,), generator=g))
            for _ in range(n)]  # fmt: skip


def imgs(n=6, b=4, c=3, hw=16, k=10, seed=12):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(b, c, hw, hw, generator=g), torch.randint(0, k, (b,), generator=g))
            for _ in range(n)]  # fmt: skip


def mlp(f=8, h=16, c=4, bn=False, drop=0.0):
    layers = [nn.Linear(f, h)]
    if bn:
        layers.append(nn.BatchNorm1d(h))
    layers += [nn.ReLU(), nn.Dropout(drop), nn.Linear(h, c)]
    return nn.Sequential(*layers)


def fused_sgd(params, lr=0.05, **kw):
    return torch.optim.SGD(params, lr=lr, momentum=0.9, fused=True, **kw)


def fused_adamw(params, lr=1e-3, **kw):
    return torch.optim.AdamW(params, lr=lr, fused=True, capturable=True, **kw)


def ce(m, x, y):
    return F.cross_entropy(m(x), y)


def plain_loop(ctx, m, opt, batches, loss_fn=ce, clip=None, **cap_kw):
    """The most common loop: zero_grad, forward, loss, backward, (clip), step."""
    losses = []
    with ctx.capture(m, **cap_kw):
        for x, y in batches:
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(m, x, y)
            loss.backward()
            if clip is not None:
                nn.utils.clip_grad_norm_(m.parameters(), clip)
            opt.step()
            losses.append(loss.detach())
    return {"m": m, "opt": opt, "losses": losses}


def step_loop(ctx, m, opt, batches, loss_fn=ce, **kw):
    step = ctx.step(m, loss_fn, opt, **kw)
    return {"m": m, "opt": opt, "losses": [step(x, y) for x, y in batches]}


class Counts:
    """A ReplayCallback's summary (or any entry) as the harness reads entries: counts, reasons."""

    def __init__(self, cb):
        self.cb = cb

    def _parts(self):
        return list(self.cb.summary().values())

    @property
    def counts(self):
        c = Counter()
        for d in self._parts():
            for k in ("record", "replay", "eager"):
                c[k] += d.get(k, 0)
        return dict(c)

    @property
    def eager_reasons(self):
        c = Counter()
        for d in self._parts():
            c.update(d.get("eager_reasons", {}))
        return dict(c)

    @property
    def retired(self):
        return any(d.get("retired") for d in self._parts())

    @property
    def retire_reason(self):
        return "; ".join(str(d["retired"]) for d in self._parts() if d.get("retired"))


def callbacks(ctx, *paths, **kw):
    if not ctx.replay:
        return []
    from replaykit.lightning import ReplayCallback

    cb = ReplayCallback(*paths, backend="emulated", **kw)
    ctx.entries.append(Counts(cb))
    return [cb]


def trainer(**kw):
    import lightning as L

    base = {"accelerator": "cpu", "max_epochs": 1, "logger": False, "enable_checkpointing": False,
            "enable_progress_bar": False, "enable_model_summary": False}  # fmt: skip
    return L.Trainer(**{**base, **kw})


def loader(n=10, b=8, seed=11):
    data = vecs(n, b=b, seed=seed)
    xs, ys = torch.cat([x for x, _ in data]), torch.cat([y for _, y in data])
    return torch.utils.data.DataLoader(list(zip(xs, ys, strict=True)), batch_size=b)


def tv():
    """torchvision, or an ImportError. Its CUDA wheel's C ops do not load beside a CPU torch;
    the models are Python, so its op registrations are skipped (``HOSTILE_TV``: a --target dir)."""
    try:
        import torchvision

        return torchvision
    except Exception:
        pass
    path = os.environ.get("HOSTILE_TV", "/tmp/h5tv")
    if path not in sys.path:
        sys.path.append(path)
    for k in [k for k in sys.modules if k.startswith("torchvision")]:
        del sys.modules[k]
    sys.modules["torchvision._meta_registrations"] = types.ModuleType("stub")
    import torchvision

    return torchvision


# ===================================================================== A. AMP


@scenario("capture")
def cap_bf16_autocast_cpu_scaler_disabled(ctx):
    m = mlp(bn=True)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", enabled=False)  # the usual "AMP off on CPU" switch
    losses = []
    with ctx.capture(m):
        for x, y in vecs(8):
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.cross_entropy(m(x), y)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            losses.append(loss.detach())
    return {"m": m, "opt": opt, "losses": losses}


@scenario("step")
def step_bf16_precision_scaler_disabled(ctx):
    m = mlp(bn=True)
    opt = fused_adamw(m.parameters())
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    return step_loop(ctx, m, opt, vecs(7), precision="bf16-mixed", scaler=scaler, max_norm=1.0)


@scenario("capture")
def cap_amp_switched_on_after_warmup(ctx):
    m = mlp()
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
    losses = []
    with ctx.capture(m):
        for i, (x, y) in enumerate(vecs(9)):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=i >= 3):
                loss = F.cross_entropy(m(x).float(), y)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
    return {"m": m, "opt": opt, "losses": losses}


class AmpInside(nn.Module):
    """Autocast entered inside forward, with an fp32 island for the softmax."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.out = nn.Linear(8, 4)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            q, k, v = self.q(x), self.k(x), self.v(x)
            with torch.autocast("cpu", enabled=False):
                att = (q.float() @ k.float().t() / math.sqrt(8)).softmax(-1)
            h = att.to(v.dtype) @ v
            return self.out(h).float()


@scenario("capture")
def cap_autocast_inside_forward_fp32_island(ctx):
    m = AmpInside()
    return plain_loop(ctx, m, torch.optim.Adam(m.parameters(), lr=1e-3), vecs(8))


@scenario("step")
def step_loss_autocast_dtype_from_config_toggled(ctx):
    m = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    opt = fused_adamw(m.parameters())
    cfg = {"amp": True, "dtype": torch.bfloat16}

    def loss_fn(model, x, y):
        with torch.autocast("cpu", dtype=cfg["dtype"], enabled=cfg["amp"]):
            out = model(x)
        return F.cross_entropy(out.float(), y)

    step = ctx.step(m, loss_fn, opt)
    losses = []
    for i, (x, y) in enumerate(vecs(8)):
        if i == 4:
            cfg["amp"] = False  # "loss spikes: AMP off"
        losses.append(step(x, y))
    return {"m": m, "opt": opt, "losses": losses}


@scenario("capture")
def cap_fp16_scaler_growth_interval_2_clip_value(ctx):
    m = mlp()
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4, growth_interval=2)
    losses = []
    with ctx.capture(m):
        for x, y in vecs(9):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(m(x), y)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            nn.utils.clip_grad_value_(m.parameters(), 0.1)
            scaler.step(opt)
            scaler.update()
            losses.append(loss.detach())
    return {"m": m, "opt": opt, "scaler": scaler, "losses": losses}


class Fp32Gelu(torch.autograd.Function):
    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu", cast_inputs=torch.float32)
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return F.gelu(x)

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        cdf = 0.5 * (1 + torch.erf(x / math.sqrt(2)))
        pdf = torch.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
        return g * (cdf + x * pdf)


class CustomFwdNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.b(Fp32Gelu.apply(self.a(x)))


@scenario("capture")
def cap_custom_fwd_cast_inputs_under_bf16(ctx):
    m = CustomFwdNet()
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    losses = []
    with ctx.capture(m):
        for x, y in vecs(8):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.cross_entropy(m(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
    return {"m": m, "opt": opt, "losses": losses}


@scenario("step")
def step_custom_fwd_cast_inputs_bf16_precision(ctx):
    m = CustomFwdNet()
    return step_loop(ctx, m, fused_sgd(m.parameters()), vecs(7), precision="bf16-mixed")


# ===================================================================== B. accumulation


@scenario("capture")
def cap_accum_3_clip_on_step_partial_flush(ctx):
    m = mlp(drop=0.1)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    data, acc, losses = vecs(10), 3, []
    with ctx.capture(m):
        for i, (x, y) in enumerate(data):
            loss = F.cross_entropy(m(x), y) / acc
            loss.backward()
            if (i + 1) % acc == 0 or i == len(data) - 1:
                nn.utils.clip_grad_norm_(m.parameters(), 0.5)
                opt.step()
                opt.zero_grad(set_to_none=True)
            losses.append(loss.detach())
    return {"m": m, "opt": opt, "losses": losses}


@scenario("step")
def step_accumulate_4_ragged_microbatches(ctx):
    m = mlp()
    opt = fused_adamw(m.parameters())
    step = ctx.step(m, ce, opt, accumulate=4, max_norm=1.0)
    g = torch.Generator().manual_seed(3)
    losses = []
    for b in [8, 8, 8, 5, 8, 8, 8, 3]:  # each epoch's last micro-batch is short
        losses.append(step(torch.randn(b, 8, generator=g), torch.randint(0, 4, (b,), generator=g)))
    return {"m": m, "opt": opt, "losses": losses}


@scenario("capture")
def cap_accum_sum_then_grad_div_inplace(ctx):
    m = mlp()
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    losses = []
    with ctx.capture(m):
        for k in range(3):
            opt.zero_grad(set_to_none=False)
            n = 2 + k % 2
            for x, y in vecs(n, seed=k):
                loss = F.cross_entropy(m(x), y, reduction="sum")
                loss.backward()
                losses.append(loss.detach())
            for p in m.parameters():
                p.grad.div_(n * 8)
            opt.step()
    return {"m": m, "opt": opt, "losses": losses}


class TwoHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
        self.cls, self.reg = nn.Linear(16, 4), nn.Linear(16, 1)

    def forward(self, x):
        h = self.body(x)
        return self.cls(h), self.reg(h).squeeze(-1)


@scenario("capture")
def cap_autograd_backward_list_of_losses(ctx):
    m = TwoHead()
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)
    losses = []
    with ctx.capture(m):
        for x, y in vecs(8):
            opt.zero_grad()
            logits, r = m(x)
            la, lb = F.cross_entropy(logits, y), F.mse_loss(r, y.float())
            torch.autograd.backward([la, lb * 0.5])
            opt.step()
            losses += [la.detach(), lb.detach()]
    return {"m": m, "opt": opt, "losses": losses}


class SyncFlag(nn.Module):
    """DDP-like: a no_sync() context flips a flag the forward never reads."""

    def __init__(self):
        super().__init__()
        self.net = mlp()
        self.require_backward_grad_sync = True

    def forward(self, x):
        return self.net(x)

    @contextlib.contextmanager
    def no_sync(self):
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = True


@scenario("capture")
def cap_no_sync_like_flag_between_micro_batches(ctx):
    m = SyncFlag()
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    losses = []
    with ctx.capture(m):
        for i, (x, y) in enumerate(vecs(10)):
            ctxm = m.no_sync() if i % 2 == 0 else contextlib.nullcontext()
            with ctxm:
                loss = F.cross_entropy(m(x), y) / 2
                loss.backward()
            if i % 2 == 1:
                opt.step()
                opt.zero_grad()
            losses.append(loss.detach())
    return {"m": m, "opt": opt, "losses": losses}


# ===================================================================== C. clipping


@scenario("capture")
def cap_clip_value_then_norm_inf(ctx):
    m = mlp()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    losses = []
    with ctx.capture(m):
        for x, y in vecs(8):
            opt.zero_grad()
            loss = F.cross_entropy(m(x), y)
            loss.backward()
            nn.utils.clip_grad_value_(m.parameters(), 0.05)
            nn.utils.clip_grad_norm_(m.parameters(), 0.1, norm_type=float("inf"))
            opt.step()
            losses.append(loss.detach())
    return {"m": m, "opt": opt, "losses": losses}


def agc_(params, clip=0.01, eps=1e-3):
    """Adaptive gradient clipping (NFNets): unit-wise ratio of grad norm to weight norm."""
    for p in params:
        if p.grad is None:
            continue
        dims = tuple(range(1, p.ndim)) if p.ndim > 1 else (0,)
        pn = p.detach().norm(dim=dims, keepdim=True).clamp_min(eps)
        gn = p.grad.norm(dim=dims, keepdim=True)
        mx = pn * clip
        p.grad.copy_(torch.where(gn > mx, p.grad * (mx / gn.clamp_min(1e-6)), p.grad))


@scenario("capture")
def cap_adaptive_grad_clipping_unitwise(ctx):
    m = mlp(bn=True)
    opt = torch.optim.SGD(m.parameters(), lr=0.1, nesterov=True, momentum=0.9)
    losses = []
    with ctx.capture(m):
        for x, y in vecs(8):
            opt.zero_grad()
            loss = F.cross_entropy(m(x), y)
            loss.backward()
            agc_(m.parameters())
            opt.step()
            losses.append(loss.detach())
    return {"m": m, "opt": opt, "losses": losses}


@scenario("capture")
def cap_clip_norm_returned_skip_step_if_spike(ctx):
    m = mlp()
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    losses, norms = [], []
    with ctx.capture(m):
        for i, (x, y) in enumerate(vecs(9)):
            opt.zero_grad()
            loss = F.cross_entropy(m(x * (10.0 if i == 4 else 1.0)), y)
            loss.backward()
            n = nn.utils.clip_grad_norm_(m.parameters(), 1.0, norm_type=1.0, foreach=False)
            norms.append(n)
            if n.item() < 5.0:
                opt.step()
            losses.append(loss.detach())
    return {"m": m, "opt": opt, "losses": losses, "norms": norms}


@scenario("step")
def step_max_norm_tiny_clips_every_step(ctx):
    m = mlp(bn=True)
    return step_loop(ctx, m, fused_adamw(m.parameters(), lr=1e-2), vecs(7), max_norm=1e-3)


# ===================================================================== D. schedules


@scenario("capture")
def cap_lambda_warmup_float_lr_adam(ctx):
    m = mlp()
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
    losses = []
    with ctx.capture(m):
        for x, y in vecs(8):
            opt.zero_grad()
            loss = ce(m, x, y)
            loss.backward()
            opt.step()
            sched.step()
            losses.append(loss.detach())
    return {"m": m, "opt": opt, "losses": losses}


@scenario("step")
def step_sequential_warmup_cosine_tensor_lr(ctx):
    m = mlp()
    opt = fused_adamw(m.parameters(), lr=torch.tensor(1e-2))
    s1 = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=3)
    s2 = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=5)
    sched = torch.optim.lr_scheduler.SequentialLR(opt, [s1, s2], milestones=[3])
    step = ctx.step(m, ce, opt, max_norm=1.0)
    losses = []
    for x, y in vecs(8):
        losses.append(step(x, y))
        sched.step()
    return {"m": m, "opt": opt, "losses": losses, "lr": opt.param_groups[0]["lr"]}


@scenario("step")
def step_reduce_on_plateau_tensor_lr(ctx):
    m = mlp()
    opt = fused_sgd(m.parameters(), lr=torch.tensor(0.5))
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0)
    step = ctx.step(m, ce, opt)
    losses = []
    for x, y in vecs(8):
        loss = step(x, y)
        sched.step(float(loss))
        losses.append(loss)
    return {"m": m, "opt": opt, "losses": losses}


@scenario("step")
def step_chained_multistep_exponential_tensor_lr(ctx):
    m = mlp()
    opt = fused_sgd(m.parameters(), lr=torch.tensor(0.1))
    sched = torch.optim.lr_scheduler.ChainedScheduler(
        [
            torch.optim.lr_scheduler.MultiStepLR(opt, [2, 5], 0.3),
            torch.optim.lr_scheduler.ExponentialLR(opt, 0.9),
        ]
    )
    step = ctx.step(m, ce, opt)
    losses = []
    for x, y in vecs(8):
        losses.append(step(x, y))
        sched.step()
    return {"m": m, "opt": opt, "losses": losses}


@scenario("step")
def step_tensor_lr_filled_by_hand(ctx):
    m = mlp()
    opt = fused_adamw(m.parameters(), lr=torch.tensor(1e-3))
    step = ctx.step(m, ce, opt)
    losses = []
    for i, (x, y) in enumerate(vecs(8)):
        for g in opt.param_groups:
            g["lr"].fill_(1e-3 * min(1.0, (i + 1) / 3) * 0.5 ** (i // 4))
        losses.append(step(x, y))
    return {"m": m, "opt": opt, "losses": losses}


@scenario("step")
def step_cyclic_lr_momentum_cycling_float(ctx):
    m = mlp()
    opt = torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9, fused=True)
    sched = torch.optim.lr_scheduler.CyclicLR(opt, 0.01, 0.1, step_size_up=2)
    step = ctx.step(m, ce, opt)
    losses = []
    for x, y in vecs(8):
        losses.append(step(x, y))
        sched.step()
    return {"m": m, "opt": opt, "losses": losses}


@scenario("capture")
def cap_polynomial_lr_and_weight_decay_by_hand(ctx):
    m = mlp()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.PolynomialLR(opt, total_iters=8, power=2.0)
    losses = []
    with ctx.capture(m):
        for i, (x, y) in enumerate(vecs(8)):
            for g in opt.param_groups:
                g["weight_decay"] = 0.05 * (i // 2)
            opt.zero_grad()
            loss = ce(m, x, y)
            loss.backward()
            opt.step()
            sched.step()
            losses.append(loss.detach())
    return {"m": m, "opt": opt, "losses": losses}


# ===================================================================== E. EMA / SWA


@scenario("capture")
def cap_averagedmodel_ema_use_buffers_eval(ctx):
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    m = mlp(bn=True, drop=0.1)
    ema = AveragedModel(m, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=True)
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
    losses, vals = [], []
    with ctx.capture(m):
        for i, (x, y) in enumerate(vecs(9)):
            opt.zero_grad()
            loss = ce(m, x, y)
            loss.backward()
            opt.step()
            ema.update_parameters(m)
            losses.append(loss.detach())
            if i % 3 == 2:
                ema.eval()
                with torch.no_grad():
                    vals.append(ema(x))
    return {"m": m, "ema": ema, "opt": opt, "losses": losses, "vals": vals}


@scenario("step")
def step_averagedmodel_ema_after_each_step(ctx):
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    m = mlp(bn=True)
    ema = AveragedModel(m, multi_avg_fn=get_ema_multi_avg_fn(0.95), use_buffers=True)
    opt = fused_sgd(m.parameters())
    step = ctx.step(m, ce, opt)
    losses = []
    for x, y in vecs(8):
        losses.append(step(x, y))
        ema.update_parameters(m)
    return {"m": m, "ema": ema, "opt": opt, "losses": losses}


class TorchEMA:
    """torch_ema's pattern: shadow params, store/copy_to/restore around validation."""

    def __init__(self, params, decay=0.9):
        self.params = list(params)
        self.shadow = [p.detach().clone() for p in self.params]
        self.decay = decay

    @torch.no_grad()
    def update(self):
        torch._foreach_lerp_(self.shadow, [p.detach() for p in self.params], 1 - self.decay)

    @contextlib.contextmanager
    def average_parameters(self):
        backup = [p.detach().clone() for p in self.params]
        with torch.no_grad():
            for p, s in zip(self.params, self.shadow, strict=True):
                p.copy_(s)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, b in zip(self.params, backup, strict=True):
                    p.copy_(b)


@scenario("capture")
def cap_ema_copied_in_for_grad_validation(ctx):
    m = mlp(drop=0.1)
    ema = TorchEMA(m.parameters())
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    losses, vals = [], []
    data = vecs(9)
    with ctx.capture(m):
        for i, (x, y) in enumerate(data):
            opt.zero_grad()
            loss = ce(m, x, y)
            loss.backward()
            opt.step()
            ema.update()
            losses.append(loss.detach())
            if i % 3 == 1:
                with ema.average_parameters():
                    xv = x.clone().requires_grad_()  # a saliency check on the EMA weights
                    ce(m, xv, y).backward()
                    vals.append(xv.grad)
                m.zero_grad(set_to_none=True)
    return {"m": m, "opt": opt, "losses": losses, "vals": vals, "shadow": ema.shadow}


@scenario("step")
def step_ema_swapped_in_via_data_for_validation(ctx):
    m = mlp(bn=True)
    opt = fused_adamw(m.parameters())
    shadow = [p.detach().clone() for p in m.parameters()]
    step = ctx.step(m, ce, opt)
    losses, vals = [], []
    for i, (x, y) in enumerate(vecs(8)):
        losses.append(step(x, y))
        with torch.no_grad():
            torch._foreach_lerp_(shadow, [p.detach() for p in m.parameters()], 0.1)
        if i % 3 == 2:
            for p, s in zip(m.parameters(), shadow, strict=True):
                p.data, s.data = s.data, p.data  # swap in
            m.eval()
            with torch.no_grad():
                vals.append(m(x))
            m.train()
            for p, s in zip(m.parameters(), shadow, strict=True):
                p.data, s.data = s.data, p.data  # swap back
    return {"m": m, "opt": opt, "losses": losses, "vals": vals, "shadow": shadow}


# ===================================================================== F. parametrizations


class ParamNet(nn.Module):
    def __init__(self, wrap):
        super().__init__()
        self.a = wrap(nn.Linear(8, 8))
        self.b = nn.Linear(8, 4)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


@scenario("capture")
def cap_orthogonal_parametrization(ctx):
    from torch.nn.utils.parametrizations import orthogonal

    m = ParamNet(orthogonal)
    return plain_loop(ctx, m, torch.optim.Adam(m.parameters(), lr=1e-2), vecs(8))


@scenario("step")
def step_orthogonal_parametrization(ctx):
    from torch.nn.utils.parametrizations import orthogonal

    m = ParamNet(orthogonal)
    return step_loop(ctx, m, fused_adamw(m.parameters(), lr=1e-2), vecs(7))


class Disc(nn.Module):
    def __init__(self, sn):
        super().__init__()
        self.c1 = sn(nn.Linear(8, 16))
        self.c2 = sn(nn.Linear(16, 1))

    def forward(self, x):
        return self.c2(F.leaky_relu(self.c1(x), 0.2)).squeeze(-1)


def hinge_d(d, real, fake):
    return F.relu(1 - d(real)).mean() + F.relu(1 + d(fake)).mean()


def hinge_d_cat(d, real, fake):
    s = d(torch.cat([real, fake]))
    return F.relu(1 - s[: len(real)]).mean() + F.relu(1 + s[len(real) :]).mean()


def gan_data(n=8, b=8, seed=5):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(b, 8, generator=g) + 1, torch.randn(b, 8, generator=g)) for _ in range(n)]


@scenario("step")
def step_spectral_norm_parametrization_disc(ctx):
    from torch.nn.utils.parametrizations import spectral_norm

    d = Disc(spectral_norm)
    opt = fused_adamw(d.parameters(), lr=2e-4, betas=(0.0, 0.9))
    step = ctx.step(d, hinge_d_cat, opt)
    return {"d": d, "opt": opt, "losses": [step(r, f) for r, f in gan_data()]}


@scenario("capture")
def cap_spectral_norm_parametrization_disc_cat(ctx):
    from torch.nn.utils.parametrizations import spectral_norm

    d = Disc(spectral_norm)
    opt = torch.optim.Adam(d.parameters(), lr=2e-4, betas=(0.0, 0.9))
    losses = []
    with ctx.capture(d):
        for r, f in gan_data():
            opt.zero_grad()
            loss = hinge_d_cat(d, r, f)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
    return {"d": d, "opt": opt, "losses": losses}


@scenario("capture")
def cap_old_spectral_norm_hook_disc(ctx):
    d = Disc(nn.utils.spectral_norm)  # the deprecated pre-hook form, u updated in place
    opt = torch.optim.Adam(d.parameters(), lr=2e-4, betas=(0.0, 0.9))
    losses = []
    with ctx.capture(d):
        for r, f in gan_data():
            opt.zero_grad()
            loss = hinge_d_cat(d, r, f)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
    return {"d": d, "opt": opt, "losses": losses}


@scenario("capture")
def cap_old_weight_norm_hook(ctx):
    m = ParamNet(nn.utils.weight_norm)
    return plain_loop(ctx, m, torch.optim.SGD(m.parameters(), lr=0.1), vecs(8))


@scenario("capture")
def cap_parametrize_cached_region(ctx):
    from torch.nn.utils.parametrizations import weight_norm

    m = ParamNet(weight_norm)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    losses = []
    with ctx.capture(m):
        for x, y in vecs(8):
            opt.zero_grad()
            with parametrize.cached():
                loss = ce(m, x, y)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
    return {"m": m, "opt": opt, "losses": losses}


class Symmetric(nn.Module):
    def forward(self, x):
        return x.triu() + x.triu(1).transpose(-1, -2)

    def right_inverse(self, a):
        return a.triu()


def sym(lin):
    parametrize.register_parametrization(lin, "weight", Symmetric())
    return lin


@scenario("step")
def step_symmetric_parametrization_assigned_midrun(ctx):
    m = ParamNet(sym)
    opt = fused_adamw(m.parameters())
    step = ctx.step(m, ce, opt)
    losses = []
    for i, (x, y) in enumerate(vecs(8)):
        if i == 4:
            with torch.no_grad():
                m.a.weight = torch.eye(8) * 0.5  # through right_inverse, into original in place
        losses.append(step(x, y))
    return {"m": m, "opt": opt, "losses": losses}


@scenario("capture")
def cap_weight_norm_removed_midrun_new_optimizer(ctx):
    from torch.nn.utils.parametrizations import weight_norm

    m = ParamNet(weight_norm)
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    losses = []
    with ctx.capture(m):
        for i, (x, y) in enumerate(vecs(8)):
            if i == 4:
                parametrize.remove_parametrizations(m.a, "weight", leave_parametrized=True)
                opt = torch.optim.Adam(m.parameters(), lr=1e-2)
            opt.zero_grad()
            loss = ce(m, x, y)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
    return {"m": m, "opt": opt, "losses": losses}


# ===================================================================== G. activation checkpointing


class CkptNet(nn.Module):
    def __init__(self, reentrant=False, preserve=True, bn=False, drop=0.2, ctx_fn=None):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(
            nn.Sequential(
                nn.Linear(16, 16),
                nn.BatchNorm1d(16) if bn else nn.Identity(),
                nn.GELU(),
                nn.Dropout(drop),
            )
            for _ in range(2)
        )
        self.out = nn.Linear(16, 4)
        self.kw = {"use_reentrant": reentrant, "preserve_rng_state": preserve}
        if ctx_fn is not None:
            self.kw["context_fn"] = ctx_fn

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = h + checkpoint(b, h, **self.kw)
        return self.out(h)


@scenario("capture")
def cap_checkpoint_reentrant_dropout(ctx):
    m = CkptNet(reentrant=True)
    return plain_loop(ctx, m, torch.optim.SGD(m.parameters(), lr=0.1), vecs(8))


@scenario("step")
def step_checkpoint_reentrant_dropout(ctx):
    m = CkptNet(reentrant=True)
    return step_loop(ctx, m, fused_sgd(m.parameters()), vecs(7))


@scenario("capture")
def cap_checkpoint_no_preserve_rng_dropout(ctx):
    m = CkptNet(preserve=False)  # eager's recompute draws a new mask: its gradient is eager's
    return plain_loop(ctx, m, torch.optim.SGD(m.parameters(), lr=0.1), vecs(8))


@scenario("step")
def step_checkpoint_no_preserve_rng_dropout(ctx):
    m = CkptNet(preserve=False)
    return step_loop(ctx, m, fused_sgd(m.parameters()), vecs(7))


@scenario("capture")
def cap_checkpoint_bn_running_stats_updated_twice(ctx):
    m = CkptNet(bn=True, drop=0.0)  # the recompute updates BN's running stats a second time
    return plain_loop(ctx, m, torch.optim.SGD(m.parameters(), lr=0.1), vecs(8))


@scenario("step")
def step_checkpoint_bn_running_stats_updated_twice(ctx):
    m = CkptNet(bn=True, drop=0.0)
    return step_loop(ctx, m, fused_sgd(m.parameters()), vecs(7))


def sac_policy():
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def policy(ctx, op, *args, **kwargs):
        if op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return lambda: create_selective_checkpoint_contexts(policy)


@scenario("step")
def step_selective_activation_checkpoint_policy(ctx):
    m = CkptNet(ctx_fn=sac_policy())
    return step_loop(ctx, m, fused_sgd(m.parameters()), vecs(7))


@scenario("capture")
def cap_selective_activation_checkpoint_policy(ctx):
    m = CkptNet(ctx_fn=sac_policy())
    return plain_loop(ctx, m, torch.optim.SGD(m.parameters(), lr=0.1), vecs(8))


@scenario("step")
def step_checkpoint_sequential_segments(ctx):
    body = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(4)])

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp, self.body, self.out = nn.Linear(8, 16), body, nn.Linear(16, 4)

        def forward(self, x):
            return self.out(checkpoint_sequential(self.body, 2, self.inp(x), use_reentrant=False))

    m = Net()
    return step_loop(ctx, m, fused_adamw(m.parameters()), vecs(7))


# ===================================================================== H. custom autograd Functions


class GradReverse(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, alpha):
        ctx.alpha = alpha
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return -ctx.alpha * g, None


class DANN(nn.Module):
    def __init__(self):
        super().__init__()
        self.feat = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
        self.cls = nn.Linear(16, 4)
        self.dom = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, x, alpha):
        h = self.feat(x)
        return self.cls(h), self.dom(GradReverse.apply(h, alpha)).squeeze(-1)


@scenario("capture")
def cap_dann_grad_reverse_alpha_per_epoch(ctx):
    m = DANN()
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
    losses = []
    data = vecs(9)
    with ctx.capture(m):
        for i, (x, y) in enumerate(data):
            p = (i // 3) / 3
            alpha = 2.0 / (1 + math.exp(-10 * p)) - 1  # the DANN schedule, per epoch
            opt.zero_grad()
            logits, dom = m(x, alpha)
            loss = F.cross_entropy(logits, y) + F.binary_cross_entropy_with_logits(
                dom, (torch.arange(8) % 2).float()
            )
            loss.backward()
            opt.step()
            losses.append(loss.detach())
    return {"m": m, "opt": opt, "losses": losses}


@scenario("step")
def step_dann_grad_reverse_alpha_tensor(ctx):
    m = DANN()
    opt = fused_sgd(m.parameters())
    alpha = torch.tensor(0.0)  # a tensor, so the schedule needs no re-record

    class GRT(torch.autograd.Function):
        @staticmethod
        def forward(ctx_, x, a):
            ctx_.save_for_backward(a)
            return x.view_as(x)

        @staticmethod
        def backward(ctx_, g):
            (a,) = ctx_.saved_tensors
            return -a * g, None

    def loss_fn(model, x, y):
        h = model.feat(x)
        dom = model.dom(GRT.apply(h, alpha)).squeeze(-1)
        return F.cross_entropy(model.cls(h), y) + F.binary_cross_entropy_with_logits(
            dom, (torch.arange(8) % 2).float()
        )

    step = ctx.step(m, loss_fn, opt)
    losses = []
    for i, (x, y) in enumerate(vecs(8)):
        alpha.fill_(2.0 / (1 + math.exp(-10 * i / 8)) - 1)
        losses.append(step(x, y))
    return {"m": m, "opt": opt, "losses": losses}


class LSQ(torch.autograd.Function):
    """Learned step size quantization: straight-through with a gradient for the scale."""

    @staticmethod
    def forward(ctx, x, s, qmax):
        ctx.save_for_backward(x, s)
        ctx.qmax = qmax
        return (x / s).round().clamp(-qmax, qmax) * s

    @staticmethod
    def backward(ctx, g):
        x, s = ctx.saved_tensors
        q = x / s
        inside = (q.abs() <= ctx.qmax).to(g.dtype)
        gs = (g * (inside * (q.round() - q) + (1 - inside) * q.sign() * ctx.qmax)).sum()
        return g * inside, gs.view_as(s), None


class QuantNet(nn.Module):
    def __init__(self, bits=4):
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)
        self.s = nn.Parameter(torch.tensor(0.1))
        self.qmax = 2 ** (bits - 1) - 1

    def forward(self, x):
        w = LSQ.apply(self.a.weight, self.s, self.qmax)
        return self.b(F.relu(F.linear(x, w, self.a.bias)))


@scenario("capture")
def cap_lsq_quantizer_bits_lowered_midrun(ctx):
    m = QuantNet()
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    losses = []
    with ctx.capture(m):
        for i, (x, y) in enumerate(vecs(9)):
            if i == 5:
                m.qmax = 2 ** (2 - 1) - 1  # progressive quantization: 4 -> 2 bits
            opt.zero_grad()
            loss = ce(m, x, y)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
    return {"m": m, "opt": opt, "losses": losses}


@scenario("step")
def step_lsq_quantizer(ctx):
    m = QuantNet()
    return step_loop(ctx, m, fused_adamw(m.parameters(), lr=1e-2), vecs(7))


class TopKMask(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, k):
        idx = x.topk(k, dim=-1).indices
        mask = torch.zeros_like(x).scatter_(-1, idx, 1.0)
        ctx.save_for_backward(mask)
        ctx.mark_non_differentiable(idx)
        return x * mask, idx

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g, _gi):
        (mask,) = ctx.saved_tensors
        return g * mask, None


@scenario("step")
def step_topk_function_non_differentiable_output(ctx):
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
    head = nn.Linear(16, 4)
    opt = fused_adamw(list(m.parameters()) + list(head.parameters()))

    def loss_fn(model, x, y):
        h, idx = TopKMask.apply(model(x), 4)
        return F.cross_entropy(head(h), y) + 0.0 * idx.float().sum()

    return step_loop(ctx, m, opt, vecs(7), loss_fn=loss_fn) | {"head": head}


class MyLinear(torch.autograd.Function):
    @staticmethod
    def forward(x, w, b):
        return x @ w.t() + b

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, w, _ = inputs
        ctx.save_for_backward(x, w)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        gx = g @ w if ctx.needs_input_grad[0] else None
        gw = g.t() @ x if ctx.needs_input_grad[1] else None
        gb = g.sum(0) if ctx.needs_input_grad[2] else None
        return gx, gw, gb


class MyLinearNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        h = F.relu(MyLinear.apply(x, self.l1.weight, self.l1.bias))
        return MyLinear.apply(h, self.l2.weight, self.l2.bias)


@scenario("capture")
def cap_setup_context_function_needs_input_grad_freeze_toggle(ctx):
    m = MyLinearNet()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    losses = []
    with ctx.capture(m):
        for i, (x, y) in enumerate(vecs(9)):
            m.l1.weight.requires_grad_(i % 3 != 1)  # a layer frozen every third step
            opt.zero_grad(set_to_none=True)
            loss = ce(m, x, y)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
    return {"m": m, "opt": opt, "losses": losses}


class ItemFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.k = max(1, int(x.abs().max().item() * 2))  # a host read inside the Function
        return x / ctx.k

    @staticmethod
    def backward(ctx, g):
        return g / ctx.k


@scenario("capture")
def cap_function_host_read_in_ctx(ctx):
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)

        def forward(self, x):
            return self.b(ItemFn.apply(self.a(x)))

    m = Net()
    return plain_loop(ctx, m, torch.optim.SGD(m.parameters(), lr=0.1), vecs(8))


# ===================================================================== I. hooks


@scenario("capture")
def cap_root_forward_pre_hook_normalizes_input(ctx):
    m = mlp()
    stats = {"scale": 1.0}
    m.register_forward_pre_hook(lambda mod, args: (args[0] * stats["scale"],))
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    losses = []
    with ctx.capture(m):
        for i, (x, y) in enumerate(vecs(8)):
            stats["scale"] = 1.0 / (1 + 0.1 * i)
            opt.zero_grad()
            loss = ce(m, x, y)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
    return {"m": m, "opt": opt, "losses": losses}


@scenario("capture")
def cap_submodule_pre_hook_scale_from_closure(ctx):
    m = mlp()
    stats = {"scale": 1.0}
    m[2].register_forward_pre_hook(lambda mod, args: (args[0] * stats["scale"],))
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    losses = []
    with ctx.capture(m):
        for i, (x, y) in enumerate(vecs(8)):
            stats["scale"] = 1.0 / (1 + (i // 3))
            opt.zero_grad()
            loss = ce(m, x, y)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
    return {"m": m, "opt": opt, "losses": losses}


@scenario("capture")
def cap_full_backward_hook_logs_grad_norms(ctx):
    m = mlp()
    log = []
    m[0].register_full_backward_hook(lambda mod, gi, go: log.append(go[0].norm().detach()))
    out = plain_loop(ctx, m, torch.optim.SGD(m.parameters(), lr=0.05), vecs(8))
    return out | {"log": log, "nlog": len(log)}


@scenario("capture")
def cap_forward_hook_logs_activation_stats(ctx):
    m = mlp(bn=True)
    stats = []
    for layer in m:
        if isinstance(layer, nn.Linear):
            layer.register_forward_hook(lambda mod, i, o: stats.append(o.detach().std()))
    out = plain_loop(ctx, m, torch.optim.SGD(m.parameters(), lr=0.05), vecs(8))
    return out | {"stats": stats, "n": len(stats)}


class ClampGrad(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)
        self.c = 1e-2

    def forward(self, x):
        h = torch.relu(self.a(x))
        if h.requires_grad:
            h.register_hook(lambda g: g.clamp(-self.c, self.c))
        return self.b(h)


@scenario("capture")
def cap_tensor_hook_in_forward_clamp_attr_changes(ctx):
    m = ClampGrad()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    losses = []
    with ctx.capture(m):
        for i, (x, y) in enumerate(vecs(8)):
            if i == 4:
                m.c = 1e-3
            opt.zero_grad()
            loss = ce(m, x, y)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
    return {"m": m, "opt": opt, "losses": losses}


@scenario("step")
def step_tensor_hook_in_forward_clamp(ctx):
    m = ClampGrad()
    return step_loop(ctx, m, fused_sgd(m.parameters()), vecs(7))


@scenario("step")
def step_full_backward_pre_hook_scales_grad_output(ctx):
    m = mlp()
    m[3].register_full_backward_pre_hook(lambda mod, go: (go[0] * 0.5,))
    return step_loop(ctx, m, fused_sgd(m.parameters()), vecs(7))


@scenario("capture")
def cap_full_backward_pre_hook_scales_grad_output(ctx):
    m = mlp()
    m[3].register_full_backward_pre_hook(lambda mod, go: (go[0] * 0.5,))
    return plain_loop(ctx, m, torch.optim.SGD(m.parameters(), lr=0.1), vecs(8))


class Masked(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = mlp(h=16)
        self.register_buffer("mask", torch.ones(16))
        self.net[0].register_forward_hook(lambda mod, i, o: o * self.mask)


@scenario("capture")
def cap_forward_hook_output_mask_buffer_pruned_inplace(ctx):
    mm = Masked()
    m = mm.net
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    losses = []
    with ctx.capture(m):
        for i, (x, y) in enumerate(vecs(9)):
            if i % 3 == 2:
                with torch.no_grad():  # prune the weakest remaining unit
                    score = m[0].weight.norm(dim=1) + (1 - mm.mask) * 1e9
                    mm.mask[score.argmin()] = 0
            opt.zero_grad()
            loss = ce(m, x, y)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
    return {"m": m, "mask": mm.mask, "opt": opt, "losses": losses}


@scenario("capture")
def cap_global_module_forward_hook_registered_midrun(ctx):
    from torch.nn.modules.module import register_module_forward_hook

    m = mlp()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    seen, losses, h = [], [], None
    with ctx.capture(m):
        for i, (x, y) in enumerate(vecs(8)):
            if i == 3:  # a profiler-like global hook, on for three steps
                h = register_module_forward_hook(
                    lambda mod, inp, out: seen.append(type(mod).__name__)
                )
                h2 = register_module_forward_hook(
                    lambda mod, inp, out: out * 0.5 if isinstance(mod, nn.ReLU) else None
                )
            if i == 6:
                h.remove()
                h2.remove()
            opt.zero_grad()
            loss = ce(m, x, y)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
    return {"m": m, "opt": opt, "losses": losses, "seen": seen}


@scenario("step")
def step_optimizer_step_post_hook_weight_clamp(ctx):
    m = mlp()
    opt = fused_sgd(m.parameters())

    def clamp(o, args, kwargs):
        with torch.no_grad():
            for p in m.parameters():
                p.clamp_(-0.3, 0.3)

    opt.register_step_post_hook(clamp)
    return step_loop(ctx, m, opt, vecs(7))


@scenario("capture")
def cap_post_accumulate_grad_hook_optimizer_in_backward(ctx):
    m = mlp()
    opts = {p: torch.optim.SGD([p], lr=0.05, momentum=0.9) for p in m.parameters()}

    def hook(p):
        opts[p].step()
        opts[p].zero_grad(set_to_none=True)

    for p in m.parameters():
        p.register_post_accumulate_grad_hook(hook)
    losses = []
    with ctx.capture(m):
        for x, y in vecs(8):
            loss = ce(m, x, y)
            loss.backward()
            losses.append(loss.detach())
    return {"m": m, "opts": list(opts.values()), "losses": losses}


@scenario("step")
def step_post_accumulate_grad_hook_grad_stats(ctx):
    m = mlp()
    sq = {n: torch.zeros(()) for n, _ in m.named_parameters()}

    def hook(p, n):
        sq[n].add_(p.grad.pow(2).sum())

    for n, p in m.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, n=n: hook(p, n))
    out = step_loop(ctx, m, fused_sgd(m.parameters()), vecs(7))
    return out | {"sq": sq}


@scenario("capture")
def cap_param_hook_mask_updated_inplace(ctx):
    m = mlp()
    mask = torch.ones_like(m[0].weight)
    m[0].weight.register_hook(lambda g: g * mask)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    losses = []
    with ctx.capture(m):
        for i, (x, y) in enumerate(vecs(8)):
            if i % 2 == 1:
                with torch.no_grad():
                    mask.copy_((m[0].weight.abs() > m[0].weight.abs().quantile(0.1 * i)).float())
            opt.zero_grad()
            loss = ce(m, x, y)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
    return {"m": m, "opt": opt, "losses": losses}


@scenario("capture")
def cap_state_dict_hooks_checkpoint_roundtrip(ctx):
    m = mlp()

    def post(mod, sd, prefix, local):
        sd[prefix + "meta_version"] = torch.tensor(2)

    def pre(mod, sd, prefix, *a):
        sd.pop(prefix + "meta_version", None)

    m.register_state_dict_post_hook(post)
    m.register_load_state_dict_pre_hook(pre)
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    losses = []
    with ctx.capture(m):
        for i, (x, y) in enumerate(vecs(8)):
            opt.zero_grad()
            loss = ce(m, x, y)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
            if i == 3:
                buf = io.BytesIO()
                torch.save({"m": m.state_dict(), "o": opt.state_dict()}, buf)
                buf.seek(0)
                ck = torch.load(buf, weights_only=True)
                m.load_state_dict(ck["m"])
                opt.load_state_dict(ck["o"])
    return {"m": m, "opt": opt, "losses": losses}


# ===================================================================== J. torchvision models


def tv_model(name, **kw):
    return getattr(tv().models, name)(num_classes=10, **kw)


@scenario("capture")
def cap_tv_resnet18_channels_last(ctx):
    m = tv_model("resnet18").to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    losses = []
    with ctx.capture(m):
        for x, y in imgs(5, hw=32):
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(m(x.to(memory_format=torch.channels_last)), y)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
    return {"m": m, "opt": opt, "losses": losses}


@scenario("step")
def step_tv_resnet18_bf16_label_smoothing(ctx):
    m = tv_model("resnet18", zero_init_residual=True)
    opt = fused_sgd(m.parameters(), lr=torch.tensor(0.05), nesterov=True)

    def loss_fn(model, x, y):
        return F.cross_entropy(model(x), y, label_smoothing=0.1)

    return step_loop(ctx, m, opt, imgs(5, hw=16), loss_fn=loss_fn, precision="bf16-mixed")


@scenario("step")
def step_tv_mobilenet_v3_small_adamw(ctx):
    m = tv_model("mobilenet_v3_small")
    return step_loop(ctx, m, fused_adamw(m.parameters()), imgs(5, hw=32), max_norm=2.0)


@scenario("capture")
def cap_tv_mobilenet_v2_frozen_bn_finetune(ctx):
    m = tv_model("mobilenet_v2")
    m.features.requires_grad_(False)
    opt = torch.optim.SGD(m.classifier.parameters(), lr=0.05)
    losses = []
    with ctx.capture(m):
        for x, y in imgs(5, hw=32):
            m.train()
            m.features.apply(lambda mod: mod.eval() if isinstance(mod, nn.BatchNorm2d) else None)
            opt.zero_grad()
            loss = F.cross_entropy(m(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
    return {"m": m, "opt": opt, "losses": losses}


@scenario("capture")
def cap_tv_efficientnet_b0_stochastic_depth(ctx):
    m = tv_model("efficientnet_b0", stochastic_depth_prob=0.2)
    opt = torch.optim.RMSprop(m.parameters(), lr=1e-3)
    losses = []
    with ctx.capture(m):
        for x, y in imgs(4, b=2, hw=32):
            opt.zero_grad()
            loss = F.cross_entropy(m(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
    return {"m": m, "opt": opt, "losses": losses}


@scenario("capture")
def cap_tv_shufflenet_channel_shuffle(ctx):
    m = tv_model("shufflenet_v2_x0_5")
    return plain_loop(ctx, m, torch.optim.SGD(m.parameters(), lr=0.05), imgs(5, hw=32))


# ===================================================================== K. embeddings


class BagNet(nn.Module):
    def __init__(self, v=30, d=8):
        super().__init__()
        self.emb = nn.Embedding(v, d, padding_idx=0, scale_grad_by_freq=True)
        self.fc = nn.Linear(d, 4)

    def forward(self, ids):
        return self.fc(self.emb(ids).sum(1))


def id_batches(n=8, b=4, t=6, v=30, seed=21):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(1, v, (b, t), generator=g)
        lens = torch.randint(2, t + 1, (b,), generator=g)
        ids[torch.arange(t)[None] >= lens[:, None]] = 0  # padding
        out.append((ids, torch.randint(0, 4, (b,), generator=g)))
    return out


@scenario("capture")
def cap_embedding_padding_idx_scale_grad_by_freq(ctx):
    m = BagNet()
    return plain_loop(ctx, m, torch.optim.Adam(m.parameters(), lr=1e-2), id_batches())


@scenario("step")
def step_embedding_padding_idx_scale_grad_by_freq(ctx):
    m = BagNet()
    return step_loop(ctx, m, fused_adamw(m.parameters(), lr=1e-2), id_batches(7))


class EBNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.bag = nn.EmbeddingBag(40, 8, mode="sum")
        self.fc = nn.Linear(8, 4)

    def forward(self, flat, offsets, w):
        return self.fc(self.bag(flat, offsets, per_sample_weights=w))


@scenario("step")
def step_embeddingbag_offsets_per_sample_weights(ctx):
    m = EBNet()
    opt = fused_sgd(m.parameters())
    step = ctx.step(m, lambda mm, f, o, w, y: F.cross_entropy(mm(f, o, w), y), opt)
    g = torch.Generator().manual_seed(4)
    losses = []
    for _ in range(7):
        lens = torch.randint(1, 5, (4,), generator=g)
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)[:-1]])
        flat = torch.randint(0, 40, (12,), generator=g)[: int(lens.sum())]  # a ragged total
        flat = torch.cat([flat, torch.zeros(12 - len(flat), dtype=torch.long)])  # padded to 12
        w = torch.rand(12, generator=g)
        losses.append(step(flat, offsets, w, torch.randint(0, 4, (4,), generator=g)))
    return {"m": m, "opt": opt, "losses": losses}


@scenario("capture")
def cap_embedding_bag_mean_ragged_total_lengths(ctx):
    m = nn.EmbeddingBag(40, 8, mode="mean")
    head = nn.Linear(8, 4)
    opt = torch.optim.SGD(list(m.parameters()) + list(head.parameters()), lr=0.1)
    g = torch.Generator().manual_seed(4)
    losses = []
    with ctx.capture(m):
        for _ in range(8):
            lens = torch.randint(1, 4, (4,), generator=g)
            offsets = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)[:-1]])
            flat = torch.randint(0, 40, (int(lens.sum()),), generator=g)
            opt.zero_grad()
            loss = F.cross_entropy(head(m(flat, offsets)), torch.randint(0, 4, (4,), generator=g))
            loss.backward()
            opt.step()
            losses.append(loss.detach())
    return {"m": m, "head": head, "opt": opt, "losses": losses}


@scenario("capture")
def cap_embedding_pad_row_rezeroed_each_step(ctx):
    m = BagNet()
    m.emb.padding_idx = None  # a model built without padding_idx, the row kept at zero by hand
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    losses = []
    with ctx.capture(m):
        for ids, y in id_batches():
            opt.zero_grad()
            loss = ce(m, ids, y)
            loss.backward()
            opt.step()
            with torch.no_grad():
                m.emb.weight[0].zero_()
            losses.append(loss.detach())
    return {"m": m, "opt": opt, "losses": losses}


# ===================================================================== L. losses


@scenario("step")
def step_ce_smoothing_weights_ignore_index(ctx):
    m = mlp()
    w = torch.tensor([1.0, 2.0, 0.5, 1.0])

    def loss_fn(model, x, y):
        return F.cross_entropy(model(x), y, weight=w, ignore_index=-100, label_smoothing=0.1)

    g = torch.Generator().manual_seed(8)
    data = []
    for x, y in vecs(7):
        y = y.clone()
        y[torch.rand(8, generator=g) < 0.3] = -100  # a varying number ignored
        data.append((x, y))
    return step_loop(ctx, m, fused_adamw(m.parameters()), data, loss_fn=loss_fn)


class MultiTask(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
        self.heads = nn.ModuleDict({"cls": nn.Linear(16, 4), "reg": nn.Linear(16, 2),
                                    "aux": nn.Linear(16, 3)})  # fmt: skip

    def forward(self, x):
        h = self.body(x)
        return {k: head(h) for k, head in self.heads.items()}


def mt_data(n=8, seed=9):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 8, generator=g),
             {"cls": torch.randint(0, 4, (8,), generator=g), "reg": torch.randn(8, 2, generator=g),
              "aux": torch.randint(0, 3, (8,), generator=g)}) for _ in range(n)]  # fmt: skip


def mt_losses(out, t):
    return {"cls": F.cross_entropy(out["cls"], t["cls"]), "reg": F.smooth_l1_loss(out["reg"], t["reg"]),
            "aux": F.cross_entropy(out["aux"], t["aux"])}  # fmt: skip


@scenario("capture")
def cap_uncertainty_weighted_multitask_log_vars(ctx):
    m = MultiTask()
    log_vars = nn.Parameter(torch.zeros(3))  # Kendall et al.: learned outside the model
    opt = torch.optim.Adam([*list(m.parameters()), log_vars], lr=1e-2)
    out_l = []
    with ctx.capture(m):
        for x, t in mt_data():
            opt.zero_grad()
            ls = mt_losses(m(x), t)
            loss = sum(torch.exp(-log_vars[i]) * v + log_vars[i] for i, v in enumerate(ls.values()))
            loss.backward()
            opt.step()
            out_l.append({k: v.detach() for k, v in ls.items()})
    return {"m": m, "lv": log_vars, "opt": opt, "losses": out_l}


class UncertaintyWeights(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.log_vars = nn.Parameter(torch.zeros(n))

    def forward(self, ls):
        return sum(torch.exp(-self.log_vars[i]) * v + self.log_vars[i] for i, v in enumerate(ls))


@scenario("step")
def step_uncertainty_weighting_module_in_closure(ctx):
    m = MultiTask()
    uw = UncertaintyWeights(3)
    opt = fused_adamw(list(m.parameters()) + list(uw.parameters()), lr=1e-2)

    def loss_fn(model, x, t):
        return uw(list(mt_losses(model(x), t).values()))

    step = ctx.step(m, loss_fn, opt)
    return {"m": m, "uw": uw, "opt": opt, "losses": [step(x, t) for x, t in mt_data(7)]}


@scenario("step")
def step_multitask_weights_dict_changed_per_epoch(ctx):
    m = MultiTask()
    opt = fused_sgd(m.parameters())
    wts = {"cls": 1.0, "reg": 1.0, "aux": 0.5}

    def loss_fn(model, x, t):
        ls = mt_losses(model(x), t)
        return sum(wts[k] * v for k, v in ls.items())

    step = ctx.step(m, loss_fn, opt)
    losses = []
    for i, (x, t) in enumerate(mt_data(9)):
        if i % 3 == 0 and i:
            wts["aux"] *= 0.5  # anneal the auxiliary task
        losses.append(step(x, t))
    return {"m": m, "opt": opt, "losses": losses}


class CTCNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.GRU(6, 12, batch_first=True)
        self.fc = nn.Linear(12, 5)

    def forward(self, x):
        return self.fc(self.rnn(x)[0]).log_softmax(-1)


@scenario("capture")
def cap_ctc_loss_variable_target_lengths(ctx):
    m = CTCNet()
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(6)
    losses = []
    with ctx.capture(m):
        for _ in range(8):
            x = torch.randn(3, 10, 6, generator=g)
            tl = torch.randint(2, 5, (3,), generator=g)
            tgt = torch.randint(1, 5, (int(tl.sum()),), generator=g)
            il = torch.tensor([10, 9, 8])
            opt.zero_grad()
            lp = m(x).transpose(0, 1)
            loss = F.ctc_loss(lp, tgt, il, tl, zero_infinity=True)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
    return {"m": m, "opt": opt, "losses": losses}


class TinyLM(nn.Module):
    def __init__(self, v=20, d=12):
        super().__init__()
        self.emb = nn.Embedding(v, d, padding_idx=0)
        self.rnn = nn.GRU(d, d, batch_first=True)
        self.out = nn.Linear(d, v)

    def forward(self, x):
        return self.out(self.rnn(self.emb(x))[0])


@scenario("step")
def step_nll_sum_over_nonpad_token_count(ctx):
    m = TinyLM()

    def loss_fn(model, x, y):
        lp = model(x).log_softmax(-1)
        tot = F.nll_loss(lp.flatten(0, 1), y.flatten(), ignore_index=0, reduction="sum")
        return tot / (y != 0).sum().clamp_min(1)

    data = [(ids, ids.roll(-1, 1)) for ids, _ in id_batches(7, v=20)]
    return step_loop(ctx, m, fused_adamw(m.parameters()), data, loss_fn=loss_fn)


@scenario("capture")
def cap_triplet_batch_hard_mining(ctx):
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    losses = []
    with ctx.capture(m):
        for x, y in vecs(8):
            opt.zero_grad()
            e = F.normalize(m(x), dim=-1)
            d = torch.cdist(e, e)
            same = y[:, None] == y[None]
            hardest_pos = (d * same).max(1).values
            hardest_neg = (d + same * 1e4).min(1).values
            loss = F.relu(hardest_pos - hardest_neg + 0.2).mean()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
    return {"m": m, "opt": opt, "losses": losses}


@scenario("step")
def step_mixup_beta_sampled_in_loss_torch_rng(ctx):
    m = mlp()
    beta = torch.distributions.Beta(torch.tensor(0.4), torch.tensor(0.4))

    def loss_fn(model, x, y):
        lam = beta.sample()
        perm = torch.randperm(x.size(0))
        out = model(lam * x + (1 - lam) * x[perm])
        return lam * F.cross_entropy(out, y) + (1 - lam) * F.cross_entropy(out, y[perm])

    out = step_loop(ctx, m, fused_sgd(m.parameters()), vecs(7), loss_fn=loss_fn)
    return out | {"rng": torch.rand(3)}


@scenario("capture")
def cap_mixup_beta_torch_rng_outside(ctx):
    m = mlp(bn=True)
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    beta = torch.distributions.Beta(torch.tensor(0.4), torch.tensor(0.4))
    losses = []
    with ctx.capture(m):
        for x, y in vecs(8):
            lam = beta.sample()
            perm = torch.randperm(x.size(0))
            opt.zero_grad()
            out = m(lam * x + (1 - lam) * x[perm])
            loss = lam * F.cross_entropy(out, y) + (1 - lam) * F.cross_entropy(out, y[perm])
            loss.backward()
            opt.step()
            losses.append(loss.detach())
    return {"m": m, "opt": opt, "losses": losses, "rng": torch.rand(3)}


@scenario("step")
def step_cutmix_box_with_item_in_loss(ctx):
    m = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                      nn.Flatten(), nn.Linear(8, 10))  # fmt: skip

    def loss_fn(model, x, y):
        lam = torch.rand(())
        cut = int((1 - lam).sqrt().item() * 16)
        cx, cy = torch.randint(0, 16 - cut + 1, (2,)).tolist()
        perm = torch.randperm(x.size(0))
        x = x.clone()
        x[:, :, cy : cy + cut, cx : cx + cut] = x[perm, :, cy : cy + cut, cx : cx + cut]
        lam_adj = 1 - cut * cut / 256
        out = model(x)
        return lam_adj * F.cross_entropy(out, y) + (1 - lam_adj) * F.cross_entropy(out, y[perm])

    out = step_loop(ctx, m, fused_sgd(m.parameters()), imgs(6), loss_fn=loss_fn)
    return out | {"rng": torch.rand(3)}


@scenario("capture")
def cap_dict_losses_logged_as_floats(ctx):
    m = MultiTask()
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    hist = []
    with ctx.capture(m):
        for x, t in mt_data():
            opt.zero_grad()
            ls = mt_losses(m(x), t)
            total = sum(ls.values())
            total.backward()
            opt.step()
            hist.append({k: float(v) for k, v in ls.items()})
    return {"m": m, "opt": opt, "hist": hist}


# ===================================================================== M. modes


@scenario("capture")
def cap_train_with_bn_eval_submodules(ctx):
    m = mlp(bn=True, drop=0.1)
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    losses = []
    with ctx.capture(m):
        for i, (x, y) in enumerate(vecs(8)):
            m.train()
            if i >= 3:
                m[1].eval()  # freeze BN statistics after warm-up
            opt.zero_grad()
            loss = ce(m, x, y)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
    return {"m": m, "opt": opt, "losses": losses}


@scenario("step")
def step_submodule_eval_midrun_bn_stats_frozen(ctx):
    m = mlp(bn=True, drop=0.1)
    opt = fused_sgd(m.parameters())
    step = ctx.step(m, ce, opt)
    losses = []
    for i, (x, y) in enumerate(vecs(8)):
        if i == 3:
            m[1].eval()
        losses.append(step(x, y))
    return {"m": m, "opt": opt, "losses": losses}


@scenario("capture")
def cap_alternate_weights_and_adversarial_input(ctx):
    m = mlp()
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    delta = torch.zeros(8, 8, requires_grad=True)
    dopt = torch.optim.SGD([delta], lr=0.1)
    losses = []
    with ctx.capture(m):
        for i, (x, y) in enumerate(vecs(10)):
            if i % 2 == 0:  # attack: weights frozen, maximise the loss in delta
                m.requires_grad_(False)
                dopt.zero_grad()
                loss = -ce(m, x + delta, y)
                loss.backward()
                dopt.step()
                with torch.no_grad():
                    delta.clamp_(-0.1, 0.1)
                m.requires_grad_(True)
            else:
                opt.zero_grad()
                loss = ce(m, x + delta.detach(), y)
                loss.backward()
                opt.step()
            losses.append(loss.detach())
    return {"m": m, "delta": delta, "opt": opt, "losses": losses}


# ===================================================================== N. freeze, groups, resume


class TwoBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
        self.b = nn.Sequential(nn.Linear(16, 16), nn.ReLU())
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.b(self.a(x)))


@scenario("capture")
def cap_alternating_block_freeze_every_step(ctx):
    m = TwoBlock()
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    losses = []
    with ctx.capture(m):
        for i, (x, y) in enumerate(vecs(10)):
            m.a.requires_grad_(i % 2 == 0)
            m.b.requires_grad_(i % 2 == 1)
            opt.zero_grad(set_to_none=True)
            loss = ce(m, x, y)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
    return {"m": m, "opt": opt, "losses": losses}


@scenario("step")
def step_alternating_block_freeze_every_step(ctx):
    m = TwoBlock()
    opt = fused_adamw(m.parameters())
    step = ctx.step(m, ce, opt)
    losses = []
    for i, (x, y) in enumerate(vecs(9)):
        m.a.requires_grad_(i % 2 == 0)
        m.b.requires_grad_(i % 2 == 1)
        losses.append(step(x, y))
    return {"m": m, "opt": opt, "losses": losses}


class Growing(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
        self.heads = nn.ModuleList([nn.Linear(16, 4)])

    def forward(self, x):
        h = self.body(x)
        return sum(head(h) for head in self.heads)


@scenario("step")
def step_new_head_attached_midrun_add_param_group(ctx):
    m = Growing()
    opt = fused_adamw(m.parameters())
    step = ctx.step(m, ce, opt)
    losses = []
    for i, (x, y) in enumerate(vecs(8)):
        if i == 4:
            head = nn.Linear(16, 4)
            nn.init.zeros_(head.weight)
            m.heads.append(head)
            opt.add_param_group({"params": head.parameters(), "lr": 1e-2})
        losses.append(step(x, y))
    return {"m": m, "opt": opt, "losses": losses}


@scenario("capture")
def cap_new_head_attached_midrun_add_param_group(ctx):
    m = Growing()
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)
    losses = []
    with ctx.capture(m):
        for i, (x, y) in enumerate(vecs(8)):
            if i == 4:
                head = nn.Linear(16, 4)
                m.heads.append(head)
                opt.add_param_group({"params": head.parameters(), "lr": 1e-2})
            opt.zero_grad()
            loss = ce(m, x, y)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
    return {"m": m, "opt": opt, "losses": losses}


@scenario("capture")
def cap_rewind_to_earlier_checkpoint_on_spike(ctx):
    m = mlp(bn=True)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    losses, ckpt = [], None
    with ctx.capture(m):
        for i, (x, y) in enumerate(vecs(10)):
            if i % 3 == 0:
                ckpt = copy.deepcopy({"m": m.state_dict(), "o": opt.state_dict()})
            opt.zero_grad()
            loss = ce(m, x * (20.0 if i == 5 else 1.0), y)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
            if loss.item() > 5.0:  # spike: go back to the last checkpoint
                m.load_state_dict(ckpt["m"])
                opt.load_state_dict(ckpt["o"])
    return {"m": m, "opt": opt, "losses": losses}


@scenario("step")
def step_rewind_checkpoint_with_scheduler_state(ctx):
    m = mlp(bn=True)
    opt = fused_adamw(m.parameters(), lr=torch.tensor(1e-2))
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
    step = ctx.step(m, ce, opt)
    losses, ckpt = [], None
    for i, (x, y) in enumerate(vecs(10)):
        if i % 3 == 0:
            ckpt = copy.deepcopy(
                {"m": m.state_dict(), "o": opt.state_dict(), "s": sched.state_dict()}
            )
        loss = step(x * (20.0 if i == 5 else 1.0), y)
        sched.step()
        losses.append(loss)
        if loss.item() > 5.0:
            m.load_state_dict(ckpt["m"])
            opt.load_state_dict(ckpt["o"])
            sched.load_state_dict(ckpt["s"])
    return {"m": m, "opt": opt, "losses": losses, "lr": opt.param_groups[0]["lr"]}


@scenario("capture")
def cap_optimizer_recreated_each_epoch(ctx):
    m = mlp()
    losses = []
    with ctx.capture(m):
        for ep in range(3):
            opt = torch.optim.SGD(m.parameters(), lr=0.1 / (ep + 1), momentum=0.9)
            for x, y in vecs(3, seed=ep):
                opt.zero_grad()
                loss = ce(m, x, y)
                loss.backward()
                opt.step()
                losses.append(loss.detach())
    return {"m": m, "opt": opt, "losses": losses}


@scenario("step")
def step_optimizer_state_loaded_from_other_run(ctx):
    m = mlp()
    opt = fused_adamw(m.parameters())
    donor = mlp()
    dopt = fused_adamw(donor.parameters())
    for x, y in vecs(2, seed=3):  # another run's state, loaded mid-training
        dopt.zero_grad()
        ce(donor, x, y).backward()
        dopt.step()
    step = ctx.step(m, ce, opt)
    losses = []
    for i, (x, y) in enumerate(vecs(8)):
        if i == 4:
            m.load_state_dict(donor.state_dict())
            opt.load_state_dict(dopt.state_dict())
        losses.append(step(x, y))
    return {"m": m, "opt": opt, "losses": losses}


# ===================================================================== O. torch.compile


@scenario("step")
def step_compiled_model_backend_eager(ctx):
    torch._dynamo.reset()
    m = mlp(bn=True)
    cm = torch.compile(m, backend="eager")
    return step_loop(ctx, cm, fused_adamw(m.parameters()), vecs(6)) | {"m": m}


@scenario("capture")
def cap_model_with_compiled_submodule_aot_eager(ctx):
    torch._dynamo.reset()

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = torch.compile(
                nn.Sequential(nn.Linear(8, 16), nn.GELU()), backend="aot_eager"
            )
            self.head = nn.Linear(16, 4)

        def forward(self, x):
            return self.head(self.body(x))

    m = Net()
    return plain_loop(ctx, m, torch.optim.SGD(m.parameters(), lr=0.1), vecs(6))


# ===================================================================== P. Lightning


def lit_net():
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.1),
                         nn.Linear(16, 4))  # fmt: skip


def lit_base():
    import lightning as L

    class Base(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = lit_net()
            self.losses = []

        def training_step(self, batch, idx):
            x, y = batch
            loss = F.cross_entropy(self.net(x), y)
            self.log("loss", loss)
            self.losses.append(loss.detach())
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9, fused=True)

    return Base


@scenario("callback")
def cb_opt_step_clip_value_accum3_bf16(ctx):
    class M(lit_base()):
        def configure_optimizers(self):  # Lightning refuses clipping a fused one under AMP
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    mod = M()
    tr = trainer(callbacks=callbacks(ctx, "net", optimizer_step=True), precision="bf16-mixed",
                 gradient_clip_val=0.05, gradient_clip_algorithm="value", accumulate_grad_batches=3)  # fmt: skip
    tr.fit(mod, loader(12))
    return {"net": mod.net, "opt": mod.optimizers().optimizer, "losses": mod.losses}


@scenario("callback")
def cb_step_interval_onecycle_tensor_lr(ctx):
    class M(lit_base()):
        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=torch.tensor(1e-2), fused=True,
                                    capturable=True)  # fmt: skip
            sch = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=12,
                                                      cycle_momentum=False)  # fmt: skip
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sch, "interval": "step"}}

    mod = M()
    tr = trainer(callbacks=callbacks(ctx, "net", optimizer_step=True), gradient_clip_val=1.0)
    tr.fit(mod, loader(12))
    return {"net": mod.net, "opt": mod.optimizers().optimizer, "losses": mod.losses}


@scenario("callback")
def cb_backbone_finetuning_callback(ctx):
    from lightning.pytorch.callbacks import BackboneFinetuning

    class M(lit_base()):
        def __init__(self):
            super().__init__()
            self.backbone = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
            self.net = nn.Linear(16, 4)

        def training_step(self, batch, idx):
            x, y = batch
            loss = F.cross_entropy(self.net(self.backbone(x)), y)
            self.losses.append(loss.detach())
            return loss

        def configure_optimizers(self):
            return torch.optim.Adam(filter(lambda p: p.requires_grad, self.parameters()), lr=1e-2)

    mod = M()
    ft = BackboneFinetuning(unfreeze_backbone_at_epoch=1, lambda_func=lambda e: 1.5, verbose=False)
    tr = trainer(callbacks=[ft, *callbacks(ctx, "backbone", "net")], max_epochs=3)
    tr.fit(mod, loader(5))
    return {"mod": mod, "opt": mod.optimizers().optimizer, "losses": mod.losses}


@scenario("callback")
def cb_stochastic_weight_averaging_callback(ctx):
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    class M(lit_base()):
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    mod = M()
    swa = StochasticWeightAveraging(swa_lrs=0.02, swa_epoch_start=1, annealing_epochs=1)
    tr = trainer(callbacks=[swa, *callbacks(ctx, "net")], max_epochs=3)
    tr.fit(mod, loader(4))
    return {"net": mod.net, "losses": mod.losses}


@scenario("callback")
def cb_manual_gan_toggle_optimizer(ctx):
    import lightning as L

    class GAN(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False
            self.gen = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
            self.disc = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
            self.losses = []

        def configure_optimizers(self):
            return (torch.optim.Adam(self.gen.parameters(), lr=1e-3, betas=(0.5, 0.9)),
                    torch.optim.Adam(self.disc.parameters(), lr=1e-3, betas=(0.5, 0.9)))  # fmt: skip

        def training_step(self, batch, idx):
            real, _ = batch
            og, od = self.optimizers()
            z = torch.randn(real.size(0), 4)
            self.toggle_optimizer(od)
            fake = self.gen(z).detach()
            d_loss = F.softplus(-self.disc(real)).mean() + F.softplus(self.disc(fake)).mean()
            od.zero_grad()
            self.manual_backward(d_loss)
            od.step()
            self.untoggle_optimizer(od)
            self.toggle_optimizer(og)
            g_loss = F.softplus(-self.disc(self.gen(z))).mean()
            og.zero_grad()
            self.manual_backward(g_loss)
            og.step()
            self.untoggle_optimizer(og)
            self.losses += [d_loss.detach(), g_loss.detach()]

    mod = GAN()
    tr = trainer(callbacks=callbacks(ctx, "gen", "disc"))
    tr.fit(mod, loader(8))
    return {"mod": mod, "losses": mod.losses}


@scenario("callback")
def cb_automatic_resume_from_checkpoint(ctx, tmp=None):
    import tempfile

    from lightning.pytorch.callbacks import ModelCheckpoint

    d = tempfile.mkdtemp()
    mod = lit_base()()
    ck = ModelCheckpoint(dirpath=d, save_last=True)
    tr = trainer(callbacks=[ck, *callbacks(ctx, "net", optimizer_step=True)],
                 enable_checkpointing=True, max_epochs=1)  # fmt: skip
    tr.fit(mod, loader(6))
    mod2 = lit_base()()
    tr2 = trainer(callbacks=[ModelCheckpoint(dirpath=d), *callbacks(ctx, "net", optimizer_step=True)],
                  enable_checkpointing=True, max_epochs=2)  # fmt: skip
    tr2.fit(mod2, loader(6), ckpt_path=os.path.join(d, "last.ckpt"))
    return {"net": mod2.net, "opt": mod2.optimizers().optimizer, "losses": mod.losses + mod2.losses}


@scenario("whole_step")
def ws_whole_step_manual_lr_scheduler_and_logging(ctx):
    import lightning as L

    class M(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False
            self.net = lit_net()
            self.losses = []

        def configure_optimizers(self):
            opt = fused_adamw(self.net.parameters(), lr=torch.tensor(1e-2))
            return [opt], [torch.optim.lr_scheduler.ExponentialLR(opt, 0.8)]

        def on_train_start(self):
            self.step = None
            if ctx.replay:
                from replaykit.lightning import whole_step

                self.step = whole_step(self, self.net, ce, backend="emulated", accumulate=2,
                                       max_norm=0.5)  # fmt: skip
                ctx.entries.append(self.step)

        def training_step(self, batch, idx):
            x, y = batch
            if self.step is not None:
                loss = self.step(x, y)
            else:
                opt = self.optimizers()
                loss = ce(self.net, x, y)
                self.manual_backward(loss / 2)
                if (idx + 1) % 2 == 0:
                    nn.utils.clip_grad_norm_(list(self.net.parameters()), 0.5, foreach=True)
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                loss = loss.detach()
            self.log("train_loss", loss, prog_bar=True)
            if (idx + 1) % 2 == 0:
                self.lr_schedulers().step()
            self.losses.append(loss)

    mod = M()
    tr = trainer(max_epochs=2)
    tr.fit(mod, loader(6))
    return {"net": mod.net, "opt": mod.optimizers().optimizer, "losses": mod.losses}


# ===================================================================== Q. inputs


class InplaceNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = mlp()

    def forward(self, x):
        x.sub_(x.mean(0, keepdim=True))  # normalises the caller's batch in place
        return self.net(x)


@scenario("capture")
def cap_input_view_of_dataset_written_inplace(ctx):
    m = InplaceNorm()
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(2)
    X, Y = torch.randn(64, 8, generator=g), torch.randint(0, 4, (64,), generator=g)
    losses = []
    with ctx.capture(m):
        for _ep in range(2):
            for i in range(0, 32, 8):
                opt.zero_grad()
                loss = F.cross_entropy(m(X[i : i + 8]), Y[i : i + 8])
                loss.backward()
                opt.step()
                losses.append(loss.detach())
    return {"m": m, "opt": opt, "losses": losses, "X": X}


@scenario("capture")
def cap_noncontiguous_inputs_alternating_layouts(ctx):
    m = mlp()
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    losses = []
    with ctx.capture(m):
        for i, (x, y) in enumerate(vecs(9)):
            if i % 3 == 1:
                x = torch.cat([x, x], 1)[:, ::2]  # strided columns
            elif i % 3 == 2:
                x = x.t().contiguous().t()  # column-major
            opt.zero_grad()
            loss = ce(m, x, y)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
    return {"m": m, "opt": opt, "losses": losses}


class SeqNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 12)
        self.enc = nn.TransformerEncoderLayer(12, 2, 24, dropout=0.1, batch_first=True)
        self.fc = nn.Linear(12, 4)

    def forward(self, ids):
        return self.fc(self.enc(self.emb(ids)).mean(1))


@scenario("capture")
def cap_sequence_length_changes_every_batch(ctx):
    m = SeqNet()
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(3)
    losses = []
    with ctx.capture(m):
        for _ in range(12):
            t = int(torch.randint(3, 14, (1,), generator=g))
            ids, y = (
                torch.randint(0, 20, (4, t), generator=g),
                torch.randint(0, 4, (4,), generator=g),
            )
            opt.zero_grad()
            loss = ce(m, ids, y)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
    return {"m": m, "opt": opt, "losses": losses}


@scenario("step")
def step_sequence_length_bucketed(ctx):
    m = SeqNet()
    opt = fused_adamw(m.parameters())
    step = ctx.step(m, ce, opt)
    g = torch.Generator().manual_seed(3)
    losses = []
    for _ in range(10):
        t = [4, 8][int(torch.randint(0, 2, (1,), generator=g))]
        ids, y = torch.randint(0, 20, (4, t), generator=g), torch.randint(0, 4, (4,), generator=g)
        losses.append(step(ids, y))
    return {"m": m, "opt": opt, "losses": losses}


class MaskIdx(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.fc = nn.Linear(8, 4)

    def forward(self, x, keep, idx):
        h = (x + self.emb(idx)) * keep.unsqueeze(-1)
        return self.fc(h)


@scenario("step")
def step_int_and_bool_inputs_values_change(ctx):
    m = MaskIdx()
    opt = fused_sgd(m.parameters())
    step = ctx.step(m, lambda mm, x, k, i, y: F.cross_entropy(mm(x, k, i), y), opt)
    g = torch.Generator().manual_seed(5)
    losses = []
    for _ in range(7):
        x = torch.randn(8, 8, generator=g)
        keep = torch.rand(8, generator=g) > 0.3
        idx = torch.randint(0, 10, (8,), generator=g)
        losses.append(step(x, keep, idx, torch.randint(0, 4, (8,), generator=g)))
    return {"m": m, "opt": opt, "losses": losses}


class TempNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = mlp()

    def forward(self, x, temperature, depth=1):
        h = x
        for _ in range(depth):
            h = h + 0.1 * torch.tanh(h)
        return self.net(h) / temperature


@scenario("capture")
def cap_python_float_arg_changes_every_call(ctx):
    m = TempNet()
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    losses = []
    with ctx.capture(m):
        for i, (x, y) in enumerate(vecs(12)):
            opt.zero_grad()
            loss = F.cross_entropy(m(x, 1.0 + 0.05 * i), y)  # annealed temperature
            loss.backward()
            opt.step()
            losses.append(loss.detach())
    return {"m": m, "opt": opt, "losses": losses}


@scenario("capture")
def cap_python_int_arg_drives_control_flow(ctx):
    m = TempNet()
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    losses = []
    with ctx.capture(m):
        for i, (x, y) in enumerate(vecs(9)):
            opt.zero_grad()
            loss = F.cross_entropy(m(x, 1.0, depth=1 + i % 3), y)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
    return {"m": m, "opt": opt, "losses": losses}


@scenario("step")
def step_python_float_arg_changes_every_call(ctx):
    m = TempNet()
    opt = fused_sgd(m.parameters())
    step = ctx.step(m, lambda mm, x, y, t: F.cross_entropy(mm(x, t), y), opt)
    losses = [step(x, y, 1.0 + 0.05 * i) for i, (x, y) in enumerate(vecs(10))]
    return {"m": m, "opt": opt, "losses": losses}


class Cond(nn.Module):
    def __init__(self):
        super().__init__()
        self.fx, self.fc = nn.Linear(8, 16), nn.Linear(8, 16)
        self.out = nn.Linear(16, 4)

    def forward(self, x, c):
        return self.out(F.relu(self.fx(x) + self.fc(c)))


@scenario("capture")
def cap_expanded_conditioning_input_stride0(ctx):
    m = Cond()
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    losses = []
    with ctx.capture(m):
        for x, y in vecs(8):
            c = torch.randn(1, 8, generator=g).expand(8, 8)  # one class vector for the batch
            opt.zero_grad()
            loss = F.cross_entropy(m(x, c), y)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
    return {"m": m, "opt": opt, "losses": losses}


class Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.mha = nn.MultiheadAttention(8, 2, batch_first=True)
        self.fc = nn.Linear(8, 4)

    def forward(self, q, kv, pad=None):
        h, w = self.mha(q, kv, kv, key_padding_mask=pad, need_weights=True)
        return self.fc(h.mean(1)), w


@scenario("capture")
def cap_self_and_cross_attention_same_tensor_or_not(ctx):
    m = Attn()
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(2)
    losses, ws = [], []
    with ctx.capture(m):
        for i in range(9):
            q = torch.randn(4, 5, 8, generator=g)
            kv = q if i % 2 == 0 else torch.randn(4, 5, 8, generator=g)  # self- vs cross-attn
            pad = torch.zeros(4, 5, dtype=torch.bool)
            pad[:, 5 - i % 3 :] = bool(i % 3)
            opt.zero_grad()
            logits, w = m(q, kv, pad)
            loss = F.cross_entropy(logits, torch.randint(0, 4, (4,), generator=g))
            loss.backward()
            opt.step()
            losses.append(loss.detach())
            ws.append(w.detach())
    return {"m": m, "opt": opt, "losses": losses, "ws": ws}


@scenario("step")
def step_optional_kwarg_mask_sometimes_none(ctx):
    m = Attn()
    opt = fused_adamw(m.parameters())

    def loss_fn(model, q, y, pad=None):
        return F.cross_entropy(model(q, q, pad)[0], y)

    step = ctx.step(m, loss_fn, opt)
    g = torch.Generator().manual_seed(2)
    losses = []
    for i in range(8):
        q, y = torch.randn(4, 5, 8, generator=g), torch.randint(0, 4, (4,), generator=g)
        if i % 2:
            pad = torch.zeros(4, 5, dtype=torch.bool)
            pad[:, -1] = True
            losses.append(step(q, y, pad=pad))
        else:
            losses.append(step(q, y))
    return {"m": m, "opt": opt, "losses": losses}


@scenario("capture")
def cap_input_requires_grad_every_third_call(ctx):
    m = mlp()
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    losses, sal = [], []
    with ctx.capture(m):
        for i, (x, y) in enumerate(vecs(9)):
            if i % 3 == 0:
                x = x.clone().requires_grad_()
            opt.zero_grad()
            loss = ce(m, x, y)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
            if x.requires_grad:
                sal.append(x.grad)
    return {"m": m, "opt": opt, "losses": losses, "sal": sal}


@scenario("capture")
def cap_numpy_buffer_refilled_before_backward(ctx):
    m = mlp()
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    rng = np.random.default_rng(0)
    buf = np.zeros((8, 8), np.float32)  # a loader's reused staging buffer
    y = torch.arange(8) % 4
    buf[:] = rng.standard_normal((8, 8))
    losses = []
    with ctx.capture(m):
        for _ in range(8):
            x = torch.from_numpy(buf)
            opt.zero_grad()
            loss = ce(m, x, y)
            buf[:] = rng.standard_normal((8, 8))  # prefetch the next batch into the buffer
            loss.backward()
            opt.step()
            losses.append(loss.detach())
    return {"m": m, "opt": opt, "losses": losses}


@scenario("capture")
def cap_input_data_refilled_before_backward(ctx):
    m = mlp()
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(0)
    buf = torch.randn(8, 8, generator=g)  # a staging tensor refilled through .data
    y = torch.arange(8) % 4
    losses = []
    with ctx.capture(m):
        for _ in range(8):
            opt.zero_grad()
            loss = ce(m, buf, y)
            buf.data.copy_(torch.randn(8, 8, generator=g))  # no version bump: eager raises nothing
            loss.backward()
            opt.step()
            losses.append(loss.detach())
    return {"m": m, "opt": opt, "losses": losses}


@scenario("step")
def step_batch_dict_with_string_ids(ctx):
    m = mlp()
    opt = fused_sgd(m.parameters())

    def loss_fn(model, x, y, ids):
        return F.cross_entropy(model(x), y)

    step = ctx.step(m, loss_fn, opt)
    losses = []
    for i, (x, y) in enumerate(vecs(7)):
        batch = {"x": x, "y": y, "ids": [f"sample-{i}-{k}" for k in range(8)]}
        losses.append(step(**batch))
    return {"m": m, "opt": opt, "losses": losses}


@scenario("capture")
def cap_input_mutated_after_forward_by_augmentation(ctx):
    m = mlp()
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    losses = []
    with ctx.capture(m):
        for x, y in vecs(8):
            opt.zero_grad()
            out = m(x)
            loss = F.cross_entropy(out, y)
            loss.backward()
            x.mul_(-1)  # the loader reuses x for the next flip-augmented view
            out2 = m(x)
            loss2 = F.cross_entropy(out2, y)
            loss2.backward()
            opt.step()
            losses += [loss.detach(), loss2.detach()]
    return {"m": m, "opt": opt, "losses": losses}


# ===================================================================== R. optimisers, layers, misc


class Lion(torch.optim.Optimizer):
    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0):
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["exp_avg"] = torch.zeros_like(p)
                b1, b2 = g["betas"]
                p.mul_(1 - g["lr"] * g["weight_decay"])
                upd = st["exp_avg"].mul(b1).add(p.grad, alpha=1 - b1).sign_()
                p.add_(upd, alpha=-g["lr"])
                st["exp_avg"].mul_(b2).add_(p.grad, alpha=1 - b2)


@scenario("step")
def step_custom_lion_optimizer(ctx):
    m = mlp()
    return step_loop(ctx, m, Lion(m.parameters(), lr=1e-3, weight_decay=0.1), vecs(7), max_norm=1.0)


@scenario("step")
def step_radam_default_non_fused(ctx):
    m = mlp(bn=True)
    return step_loop(ctx, m, torch.optim.RAdam(m.parameters(), lr=1e-2, decoupled_weight_decay=True,
                                               weight_decay=0.01), vecs(7))  # fmt: skip


@scenario("step")
def step_sgd_nesterov_maximize_fused(ctx):
    m = mlp()

    def neg_loss(model, x, y):
        return -F.cross_entropy(model(x), y)

    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, nesterov=True, maximize=True,
                          weight_decay=1e-3, fused=True)  # fmt: skip
    return step_loop(ctx, m, opt, vecs(7), loss_fn=neg_loss)


@scenario("step")
def step_adam_amsgrad_fused_capturable(ctx):
    m = mlp()
    opt = torch.optim.Adam(m.parameters(), lr=1e-2, amsgrad=True, weight_decay=1e-2, fused=True,
                           capturable=True)  # fmt: skip
    return step_loop(ctx, m, opt, vecs(7))


@scenario("step")
def step_nadam_and_adamax_default(ctx):
    m = TwoBlock()
    opt = torch.optim.NAdam(m.parameters(), lr=1e-2, momentum_decay=4e-3)
    return step_loop(ctx, m, opt, vecs(7))


@scenario("capture")
def cap_gradient_noise_injection_after_backward(ctx):
    m = mlp()
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    losses = []
    with ctx.capture(m):
        for i, (x, y) in enumerate(vecs(8)):
            opt.zero_grad()
            loss = ce(m, x, y)
            loss.backward()
            sigma = 0.01 / (1 + i) ** 0.55
            for p in m.parameters():
                p.grad.add_(torch.randn_like(p.grad) * sigma)
            opt.step()
            losses.append(loss.detach())
    return {"m": m, "opt": opt, "losses": losses, "rng": torch.rand(2)}


@scenario("step")
def step_user_zero_grad_keeps_zeros_between_calls(ctx):
    m = mlp()
    opt = fused_adamw(m.parameters())
    step = ctx.step(m, ce, opt)
    losses, gs = [], []
    for x, y in vecs(7):
        opt.zero_grad(set_to_none=False)  # a habit from older code: zeros, not None
        losses.append(step(x, y))
        gs.append([None if p.grad is None else p.grad.clone() for p in m.parameters()])
    return {"m": m, "opt": opt, "losses": losses, "gs": gs}


@scenario("capture")
def cap_transformer_encoder_nested_tensor_eval_between(ctx):
    enc = nn.TransformerEncoder(
        nn.TransformerEncoderLayer(8, 2, 16, dropout=0.1, batch_first=True), 2,
        enable_nested_tensor=True,
    )  # fmt: skip
    head = nn.Linear(8, 4)
    opt = torch.optim.Adam(list(enc.parameters()) + list(head.parameters()), lr=1e-3)
    g = torch.Generator().manual_seed(4)
    losses, vals = [], []
    with ctx.capture(enc):
        for i in range(8):
            x = torch.randn(4, 6, 8, generator=g)
            pad = torch.zeros(4, 6, dtype=torch.bool)
            pad[1:, 4:] = True
            opt.zero_grad()
            h = enc(x, src_key_padding_mask=pad)
            loss = F.cross_entropy(head(h[:, 0]), torch.randint(0, 4, (4,), generator=g))
            loss.backward()
            opt.step()
            losses.append(loss.detach())
            if i % 3 == 2:
                enc.eval()
                with torch.no_grad():  # the fast path: nested tensors
                    vals.append(enc(x, src_key_padding_mask=pad))
                enc.train()
    return {"enc": enc, "head": head, "opt": opt, "losses": losses, "vals": vals}


@scenario("capture")
def cap_instancenorm_track_running_stats(ctx):
    m = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1),
                      nn.InstanceNorm2d(8, affine=True, track_running_stats=True), nn.ReLU(),
                      nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))  # fmt: skip
    return plain_loop(ctx, m, torch.optim.SGD(m.parameters(), lr=0.05), imgs(6, hw=8))


@scenario("capture")
def cap_bn_momentum_changed_midrun(ctx):
    m = mlp(bn=True)
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    losses = []
    with ctx.capture(m):
        for i, (x, y) in enumerate(vecs(9)):
            if i == 4:
                m[1].momentum = 0.01
            opt.zero_grad()
            loss = ce(m, x, y)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
    return {"m": m, "opt": opt, "losses": losses}


class FunctionalBN(nn.Module):
    """Running statistics kept as plain tensor attributes (not buffers), as ported code does."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)
        self.w, self.b = nn.Parameter(torch.ones(16)), nn.Parameter(torch.zeros(16))
        self.rm, self.rv = torch.zeros(16), torch.ones(16)

    def forward(self, x):
        h = F.batch_norm(self.fc1(x), self.rm, self.rv, self.w, self.b, self.training, 0.1)
        return self.fc2(F.relu(h))


@scenario("capture")
def cap_functional_bn_stats_plain_tensor_attrs(ctx):
    m = FunctionalBN()
    out = plain_loop(ctx, m, torch.optim.SGD(m.parameters(), lr=0.05), vecs(8))
    return out | {"rm": m.rm, "rv": m.rv}


@scenario("step")
def step_functional_bn_stats_plain_tensor_attrs(ctx):
    m = FunctionalBN()
    out = step_loop(ctx, m, fused_sgd(m.parameters()), vecs(7))
    return out | {"rm": m.rm, "rv": m.rv}


@scenario("step")
def step_rmsnorm_and_layernorm_no_affine(ctx):
    m = nn.Sequential(nn.Linear(8, 16), nn.RMSNorm(16), nn.SiLU(),
                      nn.LayerNorm(16, elementwise_affine=False), nn.Linear(16, 4))  # fmt: skip
    return step_loop(ctx, m, fused_adamw(m.parameters()), vecs(7))


def qat_model():
    import torch.ao.quantization as tq

    m = nn.Sequential(tq.QuantStub(), nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4),
                      tq.DeQuantStub())  # fmt: skip
    m.train()
    m.qconfig = tq.get_default_qat_qconfig("fbgemm")
    return tq.prepare_qat(m)


@scenario("capture")
def cap_qat_fake_quant_observer_disabled_midrun(ctx):
    import torch.ao.quantization as tq

    m = qat_model()
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    losses = []
    with ctx.capture(m):
        for i, (x, y) in enumerate(vecs(9)):
            if i == 4:
                m.apply(tq.disable_observer)  # freeze the quantisation ranges
            if i == 6:
                m.apply(torch.ao.nn.intrinsic.qat.freeze_bn_stats)
            opt.zero_grad()
            loss = ce(m, x, y)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
    return {"m": m, "opt": opt, "losses": losses}


@scenario("step")
def step_qat_fake_quant(ctx):
    m = qat_model()
    return step_loop(ctx, m, fused_sgd(m.parameters()), vecs(7))


@scenario("capture")
def cap_siamese_two_batch_sizes_one_backward(ctx):
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(3)
    losses = []
    with ctx.capture(m):
        for _ in range(7):
            anchors, gallery = torch.randn(4, 8, generator=g), torch.randn(12, 8, generator=g)
            opt.zero_grad()
            ea, eg = F.normalize(m(anchors), dim=-1), F.normalize(m(gallery), dim=-1)
            loss = F.cross_entropy(ea @ eg.t() / 0.1, torch.arange(4) * 3)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
    return {"m": m, "opt": opt, "losses": losses}


class Lookahead:
    def __init__(self, opt, k=3, alpha=0.5):
        self.opt, self.k, self.alpha, self.n = opt, k, alpha, 0
        self.slow = [p.detach().clone() for g in opt.param_groups for p in g["params"]]

    def zero_grad(self, set_to_none=True):
        self.opt.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def step(self):
        self.opt.step()
        self.n += 1
        if self.n % self.k == 0:
            ps = [p for g in self.opt.param_groups for p in g["params"]]
            for p, s in zip(ps, self.slow, strict=True):
                s.add_(p - s, alpha=self.alpha)
                p.copy_(s)


@scenario("capture")
def cap_lookahead_wrapper_copies_slow_weights(ctx):
    m = mlp(bn=True)
    opt = Lookahead(torch.optim.Adam(m.parameters(), lr=1e-2))
    out = plain_loop(ctx, m, opt, vecs(9))
    return out | {"opt": opt.opt, "slow": opt.slow}


@scenario("optstep")
def optstep_network_replay_plus_optimizer_step_clip(ctx):
    import replaykit as rk

    m = mlp(bn=True)
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, fused=True)
    ostep = None
    if ctx.replay:
        ostep = rk.OptimizerStep(opt, backend="emulated")
        ctx.entries.append(ostep)
    losses = []

    def body():
        nn.utils.clip_grad_norm_(m.parameters(), 0.5)
        opt.step()

    with ctx.capture(m):
        for x, y in vecs(8):
            opt.zero_grad(set_to_none=True)
            loss = ce(m, x, y)
            loss.backward()
            if ostep is not None:
                ostep(body, key=("norm", 0.5))
            else:
                body()
            losses.append(loss.detach())
    return {"m": m, "opt": opt, "losses": losses}


@scenario("optstep")
def optstep_fp16_scaler_fused_adamw_growth(ctx):
    import replaykit as rk

    m = mlp()
    opt = fused_adamw(m.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2)
    ostep = None
    if ctx.replay:
        ostep = rk.OptimizerStep(opt, scaler=scaler, backend="emulated")
        ctx.entries.append(ostep)

    def body():
        scaler.unscale_(opt)
        nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()

    losses = []
    for x, y in vecs(8):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = ce(m, x, y)
        scaler.scale(loss).backward()
        if ostep is not None:
            ostep(body, key=("norm", 1.0))
        else:
            body()
        losses.append(loss.detach())
    return {"m": m, "opt": opt, "scaler": scaler, "losses": losses}


# ===================================================================== S. model recipes with traps


@scenario("capture")
def cap_sam_two_passes_weights_perturbed_inplace(ctx):
    m = mlp(bn=True)
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
    rho, losses = 0.05, []
    with ctx.capture(m):
        for x, y in vecs(7):
            loss = ce(m, x, y)
            loss.backward()
            with torch.no_grad():
                gn = torch.norm(torch.stack([p.grad.norm() for p in m.parameters()]))
                eps = [p.grad * (rho / (gn + 1e-12)) for p in m.parameters()]
                for p, e in zip(m.parameters(), eps, strict=True):
                    p.add_(e)
            opt.zero_grad()
            ce(m, x, y).backward()
            with torch.no_grad():
                for p, e in zip(m.parameters(), eps, strict=True):
                    p.sub_(e)
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
    return {"m": m, "opt": opt, "losses": losses}


class MoCo(nn.Module):
    """MoCo v2's forward: momentum update of the key encoder and a queue, both inside forward."""

    def __init__(self, k=32, m=0.9):
        super().__init__()
        self.enc_q = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
        self.enc_k = copy.deepcopy(self.enc_q).requires_grad_(False)
        self.m, self.k = m, k
        self.register_buffer("queue", F.normalize(torch.randn(8, k), dim=0))
        self.register_buffer("queue_ptr", torch.zeros(1, dtype=torch.long))

    @torch.no_grad()
    def _momentum_update(self):
        for pq, pk in zip(self.enc_q.parameters(), self.enc_k.parameters(), strict=True):
            pk.data = pk.data * self.m + pq.data * (1.0 - self.m)

    @torch.no_grad()
    def _enqueue(self, keys):
        ptr = int(self.queue_ptr)
        self.queue[:, ptr : ptr + keys.shape[0]] = keys.T
        self.queue_ptr[0] = (ptr + keys.shape[0]) % self.k

    def forward(self, im_q, im_k):
        q = F.normalize(self.enc_q(im_q), dim=1)
        with torch.no_grad():
            self._momentum_update()
            k = F.normalize(self.enc_k(im_k), dim=1)
        logits = torch.cat([(q * k).sum(1, keepdim=True), q @ self.queue.clone().detach()], 1)
        self._enqueue(k)
        return logits / 0.2


class MoCoRoll(MoCo):
    """The same without the host pointer: the queue rolled by tensor ops, in place."""

    @torch.no_grad()
    def _enqueue(self, keys):
        self.queue.copy_(torch.cat([keys.T, self.queue[:, : -keys.shape[0]]], 1))


@scenario("capture")
def cap_moco_roll_queue_momentum_data_rebind_in_forward(ctx):
    m = MoCoRoll()
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
    losses = []
    with ctx.capture(m):
        for x, _ in vecs(8):
            opt.zero_grad()
            logits = m(x + 0.1 * torch.randn_like(x), x + 0.1 * torch.randn_like(x))
            loss = F.cross_entropy(logits, torch.zeros(len(x), dtype=torch.long))
            loss.backward()
            opt.step()
            losses.append(loss.detach())
    return {"m": m, "opt": opt, "losses": losses}


@scenario("step")
def step_moco_roll_queue_momentum_data_rebind_in_forward(ctx):
    m = MoCoRoll()
    opt = fused_sgd([p for p in m.parameters() if p.requires_grad])

    def loss_fn(model, x):
        logits = model(x + 0.1 * torch.randn_like(x), x + 0.1 * torch.randn_like(x))
        return F.cross_entropy(logits, torch.zeros(len(x), dtype=torch.long))

    step = ctx.step(m, loss_fn, opt)
    return {"m": m, "opt": opt, "losses": [step(x) for x, _ in vecs(7)]}


@scenario("capture")
def cap_moco_momentum_encoder_and_queue_in_forward(ctx):
    m = MoCo()
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
    losses = []
    with ctx.capture(m):
        for x, _ in vecs(8):
            opt.zero_grad()
            logits = m(x + 0.1 * torch.randn_like(x), x + 0.1 * torch.randn_like(x))
            loss = F.cross_entropy(logits, torch.zeros(len(x), dtype=torch.long))
            loss.backward()
            opt.step()
            losses.append(loss.detach())
    return {"m": m, "opt": opt, "losses": losses}


@scenario("step")
def step_moco_momentum_encoder_and_queue_in_forward(ctx):
    m = MoCo()
    opt = fused_sgd([p for p in m.parameters() if p.requires_grad])

    def loss_fn(model, x):
        logits = model(x + 0.1 * torch.randn_like(x), x + 0.1 * torch.randn_like(x))
        return F.cross_entropy(logits, torch.zeros(len(x), dtype=torch.long))

    step = ctx.step(m, loss_fn, opt)
    return {"m": m, "opt": opt, "losses": [step(x) for x, _ in vecs(7)]}


class VQEMA(nn.Module):
    """VQ-VAE with an EMA codebook updated in forward; returns the codebook for logging."""

    def __init__(self, n=16, d=4, decay=0.9):
        super().__init__()
        self.enc, self.dec = nn.Linear(8, d), nn.Linear(d, 8)
        self.decay = decay
        g = torch.Generator().manual_seed(0)
        self.register_buffer("embed", torch.randn(n, d, generator=g))
        self.register_buffer("cluster_size", torch.zeros(n))
        self.register_buffer("embed_avg", self.embed.clone())

    def forward(self, x):
        z = self.enc(x)
        d = z.pow(2).sum(1, keepdim=True) - 2 * z @ self.embed.t() + self.embed.pow(2).sum(1)
        idx = d.argmin(1)
        onehot = torch.zeros(len(z), self.embed.shape[0]).scatter_(1, idx[:, None], 1.0)
        q = self.embed[idx]
        if self.training:
            with torch.no_grad():
                self.cluster_size.mul_(self.decay).add_(onehot.sum(0), alpha=1 - self.decay)
                self.embed_avg.mul_(self.decay).add_(onehot.t() @ z, alpha=1 - self.decay)
                n = self.cluster_size.sum()
                cs = (self.cluster_size + 1e-5) / (n + 16 * 1e-5) * n
                self.embed.copy_(self.embed_avg / cs.unsqueeze(1))
        commit = F.mse_loss(z, q.detach())
        q = z + (q - z).detach()
        return self.dec(q), commit, self.embed


@scenario("capture")
def cap_vqvae_ema_codebook_returned_buffer_kept(ctx):
    m = VQEMA()
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    losses, books = [], []
    with ctx.capture(m):
        for x, _ in vecs(8):
            opt.zero_grad()
            rec, commit, book = m(x)
            loss = F.mse_loss(rec, x) + 0.25 * commit
            loss.backward()
            opt.step()
            losses.append(loss.detach())
            books.append(book)  # kept for a codebook-usage plot at the end of the epoch
    return {"m": m, "opt": opt, "losses": losses, "books": books}


@scenario("step")
def step_vqvae_ema_codebook(ctx):
    m = VQEMA()

    def loss_fn(model, x):
        rec, commit, _ = model(x)
        return F.mse_loss(rec, x) + 0.25 * commit

    step = ctx.step(m, loss_fn, fused_adamw(m.parameters(), lr=1e-2))
    return {"m": m, "losses": [step(x) for x, _ in vecs(7)]}


class CLIPish(nn.Module):
    def __init__(self):
        super().__init__()
        self.img, self.txt = nn.Linear(8, 6), nn.Linear(8, 6)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))

    def forward(self, a, b):
        return F.normalize(self.img(a), dim=-1), F.normalize(self.txt(b), dim=-1), self.logit_scale


@scenario("capture")
def cap_clip_returns_logit_scale_parameter_clamped(ctx):
    m = CLIPish()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    losses = []
    with ctx.capture(m):
        for x, _ in vecs(8):
            opt.zero_grad()
            fi, ft, scale = m(x, x.flip(0))
            logits = scale.exp() * fi @ ft.t()
            lab = torch.arange(len(x))
            loss = (F.cross_entropy(logits, lab) + F.cross_entropy(logits.t(), lab)) / 2
            loss.backward()
            opt.step()
            with torch.no_grad():
                m.logit_scale.clamp_(0, math.log(100))
            losses.append(loss.detach())
    return {"m": m, "opt": opt, "losses": losses}


@scenario("step")
def step_clip_returns_logit_scale_parameter(ctx):
    m = CLIPish()

    def loss_fn(model, a):
        fi, ft, scale = model(a, a.flip(0))
        logits = scale.exp() * fi @ ft.t()
        lab = torch.arange(len(a))
        return (F.cross_entropy(logits, lab) + F.cross_entropy(logits.t(), lab)) / 2

    opt = fused_adamw(m.parameters(), lr=1e-2)
    step = ctx.step(m, loss_fn, opt)
    losses = []
    for x, _ in vecs(7):
        losses.append(step(x))
        with torch.no_grad():
            m.logit_scale.clamp_(0, math.log(100))
    return {"m": m, "opt": opt, "losses": losses}


class Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.ff = nn.Linear(8, 4)

    def forward(self, queries, memory):
        q = queries.unsqueeze(0).expand(memory.size(0), -1, -1)
        return self.ff(self.attn(q, memory, memory, need_weights=False)[0])


@scenario("capture")
def cap_other_modules_parameter_passed_as_input(ctx):
    dec = Decoder()
    query_embed = nn.Embedding(3, 8)  # DETR: learned queries handed to the decoder
    opt = torch.optim.AdamW(list(dec.parameters()) + list(query_embed.parameters()), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    losses = []
    with ctx.capture(dec):
        for _ in range(8):
            mem = torch.randn(2, 5, 8, generator=g)
            opt.zero_grad()
            out = dec(query_embed.weight, mem)
            loss = F.cross_entropy(out.flatten(0, 1), torch.randint(0, 4, (6,), generator=g))
            loss.backward()
            opt.step()
            losses.append(loss.detach())
    return {"dec": dec, "q": query_embed, "opt": opt, "losses": losses}


@scenario("capture")
def cap_output_hook_and_retain_grad(ctx):
    m = mlp()
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    losses, lg = [], []
    with ctx.capture(m):
        for i, (x, y) in enumerate(vecs(8)):
            opt.zero_grad()
            out = m(x)
            out.retain_grad()
            mask = torch.ones(4)
            mask[i % 4] = 0.0  # drop one class's gradient this step
            out.register_hook(lambda g, mask=mask: g * mask)
            loss = F.cross_entropy(out, y)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
            lg.append(out.grad)
    return {"m": m, "opt": opt, "losses": losses, "lg": lg}


@scenario("capture")
def cap_fomaml_functional_call_fast_weights(ctx):
    from torch.func import functional_call

    m = mlp()
    meta = torch.optim.Adam(m.parameters(), lr=1e-3)
    losses = []
    with ctx.capture(m):
        for (xs, ys), (xq, yq) in zip(vecs(5, seed=1), vecs(5, seed=2), strict=True):
            params = dict(m.named_parameters())
            inner = F.cross_entropy(functional_call(m, params, (xs,)), ys)
            grads = torch.autograd.grad(inner, list(params.values()))
            fast = {
                n: p - 0.1 * g.detach() for (n, p), g in zip(params.items(), grads, strict=True)
            }
            meta.zero_grad()
            outer = F.cross_entropy(functional_call(m, fast, (xq,)), yq)
            outer.backward()
            meta.step()
            losses += [inner.detach(), outer.detach()]
    return {"m": m, "opt": meta, "losses": losses}


class PassThrough(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = mlp()

    def forward(self, x):
        return {"logits": self.net(x), "inputs": x}


@scenario("capture")
def cap_forward_returns_its_input(ctx):
    m = PassThrough()
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    losses, same = [], []
    with ctx.capture(m):
        for x, y in vecs(8):
            opt.zero_grad()
            out = m(x)
            same.append(out["inputs"] is x)
            loss = F.cross_entropy(out["logits"], y)
            loss.backward()
            out["inputs"].mul_(0.5)  # the user rescales "the batch" it got back
            opt.step()
            losses.append(loss.detach())
            losses.append(x.clone())
    return {"m": m, "opt": opt, "losses": losses, "same": same}


@scenario("capture")
def cap_head_captured_on_uncaptured_bn_backbone(ctx):
    backbone = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU())
    head = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Dropout(0.1), nn.Linear(16, 4))
    opt = torch.optim.SGD(list(backbone.parameters()) + list(head.parameters()), lr=0.05)
    losses = []
    with ctx.capture(head):
        for x, y in vecs(8):
            opt.zero_grad()
            loss = F.cross_entropy(head(backbone(x)), y)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
    return {"b": backbone, "h": head, "opt": opt, "losses": losses}


@scenario("capture")
def cap_fixmatch_weak_nograd_strong_grad(ctx):
    m = mlp(drop=0.1)
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    losses = []
    with ctx.capture(m):
        for (xl, yl), (xu, _) in zip(vecs(8, seed=1), vecs(8, seed=2), strict=True):
            with torch.no_grad():
                p = m(xu + 0.01 * torch.randn_like(xu)).softmax(-1)
            conf, pseudo = p.max(-1)
            mask = (conf > 0.3).float()
            opt.zero_grad()
            ls = F.cross_entropy(m(xl), yl)
            lu = (
                F.cross_entropy(m(xu + 0.3 * torch.randn_like(xu)), pseudo, reduction="none") * mask
            ).mean()
            (ls + lu).backward()
            opt.step()
            losses.append((ls + lu).detach())
    return {"m": m, "opt": opt, "losses": losses}


# ===================================================================== T. arguments and flat params


@scenario("capture")
def cap_trpo_style_vector_to_parameters_update(ctx):
    from torch.nn.utils import parameters_to_vector, vector_to_parameters

    m = mlp()
    losses = []
    with ctx.capture(m):
        for x, y in vecs(8):
            loss = ce(m, x, y)
            grads = torch.autograd.grad(loss, list(m.parameters()))
            flat_g = torch.cat([g.reshape(-1) for g in grads])
            with torch.no_grad():
                for step_frac in (1.0, 0.5):  # a backtracking line search
                    new = parameters_to_vector(m.parameters()) - 0.5 * step_frac * flat_g
                    old = parameters_to_vector(m.parameters())
                    vector_to_parameters(new, m.parameters())
                    if ce(m, x, y) < loss:
                        break
                    vector_to_parameters(old, m.parameters())
            losses.append(loss.detach())
    return {"m": m, "losses": losses}


@scenario("step")
def step_params_set_by_vector_to_parameters_between_calls(ctx):
    from torch.nn.utils import parameters_to_vector, vector_to_parameters

    m = mlp()
    opt = fused_sgd(m.parameters())
    step = ctx.step(m, ce, opt)
    losses = []
    for i, (x, y) in enumerate(vecs(8)):
        losses.append(step(x, y))
        if i % 3 == 2:  # a model soup: average with a perturbed copy, written back as views
            with torch.no_grad():
                v = parameters_to_vector(m.parameters())
                vector_to_parameters(v * 0.9, m.parameters())
    return {"m": m, "opt": opt, "losses": losses}


class OptsNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = mlp()

    def forward(self, x, opts):
        h = F.dropout(x, opts["p"], self.training) * opts["scale"]
        return self.net(h)


@scenario("capture")
def cap_dict_argument_mutated_in_place_between_calls(ctx):
    m = OptsNet()
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    opts = {"p": 0.0, "scale": 1.0}  # one dict the loop mutates
    losses = []
    with ctx.capture(m):
        for i, (x, y) in enumerate(vecs(9)):
            if i % 3 == 0:
                opts["scale"] = 1.0 + i / 10
                opts["p"] = 0.1 * (i // 3)
            opt.zero_grad()
            loss = F.cross_entropy(m(x, opts), y)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
    return {"m": m, "opt": opt, "losses": losses}


class Hp:
    def __init__(self):
        self.scale = 1.0


class HpNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = mlp()

    def forward(self, x, hp):
        return self.net(x * hp.scale)


@scenario("capture")
def cap_object_argument_attribute_mutated(ctx):
    m = HpNet()
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    hp = Hp()
    losses = []
    with ctx.capture(m):
        for i, (x, y) in enumerate(vecs(9)):
            if i % 3 == 0:
                hp.scale = 1.0 + i / 10
            opt.zero_grad()
            loss = F.cross_entropy(m(x, hp), y)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
    return {"m": m, "opt": opt, "losses": losses}


class ListNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = mlp()

    def forward(self, xs):
        return self.net(sum(xs) / len(xs))


@scenario("capture")
def cap_list_of_tensors_argument_reused_and_mutated(ctx):
    m = ListNet()
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    views = []  # one list object, refilled in place every step
    losses = []
    with ctx.capture(m):
        for i, (x, y) in enumerate(vecs(9)):
            views[:] = [x, x.flip(0)] if i % 2 else [x, x * 0.5, x.roll(1, 0)]
            opt.zero_grad()
            loss = F.cross_entropy(m(views), y)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
    return {"m": m, "opt": opt, "losses": losses}


class ModeNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc, self.cls, self.rec = nn.Linear(8, 16), nn.Linear(16, 4), nn.Linear(16, 8)

    def forward(self, x, mode="cls", *, return_hidden=False):
        h = torch.relu(self.enc(x))
        out = self.cls(h) if mode == "cls" else self.rec(h)
        return (out, h) if return_hidden else out


@scenario("capture")
def cap_string_mode_and_bool_kwargs_alternate(ctx):
    m = ModeNet()
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    losses = []
    with ctx.capture(m):
        for i, (x, y) in enumerate(vecs(10)):
            opt.zero_grad()
            if i % 2 == 0:
                out, h = m(x, "cls", return_hidden=True)
                loss = F.cross_entropy(out, y) + 1e-3 * h.pow(2).mean()
            else:
                loss = F.mse_loss(m(x, mode="rec"), x)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
    return {"m": m, "opt": opt, "losses": losses}


class KwNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 4), nn.Linear(8, 4)

    def forward(self, x, z):
        return self.a(x) - 0.5 * self.b(z)


@scenario("capture")
def cap_keyword_order_swapped(ctx):
    m = KwNet()
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    losses = []
    with ctx.capture(m):
        for i, ((x, y), (z, _)) in enumerate(zip(vecs(8, seed=1), vecs(8, seed=2), strict=True)):
            opt.zero_grad()
            out = m(x=x, z=z) if i % 2 else m(z=z, x=x)
            loss = F.cross_entropy(out, y)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
    return {"m": m, "opt": opt, "losses": losses}


@scenario("capture")
def cap_clip_logit_scale_returned_and_logged(ctx):
    m = CLIPish()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    losses, scales = [], []
    with ctx.capture(m):
        for x, _ in vecs(7):
            opt.zero_grad()
            fi, ft, scale = m(x, x.flip(0))
            lab = torch.arange(len(x))
            loss = F.cross_entropy(scale.exp() * fi @ ft.t(), lab)
            loss.backward()
            opt.step()
            scales.append(scale)  # logged later (eager: the parameter itself)
            losses.append(loss.detach())
    return {"m": m, "opt": opt, "losses": losses, "scales": scales}


# ===================================================================== U. late probes


@scenario("capture")
def cap_dpsgd_microbatch_per_sample_clip_noise(ctx):
    m = mlp()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(7)
    losses = []
    with ctx.capture(m):
        for x, y in vecs(4, b=4):
            acc = [torch.zeros_like(p) for p in m.parameters()]
            for i in range(len(x)):  # one sample at a time, each gradient clipped
                opt.zero_grad(set_to_none=True)
                loss = ce(m, x[i : i + 1], y[i : i + 1])
                loss.backward()
                nn.utils.clip_grad_norm_(m.parameters(), 1.0)
                for a, p in zip(acc, m.parameters(), strict=True):
                    a.add_(p.grad)
                losses.append(loss.detach())
            for a, p in zip(acc, m.parameters(), strict=True):
                p.grad = (a + 0.5 * torch.randn(a.shape, generator=g)) / len(x)
            opt.step()
    return {"m": m, "opt": opt, "losses": losses}


class CkptOuter(nn.Module):
    def __init__(self, block):
        super().__init__()
        self.inp, self.block, self.out = nn.Linear(8, 16), block, nn.Linear(16, 4)

    def forward(self, x):
        h = self.inp(x)
        return self.out(h + checkpoint(self.block, h, use_reentrant=False))


@scenario("capture")
def cap_captured_block_inside_outer_checkpoint(ctx):
    block = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Dropout(0.1))
    m = CkptOuter(block)
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    losses = []
    with ctx.capture(block):
        for x, y in vecs(8):
            opt.zero_grad()
            loss = ce(m, x, y)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
    return {"m": m, "opt": opt, "losses": losses}


class Twice(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = mlp()

    def forward(self, x):
        out = self.net(x)
        return out, out, out[:, :2]


@scenario("capture")
def cap_output_returned_twice_and_a_view_written_in_place(ctx):
    m = Twice()
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    losses, kept = [], []
    with ctx.capture(m):
        for x, y in vecs(8):
            opt.zero_grad()
            a, b, v = m(x)
            loss = F.cross_entropy(a, y)
            loss.backward()
            opt.step()
            with torch.no_grad():
                v.mul_(2.0)  # eager: a and b change too (one tensor, one storage)
            kept.append((a.detach(), b.detach()))  # values only: `a is b` differs (a note)
            losses.append(loss.detach())
    return {"m": m, "opt": opt, "losses": losses, "kept": kept}


@scenario("capture")
def cap_weight_scaled_through_data_between_forward_and_backward(ctx):
    m = mlp()
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    losses = []
    with ctx.capture(m):
        for x, y in vecs(8):
            opt.zero_grad()
            loss = ce(m, x, y)
            m[3].weight.data.mul_(0.99)  # a weight-decay-by-hand placed between the two
            loss.backward()
            opt.step()
            losses.append(loss.detach())
    return {"m": m, "opt": opt, "losses": losses}
