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
    except Exception:  # noqa: BLE001
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
        [torch.optim.lr_scheduler.MultiStepLR(opt, [2, 5], 0.3),
         torch.optim.lr_scheduler.ExponentialLR(opt, 0.9)]  # fmt: skip
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
