"""The user loops of the hostile DDP run; each ``fn(ctx) -> (net, optimizer, losses)``.

Every scenario is realistic DDP user code; ``ctx.make_step`` builds the mode's step (hand-written
eager DDP, the eager twin, or the replayed TrainStep) and ``ctx.keep`` records extra outputs.
"""

from __future__ import annotations

import io

import torch
import torch.distributed as dist
from harness import ce, data, net_bn
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

STEPS = 8


def _base(ctx, *, opt_fn=None, ddp_kw=None, step_kw=None, net=None, steps=STEPS, batches=None):
    torch.manual_seed(0)
    net = net if net is not None else net_bn()
    ddp = DDP(net, **(ddp_kw or {}))
    opt = opt_fn(ddp) if opt_fn else torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    torch.manual_seed(1 + ctx.rank)  # per-rank dropout seeds
    kw = {"max_norm": 1.0, **(step_kw or {})}
    batches = batches if batches is not None else data(ctx.rank, steps * kw.get("accumulate", 1))
    return net, ddp, opt, kw, batches


def base_sgd(ctx):
    net, ddp, opt, kw, batches = _base(ctx)
    step = ctx.make_step(ddp, ce, opt, **kw)
    return net, opt, [step(x, y) for x, y in batches]


def broadcast_buffers_false(ctx):
    net, ddp, opt, kw, batches = _base(ctx, ddp_kw={"broadcast_buffers": False})
    step = ctx.make_step(ddp, ce, opt, **kw)
    return net, opt, [step(x, y) for x, y in batches]


def last_smaller_batch(ctx):
    batches = data(ctx.rank, STEPS)
    x, y = batches[-1]
    batches[-1] = (x[:5], y[:5])
    net, ddp, opt, kw, batches = _base(ctx, batches=batches)
    step = ctx.make_step(ddp, ce, opt, **kw)
    return net, opt, [step(x, y) for x, y in batches]


def uneven_rank_batch_sizes(ctx):
    batches = data(ctx.rank, STEPS, batch=8 if ctx.rank == 0 else 6)
    net, ddp, opt, kw, batches = _base(ctx, batches=batches)
    step = ctx.make_step(ddp, ce, opt, **kw)
    return net, opt, [step(x, y) for x, y in batches]


def _mlp():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def empty_batch_rank1(ctx):
    """Rank 1 gets an empty batch at step 6 (a sharded dataset's remainder); loss sums / 8."""
    batches = data(ctx.rank, STEPS)
    if ctx.rank == 1:
        x, y = batches[5]
        batches[5] = (x[:0], y[:0])

    def loss_fn(model, x, y):
        return nn.functional.cross_entropy(model(x), y, reduction="sum") / 8

    net, ddp, opt, kw, batches = _base(ctx, net=_mlp(), batches=batches)
    step = ctx.make_step(ddp, loss_fn, opt, **kw)
    return net, opt, [step(x, y) for x, y in batches]


def freeze_midrun_same_ddp(ctx):
    """Freeze the first layer after 4 steps, keep the same DDP (eager DDP should raise)."""
    net, ddp, opt, kw, batches = _base(ctx)
    step = ctx.make_step(ddp, ce, opt, **kw)
    losses = []
    for i, (x, y) in enumerate(batches):
        if i == 4:
            net[0].weight.requires_grad_(False)
            net[0].bias.requires_grad_(False)
        losses.append(step(x, y))
    return net, opt, losses


def freeze_midrun_rewrap(ctx):
    """Freeze the first layer after 4 steps and re-wrap in a new DDP and a new step (the
    documented way: DDP's reducer is built for the parameters requiring grad)."""
    net, ddp, opt, kw, batches = _base(ctx)
    step = ctx.make_step(ddp, ce, opt, **kw)
    losses = []
    for i, (x, y) in enumerate(batches):
        if i == 4:
            net[0].weight.requires_grad_(False)
            net[0].bias.requires_grad_(False)
            ddp = DDP(net)
            step = ctx.make_step(ddp, ce, opt, **kw)
        losses.append(step(x, y))
    return net, opt, losses


def adamw_fused_amsgrad(ctx):
    """(capturable=True is CUDA-only: on the CPU, fused is the replayable AdamW.)"""
    net, ddp, opt, kw, batches = _base(
        ctx,
        opt_fn=lambda m: torch.optim.AdamW(
            m.parameters(), lr=1e-2, weight_decay=0.1, fused=True, amsgrad=True
        ),
    )
    step = ctx.make_step(ddp, ce, opt, **kw)
    return net, opt, [step(x, y) for x, y in batches]


def adam_fused(ctx):
    net, ddp, opt, kw, batches = _base(
        ctx, opt_fn=lambda m: torch.optim.Adam(m.parameters(), lr=1e-2, fused=True)
    )
    step = ctx.make_step(ddp, ce, opt, **kw)
    return net, opt, [step(x, y) for x, y in batches]


def adam_plain_default(ctx):
    """Adam() with defaults (not capturable, not fused): the step should route eager."""
    net, ddp, opt, kw, batches = _base(ctx, opt_fn=lambda m: torch.optim.Adam(m.parameters()))
    step = ctx.make_step(ddp, ce, opt, **kw)
    return net, opt, [step(x, y) for x, y in batches]


def sgd_nesterov_wd(ctx):
    net, ddp, opt, kw, batches = _base(
        ctx,
        opt_fn=lambda m: torch.optim.SGD(
            m.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3
        ),
    )
    step = ctx.make_step(ddp, ce, opt, **kw)
    return net, opt, [step(x, y) for x, y in batches]


def sched_float_lr(ctx):
    net, ddp, opt, kw, batches = _base(ctx, steps=12)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    step = ctx.make_step(ddp, ce, opt, **kw)
    losses = []
    for x, y in batches:
        losses.append(step(x, y))
        sched.step()
    return net, opt, losses


def sched_cosine_float_every_step(ctx):
    net, ddp, opt, kw, batches = _base(ctx, steps=12)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=12)
    step = ctx.make_step(ddp, ce, opt, **kw)
    losses = []
    for x, y in batches:
        losses.append(step(x, y))
        sched.step()
    return net, opt, losses


def sched_tensor_lr(ctx):
    net, ddp, opt, kw, batches = _base(
        ctx,
        steps=10,
        opt_fn=lambda m: torch.optim.AdamW(m.parameters(), lr=torch.tensor(1e-2), fused=True),
    )
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
    step = ctx.make_step(ddp, ce, opt, **kw)
    losses = []
    for x, y in batches:
        losses.append(step(x, y))
        sched.step()
    return net, opt, losses


def ema(ctx):
    import replaykit as rk

    net, ddp, opt, kw, batches = _base(ctx)
    e = rk.EMA(net, 0.9)
    step = ctx.make_step(ddp, ce, opt, ema=e, **kw)
    losses = [step(x, y) for x, y in batches]
    ctx.keep("ema", list(e.params))
    return net, opt, losses


def fp16_scaler(ctx):
    net, ddp, opt, kw, batches = _base(
        ctx,
        opt_fn=lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, fused=True),
    )
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**14)
    step = ctx.make_step(ddp, ce, opt, scaler=scaler, precision="16-mixed", **kw)
    losses = [step(x, y) for x, y in batches]
    ctx.keep("scale", scaler.get_scale())
    return net, opt, losses


def bf16_accum2(ctx):
    net, ddp, opt, kw, batches = _base(ctx, step_kw={"accumulate": 2, "precision": "bf16-mixed"})
    step = ctx.make_step(ddp, ce, opt, **kw)
    return net, opt, [step(x, y) for x, y in batches]


def accum3_trailing_micro(ctx):
    """accumulate=3 and a run that ends mid-accumulation (grads left on .grad)."""
    net, ddp, opt, kw, batches = _base(ctx, step_kw={"accumulate": 3}, steps=4)
    batches = batches[:-1]  # 11 micro-batches: the last optimizer step is incomplete
    step = ctx.make_step(ddp, ce, opt, **kw)
    return net, opt, [step(x, y) for x, y in batches]


def user_no_sync_in_loss(ctx):
    """Wrong usage: the user accumulates by hand inside loss_fn with ddp.no_sync() on odd calls
    (accumulate=1 in the step): eager DDP skips the all-reduce when the forward ran under no_sync."""
    net, ddp, opt, kw, batches = _base(ctx)
    calls = [0]

    def loss_fn(model, x, y):
        calls[0] += 1
        cm = ddp.no_sync() if calls[0] % 2 else torch.enable_grad()
        with cm:
            return ce(model, x, y)

    step = ctx.make_step(ddp, loss_fn, opt, **kw)
    return net, opt, [step(x, y) for x, y in batches]


def user_no_sync_always(ctx):
    """Local training: the user's loss_fn always runs the forward under ddp.no_sync()."""
    net, ddp, opt, kw, batches = _base(ctx)

    def loss_fn(model, x, y):
        with ddp.no_sync():
            return ce(model, x, y)

    step = ctx.make_step(ddp, loss_fn, opt, **kw)
    return net, opt, [step(x, y) for x, y in batches]


def eval_between_steps(ctx):
    net, ddp, opt, kw, batches = _base(ctx)
    xv = data(ctx.rank, 1, seed=7)[0][0]
    step = ctx.make_step(ddp, ce, opt, **kw)
    losses = []
    for i, (x, y) in enumerate(batches):
        losses.append(step(x, y))
        if i % 2 == 1:
            ddp.eval()
            with torch.no_grad():
                ctx.keep(f"val{i}", ddp(xv))
            ddp.train()
    return net, opt, losses


def eval_via_module_between_steps(ctx):
    net, ddp, opt, kw, batches = _base(ctx)
    xv = data(ctx.rank, 1, seed=7)[0][0]
    step = ctx.make_step(ddp, ce, opt, **kw)
    losses = []
    for i, (x, y) in enumerate(batches):
        losses.append(step(x, y))
        if i % 3 == 2:
            net.eval()
            with torch.no_grad():
                ctx.keep(f"val{i}", net(xv))
            net.train()
    return net, opt, losses


def train_forward_no_grad_between(ctx):
    """A no_grad forward in train mode between steps (a probe of BN stats): DDP's forward skips the
    next buffer broadcast (require_forward_param_sync off)."""
    net, ddp, opt, kw, batches = _base(ctx)
    xv = data(ctx.rank, 1, seed=7)[0][0]
    step = ctx.make_step(ddp, ce, opt, **kw)
    losses = []
    for i, (x, y) in enumerate(batches):
        losses.append(step(x, y))
        if i in (3, 5):
            with torch.no_grad():
                ctx.keep(f"probe{i}", ddp(xv))
    return net, opt, losses


def zero_grad_false_with_existing_grads(ctx):
    """The user primes .grad with one eager DDP backward and zero_grad(set_to_none=False) before
    the loop: every step then starts from zero tensors, not None."""
    net, ddp, opt, kw, batches = _base(ctx)
    x0, y0 = batches[0]
    ce(ddp, x0, y0).backward()
    opt.zero_grad(set_to_none=False)
    step = ctx.make_step(ddp, ce, opt, **kw)
    losses = []
    for x, y in batches:
        opt.zero_grad(set_to_none=False)
        losses.append(step(x, y))
    return net, opt, losses


def dropout_reseed_each_step(ctx):
    net, ddp, opt, kw, batches = _base(ctx)
    step = ctx.make_step(ddp, ce, opt, **kw)
    losses = []
    for i, (x, y) in enumerate(batches):
        torch.manual_seed(1000 * ctx.rank + i)
        losses.append(step(x, y))
    return net, opt, losses


def loss_calls_ddp_closure(ctx):
    """loss_fn ignores its model argument and calls the DDP wrapper from its closure."""
    net, ddp, opt, kw, batches = _base(ctx)

    def loss_fn(model, x, y):
        return nn.functional.cross_entropy(ddp(x), y)

    step = ctx.make_step(ddp, loss_fn, opt, **kw)
    return net, opt, [step(x, y) for x, y in batches]


def loss_calls_module_closure(ctx):
    """loss_fn calls the wrapped module from its closure (bypassing DDP's forward): eager DDP
    then never all-reduces (the reducer is not prepared) -- a user bug, but the promise is parity."""
    net, ddp, opt, kw, batches = _base(ctx)

    def loss_fn(model, x, y):
        return nn.functional.cross_entropy(net(x), y)

    step = ctx.make_step(ddp, loss_fn, opt, **kw)
    return net, opt, [step(x, y) for x, y in batches]


class Counting(nn.Module):
    """Registers a buffer at its first forward and counts forwards in it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 4)

    def forward(self, x):
        if not hasattr(self, "seen"):
            self.register_buffer("seen", torch.zeros(()))
            self.register_buffer("mean", torch.zeros(8))
        if self.training:
            self.seen += 1
            self.mean.mul_(0.9).add_(x.mean(0), alpha=0.1)
        return self.lin(x - self.mean)


def buffer_registered_in_forward(ctx):
    net, ddp, opt, kw, batches = _base(ctx, net=Counting())
    step = ctx.make_step(ddp, ce, opt, **kw)
    return net, opt, [step(x, y) for x, y in batches]


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 16)
        self.c = nn.Linear(16, 16)
        self.c.weight = self.b.weight  # shared between modules
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(torch.relu(self.c(torch.relu(self.b(torch.relu(self.a(x)))))))


def shared_parameters(ctx):
    net, ddp, opt, kw, batches = _base(ctx, net=Tied())
    step = ctx.make_step(ddp, ce, opt, **kw)
    return net, opt, [step(x, y) for x, y in batches]


def clip_by_value_hook(ctx):
    """Clip by value the way one can with a whole step: a gradient hook on every parameter."""
    net, ddp, opt, kw, batches = _base(ctx, step_kw={"max_norm": None})
    for p in net.parameters():
        p.register_hook(lambda g: g.clamp(-0.01, 0.01))
    step = ctx.make_step(ddp, ce, opt, **kw)
    return net, opt, [step(x, y) for x, y in batches]


def checkpoint_reload_midrun(ctx):
    """Save model+optimizer state after 4 steps (torch.save to bytes), load it back, continue."""
    net, ddp, opt, kw, batches = _base(ctx, steps=10)
    step = ctx.make_step(ddp, ce, opt, **kw)
    losses = []
    for i, (x, y) in enumerate(batches):
        if i == 5:
            buf = io.BytesIO()
            torch.save({"model": ddp.state_dict(), "opt": opt.state_dict()}, buf)
            buf.seek(0)
            ck = torch.load(buf, weights_only=True)
            ddp.load_state_dict(ck["model"])
            opt.load_state_dict(ck["opt"])
        losses.append(step(x, y))
    return net, opt, losses


def checkpoint_rollback(ctx):
    """Keep a checkpoint at step 4, roll back to it at step 7 (a loss spike), continue."""
    net, ddp, opt, kw, batches = _base(ctx, steps=11)
    step = ctx.make_step(ddp, ce, opt, **kw)
    losses, ck = [], None
    for i, (x, y) in enumerate(batches):
        if i == 4:
            buf = io.BytesIO()
            torch.save({"model": ddp.state_dict(), "opt": opt.state_dict()}, buf)
            ck = buf.getvalue()
        if i == 7:
            c = torch.load(io.BytesIO(ck), weights_only=True)
            ddp.load_state_dict(c["model"])
            opt.load_state_dict(c["opt"])
        losses.append(step(x, y))
    return net, opt, losses


def manual_require_backward_grad_sync(ctx):
    """Local SGD by hand: ddp.require_backward_grad_sync = False for calls 5-6, then True."""
    net, ddp, opt, kw, batches = _base(ctx, steps=10)
    step = ctx.make_step(ddp, ce, opt, **kw)
    losses = []
    for i, (x, y) in enumerate(batches):
        ddp.require_backward_grad_sync = i not in (5, 6)
        losses.append(step(x, y))
    return net, opt, losses


def comm_hook_after_step_built(ctx):
    """fp16 gradient compression registered after the step is built (before the first call)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    net, ddp, opt, kw, batches = _base(ctx)
    step = ctx.make_step(ddp, ce, opt, **kw)
    ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    return net, opt, [step(x, y) for x, y in batches]


def lr_set_by_hand(ctx):
    net, ddp, opt, kw, batches = _base(ctx, steps=10)
    step = ctx.make_step(ddp, ce, opt, **kw)
    losses = []
    for i, (x, y) in enumerate(batches):
        if i == 6:
            for g in opt.param_groups:
                g["lr"] = 0.01
                g["momentum"] = 0.5
        losses.append(step(x, y))
    return net, opt, losses


def rank1_forward_hook_midrun(ctx):
    """Rank 1 alone registers a forward hook (a debug print of activations) at step 6."""
    net, ddp, opt, kw, batches = _base(ctx, steps=10)
    step = ctx.make_step(ddp, ce, opt, **kw)
    losses, seen = [], []
    for i, (x, y) in enumerate(batches):
        if i == 6 and ctx.rank == 1:
            net[2].register_forward_hook(lambda m, a, o: seen.append(o.detach().sum()))
        losses.append(step(x, y))
    ctx.keep("seen", seen)
    return net, opt, losses


def param_data_swap(ctx):
    """Load weights by assigning p.data (an older habit), after step 5."""
    net, ddp, opt, kw, batches = _base(ctx, steps=10)
    step = ctx.make_step(ddp, ce, opt, **kw)
    losses = []
    for i, (x, y) in enumerate(batches):
        if i == 5:
            with torch.no_grad():
                for p in net.parameters():
                    p.data = p.data.clone() * 0.5
        losses.append(step(x, y))
    return net, opt, losses


def dropout_p_changed_on_both(ctx):
    net, ddp, opt, kw, batches = _base(ctx, steps=10)
    step = ctx.make_step(ddp, ce, opt, **kw)
    losses = []
    for i, (x, y) in enumerate(batches):
        if i == 6:
            net[3].p = 0.5
        losses.append(step(x, y))
    return net, opt, losses


def weight_inplace_edit(ctx):
    """Weight normalisation by hand between steps (in place, under no_grad): rank-identical."""
    net, ddp, opt, kw, batches = _base(ctx, steps=10)
    step = ctx.make_step(ddp, ce, opt, **kw)
    losses = []
    for x, y in batches:
        losses.append(step(x, y))
        with torch.no_grad():
            w = net[0].weight
            w.div_(w.norm(dim=1, keepdim=True).clamp_min(1.0))
    return net, opt, losses


def loss_reads_rank_scalar(ctx):
    """A loss weight that is a Python float kept on a config object, changed at step 6."""
    net, ddp, opt, kw, batches = _base(ctx, steps=10)

    class Cfg:
        w = 1.0

    cfg = Cfg()

    def loss_fn(model, x, y):
        return cfg.w * nn.functional.cross_entropy(model(x), y)

    step = ctx.make_step(ddp, loss_fn, opt, **kw)
    losses = []
    for i, (x, y) in enumerate(batches):
        if i == 6:
            cfg.w = 0.5
        losses.append(step(x, y))
    return net, opt, losses


def world_size_in_loss(ctx):
    """The loss divides by dist.get_world_size() and all_reduces a detached metric (a logging
    collective inside loss_fn)."""
    net, ddp, opt, kw, batches = _base(ctx)

    def loss_fn(model, x, y):
        loss = nn.functional.cross_entropy(model(x), y)
        metric = loss.detach().clone()
        dist.all_reduce(metric)
        ctx.keep(f"metric{len(ctx.extras)}", metric)
        return loss

    step = ctx.make_step(ddp, loss_fn, opt, **kw)
    return net, opt, [step(x, y) for x, y in batches]


# ------------------------------------------------------------------ second batch


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.c2 = nn.Conv2d(8, 8, 3, padding=1)
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        h = torch.relu(self.bn(self.c1(x)))
        h = torch.relu(self.c2(h))
        return self.fc(h.mean((2, 3)))


def channels_last_conv(ctx):
    """A channels_last conv net (parameters with non-default strides in DDP's buckets)."""
    g = torch.Generator().manual_seed(100 + ctx.rank)
    batches = [
        (
            torch.randn(4, 3, 6, 6, generator=g).to(memory_format=torch.channels_last),
            torch.randint(0, 4, (4,), generator=g),
        )
        for _ in range(STEPS)
    ]
    torch.manual_seed(0)
    net = ConvNet().to(memory_format=torch.channels_last)
    net, ddp, opt, kw, batches = _base(ctx, net=net, batches=batches)
    step = ctx.make_step(ddp, ce, opt, **kw)
    return net, opt, [step(x, y) for x, y in batches]


class Mixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 16).double()
        self.c = nn.Linear(16, 4)

    def forward(self, x):
        h = torch.relu(self.a(x))
        h = torch.relu(self.b(h.double())).float()
        return self.c(h)


def mixed_dtype_params(ctx):
    """float32 and float64 parameters: DDP buckets them apart."""
    net, ddp, opt, kw, batches = _base(ctx, net=Mixed())
    step = ctx.make_step(ddp, ce, opt, **kw)
    return net, opt, [step(x, y) for x, y in batches]


def frozen_from_start(ctx):
    torch.manual_seed(0)
    net = net_bn()
    net[0].requires_grad_(False)
    net, ddp, opt, kw, batches = _base(
        ctx,
        net=net,
        opt_fn=lambda m: torch.optim.SGD(
            [p for p in m.parameters() if p.requires_grad], lr=0.05, momentum=0.9
        ),
    )
    step = ctx.make_step(ddp, ce, opt, **kw)
    return net, opt, [step(x, y) for x, y in batches]


def two_steps_same_ddp(ctx):
    """Multi-task: two steps (two losses) over one DDP model and one optimizer, alternating."""
    net, ddp, opt, kw, batches = _base(ctx, steps=12)

    def loss_b(model, x, y):
        return (model(x) ** 2).mean()

    step_a = ctx.make_step(ddp, ce, opt, **kw)
    step_b = ctx.make_step(ddp, loss_b, opt, **kw)
    losses = []
    for i, (x, y) in enumerate(batches):
        losses.append((step_a if i % 2 == 0 else step_b)(x, y))
    return net, opt, losses


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 4)

    def forward(self, x):
        h = torch.relu(self.a(x))
        if x.mean() > 0:  # data-dependent host branch: ranks may take different ones
            h = h * 2
        return self.b(h)


def data_dependent_branch(ctx):
    net, ddp, opt, kw, batches = _base(ctx, net=Branchy(), steps=10)
    step = ctx.make_step(ddp, ce, opt, **kw)
    return net, opt, [step(x, y) for x, y in batches]


def loss_item_logging(ctx):
    """The loss logs loss.item() into a list (a host read inside loss_fn)."""
    net, ddp, opt, kw, batches = _base(ctx)
    logged = []

    def loss_fn(model, x, y):
        loss = ce(model, x, y)
        logged.append(loss.item())
        return loss

    step = ctx.make_step(ddp, loss_fn, opt, **kw)
    losses = [step(x, y) for x, y in batches]
    ctx.keep("logged", list(logged))
    return net, opt, losses


def bn_frozen_eval(ctx):
    """Fine-tuning with BatchNorm kept in eval mode (frozen statistics) while training."""
    net, ddp, opt, kw, batches = _base(ctx)
    net[1].eval()
    step = ctx.make_step(ddp, ce, opt, **kw)
    return net, opt, [step(x, y) for x, y in batches]


def bn_eval_toggled_midrun(ctx):
    """BatchNorm switched to eval at step 5 (freeze statistics late in training)."""
    net, ddp, opt, kw, batches = _base(ctx, steps=10)
    step = ctx.make_step(ddp, ce, opt, **kw)
    losses = []
    for i, (x, y) in enumerate(batches):
        if i == 5:
            net[1].eval()
        losses.append(step(x, y))
    return net, opt, losses


def small_buckets(ctx):
    """bucket_cap_mb tiny: one bucket per parameter or so."""
    net, ddp, opt, kw, batches = _base(ctx, ddp_kw={"bucket_cap_mb": 0.0005})
    step = ctx.make_step(ddp, ce, opt, **kw)
    return net, opt, [step(x, y) for x, y in batches]


def ignored_params(ctx):
    """DDP told to ignore one layer's parameters (kept local on each rank)."""
    torch.manual_seed(0)
    net = net_bn()
    DDP._set_params_and_buffers_to_ignore_for_model(net, ["4.weight", "4.bias"])
    net, ddp, opt, kw, batches = _base(ctx, net=net)
    step = ctx.make_step(ddp, ce, opt, **kw)
    return net, opt, [step(x, y) for x, y in batches]


def user_no_sync_around_step(ctx):
    """Wrong usage: the user wraps every other step(x, y) in ddp.no_sync() (accumulate=1)."""
    import contextlib

    net, ddp, opt, kw, batches = _base(ctx)
    step = ctx.make_step(ddp, ce, opt, **kw)
    losses = []
    for i, (x, y) in enumerate(batches):
        with ddp.no_sync() if i % 2 == 0 else contextlib.nullcontext():
            losses.append(step(x, y))
    return net, opt, losses


def unfreeze_midrun_same_ddp(ctx):
    """Backbone frozen before DDP is built, unfrozen at step 5 with the same DDP: DDP's reducer
    does not know the layer, so eager DDP trains it with each rank's local gradient."""
    torch.manual_seed(0)
    net = net_bn()
    net[0].requires_grad_(False)
    net, ddp, opt, kw, batches = _base(ctx, net=net, steps=10)
    step = ctx.make_step(ddp, ce, opt, **kw)
    losses = []
    for i, (x, y) in enumerate(batches):
        if i == 5:
            net[0].requires_grad_(True)
        losses.append(step(x, y))
    return net, opt, losses


def unfreeze_before_step_built(ctx):
    """As above, but unfrozen after DDP is built and before the step is built."""
    torch.manual_seed(0)
    net = net_bn()
    net[0].requires_grad_(False)
    net, ddp, opt, kw, batches = _base(ctx, net=net)
    net[0].requires_grad_(True)
    step = ctx.make_step(ddp, ce, opt, **kw)
    return net, opt, [step(x, y) for x, y in batches]


def fp16_scaler_overflow_rank1(ctx):
    """fp16 + GradScaler; at step 6 rank 1 alone gets a batch that overflows fp16."""
    batches = data(ctx.rank, STEPS)
    if ctx.rank == 1:
        x, y = batches[5]
        batches[5] = (x * 1e6, y)
    net, ddp, opt, kw, batches = _base(
        ctx,
        batches=batches,
        opt_fn=lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, fused=True),
    )
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    step = ctx.make_step(ddp, ce, opt, scaler=scaler, precision="16-mixed", **kw)
    losses = [step(x, y) for x, y in batches]
    ctx.keep("scale", scaler.get_scale())
    return net, opt, losses


def adamw_foreach_default(ctx):
    net, ddp, opt, kw, batches = _base(
        ctx, opt_fn=lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=True)
    )
    step = ctx.make_step(ddp, ce, opt, **kw)
    return net, opt, [step(x, y) for x, y in batches]


def allreduce_metric_in_loss(ctx):
    """A logging all_reduce of a detached metric inside loss_fn (kept nowhere)."""
    net, ddp, opt, kw, batches = _base(ctx)

    def loss_fn(model, x, y):
        loss = nn.functional.cross_entropy(model(x), y)
        metric = loss.detach().clone()
        dist.all_reduce(metric)
        return loss

    step = ctx.make_step(ddp, loss_fn, opt, **kw)
    return net, opt, [step(x, y) for x, y in batches]


def metric_dict_in_loss(ctx):
    """loss_fn stores a detached metric into a dict held by an object it closes over."""
    net, ddp, opt, kw, batches = _base(ctx)
    store = {}

    def loss_fn(model, x, y):
        loss = nn.functional.cross_entropy(model(x), y)
        store[f"m{len(store)}"] = loss.detach().clone()
        return loss

    step = ctx.make_step(ddp, loss_fn, opt, **kw)
    losses = [step(x, y) for x, y in batches]
    ctx.keep("store", dict(store))
    return net, opt, losses


def bn_reset_assign(ctx):
    """Reset BatchNorm statistics at step 5 by assigning new buffers (DDP's broadcast list keeps
    the old tensors)."""
    net, ddp, opt, kw, batches = _base(ctx, steps=10)
    step = ctx.make_step(ddp, ce, opt, **kw)
    losses = []
    for i, (x, y) in enumerate(batches):
        if i == 5:
            net[1].running_mean = torch.zeros(16)
            net[1].running_var = torch.ones(16)
        losses.append(step(x, y))
    return net, opt, losses


def bn_reset_inplace(ctx):
    net, ddp, opt, kw, batches = _base(ctx, steps=10)
    step = ctx.make_step(ddp, ce, opt, **kw)
    losses = []
    for i, (x, y) in enumerate(batches):
        if i == 5:
            net[1].reset_running_stats()
        losses.append(step(x, y))
    return net, opt, losses


def extra_param_in_loss(ctx):
    """A learnable temperature outside the DDP model, in the optimizer (DDP does not average it)."""
    torch.manual_seed(0)
    temp = nn.Parameter(torch.ones(()))
    net, ddp, opt, kw, batches = _base(
        ctx,
        opt_fn=lambda m: torch.optim.SGD([*m.parameters(), temp], lr=0.05, momentum=0.9),
    )

    def loss_fn(model, x, y):
        return nn.functional.cross_entropy(model(x) / temp, y)

    step = ctx.make_step(ddp, loss_fn, opt, **kw)
    losses = [step(x, y) for x, y in batches]
    ctx.keep("temp", temp.detach().clone())
    return net, opt, losses


def gan_two_ddp(ctx):
    """A GAN under DDP: G and D each a DDP with its own step; G's loss calls D's DDP wrapper."""
    torch.manual_seed(0)
    gnet = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
    dnet = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
    G, D = DDP(gnet), DDP(dnet)
    optG = torch.optim.Adam(G.parameters(), lr=1e-3, betas=(0.5, 0.9), fused=True)
    optD = torch.optim.Adam(D.parameters(), lr=1e-3, betas=(0.5, 0.9), fused=True)
    torch.manual_seed(1 + ctx.rank)
    g = torch.Generator().manual_seed(100 + ctx.rank)
    batches = [(torch.randn(8, 4, generator=g), torch.randn(8, 8, generator=g)) for _ in range(10)]

    def d_loss(m, fake, real):
        return nn.functional.softplus(m(fake)).mean() + nn.functional.softplus(-m(real)).mean()

    def g_loss(m, z):
        return nn.functional.softplus(-D(m(z))).mean()

    stepD = ctx.make_step(D, d_loss, optD)
    stepG = ctx.make_step(G, g_loss, optG)
    losses = []
    for z, real in batches:
        with torch.no_grad():
            fake = G(z)
        losses.append(stepD(fake, real))
        losses.append(stepG(z))
        optD.zero_grad(set_to_none=True)
    ctx.keep("G", [p.detach().clone() for p in gnet.parameters()])
    ctx.keep("optG", [t.clone() for s in optG.state.values() for t in s.values()])
    return dnet, optD, losses


def gan_two_ddp_module_closure(ctx):
    """As gan_two_ddp, but G's loss calls D.module (bypassing D's DDP forward, as some GAN code
    does to avoid D's reducer)."""
    torch.manual_seed(0)
    gnet = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
    dnet = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
    G, D = DDP(gnet), DDP(dnet)
    optG = torch.optim.Adam(G.parameters(), lr=1e-3, betas=(0.5, 0.9), fused=True)
    optD = torch.optim.Adam(D.parameters(), lr=1e-3, betas=(0.5, 0.9), fused=True)
    torch.manual_seed(1 + ctx.rank)
    g = torch.Generator().manual_seed(100 + ctx.rank)
    batches = [(torch.randn(8, 4, generator=g), torch.randn(8, 8, generator=g)) for _ in range(10)]

    def d_loss(m, fake, real):
        return nn.functional.softplus(m(fake)).mean() + nn.functional.softplus(-m(real)).mean()

    def g_loss(m, z):
        return nn.functional.softplus(-D.module(m(z))).mean()

    stepD = ctx.make_step(D, d_loss, optD)
    stepG = ctx.make_step(G, g_loss, optG)
    losses = []
    for z, real in batches:
        with torch.no_grad():
            fake = G(z)
        losses.append(stepD(fake, real))
        losses.append(stepG(z))
        optD.zero_grad(set_to_none=True)
    ctx.keep("G", [p.detach().clone() for p in gnet.parameters()])
    ctx.keep("optG", [t.clone() for s in optG.state.values() for t in s.values()])
    return dnet, optD, losses


def global_token_norm(ctx):
    """The loss is normalised by the global number of labelled items: a count all-reduced across
    the ranks inside loss_fn (as LLM trainers do with padding masks)."""
    g = torch.Generator().manual_seed(100 + ctx.rank)
    batches = []
    for _ in range(STEPS):
        x, y = torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)
        y[torch.rand(8, generator=g) < 0.3] = -100  # ignored (padding)
        batches.append((x, y))
    net, ddp, opt, kw, batches = _base(ctx, batches=batches)

    def loss_fn(model, x, y):
        count = (y != -100).sum().float()
        dist.all_reduce(count)
        loss = nn.functional.cross_entropy(model(x), y, ignore_index=-100, reduction="sum")
        return loss * dist.get_world_size() / count

    step = ctx.make_step(ddp, loss_fn, opt, **kw)
    return net, opt, [step(x, y) for x, y in batches]


def contrastive_all_gather(ctx):
    """A contrastive loss with negatives from every rank: dist.all_gather of detached embeddings
    (CLIP-style), the local ones keeping their gradient."""

    class Enc(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.f = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))

        def forward(self, x):
            return nn.functional.normalize(self.f(x), dim=1)

    torch.manual_seed(0)
    net, ddp, opt, kw, batches = _base(ctx, net=Enc())

    def loss_fn(model, x, y):
        a, b = model(x), model(x + 0.1 * torch.roll(x, 1, 0))
        gathered = [torch.empty_like(b) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, b.detach().contiguous())
        gathered[dist.get_rank()] = b
        logits = a @ torch.cat(gathered).t() / 0.1
        target = torch.arange(len(a)) + dist.get_rank() * len(a)
        return nn.functional.cross_entropy(logits, target)

    step = ctx.make_step(ddp, loss_fn, opt, **kw)
    return net, opt, [step(x, y) for x, y in batches]


ALL = [n for n, f in list(globals().items()) if callable(f) and n[0] != "_" and
       f.__module__ == __name__ and not isinstance(f, type) and n not in ("ce", "data", "net_bn", "DDP")]  # fmt: skip
