"""Round 13 hostile patterns: STATE THE STEP'S PYTHON TOUCHES, and host values a graph may freeze.

Run:
  cd /work/main && OMP_NUM_THREADS=1 PYTHONPATH=/work/main timeout 1500 \
      .venv/bin/python scripts/hostile/round13/state.py [name-prefix ...]

Each pattern runs the same loop twice from one seed (plain eager, then through replaykit with
backend="emulated"); after every step the harness compares parameters, .grad (None pattern),
buffers, optimizer state, the loss, and every piece of Python state the pattern names in snap()
(counters, logs, metric objects, queues, the caller's batches).
S_* use rk.TrainStep, C_* use rk.capture with the user's own optimizer loop.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import itertools
import math
import queue as queue_mod
import random
import sys
import time
import types
from pathlib import Path

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from harness import run_pattern

PATTERNS: dict[str, object] = {}
STEPS = 7


def pattern(fn):
    PATTERNS[fn.__name__] = fn
    return fn


# ----------------------------------------------------------------------------- helpers
def mk(seed=0, drop=0.0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Dropout(drop), nn.Linear(8, 3))


def sgd(m, **kw):
    return torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, fused=True, **kw)


def batch(i, n=5):
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(n, 6, generator=g), torch.randn(n, 3, generator=g)


def mse(a, b):
    return (a - b).pow(2).mean()


def plain(v):
    """Python state made comparable by the harness (deques, objects -> lists, dicts)."""
    if isinstance(v, collections.deque):
        return [plain(x) for x in v]
    if isinstance(v, (list, tuple)):
        return [plain(x) for x in v]
    if isinstance(v, dict):
        return {str(k): plain(x) for k, x in v.items()}
    if isinstance(v, np.ndarray):
        return v.tolist()
    if isinstance(v, torch.Tensor):
        return v
    if hasattr(v, "__dict__") and not isinstance(v, (nn.Module, type)):
        return {k: plain(x) for k, x in vars(v).items() if not callable(x)}
    return v


def step_loop(
    run,
    model,
    lf,
    opt,
    extras=dict,
    steps=STEPS,
    args=None,
    kw=None,
    mods=(),
    before=None,
    keep=None,
    **stepkw,
):
    step = run.step(model, lf, opt, **stepkw)
    for i in range(steps):
        if before is not None:
            before(i)
        a = args(i) if args is not None else batch(i)
        loss = step(*a, **(kw(i) if kw is not None else {}))
        if keep is not None:
            keep.append(loss)
        run.snap([model, *mods], [opt], loss=loss, **{k: plain(v) for k, v in extras().items()})
    return step


def cap_loop(
    run,
    model,
    opt,
    crit=mse,
    extras=dict,
    steps=STEPS,
    mods=(),
    before=None,
    fwd=None,
    args=None,
    **capkw,
):
    run.wrap(model, **capkw)
    for i in range(steps):
        if before is not None:
            before(i)
        x, y = args(i) if args is not None else batch(i)
        out = fwd(model, x) if fwd is not None else model(x)
        loss = crit(out, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        run.snap(
            [model, *mods], [opt], loss=loss.detach(), **{k: plain(v) for k, v in extras().items()}
        )


# ============================================================================ counters
STEP_N = 0


@pattern
def S_global_counter_weight(run):
    global STEP_N
    STEP_N = 0
    m = mk()
    opt = sgd(m)

    def lf(m, x, y):
        global STEP_N
        STEP_N += 1
        w = 1.0 if STEP_N <= 3 else 0.25
        return w * mse(m(x), y)

    step_loop(run, m, lf, opt, extras=lambda: {"n": STEP_N})


@pattern
def S_nonlocal_counter_weight(run):
    m = mk()
    opt = sgd(m)
    n = 0

    def lf(m, x, y):
        nonlocal n
        n += 1
        return (0.5 + 0.1 * min(n, 4)) * mse(m(x), y)

    step_loop(run, m, lf, opt, extras=lambda: {"n": n})


class ClassCountCrit:
    calls = 0

    def __call__(self, m, x, y):
        type(self).calls += 1
        w = 2.0 if type(self).calls % 2 else 1.0
        return w * mse(m(x), y)


@pattern
def S_class_attr_counter(run):
    ClassCountCrit.calls = 0
    m = mk()
    opt = sgd(m)
    step_loop(run, m, ClassCountCrit(), opt, extras=lambda: {"n": ClassCountCrit.calls})


def lf_fattr(m, x, y):
    lf_fattr.calls += 1
    w = 1.0 if lf_fattr.calls < 4 else 0.1
    return w * mse(m(x), y)


@pattern
def S_function_attr_counter_module_level(run):
    lf_fattr.calls = 0
    m = mk()
    opt = sgd(m)
    step_loop(run, m, lf_fattr, opt, extras=lambda: {"n": lf_fattr.calls})


@pattern
def S_function_attr_counter_closure(run):
    m = mk()
    opt = sgd(m)

    def lf(m, x, y):
        lf.calls += 1
        return (1.0 if lf.calls < 4 else 0.1) * mse(m(x), y)

    lf.calls = 0
    step_loop(run, m, lf, opt, extras=lambda: {"n": lf.calls})


class Trainer:
    def __init__(self):
        self.it = 0
        self.warm = 3

    def loss(self, m, x, y):
        self.it += 1
        w = min(1.0, self.it / self.warm)
        return w * mse(m(x), y)


@pattern
def S_bound_method_counter(run):
    m = mk()
    opt = sgd(m)
    t = Trainer()
    step_loop(run, m, t.loss, opt, extras=lambda: {"it": t.it})


@pattern
def S_simplenamespace_counter(run):
    m = mk()
    opt = sgd(m)
    st = types.SimpleNamespace(step=0, seen=0)

    def lf(m, x, y):
        st.step += 1
        st.seen += x.shape[0]
        return (1.0 if st.step < 4 else 0.5) * mse(m(x), y)

    step_loop(run, m, lf, opt, extras=lambda: {"st": vars(st)})


@pattern
def S_argparse_namespace_counter(run):
    m = mk()
    opt = sgd(m)
    args = argparse.Namespace(global_step=0, aux_weight=0.3, aux_until=3)

    def lf(m, x, y):
        args.global_step += 1
        out = m(x)
        loss = mse(out, y)
        if args.global_step <= args.aux_until:
            loss = loss + args.aux_weight * out.pow(2).mean()
        return loss

    step_loop(run, m, lf, opt, extras=lambda: {"args": vars(args)})


@pattern
def S_nested_dict_deep_counter(run):
    m = mk()
    opt = sgd(m)
    cfg = {"train": {"sched": {"state": {"inner": {"step": 0}}}}}

    def lf(m, x, y):
        s = cfg["train"]["sched"]["state"]["inner"]
        s["step"] += 1
        return (1.0 if s["step"] < 4 else 0.2) * mse(m(x), y)

    step_loop(run, m, lf, opt, extras=lambda: {"cfg": cfg})


@pattern
def S_list_in_tuple_counter(run):
    m = mk()
    opt = sgd(m)
    state = ([0],)

    def lf(m, x, y):
        state[0][0] += 1
        return (1.0 if state[0][0] < 4 else 0.2) * mse(m(x), y)

    step_loop(run, m, lf, opt, extras=lambda: {"state": state})


@pattern
def S_default_arg_list_log(run):
    m = mk()
    opt = sgd(m)

    def lf(m, x, y, _log=[]):  # noqa: B006
        _log.append(x.shape[0])
        return mse(m(x), y) * (1.0 + 0.0 * len(_log))

    step_loop(run, m, lf, opt, extras=lambda: {"log": lf.__defaults__[0]})


@pattern
def S_accumulate_counter_weight(run):
    m = mk()
    opt = sgd(m)
    n = [0]

    def lf(m, x, y):
        n[0] += 1
        w = 1.0 if n[0] % 2 else 3.0  # weight micro-batches differently
        return w * mse(m(x), y)

    step_loop(run, m, lf, opt, extras=lambda: {"n": n[0]}, steps=8, accumulate=2)


# ============================================================ helpers at module level (loss_fn calls)
LOG: list = []
_CALLS = 0


def log_metric(v):
    LOG.append(v)


def warm_weight():
    global _CALLS
    _CALLS += 1
    return min(1.0, _CALLS / 3)


@pattern
def S_helper_appends_module_log(run):
    LOG.clear()
    m = mk()
    opt = sgd(m)

    def lf(m, x, y):
        loss = mse(m(x), y)
        log_metric(loss.detach())
        return loss

    step_loop(run, m, lf, opt, extras=lambda: {"log": list(LOG)})


@pattern
def S_helper_global_counter_weight(run):
    global _CALLS
    _CALLS = 0
    m = mk()
    opt = sgd(m)

    def lf(m, x, y):
        return warm_weight() * mse(m(x), y)

    step_loop(run, m, lf, opt, extras=lambda: {"calls": _CALLS})


class Logger:
    def __init__(self):
        self.rows = []
        self.n = 0

    def log(self, **kw):
        self.n += 1
        self.rows.append(kw)


LOGGER = Logger()


def training_log(loss):
    LOGGER.log(loss=loss.detach())


@pattern
def S_helper_logger_object_two_levels(run):
    LOGGER.rows.clear()
    LOGGER.n = 0
    m = mk()
    opt = sgd(m)

    def lf(m, x, y):
        loss = mse(m(x), y)
        training_log(loss)
        return loss

    step_loop(run, m, lf, opt, extras=lambda: {"n": LOGGER.n, "rows": LOGGER.rows})


# ============================================================ logs and metrics
@pattern
def S_history_list_append_tensor(run):
    m = mk()
    opt = sgd(m)
    history = []

    def lf(m, x, y):
        loss = mse(m(x), y)
        history.append(loss.detach())
        return loss

    step_loop(run, m, lf, opt, extras=lambda: {"hist": history})


@pattern
def S_metrics_dict_float(run):
    m = mk()
    opt = sgd(m)
    metrics = collections.defaultdict(float)

    def lf(m, x, y):
        loss = mse(m(x), y)
        metrics["n"] += 1
        metrics["sum"] += float(loss)
        return loss

    step_loop(run, m, lf, opt, extras=lambda: {"metrics": dict(metrics)})


class MeanTensorMetric:  # torchmetrics-style, plain object, tensors updated in place
    def __init__(self):
        self.total = torch.zeros(())
        self.count = 0

    def update(self, v):
        self.total += v.detach()
        self.count += 1

    def compute(self):
        return self.total / max(self.count, 1)


@pattern
def S_metric_object_inplace_and_int(run):
    m = mk()
    opt = sgd(m)
    metric = MeanTensorMetric()

    def lf(m, x, y):
        loss = mse(m(x), y)
        metric.update(loss)
        return loss

    step_loop(
        run,
        m,
        lf,
        opt,
        extras=lambda: {"total": metric.total, "count": metric.count, "mean": metric.compute()},
    )


class MeanRebindMetric:
    def __init__(self):
        self.total = torch.zeros(())
        self.count = torch.zeros(())

    def update(self, v):
        self.total = self.total + v.detach()
        self.count = self.count + 1


@pattern
def S_metric_object_rebinds_tensors(run):
    m = mk()
    opt = sgd(m)
    metric = MeanRebindMetric()

    def lf(m, x, y):
        loss = mse(m(x), y)
        metric.update(loss)
        return loss

    step_loop(run, m, lf, opt, extras=lambda: {"total": metric.total, "count": metric.count})


class ModuleMetric(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("total", torch.zeros(()))
        self.register_buffer("count", torch.zeros(()))

    def update(self, v):
        self.total.add_(v.detach())
        self.count.add_(1)


@pattern
def S_metric_module_buffers_inplace(run):
    m = mk()
    opt = sgd(m)
    metric = ModuleMetric()

    def lf(m, x, y):
        loss = mse(m(x), y)
        metric.update(loss)
        return loss

    step_loop(run, m, lf, opt, mods=(metric,))


@pattern
def S_torchmetrics_meanmetric(run):
    import torchmetrics

    m = mk()
    opt = sgd(m)
    metric = torchmetrics.MeanMetric(nan_strategy="ignore")

    def lf(m, x, y):
        loss = mse(m(x), y)
        metric.update(loss.detach())
        return loss

    step_loop(
        run,
        m,
        lf,
        opt,
        mods=(metric,),
        extras=lambda: {"upd": metric._update_count, "val": metric.compute()},
    )


@pattern
def S_closure_tensor_rebind_ema_loss(run):
    m = mk()
    opt = sgd(m)
    ema_loss = torch.zeros(())

    def lf(m, x, y):
        nonlocal ema_loss
        loss = mse(m(x), y)
        ema_loss = 0.9 * ema_loss + 0.1 * loss.detach()
        return loss

    step_loop(run, m, lf, opt, extras=lambda: {"ema": ema_loss})


EMA_LOSS = torch.zeros(())


@pattern
def S_global_tensor_rebind_ema_loss(run):
    global EMA_LOSS
    EMA_LOSS = torch.zeros(())
    m = mk()
    opt = sgd(m)

    def lf(m, x, y):
        global EMA_LOSS
        loss = mse(m(x), y)
        EMA_LOSS = 0.9 * EMA_LOSS + 0.1 * loss.detach()
        return loss

    step_loop(run, m, lf, opt, extras=lambda: {"ema": EMA_LOSS})


@pattern
def S_closure_tensor_rebind_used_in_loss(run):
    """a running loss scale (kept in a cell) that the loss itself uses: normalise by the EMA"""
    m = mk()
    opt = sgd(m)
    run_mean = torch.ones(())

    def lf(m, x, y):
        nonlocal run_mean
        raw = mse(m(x), y)
        run_mean = 0.8 * run_mean + 0.2 * raw.detach()
        return raw / run_mean

    step_loop(run, m, lf, opt, extras=lambda: {"rm": run_mean})


TOTAL = torch.zeros(())


@pattern
def S_global_tensor_inplace_total(run):
    TOTAL.zero_()
    m = mk()
    opt = sgd(m)

    def lf(m, x, y):
        loss = mse(m(x), y)
        with torch.no_grad():
            TOTAL.add_(loss)
        return loss

    step_loop(run, m, lf, opt, extras=lambda: {"total": TOTAL.clone()})


@pattern
def S_dict_tensor_rebind_in_closure(run):
    m = mk()
    opt = sgd(m)
    stats = {"ema": torch.zeros(3)}

    def lf(m, x, y):
        out = m(x)
        stats["ema"] = 0.9 * stats["ema"] + 0.1 * out.detach().mean(0)
        return mse(out, y)

    step_loop(run, m, lf, opt, extras=lambda: {"stats": stats})


@pattern
def S_item_branch_in_loss(run):
    m = mk()
    opt = sgd(m)

    def lf(m, x, y):
        loss = mse(m(x), y)
        if loss.item() > 1.0:
            loss = loss * 0.5
        return loss

    step_loop(run, m, lf, opt)


# ============================================================ iterators, generators, queues
@pattern
def S_next_data_iterator_in_loss(run):
    m = mk()
    opt = sgd(m)
    aux = [batch(50 + k)[0] for k in range(20)]
    it = iter(aux)

    def lf(m, x, y):
        xa = next(it)
        return mse(m(x), y) + 0.1 * m(xa).pow(2).mean()

    step_loop(run, m, lf, opt, extras=lambda: {"left": it.__length_hint__()})


@pattern
def S_itertools_cycle_weight(run):
    m = mk()
    opt = sgd(m)
    ws = itertools.cycle([1.0, 0.5, 0.25])
    seen = []

    def lf(m, x, y):
        w = next(ws)
        seen.append(w)
        return w * mse(m(x), y)

    step_loop(run, m, lf, opt, extras=lambda: {"seen": seen})


@pattern
def S_generator_function_schedule(run):
    m = mk()
    opt = sgd(m)

    def sched():
        k = 0
        while True:
            k += 1
            yield 1.0 / k

    g = sched()
    seen = []

    def lf(m, x, y):
        w = next(g)
        seen.append(w)
        return w * mse(m(x), y)

    step_loop(run, m, lf, opt, extras=lambda: {"seen": seen})


@pattern
def S_moco_deque_queue(run):
    m = mk()
    opt = sgd(m)
    q = collections.deque(maxlen=3)

    def lf(m, x, y):
        out = m(x)
        loss = mse(out, y)
        if q:
            neg = torch.stack(list(q))
            loss = loss + 0.1 * (out.unsqueeze(0) * neg).mean()
        q.append(out.detach())
        return loss

    step_loop(run, m, lf, opt, extras=lambda: {"q": q})


@pattern
def S_queue_Queue_of_tensors(run):
    m = mk()
    opt = sgd(m)
    q = queue_mod.Queue()

    def lf(m, x, y):
        out = m(x)
        q.put(out.detach())
        return mse(out, y)

    step_loop(run, m, lf, opt, extras=lambda: {"qsize": q.qsize(), "q": list(q.queue)})


class MoCoBank(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = mk()
        self.register_buffer("queue", torch.zeros(12, 3))
        self.ptr = 0

    def forward(self, x):
        out = self.net(x)
        with torch.no_grad():
            k = out.detach()
            self.queue[self.ptr : self.ptr + k.shape[0]] = k
            self.ptr = (self.ptr + k.shape[0]) % 10
        return out + 0.01 * self.queue.mean(0)


@pattern
def S_moco_buffer_python_ptr(run):
    torch.manual_seed(0)
    m = MoCoBank()
    opt = sgd(m)
    step_loop(run, m, lambda m, x, y: mse(m(x), y), opt, extras=lambda: {"ptr": m.ptr})


@pattern
def C_moco_buffer_python_ptr(run):
    torch.manual_seed(0)
    m = MoCoBank()
    opt = sgd(m)
    cap_loop(run, m, opt, extras=lambda: {"ptr": m.ptr})


class MoCoTensorPtr(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = mk()
        self.register_buffer("queue", torch.zeros(10, 3))
        self.register_buffer("ptr", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        out = self.net(x)
        with torch.no_grad():
            idx = (self.ptr + torch.arange(x.shape[0])) % 10
            self.queue.index_copy_(0, idx, out.detach())
            self.ptr.add_(x.shape[0]).remainder_(10)
        return out + 0.01 * self.queue.mean(0)


@pattern
def S_moco_buffer_tensor_ptr(run):
    torch.manual_seed(0)
    m = MoCoTensorPtr()
    opt = sgd(m)
    step_loop(run, m, lambda m, x, y: mse(m(x), y), opt)


@pattern
def C_moco_buffer_tensor_ptr(run):
    torch.manual_seed(0)
    m = MoCoTensorPtr()
    opt = sgd(m)
    cap_loop(run, m, opt)


# ============================================================ momentum encoders / teachers
@pattern
def S_byol_target_inplace_in_loss(run):
    m = mk()
    opt = sgd(m)
    tgt = mk(1).requires_grad_(False)

    def lf(m, x, y):
        out = m(x)
        with torch.no_grad():
            for pt, po in zip(tgt.parameters(), m.parameters(), strict=False):
                pt.mul_(0.9).add_(po.detach(), alpha=0.1)
            t = tgt(x)
        return mse(out, t) + mse(out, y)

    step_loop(run, m, lf, opt, mods=(tgt,))


@pattern
def S_byol_cosine_momentum_counter(run):
    m = mk()
    opt = sgd(m)
    tgt = mk(1).requires_grad_(False)
    k = 0

    def lf(m, x, y):
        nonlocal k
        k += 1
        mom = 1 - (1 - 0.9) * (math.cos(math.pi * k / STEPS) + 1) / 2
        out = m(x)
        with torch.no_grad():
            for pt, po in zip(tgt.parameters(), m.parameters(), strict=False):
                pt.mul_(mom).add_(po.detach(), alpha=1 - mom)
        return mse(out, tgt(x)) + mse(out, y)

    step_loop(run, m, lf, opt, mods=(tgt,), extras=lambda: {"k": k})


class Centre:
    def __init__(self):
        self.center = torch.zeros(3)


@pattern
def S_dino_center_plain_object_rebind(run):
    m = mk()
    opt = sgd(m)
    teacher = mk(1).requires_grad_(False)
    c = Centre()

    def lf(m, x, y):
        s = m(x)
        with torch.no_grad():
            t = teacher(x)
            out = torch.softmax((t - c.center) / 0.5, -1)
            c.center = 0.9 * c.center + 0.1 * t.mean(0)
        return -(out * torch.log_softmax(s, -1)).sum(-1).mean()

    step_loop(run, m, lf, opt, mods=(teacher,), extras=lambda: {"center": c.center})


class DinoTeacher(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = mk(1)
        self.register_buffer("center", torch.zeros(3))

    def forward(self, x):
        t = self.net(x)
        out = torch.softmax((t - self.center) / 0.5, -1)
        self.center.mul_(0.9).add_(t.mean(0), alpha=0.1)
        return out


@pattern
def S_dino_teacher_module_center_inplace(run):
    m = mk()
    opt = sgd(m)
    teacher = DinoTeacher().requires_grad_(False)

    def lf(m, x, y):
        s = m(x)
        with torch.no_grad():
            t = teacher(x)
            for pt, ps in zip(teacher.net.parameters(), m.parameters(), strict=False):
                pt.mul_(0.95).add_(ps.detach(), alpha=0.05)
        return -(t * torch.log_softmax(s, -1)).sum(-1).mean()

    step_loop(run, m, lf, opt, mods=(teacher,))


class StudentWithMomentum(nn.Module):
    def __init__(self):
        super().__init__()
        self.q = mk(0)
        self.k = mk(1).requires_grad_(False)
        self.steps = 0

    def forward(self, x):
        with torch.no_grad():
            for pk, pq in zip(self.k.parameters(), self.q.parameters(), strict=False):
                pk.mul_(0.99).add_(pq.detach(), alpha=0.01)
        return self.q(x) - 0.5 * self.k(x)


@pattern
def C_momentum_encoder_in_forward(run):
    m = StudentWithMomentum()
    opt = torch.optim.SGD(m.q.parameters(), lr=0.1, momentum=0.9, fused=True)
    cap_loop(run, m, opt)


# ============================================================ buffers written in forward
class CountingNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = mk()
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.register_buffer("rm", torch.zeros(6))

    def forward(self, x):
        self.calls += 1
        with torch.no_grad():
            self.rm.mul_(0.9).add_(x.mean(0), alpha=0.1)
        return self.net(x - self.rm)


@pattern
def S_buffer_counter_and_running_mean(run):
    m = CountingNet()
    opt = sgd(m)
    step_loop(run, m, lambda m, x, y: mse(m(x), y), opt)


@pattern
def C_buffer_counter_and_running_mean(run):
    m = CountingNet()
    opt = sgd(m)
    cap_loop(run, m, opt)


class WarmupByBuffer(nn.Module):
    """reads its tensor counter on the host to pick a schedule (num_batches_tracked-like)"""

    def __init__(self):
        super().__init__()
        self.net = mk()
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.seen += 1
        w = 1.0 if int(self.seen) < 3 else 0.5
        return self.net(x) * w


@pattern
def C_buffer_counter_read_on_host(run):
    m = WarmupByBuffer()
    opt = sgd(m)
    cap_loop(run, m, opt)


# ============================================================ inputs written in place
@pattern
def S_loss_scales_target_in_place(run):
    m = mk()
    opt = sgd(m)
    kept = {}

    def lf(m, x, y):
        y.mul_(0.5)
        x.add_(1.0)
        return mse(m(x), y)

    def args(i):
        kept["b"] = batch(i)
        return kept["b"]

    step_loop(run, m, lf, opt, args=args, extras=lambda: {"x": kept["b"][0], "y": kept["b"][1]})


@pattern
def C_forward_adds_to_input(run):
    class Centering(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = mk()

        def forward(self, x):
            x -= x.mean(0, keepdim=True)
            return self.net(x)

    m = Centering()
    opt = sgd(m)
    kept = {}

    def args(i):
        kept["b"] = batch(i)
        return kept["b"]

    cap_loop(run, m, opt, args=args, extras=lambda: {"x": kept["b"][0]})


@pattern
def S_same_batch_reused_and_written(run):
    """the caller feeds the SAME tensor every step, loss_fn normalises it in place"""
    m = mk()
    opt = sgd(m)
    x0, y0 = batch(0)

    def lf(m, x, y):
        x.div_(x.norm())
        return mse(m(x), y)

    step_loop(run, m, lf, opt, args=lambda i: (x0, y0), extras=lambda: {"x": x0})


# ============================================================ host RNG / torch RNG
@pattern
def S_random_scale_drawn_value(run):
    random.seed(0)
    m = mk()
    opt = sgd(m)

    def lf(m, x, y):
        return random.uniform(0.5, 1.5) * mse(m(x), y)

    step_loop(run, m, lf, opt, extras=lambda: {"rs": random.random()})


@pattern
def S_random_branch_choice(run):
    random.seed(0)
    m = mk()
    opt = sgd(m)

    def lf(m, x, y):
        out = m(x)
        if random.random() < 0.5:
            return mse(out, y)
        return (out - y).abs().mean()

    step_loop(run, m, lf, opt, extras=lambda: {"rs": random.getstate()[1][:5]})


@pattern
def S_numpy_mask(run):
    np.random.seed(0)
    m = mk()
    opt = sgd(m)

    def lf(m, x, y):
        keep = torch.from_numpy(np.random.rand(x.shape[0]) > 0.3).float().unsqueeze(1)
        return mse(m(x) * keep, y * keep)

    step_loop(run, m, lf, opt, extras=lambda: {"ns": np.random.get_state()[2]})


@pattern
def S_torch_randperm_shuffle(run):
    m = mk()
    opt = sgd(m)
    torch.manual_seed(5)

    def lf(m, x, y):
        perm = torch.randperm(x.shape[0])
        mixed = 0.7 * x + 0.3 * x[perm]
        return mse(m(mixed), 0.7 * y + 0.3 * y[perm])

    step_loop(run, m, lf, opt, extras=lambda: {"rng": torch.get_rng_state()})


@pattern
def S_bernoulli_closure_generator(run):
    m = mk()
    opt = sgd(m)
    g = torch.Generator().manual_seed(7)

    def lf(m, x, y):
        mask = torch.bernoulli(torch.full((x.shape[0], 1), 0.7), generator=g)
        return mse(m(x) * mask, y * mask)

    step_loop(run, m, lf, opt, extras=lambda: {"g": g.get_state()})


class GenNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = mk()
        self.gen = torch.Generator().manual_seed(3)

    def forward(self, x):
        noise = torch.randn(x.shape, generator=self.gen) * 0.1
        return self.net(x + noise)


@pattern
def S_model_generator(run):
    m = GenNet()
    opt = sgd(m)
    step_loop(run, m, lambda m, x, y: mse(m(x), y), opt, extras=lambda: {"g": m.gen.get_state()})


@pattern
def C_model_generator_also_used_by_loop(run):
    m = GenNet()
    opt = sgd(m)
    drawn = []

    def before(i):
        drawn.append(torch.rand(1, generator=m.gen))  # the loop draws from the model's generator

    cap_loop(run, m, opt, before=before, extras=lambda: {"g": m.gen.get_state(), "d": drawn})


@pattern
def C_model_generator_reseeded_per_epoch(run):
    m = GenNet()
    opt = sgd(m)

    def before(i):
        if i % 3 == 0:
            m.gen.manual_seed(1000 + i)

    cap_loop(run, m, opt, before=before, extras=lambda: {"g": m.gen.get_state()})


@pattern
def S_manual_seed_fixed_in_loss(run):
    m = mk(drop=0.3)
    opt = sgd(m)

    def lf(m, x, y):
        torch.manual_seed(1234)  # "deterministic" dropout per step
        return mse(m(x), y)

    torch.manual_seed(1234)
    step_loop(run, m, lf, opt, extras=lambda: {"rng": torch.get_rng_state()})


@pattern
def S_manual_seed_counter_in_loss(run):
    m = mk(drop=0.3)
    opt = sgd(m)
    k = [0]

    def lf(m, x, y):
        k[0] += 1
        torch.manual_seed(k[0])
        return mse(m(x), y)

    step_loop(run, m, lf, opt, extras=lambda: {"rng": torch.get_rng_state(), "k": k[0]})


@pattern
def S_manual_seed_then_randn_noise(run):
    """seeds at the top of the step, like some 'reproducible augmentation' code, then draws noise"""
    m = mk()
    opt = sgd(m)
    seed = [42]

    def lf(m, x, y):
        torch.manual_seed(seed[0])
        return mse(m(x + 0.1 * torch.randn_like(x)), y)

    def before(i):
        if i == 4:
            seed[0] = 43

    torch.manual_seed(42)
    step_loop(run, m, lf, opt, before=before, extras=lambda: {"rng": torch.get_rng_state()})


@pattern
def C_manual_seed_in_forward_seed_matches(run):
    class Seeded(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = mk(drop=0.3)

        def forward(self, x):
            torch.manual_seed(7)
            return self.net(x)

    m = Seeded()
    opt = sgd(m)
    torch.manual_seed(7)
    cap_loop(run, m, opt, extras=lambda: {"rng": torch.get_rng_state()})


@pattern
def S_random_seed_in_loss_then_choice(run):
    m = mk()
    opt = sgd(m)
    k = [0]

    def lf(m, x, y):
        k[0] += 1
        random.seed(k[0] // 3)  # reseed python RNG per "epoch" of 3 steps
        out = m(x)
        return mse(out, y) if random.random() < 0.5 else (out - y).abs().mean()

    step_loop(run, m, lf, opt, extras=lambda: {"k": k[0], "rs": random.random()})


# ============================================================ hooks
@pattern
def C_forward_hook_logs_activations(run):
    m = mk()
    opt = sgd(m)
    acts = []
    m[1].register_forward_hook(lambda mod, a, o: acts.append(o.detach().mean()))
    cap_loop(run, m, opt, extras=lambda: {"acts": acts})


@pattern
def C_full_backward_hook_grad_norms(run):
    m = mk()
    opt = sgd(m)
    norms = []
    m[3].register_full_backward_hook(lambda mod, gi, go: norms.append(go[0].norm()))
    cap_loop(run, m, opt, extras=lambda: {"norms": norms})


@pattern
def C_tensor_hook_in_forward(run):
    class Hooked(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = mk()
            self.seen = []

        def forward(self, x):
            h = self.net[1](self.net[0](x))
            if h.requires_grad:
                h.register_hook(lambda g: g * 0.5)
            return self.net[3](h)

    m = Hooked()
    opt = sgd(m)
    cap_loop(run, m, opt)


@pattern
def C_tensor_hook_records_in_loop(run):
    m = mk()
    opt = sgd(m)
    grads = []

    def fwd(model, x):
        out = model(x)
        out.register_hook(lambda g: grads.append(g.clone()))
        return out

    cap_loop(run, m, opt, fwd=fwd, extras=lambda: {"grads": grads})


@pattern
def C_post_accumulate_hook_counter(run):
    m = mk()
    opt = sgd(m)
    cnt = collections.Counter()
    norms = []
    for n, p in m.named_parameters():

        def hook(p, n=n):
            cnt.update([n])
            norms.append(p.grad.norm())

        p.register_post_accumulate_grad_hook(hook)
    cap_loop(run, m, opt, extras=lambda: {"cnt": dict(cnt), "norms": norms})


@pattern
def C_post_accumulate_hook_clips_with_counter(run):
    m = mk()
    opt = sgd(m)
    k = [0]

    def hook(p):
        k[0] += 1
        p.grad.mul_(1.0 if k[0] < 12 else 0.5)

    for p in m.parameters():
        p.register_post_accumulate_grad_hook(hook)
    cap_loop(run, m, opt, extras=lambda: {"k": k[0]})


@pattern
def S_post_accumulate_hook_counter(run):
    m = mk()
    opt = sgd(m)
    k = [0]
    for p in m.parameters():
        p.register_post_accumulate_grad_hook(lambda p: k.__setitem__(0, k[0] + 1))
    step_loop(run, m, lambda m, x, y: mse(m(x), y), opt, extras=lambda: {"k": k[0]})


@pattern
def S_tensor_hook_in_loss_records(run):
    m = mk()
    opt = sgd(m)
    grads = []

    def lf(m, x, y):
        out = m(x)
        out.register_hook(lambda g: grads.append(g.detach().clone()))
        return mse(out, y)

    step_loop(run, m, lf, opt, extras=lambda: {"grads": grads})


@pattern
def S_optimizer_step_post_hook_counter(run):
    m = mk()
    opt = sgd(m)
    k = [0]
    opt.register_step_post_hook(lambda o, a, kw: k.__setitem__(0, k[0] + 1))
    step_loop(run, m, lambda m, x, y: mse(m(x), y), opt, extras=lambda: {"k": k[0]})


# ============================================================ custom autograd.Function
class ScaleGrad(torch.autograd.Function):
    seen: list = []  # noqa: RUF012

    @staticmethod
    def forward(ctx, x, s):
        ctx.s = s
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        ScaleGrad.seen.append(ctx.s)
        return g * ctx.s, None


SCALE_K = [0]


class GRLNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = mk()

    def forward(self, x):
        SCALE_K[0] += 1
        s = min(1.0, SCALE_K[0] / 4)
        h = self.net[1](self.net[0](x))
        return self.net[3](ScaleGrad.apply(h, s))


@pattern
def C_custom_function_ctx_counter(run):
    SCALE_K[0] = 0
    ScaleGrad.seen = []
    m = GRLNet()
    opt = sgd(m)
    cap_loop(run, m, opt, extras=lambda: {"k": SCALE_K[0], "seen": ScaleGrad.seen})


@pattern
def S_custom_function_ctx_counter(run):
    SCALE_K[0] = 0
    ScaleGrad.seen = []
    m = GRLNet()
    opt = sgd(m)
    step_loop(
        run,
        m,
        lambda m, x, y: mse(m(x), y),
        opt,
        extras=lambda: {"k": SCALE_K[0], "seen": ScaleGrad.seen},
    )


class GRLFixed(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = mk()

    def forward(self, x):
        h = self.net[1](self.net[0](x))
        return self.net[3](ScaleGrad.apply(h, 0.5))


@pattern
def C_custom_function_backward_logs(run):
    ScaleGrad.seen = []
    m = GRLFixed()
    opt = sgd(m)
    cap_loop(run, m, opt, extras=lambda: {"seen": list(ScaleGrad.seen)})


# ============================================================ loss_fn edits optimizer / grads
@pattern
def S_loss_sets_param_group_lr(run):
    m = mk()
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    k = [0]

    def lf(m, x, y):
        k[0] += 1
        opt.param_groups[0]["lr"] = 0.1 if k[0] < 3 else 0.05
        return mse(m(x), y)

    step_loop(run, m, lf, opt, extras=lambda: {"lr": opt.param_groups[0]["lr"]})


@pattern
def S_loss_sets_param_group_weight_decay_tensor_lr(run):
    m = mk()
    opt = torch.optim.SGD(m.parameters(), lr=torch.tensor(0.1), momentum=0.9, fused=True)
    k = [0]

    def lf(m, x, y):
        k[0] += 1
        opt.param_groups[0]["lr"].fill_(0.1 / k[0])
        return mse(m(x), y)

    step_loop(run, m, lf, opt, extras=lambda: {"lr": opt.param_groups[0]["lr"].clone()})


@pattern
def S_loss_scales_existing_grads(run):
    m = mk()
    opt = sgd(m)

    def lf(m, x, y):
        for p in m.parameters():
            if p.grad is not None:
                p.grad.mul_(0.5)  # decay earlier micro-batches
        return mse(m(x), y)

    step_loop(run, m, lf, opt, steps=8, accumulate=2)


@pattern
def S_loss_branches_on_grad_none(run):
    m = mk()
    opt = sgd(m)
    seen = []

    def lf(m, x, y):
        first = m[0].weight.grad is None
        seen.append(first)
        return (1.0 if first else 2.0) * mse(m(x), y)

    step_loop(run, m, lf, opt, steps=8, accumulate=2, extras=lambda: {"seen": seen})


# ============================================================ objects swapped mid-run
@pattern
def S_head_swapped_midrun(run):
    m = mk()
    opt = sgd(m)

    def before(i):
        if i == 3:
            torch.manual_seed(9)
            m[3] = nn.Linear(8, 3)
            opt.add_param_group({"params": m[3].parameters()})

    step_loop(run, m, lambda m, x, y: mse(m(x), y), opt, before=before)


@pattern
def C_head_swapped_midrun(run):
    m = mk()
    opt = sgd(m)

    def before(i):
        if i == 3:
            torch.manual_seed(9)
            m[3] = nn.Linear(8, 3)
            opt.add_param_group({"params": m[3].parameters()})

    cap_loop(run, m, opt, before=before)


class WeightedCrit:
    def __init__(self):
        self.w = 1.0
        self.kind = "mse"

    def __call__(self, m, x, y):
        out = m(x)
        base = mse(out, y) if self.kind == "mse" else (out - y).abs().mean()
        return self.w * base


@pattern
def S_criterion_attribute_changed(run):
    m = mk()
    opt = sgd(m)
    crit = WeightedCrit()

    def before(i):
        if i == 3:
            crit.w = 0.5
        if i == 5:
            crit.kind = "l1"

    step_loop(run, m, crit, opt, before=before)


@pattern
def S_nn_criterion_in_closure_changed(run):
    m = mk()
    opt = sgd(m)
    ce = nn.CrossEntropyLoss(label_smoothing=0.0)

    def lf(m, x, y):
        return ce(m(x), y)

    def before(i):
        if i == 3:
            ce.label_smoothing = 0.2

    step_loop(run, m, lf, opt, before=before, args=lambda i: (batch(i)[0], torch.arange(5) % 3))


CRIT = nn.MSELoss()


@pattern
def S_global_criterion_rebound(run):
    global CRIT
    CRIT = nn.MSELoss()
    m = mk()
    opt = sgd(m)

    def lf(m, x, y):
        return CRIT(m(x), y)

    def before(i):
        global CRIT
        if i == 3:
            CRIT = nn.L1Loss()

    step_loop(run, m, lf, opt, before=before)


@pattern
def S_closure_function_swapped(run):
    m = mk()
    opt = sgd(m)
    box = {"fn": mse}

    def lf(m, x, y):
        return box["fn"](m(x), y)

    def before(i):
        if i == 3:
            box["fn"] = lambda a, b: (a - b).abs().mean()

    step_loop(run, m, lf, opt, before=before)


@pattern
def S_closure_tensor_rebound_by_user(run):
    m = mk()
    opt = sgd(m)
    temp = torch.tensor(1.0)

    def lf(m, x, y):
        return mse(m(x) / temp, y)

    def before(i):
        nonlocal temp
        if i >= 3:
            temp = torch.tensor(1.0 + 0.5 * i)

    step_loop(run, m, lf, opt, before=before)


@pattern
def S_closure_tensor_updated_in_place_by_user(run):
    m = mk()
    opt = sgd(m)
    temp = torch.tensor(1.0)

    def lf(m, x, y):
        return mse(m(x) / temp, y)

    def before(i):
        temp.fill_(1.0 + 0.5 * i)

    step_loop(run, m, lf, opt, before=before)


@pattern
def C_model_plain_list_of_weights_mutated(run):
    class Mix(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = mk()
            self.ws = [1.0, 1.0]

        def forward(self, x):
            return self.net(x) * self.ws[0] + self.ws[1]

    m = Mix()
    opt = sgd(m)

    def before(i):
        if i == 3:
            m.ws[0] = 0.5

    cap_loop(run, m, opt, before=before)


@pattern
def C_forward_reads_len_of_user_list(run):
    class Curr(nn.Module):
        def __init__(self, hist):
            super().__init__()
            self.net = mk()
            self.hist = hist

        def forward(self, x):
            return self.net(x) * (1.0 if len(self.hist) < 3 else 0.5)

    hist = []
    m = Curr(hist)
    opt = sgd(m)
    cap_loop(run, m, opt, before=lambda i: hist.append(i), extras=lambda: {"h": hist})


class SchedObj:
    def __init__(self):
        self.k = 0

    def p(self):
        return 0.1 * (self.k % 3)


@pattern
def C_forward_reads_sched_in_list(run):
    """documented-silent family check: a method of an object inside a container the model holds"""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = mk()
            self.scheds = [SchedObj()]

        def forward(self, x):
            return self.net(x) * (1.0 - self.scheds[0].p())

    m = Net()
    opt = sgd(m)
    cap_loop(run, m, opt, before=lambda i: setattr(m.scheds[0], "k", i))


# ============================================================ call arguments (python values)
@pattern
def S_kwarg_temperature_float(run):
    m = mk()
    opt = sgd(m)

    def lf(m, x, y, temperature=1.0):
        return mse(m(x) / temperature, y)

    step_loop(run, m, lf, opt, kw=lambda i: {"temperature": 1.0 + 0.25 * (i % 3)})


@pattern
def S_dict_batch_python_values(run):
    m = mk()
    opt = sgd(m)

    def lf(m, b):
        out = m(b["x"]) / b["temp"]
        loss = mse(out, b["y"]) if b["mode"] == "mse" else (out - b["y"]).abs().mean()
        if b["aux"]:
            loss = loss + 0.1 * out.pow(2).mean()
        return loss

    def args(i):
        x, y = batch(i)
        return (
            {
                "x": x,
                "y": y,
                "temp": [1.0, 2.0][i % 2],
                "mode": ["mse", "l1", "mse"][i % 3],
                "aux": i >= 4,
            },
        )

    step_loop(run, m, lf, opt, args=args)


@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    y: torch.Tensor
    weight: float = 1.0


@pattern
def S_dataclass_batch(run):
    m = mk()
    opt = sgd(m)

    def lf(m, b):
        return b.weight * mse(m(b.x), b.y)

    step_loop(run, m, lf, opt, args=lambda i: (Batch(*batch(i), weight=1.0 + (i % 2)),))


@dataclasses.dataclass(frozen=True)
class FBatch:
    x: torch.Tensor
    y: torch.Tensor
    weight: float = 1.0


@pattern
def S_frozen_dataclass_batch(run):
    m = mk()
    opt = sgd(m)

    def lf(m, b):
        return b.weight * mse(m(b.x), b.y)

    step_loop(run, m, lf, opt, args=lambda i: (FBatch(*batch(i), weight=1.0 + (i % 2)),))


@pattern
def S_list_arg_with_int(run):
    m = mk()
    opt = sgd(m)

    def lf(m, items):
        x, y, k = items
        return mse(m(x), y) * (1 + k)

    step_loop(run, m, lf, opt, args=lambda i: ([*batch(i), i % 2],))


@pattern
def S_kwarg_scale_tensor_new_vs_inplace(run):
    m = mk()
    opt = sgd(m)
    s = torch.tensor(1.0)

    def lf(m, x, y, scale):
        return mse(m(x) * scale, y)

    def kw(i):
        nonlocal s
        if i % 2:
            s.fill_(1.0 + i)
        else:
            s = torch.tensor(2.0 - 0.1 * i)
        return {"scale": s}

    step_loop(run, m, lf, opt, kw=kw)


@pattern
def S_arg_mutated_after_step(run):
    """the caller keeps the batch and writes it after the step (a replay must not share it)"""
    m = mk()
    opt = sgd(m)
    x0, y0 = batch(0)

    def args(i):
        x0.copy_(batch(i)[0])
        y0.copy_(batch(i)[1])
        return x0, y0

    step_loop(run, m, lambda m, x, y: mse(m(x), y), opt, args=args)


# ============================================================ step returns / kept tensors
@pattern
def S_returned_losses_kept_in_list(run):
    m = mk()
    opt = sgd(m)
    kept = []
    step_loop(run, m, lambda m, x, y: mse(m(x), y), opt, keep=kept, extras=lambda: {"kept": kept})


@pattern
def C_outputs_detached_kept_in_list(run):
    m = mk()
    opt = sgd(m)
    outs = []

    def fwd(model, x):
        o = model(x)
        outs.append(o.detach())
        return o

    cap_loop(run, m, opt, fwd=fwd, extras=lambda: {"outs": outs})


@pattern
def C_output_returned_dict_kept(run):
    class DictOut(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = mk()

        def forward(self, x):
            h = self.net[1](self.net[0](x))
            return {"out": self.net[3](h), "feat": h, "n": x.shape[0]}

    m = DictOut()
    opt = sgd(m)
    feats = []

    def fwd(model, x):
        d = model(x)
        feats.append((d["feat"].detach(), d["n"]))
        return d["out"]

    cap_loop(run, m, opt, fwd=fwd, extras=lambda: {"feats": feats})


@pattern
def S_loss_fn_stashes_output_on_closure(run):
    m = mk()
    opt = sgd(m)
    last = {}

    def lf(m, x, y):
        out = m(x)
        last["out"] = out.detach()
        last["n"] = last.get("n", 0) + 1
        return mse(out, y)

    step_loop(run, m, lf, opt, extras=lambda: {"last": last})


@pattern
def S_dropout_p_set_from_counter(run):
    m = mk(drop=0.0)
    opt = sgd(m)
    k = [0]

    def lf(m, x, y):
        k[0] += 1
        m[2].p = 0.1 * (k[0] % 3)
        return mse(m(x), y)

    step_loop(run, m, lf, opt, extras=lambda: {"k": k[0], "p": m[2].p})


@pattern
def S_model_plain_object_counter(run):
    class Stats:
        def __init__(self):
            self.n = 0

    m = mk()
    m.stats = Stats()
    opt = sgd(m)

    def lf(m, x, y):
        m.stats.n += 1
        return (1.0 if m.stats.n < 3 else 0.5) * mse(m(x), y)

    step_loop(run, m, lf, opt, extras=lambda: {"n": m.stats.n})


@pattern
def S_numpy_array_counter(run):
    m = mk()
    opt = sgd(m)
    hist = np.zeros(3)

    def lf(m, x, y):
        hist[0] += 1
        hist[1] += x.shape[0]
        return (1.0 if hist[0] < 4 else 0.5) * mse(m(x), y)

    step_loop(run, m, lf, opt, extras=lambda: {"hist": hist})


@pattern
def S_tqdm_progress_in_loss(run):
    import io

    from tqdm import tqdm

    m = mk()
    opt = sgd(m)
    bar = tqdm(total=100, file=io.StringIO(), disable=False)

    def lf(m, x, y):
        bar.update(1)
        return (1.0 if bar.n < 4 else 0.5) * mse(m(x), y)

    step_loop(run, m, lf, opt, extras=lambda: {"n": bar.n})


@pattern
def S_lru_cache_counter_helper(run):
    m = mk()
    opt = sgd(m)
    calls = [0]

    @functools.lru_cache(maxsize=None)  # noqa: UP033
    def mask(n):
        calls[0] += 1
        return torch.ones(n, 1)

    def lf(m, x, y):
        mk_ = mask(x.shape[0])
        return mse(m(x) * mk_, y)

    step_loop(run, m, lf, opt, extras=lambda: {"calls": calls[0]})


# ============================================================ round two: holes around the first findings
@pattern
def S_function_attr_config_set_by_user(run):
    """a hyper-parameter kept as an attribute of the loss function, changed by the loop"""
    m = mk()
    opt = sgd(m)

    def lf(m, x, y):
        out = m(x)
        return mse(out, y) + lf.aux * out.pow(2).mean()

    lf.aux = 0.0

    def before(i):
        if i == 3:
            lf.aux = 0.5

    step_loop(run, m, lf, opt, before=before)


def helper_counted(h):
    helper_counted.calls += 1
    return h * (1.0 if helper_counted.calls < 3 else 0.5)


class HelperNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = mk()

    def forward(self, x):
        return helper_counted(self.net(x))


@pattern
def C_forward_helper_function_attr_counter(run):
    helper_counted.calls = 0
    m = HelperNet()
    opt = sgd(m)
    cap_loop(run, m, opt, extras=lambda: {"calls": helper_counted.calls})


@pattern
def S_forward_helper_function_attr_counter(run):
    helper_counted.calls = 0
    m = HelperNet()
    opt = sgd(m)
    step_loop(
        run, m, lambda m, x, y: mse(m(x), y), opt, extras=lambda: {"calls": helper_counted.calls}
    )


def scaled_act(h):
    return h * scaled_act.scale


class ActNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = mk()

    def forward(self, x):
        return scaled_act(self.net(x))


@pattern
def C_forward_helper_function_attr_set_by_user(run):
    scaled_act.scale = 1.0
    m = ActNet()
    opt = sgd(m)

    def before(i):
        if i == 3:
            scaled_act.scale = 0.5

    cap_loop(run, m, opt, before=before)


class Focal:
    gamma = 2.0

    def __call__(self, m, x, y):
        d = (m(x) - y).abs()
        return (d**self.gamma).mean()


@pattern
def S_callable_class_default_changed_by_user(run):
    m = mk()
    opt = sgd(m)
    crit = Focal()

    def before(i):
        if i == 3:
            Focal.gamma = 1.5

    Focal.gamma = 2.0
    try:
        step_loop(run, m, crit, opt, before=before)
    finally:
        Focal.gamma = 2.0


class InstanceCountCrit:
    calls = 0

    def __call__(self, m, x, y):
        self.__class__.calls += 1
        return mse(m(x), y)


@pattern
def S_class_attr_counter_no_branch(run):
    InstanceCountCrit.calls = 0
    m = mk()
    opt = sgd(m)
    step_loop(run, m, InstanceCountCrit(), opt, extras=lambda: {"n": InstanceCountCrit.calls})


@pattern
def S_sched_last_epoch_read_in_loss(run):
    m = mk()
    opt = torch.optim.SGD(m.parameters(), lr=torch.tensor(0.1), momentum=0.9, fused=True)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)

    def lf(m, x, y):
        out = m(x)
        w = min(1.0, sched.last_epoch / 3)  # aux-loss warm-up keyed on the schedule
        return mse(out, y) + w * out.pow(2).mean()

    step_loop(
        run,
        m,
        lf,
        opt,
        before=lambda i: sched.step() if i else None,
        extras=lambda: {"ep": sched.last_epoch},
    )


@pattern
def S_sched_get_last_lr_read_in_loss(run):
    m = mk()
    opt = torch.optim.SGD(m.parameters(), lr=torch.tensor(0.1), momentum=0.9, fused=True)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)

    def lf(m, x, y):
        out = m(x)
        lr = sched.get_last_lr()[0]
        lr = float(lr) if not isinstance(lr, torch.Tensor) else lr
        return mse(out, y) + 0.1 * out.pow(2).mean() * lr

    step_loop(run, m, lf, opt, before=lambda i: sched.step() if i else None)


@pattern
def S_param_group_custom_key_read_in_loss(run):
    m = mk()
    opt = sgd(m)
    opt.param_groups[0]["l2"] = 1e-2

    def lf(m, x, y):
        l2 = sum(p.pow(2).sum() for p in m.parameters())
        return mse(m(x), y) + opt.param_groups[0]["l2"] * l2

    def before(i):
        if i == 3:
            opt.param_groups[0]["l2"] = 0.5

    step_loop(run, m, lf, opt, before=before)


@pattern
def S_tqdm_n_read_only(run):
    import io

    from tqdm import tqdm

    m = mk()
    opt = sgd(m)
    bar = tqdm(total=100, file=io.StringIO())

    def lf(m, x, y):
        return (1.0 if bar.n < 3 else 0.5) * mse(m(x), y)

    step_loop(run, m, lf, opt, before=lambda i: bar.update(1), extras=lambda: {"n": bar.n})


@pattern
def S_environ_flag_in_loss(run):
    import os

    os.environ["R13_AUX"] = "0"
    m = mk()
    opt = sgd(m)

    def lf(m, x, y):
        out = m(x)
        return mse(out, y) + float(os.environ["R13_AUX"]) * out.pow(2).mean()

    def before(i):
        if i == 3:
            os.environ["R13_AUX"] = "0.5"

    try:
        step_loop(run, m, lf, opt, before=before)
    finally:
        os.environ.pop("R13_AUX", None)


@pattern
def C_environ_flag_in_forward(run):
    import os

    class EnvNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = mk()

        def forward(self, x):
            return self.net(x) * float(os.environ.get("R13_SCALE", "1"))

    os.environ["R13_SCALE"] = "1"
    m = EnvNet()
    opt = sgd(m)

    def before(i):
        if i == 3:
            os.environ["R13_SCALE"] = "0.5"

    try:
        cap_loop(run, m, opt, before=before)
    finally:
        os.environ.pop("R13_SCALE", None)


import contextvars  # noqa: E402
import threading  # noqa: E402

TEMP_CV = contextvars.ContextVar("temp", default=1.0)
LOCAL = threading.local()


@pattern
def S_contextvar_temperature(run):
    TEMP_CV.set(1.0)
    m = mk()
    opt = sgd(m)

    def lf(m, x, y):
        return mse(m(x) / TEMP_CV.get(), y)

    step_loop(run, m, lf, opt, before=lambda i: TEMP_CV.set(1.0 + 0.5 * (i >= 3)))


@pattern
def C_threading_local_in_forward(run):
    LOCAL.scale = 1.0

    class LocNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = mk()

        def forward(self, x):
            return self.net(x) * LOCAL.scale

    m = LocNet()
    opt = sgd(m)
    cap_loop(run, m, opt, before=lambda i: setattr(LOCAL, "scale", 1.0 if i < 3 else 0.5))


class Slotted:
    __slots__ = ("n", "w")

    def __init__(self):
        self.n = 0
        self.w = 1.0


@pattern
def S_slots_counter(run):
    m = mk()
    opt = sgd(m)
    st = Slotted()

    def lf(m, x, y):
        st.n += 1
        return (1.0 if st.n < 3 else 0.5) * mse(m(x), y)

    step_loop(run, m, lf, opt, extras=lambda: {"n": st.n})


@pattern
def S_slots_config_set_by_user(run):
    m = mk()
    opt = sgd(m)
    st = Slotted()

    def lf(m, x, y):
        return st.w * mse(m(x), y)

    step_loop(run, m, lf, opt, before=lambda i: setattr(st, "w", 1.0 if i < 3 else 0.5))


@pattern
def S_closure_made_schedule(run):
    def make_sched():
        k = 0

        def nxt():
            nonlocal k
            k += 1
            return min(1.0, k / 3)

        return nxt

    sched = make_sched()
    m = mk()
    opt = sgd(m)

    def lf(m, x, y):
        return sched() * mse(m(x), y)

    step_loop(run, m, lf, opt, extras=lambda: {"k": sched.__closure__[0].cell_contents})


class SideEffectProp:
    def __init__(self):
        self._reads = 0

    @property
    def weight(self):
        self._reads += 1
        return 1.0 if self._reads < 3 else 0.5


@pattern
def S_property_with_side_effect(run):
    m = mk()
    opt = sgd(m)
    cfg = SideEffectProp()

    def lf(m, x, y):
        return cfg.weight * mse(m(x), y)

    step_loop(run, m, lf, opt, extras=lambda: {"reads": cfg._reads})


@pattern
def C_simplenamespace_cfg_on_model(run):
    class CfgNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = mk()
            self.cfg = types.SimpleNamespace(temp=1.0)

        def forward(self, x):
            return self.net(x) / self.cfg.temp

    m = CfgNet()
    opt = sgd(m)
    cap_loop(run, m, opt, before=lambda i: setattr(m.cfg, "temp", 1.0 if i < 3 else 2.0))


@pattern
def S_argparse_cfg_read_in_loss(run):
    m = mk()
    opt = sgd(m)
    args = argparse.Namespace(temp=1.0)

    def lf(m, x, y):
        return mse(m(x) / args.temp, y)

    step_loop(run, m, lf, opt, before=lambda i: setattr(args, "temp", 1.0 if i < 3 else 2.0))


@pattern
def C_chainmap_cfg_on_model(run):
    overrides = {}

    class CMNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = mk()
            self.cfg = collections.ChainMap(overrides, {"temp": 1.0})

        def forward(self, x):
            return self.net(x) / self.cfg["temp"]

    m = CMNet()
    opt = sgd(m)

    def before(i):
        if i == 3:
            overrides["temp"] = 2.0

    cap_loop(run, m, opt, before=before)


@pattern
def S_chainmap_cfg_in_loss(run):
    overrides = {}
    cfg = collections.ChainMap(overrides, {"temp": 1.0})
    m = mk()
    opt = sgd(m)

    def lf(m, x, y):
        return mse(m(x) / cfg["temp"], y)

    def before(i):
        if i == 3:
            overrides["temp"] = 2.0

    step_loop(run, m, lf, opt, before=before)


@pattern
def C_numpy_array_attr_changed_in_place(run):
    class NpNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = mk()
            self.w = np.array([1.0])

        def forward(self, x):
            return self.net(x) * float(self.w[0])

    m = NpNet()
    opt = sgd(m)

    def before(i):
        if i == 3:
            m.w[0] = 0.5

    cap_loop(run, m, opt, before=before)


@pattern
def S_fork_rng_fixed_noise(run):
    m = mk(drop=0.2)
    opt = sgd(m)

    def lf(m, x, y):
        with torch.random.fork_rng():
            torch.manual_seed(0)
            noise = torch.randn_like(x) * 0.1
        return mse(m(x + noise), y)

    step_loop(run, m, lf, opt, extras=lambda: {"rng": torch.get_rng_state()})


@pattern
def C_fork_rng_fixed_noise_in_forward(run):
    class NoisyNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = mk(drop=0.2)

        def forward(self, x):
            with torch.random.fork_rng():
                torch.manual_seed(0)
                noise = torch.randn_like(x) * 0.1
            return self.net(x + noise)

    m = NoisyNet()
    opt = sgd(m)
    cap_loop(run, m, opt, extras=lambda: {"rng": torch.get_rng_state()})


@pattern
def S_fork_rng_no_reseed(run):
    """draws inside fork_rng leave the global generator where it was"""
    m = mk(drop=0.2)
    opt = sgd(m)

    def lf(m, x, y):
        with torch.random.fork_rng():
            noise = torch.randn_like(x) * 0.1
        return mse(m(x + noise), y)

    step_loop(run, m, lf, opt, extras=lambda: {"rng": torch.get_rng_state()})


@pattern
def S_same_dropout_twice_set_rng_state(run):
    """R-Drop-like consistency: two forwards with the SAME dropout mask via get/set_rng_state"""
    m = mk(drop=0.3)
    opt = sgd(m)

    def lf(m, x, y):
        st = torch.get_rng_state()
        a = m(x)
        torch.set_rng_state(st)
        b = m(x + 0.01)
        return mse(a, y) + mse(b, y) + 0.1 * mse(a, b)

    step_loop(run, m, lf, opt, extras=lambda: {"rng": torch.get_rng_state()})


@pattern
def S_random_seed_fixed_then_choice(run):
    random.seed(0)
    m = mk()
    opt = sgd(m)
    k = [0]

    def lf(m, x, y):
        random.seed(k[0] % 2)  # epoch-seeded choice, counter is an outside list
        out = m(x)
        return mse(out, y) if random.random() < 0.5 else (out - y).abs().mean()

    step_loop(run, m, lf, opt, before=lambda i: k.__setitem__(0, i))


@pattern
def S_random_seed_constant_then_choice(run):
    random.seed(123)
    m = mk()
    opt = sgd(m)

    def lf(m, x, y):
        random.seed(1)
        out = m(x)
        return mse(out, y) if random.random() < 0.3 else (out - y).abs().mean()

    step_loop(run, m, lf, opt, extras=lambda: {"rs": random.random()})


@pattern
def C_random_seed_constant_then_choice_in_forward(run):
    class Ld(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = mk()

        def forward(self, x):
            random.seed(1)
            h = self.net(x)
            return h if random.random() < 0.3 else h * 0.5

    random.seed(123)
    m = Ld()
    opt = sgd(m)
    cap_loop(run, m, opt, extras=lambda: {"rs": random.random()})


@pattern
def S_np_seed_then_choice(run):
    np.random.seed(5)
    m = mk()
    opt = sgd(m)

    def lf(m, x, y):
        np.random.seed(1)
        out = m(x)
        return mse(out, y) if np.random.rand() < 0.3 else (out - y).abs().mean()

    step_loop(run, m, lf, opt, extras=lambda: {"ns": np.random.get_state()[2]})


@pattern
def S_rng_state_logged(run):
    m = mk(drop=0.2)
    opt = sgd(m)
    states = []

    def lf(m, x, y):
        states.append(torch.get_rng_state())
        return mse(m(x), y)

    step_loop(run, m, lf, opt, extras=lambda: {"states": states})


@pattern
def S_model_attr_float_read_in_loss(run):
    m = mk()
    m.aux_w = 0.0
    opt = sgd(m)

    def lf(m, x, y):
        out = m(x)
        return mse(out, y) + m.aux_w * out.pow(2).mean()

    step_loop(run, m, lf, opt, before=lambda i: setattr(m, "aux_w", 0.0 if i < 3 else 0.3))


@pattern
def S_opt_state_step_python(run):
    """Adam's step counter read by loss_fn for a bias-style warm-up (non-capturable Adam)"""
    m = mk()
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    p0 = next(m.parameters())

    def lf(m, x, y):
        st = opt.state.get(p0, {})
        k = int(st["step"]) if "step" in st else 0
        return (1.0 if k < 3 else 0.5) * mse(m(x), y)

    step_loop(run, m, lf, opt)


# ============================================================ round three
@pattern
def S_float_lr_read_in_loss(run):
    """loss scaled by the current float lr (e.g. a penalty annealed with the schedule)"""
    m = mk()
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.7)

    def lf(m, x, y):
        out = m(x)
        return mse(out, y) + opt.param_groups[0]["lr"] * out.pow(2).mean()

    step_loop(run, m, lf, opt, steps=9, before=lambda i: sched.step() if i else None)


@pattern
def S_float_lr_sched_get_last_lr_in_loss(run):
    m = mk()
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.7)

    def lf(m, x, y):
        out = m(x)
        return mse(out, y) + sched.get_last_lr()[0] * out.pow(2).mean()

    step_loop(run, m, lf, opt, steps=9, before=lambda i: sched.step() if i else None)


@functools.lru_cache(maxsize=None)  # noqa: UP033
def get_config():
    return {"loss": {"temp": 1.0}}


@pattern
def S_lru_cached_config_mutated(run):
    get_config()["loss"]["temp"] = 1.0
    m = mk()
    opt = sgd(m)

    def lf(m, x, y):
        return mse(m(x) / get_config()["loss"]["temp"], y)

    def before(i):
        if i == 3:
            get_config()["loss"]["temp"] = 2.0

    try:
        step_loop(run, m, lf, opt, before=before)
    finally:
        get_config()["loss"]["temp"] = 1.0


class CfgFwd(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = mk()

    def forward(self, x):
        return self.net(x) / get_config()["loss"]["temp"]


@pattern
def C_lru_cached_config_mutated(run):
    get_config()["loss"]["temp"] = 1.0
    m = CfgFwd()
    opt = sgd(m)

    def before(i):
        if i == 3:
            get_config()["loss"]["temp"] = 2.0

    try:
        cap_loop(run, m, opt, before=before)
    finally:
        get_config()["loss"]["temp"] = 1.0


class GeluNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = mk()

    def forward(self, x):
        return nn.functional.gelu(self.net[0](x))


_ORIG_GELU = nn.functional.gelu


@pattern
def C_monkeypatched_torch_function(run):
    m = GeluNet()
    head = nn.Linear(8, 3)
    opt = torch.optim.SGD([*m.parameters(), *head.parameters()], lr=0.1, fused=True)

    def before(i):
        if i == 3:  # switch to the tanh approximation (a "speed patch")
            nn.functional.gelu = functools.partial(_ORIG_GELU, approximate="tanh")

    try:
        cap_loop(run, m, opt, before=before, fwd=lambda model, x: head(model(x)), mods=(head,))
    finally:
        nn.functional.gelu = _ORIG_GELU


@pattern
def S_monkeypatched_torch_function(run):
    m = GeluNet()
    head = nn.Linear(8, 3)
    opt = torch.optim.SGD([*m.parameters(), *head.parameters()], lr=0.1, fused=True)

    def before(i):
        if i == 3:
            nn.functional.gelu = functools.partial(_ORIG_GELU, approximate="tanh")

    try:
        step_loop(run, m, lambda m, x, y: mse(head(m(x)), y), opt, before=before, mods=(head,))
    finally:
        nn.functional.gelu = _ORIG_GELU


LOG_PATH = "/tmp/r13_state_log.csv"


@pattern
def S_loss_appends_csv_line(run):
    import os

    if os.path.exists(LOG_PATH):
        os.remove(LOG_PATH)
    m = mk()
    opt = sgd(m)

    def lines():
        with open(LOG_PATH) as f:
            return f.read().count("\n")

    def lf(m, x, y):
        with open(LOG_PATH, "a") as f:
            f.write(f"{x.shape[0]}\n")
        return mse(m(x), y)

    step_loop(run, m, lf, opt, extras=lambda: {"lines": lines()})


@pattern
def C_forward_appends_csv_line(run):
    import os

    if os.path.exists(LOG_PATH):
        os.remove(LOG_PATH)

    class FileNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = mk()

        def forward(self, x):
            with open(LOG_PATH, "a") as f:
                f.write("call\n")
            return self.net(x)

    def lines():
        with open(LOG_PATH) as f:
            return f.read().count("\n")

    m = FileNet()
    opt = sgd(m)
    cap_loop(run, m, opt, extras=lambda: {"lines": lines()})


@pattern
def S_logging_handler_records(run):
    import logging

    recs = []

    class ListHandler(logging.Handler):
        def emit(self, record):
            recs.append(record.getMessage())

    log = logging.getLogger("r13.state")
    log.handlers[:] = [ListHandler()]
    log.setLevel(logging.INFO)
    log.propagate = False
    m = mk()
    opt = sgd(m)

    def lf(m, x, y):
        log.info("step batch %d", x.shape[0])
        return mse(m(x), y)

    step_loop(run, m, lf, opt, extras=lambda: {"n": len(recs)})


@pattern
def S_param_python_attribute_read_in_loss(run):
    m = mk()
    for p in m.parameters():
        p.decay_mult = 1e-3
    opt = sgd(m)

    def lf(m, x, y):
        reg = sum(p.decay_mult * p.pow(2).sum() for p in m.parameters())
        return mse(m(x), y) + reg

    def before(i):
        if i == 3:
            m[0].weight.decay_mult = 0.5

    step_loop(run, m, lf, opt, before=before)


@pattern
def C_param_python_attribute_read_in_forward(run):
    class PNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = mk()
            self.net[0].weight.gain = 1.0

        def forward(self, x):
            w = self.net[0].weight * self.net[0].weight.gain
            return self.net[3](torch.relu(nn.functional.linear(x, w, self.net[0].bias)))

    m = PNet()
    opt = sgd(m)

    def before(i):
        if i == 3:
            m.net[0].weight.gain = 0.5

    cap_loop(run, m, opt, before=before)


@pattern
def S_buffer_python_attribute_read_in_loss(run):
    class BNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = mk()
            self.register_buffer("scale", torch.ones(3))
            self.scale.temperature = 1.0

        def forward(self, x):
            return self.net(x) * self.scale / self.scale.temperature

    m = BNet()
    opt = sgd(m)

    def before(i):
        if i == 3:
            m.scale.temperature = 2.0

    step_loop(run, m, lambda m, x, y: mse(m(x), y), opt, before=before)


@pattern
def C_forward_sched_last_epoch(run):
    class SchedNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = mk()
            self.sched = None

        def forward(self, x):
            w = 1.0 if self.sched is None else min(1.0, 0.25 * (1 + self.sched.last_epoch))
            return self.net(x) * w

    m = SchedNet()
    opt = sgd(m)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=100)
    m.sched = sched
    cap_loop(run, m, opt, before=lambda i: sched.step() if i else None)


@pattern
def S_dataloader_epoch_in_loss(run):
    """a sampler's epoch (set by the loop, as DistributedSampler.set_epoch) read by loss_fn"""

    class Sampler(torch.utils.data.Sampler):
        def __init__(self):
            self.epoch = 0

        def set_epoch(self, e):
            self.epoch = e

        def __iter__(self):
            return iter(range(5))

        def __len__(self):
            return 5

    sampler = Sampler()
    m = mk()
    opt = sgd(m)

    def lf(m, x, y):
        return (1.0 if sampler.epoch < 1 else 0.5) * mse(m(x), y)

    step_loop(run, m, lf, opt, before=lambda i: sampler.set_epoch(i // 3))


@pattern
def S_torch_distribution_param_mutated(run):
    """noise level held in a torch.distributions object the loop anneals"""
    m = mk()
    opt = sgd(m)
    noise = torch.distributions.Normal(torch.tensor(0.0), torch.tensor(0.1))

    def lf(m, x, y):
        return mse(m(x + noise.sample(x.shape)), y)

    def before(i):
        if i == 3:
            noise.scale = torch.tensor(0.5)

    step_loop(run, m, lf, opt, before=before)


@pattern
def S_global_enum_mode_switched(run):
    import enum

    class Mode(enum.Enum):
        MSE = "mse"
        L1 = "l1"

    box = types.SimpleNamespace(mode=Mode.MSE)
    m = mk()
    opt = sgd(m)

    def lf(m, x, y):
        out = m(x)
        return mse(out, y) if box.mode is Mode.MSE else (out - y).abs().mean()

    step_loop(
        run, m, lf, opt, before=lambda i: setattr(box, "mode", Mode.L1 if i >= 3 else Mode.MSE)
    )


# ============================================================ round four: arguments the step writes
@pattern
def S_arg_dict_written_by_loss(run):
    """the caller hands a fresh dict per call; loss_fn fills it with metrics"""
    m = mk()
    opt = sgd(m)
    kept = []

    def lf(m, x, y, out):
        o = m(x)
        loss = mse(o, y)
        out["loss"] = loss.detach()
        out["mean"] = o.detach().mean()
        return loss

    def args(i):
        kept.append({})
        return (*batch(i), kept[-1])

    step_loop(run, m, lf, opt, args=args, extras=lambda: {"last": kept[-1]})


@pattern
def S_arg_list_appended_by_loss(run):
    """one list the caller passes every call; loss_fn appends to it"""
    m = mk()
    opt = sgd(m)
    log = []

    def lf(m, x, y, sink):
        loss = mse(m(x), y)
        sink.append(loss.detach())
        return loss

    step_loop(run, m, lf, opt, args=lambda i: (*batch(i), log), extras=lambda: {"log": log})


@pattern
def S_arg_fresh_list_appended_by_loss(run):
    m = mk()
    opt = sgd(m)
    kept = []

    def lf(m, x, y, sink):
        loss = mse(m(x), y)
        sink.append(loss.detach())
        return loss

    def args(i):
        kept.append([])
        return (*batch(i), kept[-1])

    step_loop(run, m, lf, opt, args=args, extras=lambda: {"kept": kept})


@pattern
def C_arg_dict_written_by_forward(run):
    class FeatNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = mk()

        def forward(self, x, feats):
            h = self.net[1](self.net[0](x))
            feats["h"] = h
            return self.net[3](h)

    m = FeatNet()
    opt = sgd(m)
    kept = []

    def fwd(model, x):
        kept.append({})
        out = model(x, kept[-1])
        return out + 0.1 * kept[-1]["h"].mean() if "h" in kept[-1] else out * float("nan")

    cap_loop(run, m, opt, fwd=fwd, extras=lambda: {"h": kept[-1]})


@pattern
def C_arg_list_appended_by_forward(run):
    class LogNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = mk()

        def forward(self, x, sink):
            out = self.net(x)
            sink.append(out.detach().sum())
            return out

    m = LogNet()
    opt = sgd(m)
    sink = []
    cap_loop(run, m, opt, fwd=lambda model, x: model(x, sink), extras=lambda: {"sink": sink})


@pattern
def S_kwarg_none_vs_tensor_mask(run):
    m = mk()
    opt = sgd(m)

    def lf(m, x, y, mask=None):
        out = m(x)
        if mask is not None:
            out = out * mask
            y = y * mask
        return mse(out, y)

    step_loop(
        run,
        m,
        lf,
        opt,
        kw=lambda i: {"mask": None if i % 2 else (torch.arange(5) < 4).float().unsqueeze(1)},
    )


@pattern
def S_numpy_array_argument(run):
    m = mk()
    opt = sgd(m)

    def lf(m, x, y, w):
        return mse(m(x) * torch.from_numpy(w).float(), y)

    step_loop(run, m, lf, opt, args=lambda i: (*batch(i), np.full((1, 3), 1.0 + (i >= 3))))


@pattern
def S_int_argument_loop_count(run):
    m = mk()
    opt = sgd(m)

    def lf(m, x, y, k):
        h = x
        loss = 0.0
        for _ in range(k):
            loss = loss + mse(m(h), y)
        return loss

    step_loop(run, m, lf, opt, args=lambda i: (*batch(i), 1 + (i % 2)))


@pattern
def S_loss_assigns_model_attr_tensor(run):
    m = mk()
    opt = sgd(m)

    def lf(m, x, y):
        out = m(x)
        loss = mse(out, y)
        m.last_loss = loss.detach()
        m.last_out = out
        return loss

    m.last_loss = None
    m.last_out = None
    step_loop(run, m, lf, opt, extras=lambda: {"ll": m.last_loss, "lo": m.last_out.detach()})


@pattern
def S_accumulate_user_keeps_micro_losses(run):
    m = mk()
    opt = sgd(m)
    micro, means = [], []

    def after(i):
        pass

    step = run.step(m, lambda m, x, y: mse(m(x), y), opt, accumulate=2)
    for i in range(8):
        loss = step(*batch(i))
        micro.append(loss)
        if i % 2 == 1:
            means.append(torch.stack(micro[-2:]).mean())
        run.snap([m], [opt], loss=loss, micro=list(micro), means=list(means))


# ============================================================ round five
@pattern
def C_contextvar_in_forward(run):
    class CvNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = mk()

        def forward(self, x):
            return self.net(x) / TEMP_CV.get()

    TEMP_CV.set(1.0)
    m = CvNet()
    opt = sgd(m)
    cap_loop(run, m, opt, before=lambda i: TEMP_CV.set(1.0 + 0.5 * (i >= 3)))


@pattern
def S_loop_reseeds_every_step(run):
    m = mk(drop=0.3)
    opt = sgd(m)
    step_loop(
        run, m, lambda m, x, y: mse(m(x), y), opt, before=lambda i: torch.manual_seed(1000 + i)
    )


@pattern
def C_loop_reseeds_every_step(run):
    m = mk(drop=0.3)
    opt = sgd(m)
    cap_loop(run, m, opt, before=lambda i: torch.manual_seed(1000 + i))


@pattern
def C_loop_restores_rng_state(run):
    m = mk(drop=0.3)
    opt = sgd(m)
    torch.manual_seed(3)
    st = torch.get_rng_state()
    cap_loop(run, m, opt, before=lambda i: torch.set_rng_state(st) if i % 2 else None)


@pattern
def S_generator_argument(run):
    m = mk()
    opt = sgd(m)
    g = torch.Generator().manual_seed(11)

    def lf(m, x, y, gen):
        return mse(m(x + 0.1 * torch.randn(x.shape, generator=gen)), y)

    step_loop(run, m, lf, opt, args=lambda i: (*batch(i), g), extras=lambda: {"g": g.get_state()})


@pattern
def C_closure_schedule_held_by_model(run):
    def make_sched():
        k = 0

        def p():
            nonlocal k
            k += 1
            return 0.1 * (k % 3)

        return p

    class SNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = mk()
            self.sched = make_sched()

        def forward(self, x):
            return self.net(x) * (1.0 - self.sched())

    m = SNet()
    opt = sgd(m)
    cap_loop(run, m, opt, extras=lambda: {"k": m.sched.__closure__[0].cell_contents})


@pattern
def C_input_tensor_python_attribute(run):
    class TagNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = mk()

        def forward(self, x):
            return self.net(x) * getattr(x, "weight", 1.0)

    m = TagNet()
    opt = sgd(m)

    def args(i):
        x, y = batch(i)
        x.weight = 1.0 if i < 3 else 0.5  # e.g. a tag the data pipeline puts on augmented batches
        return x, y

    cap_loop(run, m, opt, args=args)


@pattern
def S_input_tensor_python_attribute(run):
    m = mk()
    opt = sgd(m)

    def lf(m, x, y):
        return getattr(x, "weight", 1.0) * mse(m(x), y)

    def args(i):
        x, y = batch(i)
        x.weight = 1.0 if i < 3 else 0.5
        return x, y

    step_loop(run, m, lf, opt, args=args)


@pattern
def C_hf_config_attribute_changed(run):
    from transformers import PretrainedConfig

    class HfLike(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = mk()
            self.config = PretrainedConfig(logit_scale=1.0)

        def forward(self, x):
            return self.net(x) * self.config.logit_scale

    m = HfLike()
    opt = sgd(m)
    cap_loop(run, m, opt, before=lambda i: setattr(m.config, "logit_scale", 1.0 if i < 3 else 0.5))


@pattern
def S_hf_config_in_loss_changed(run):
    from transformers import PretrainedConfig

    cfg = PretrainedConfig(aux_weight=0.0)
    m = mk()
    opt = sgd(m)

    def lf(m, x, y):
        out = m(x)
        return mse(out, y) + cfg.aux_weight * out.pow(2).mean()

    step_loop(run, m, lf, opt, before=lambda i: setattr(cfg, "aux_weight", 0.0 if i < 3 else 0.5))


@pattern
def S_module_level_logger_in_loss(run):
    m = mk()
    opt = sgd(m)
    import logging

    recs = []

    class H(logging.Handler):
        def emit(self, record):
            recs.append(1)

    MODULE_LOGGER.handlers[:] = [H()]
    MODULE_LOGGER.setLevel(logging.INFO)
    MODULE_LOGGER.propagate = False

    def lf(m, x, y):
        MODULE_LOGGER.info("step")
        return mse(m(x), y)

    step_loop(run, m, lf, opt, extras=lambda: {"n": len(recs)})


import logging as _logging  # noqa: E402

MODULE_LOGGER = _logging.getLogger("r13.module")


# ============================================================================ main
def main(argv):
    sel = [n for n in PATTERNS if not argv or any(n.startswith(a) for a in argv)]
    counts = {}
    t0 = time.time()
    for name in sel:
        t = time.time()
        verdict, n, detail = run_pattern(name, PATTERNS[name])
        counts[verdict] = counts.get(verdict, 0) + 1
        print(
            f"{name:44s} | {verdict:16s} | {n:3d} | {time.time() - t:5.1f}s | {detail[:400]}",
            flush=True,
        )
    print(f"\nSUMMARY {len(sel)} patterns in {time.time() - t0:.0f}s: {counts}")


if __name__ == "__main__":
    main(sys.argv[1:])
