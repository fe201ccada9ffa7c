"""Hostile review of issue #33 (a call that runs eagerly leaves exactly what eager leaves).

Each pattern builds a fresh world from one seed twice, trains it 8 steps with replaykit (``step``:
``rk.TrainStep``; ``cap``: ``rk.capture`` in a hand-written loop) and with a plain eager loop, and
compares everything bit for bit: weights, grads (None pattern), buffers, optimizer state and Python
group values, modules the loss holds, Python-side values, RNG (torch, random, numpy), returned
losses and printed/logged line counts. One line per pattern::

    /work/main/.venv/bin/python scripts/review/review7.py [--only SUBSTR]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import io
import itertools
import logging
import random
import signal
import sys
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's replaykit

import replaykit as rk

STEPS = 8
LOG = logging.getLogger("review7")
LOG.setLevel(logging.INFO)
LOG.propagate = False


class _Counter(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.n += 1


HANDLER = _Counter()
LOG.addHandler(HANDLER)


class Timeout(Exception):
    pass


def _alarm(signum: int, frame: Any) -> None:
    raise Timeout


# ----------------------------------------------------------------------------- models


class MLP(nn.Module):
    def __init__(self, d: int = 8, h: int = 16, o: int = 4, bn: bool = False) -> None:
        super().__init__()
        self.l1 = nn.Linear(d, h)
        self.bn = nn.BatchNorm1d(h) if bn else nn.Identity()
        self.l2 = nn.Linear(h, o)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.relu(self.bn(self.l1(x))))


class DinoHead(MLP):
    """Forward re-binds its centre buffer (DINO): ``self.center = m*center + (1-m)*mean``."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("center", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        with torch.no_grad():
            self.center = 0.9 * self.center + 0.1 * out.mean(0)
        return out - self.center


class DinoLoss(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("center", torch.zeros(4))

    def forward(self, s: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        tt = torch.softmax((t - self.center) / 0.04, -1)
        loss = -(tt * torch.log_softmax(s / 0.1, -1)).sum(-1).mean()
        with torch.no_grad():
            self.center = self.center * 0.9 + 0.1 * t.mean(0)
        return loss


class Printing(MLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        print("fwd", x.shape[0])
        return super().forward(x)


class Logging(MLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        LOG.info("fwd %d", x.shape[0])
        return super().forward(x)


class Counting(MLP):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return super().forward(x)


class HostRandom(MLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if random.random() < 0.5:
            x = x * 2
        if np.random.rand() < 0.5:
            x = x + 1
        return super().forward(x)


class HostRandomSame(MLP):
    """Draws from random/numpy but never lets them change the computation."""

    def __init__(self) -> None:
        super().__init__()
        self.draws: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        random.random()
        np.random.rand()
        return super().forward(x)


class Caching(MLP):
    def __init__(self) -> None:
        super().__init__()
        self.cache: dict[str, Any] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.l1(x)
        self.cache["h"] = h.detach()
        self.cache["n"] = self.cache.get("n", 0) + 1
        return self.l2(torch.relu(h))


class RunningNorm(MLP):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(8))
        self.register_buffer("count", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            with torch.no_grad():
                self.count += 1
                self.mean += (x.mean(0) - self.mean) / self.count
        return super().forward(x - self.mean)


class ForwardEMA(MLP):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("w_ema", self.l1.weight.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.w_ema.mul_(0.9).add_(self.l1.weight, alpha=0.1)
        return super().forward(x)


class NumpyScale(MLP):
    def __init__(self) -> None:
        super().__init__()
        self.scale = np.float32(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.scale


class SparseIn(MLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.relu(torch.sparse.mm(x, self.l1.weight.t()) + self.l1.bias))


class PrintingErr(MLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        print("fwd", x.shape[0], file=sys.stderr)
        return super().forward(x)


class Warning_(MLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        warnings.warn("fwd", stacklevel=2)
        return super().forward(x)


STATS: dict[str, int] = {"n": 0}
HISTORY: list[int] = []


class GlobalDict(MLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        STATS["n"] += 1
        HISTORY.append(STATS["n"])
        return super().forward(x)


class ClassCounter(MLP):
    calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        type(self).calls += 1
        return super().forward(x)


class DefaultDtype(MLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * torch.tensor(0.3).to(x.dtype) + torch.arange(4).float().mean()


class Dropping(MLP):
    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(self.drop(torch.relu(self.l1(x))))


class Conv(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c = nn.Conv2d(2, 4, 3, padding=1)
        self.h = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.h(self.c(x.view(-1, 2, 2, 2)).mean((2, 3)))


TICKS = itertools.count()


class IterCounter(MLP):
    """Counts calls with an iterator it holds and a global one (``next``): state no copy sees."""

    def __init__(self) -> None:
        super().__init__()
        self.ids = itertools.count()
        self.seen: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        next(self.ids)
        next(TICKS)
        return super().forward(x)


class StochasticDepth(MLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.l1(x))
        if self.training and torch.rand([]) < 0.3:
            h = h * 0
        return self.l2(h)


GLOBAL_SUM = torch.zeros(4)


class GlobalTensor(MLP):
    """Adds to a module-level statistic tensor in place (a global running sum)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        with torch.no_grad():
            GLOBAL_SUM.add_(out.mean(0))
        return out


class SlowWeights(torch.optim.SGD):
    """SGD pulling slow weights it holds as an attribute towards the parameters: kernels only."""

    def __init__(self, params: Any, **kw: Any) -> None:
        super().__init__(params, **kw)
        self.slow = [p.detach().clone() for g in self.param_groups for p in g["params"]]

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        out = super().step(closure)
        torch._foreach_lerp_(self.slow, [p for g in self.param_groups for p in g["params"]], 0.5)
        return out


SCALE = torch.tensor(1.0)  # re-bound between steps by _between (a schedule held in a global)


class GlobalScaled(MLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * SCALE


class RNN(nn.Module):
    def __init__(self, kind: str, packed: bool = False) -> None:
        super().__init__()
        cls = {"lstm": nn.LSTM, "gru": nn.GRU}[kind]
        self.rnn = cls(8, 12, batch_first=True, num_layers=2)
        self.head = nn.Linear(12, 4)
        self.packed = packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            lengths = torch.tensor([5, 4, 3, 2, 2, 1])
            x = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True)
            out, _ = self.rnn(x)
            out, _ = nn.utils.rnn.pad_packed_sequence(out, batch_first=True)
            return self.head(out[:, 0])
        out, _ = self.rnn(x)
        return self.head(out[:, -1])


# ----------------------------------------------------------------------------- optimizers


class Lookahead(torch.optim.SGD):
    """SGD whose step counts in its param groups and pulls towards slow weights every k steps."""

    def __init__(self, params: Any, **kw: Any) -> None:
        super().__init__(params, **kw)
        for g in self.param_groups:
            g["la_count"] = 0
            g["la_k"] = 2
        self.slow = [p.detach().clone() for g in self.param_groups for p in g["params"]]

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        out = super().step(closure)
        i = 0
        for g in self.param_groups:
            g["la_count"] += 1
            for p in g["params"]:
                if g["la_count"] % g["la_k"] == 0:
                    self.slow[i].lerp_(p, 0.5)
                    p.copy_(self.slow[i])
                i += 1
        return out


class SelfScheduling(torch.optim.SGD):
    """SGD that writes ``group['lr']`` as a float at every step (a scheduler inside step)."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        out = super().step(closure)
        for g in self.param_groups:
            g["lr"] = float(g["lr"] * 0.9)
        return out


# ----------------------------------------------------------------------------- worlds


def _ce(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(m(x), y)


def _batches(kind: str = "mlp") -> list[tuple]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        if kind == "seq":
            out.append((torch.randn(6, 5, 8, generator=g), torch.randint(0, 4, (6,), generator=g)))
        elif kind == "sparse":
            x = torch.randn(6, 8, generator=g)
            x[x < 0.3] = 0
            out.append((x.to_sparse(), torch.randint(0, 4, (6,), generator=g)))
        else:
            out.append((torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g)))
    return out


def _sgd(m: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)


def _fsgd(m: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, fused=True)


def _world(
    model: nn.Module,
    loss_fn: Callable[..., torch.Tensor] = _ce,
    py: Callable[[], dict] = dict,
    extra: dict[str, Any] | None = None,
    **more: Any,
) -> dict:
    """A world: the model, its fused SGD, the loss, the modules the loss holds (``extra``), and
    ``py()``, the Python-side values compared; ``more``: what only this world sets."""
    return {
        "model": model,
        "opt": _fsgd(model),
        "loss_fn": loss_fn,
        "extra": extra or {},
        "py": py,
        **more,
    }


def world_plain(model_cls: Callable[[], nn.Module], opt: Callable = _fsgd) -> Callable[[], dict]:
    def make() -> dict:
        model = model_cls()
        return {"model": model, "opt": opt(model), "loss_fn": _ce, "extra": {}, "py": dict}

    return make


def world_byol() -> dict:
    model = MLP()
    target = copy.deepcopy(model).requires_grad_(False)

    def loss_fn(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            for pt, po in zip(target.parameters(), m.parameters(), strict=True):
                pt.mul_(0.99).add_(po, alpha=0.01)
            t = target(x)
        return nn.functional.mse_loss(m(x), t) + nn.functional.cross_entropy(m(x), y)

    return _world(model, loss_fn=loss_fn, extra={"target": target})


def world_dino_loss() -> dict:
    model = MLP()
    teacher = copy.deepcopy(model).requires_grad_(False)
    crit = DinoLoss()

    def loss_fn(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            t = teacher(x)
        return crit(m(x), t)

    return _world(model, loss_fn=loss_fn, extra={"teacher": teacher, "crit": crit})


def world_teacher_bn() -> dict:
    model = MLP()
    teacher = MLP(bn=True).requires_grad_(False)  # train mode: running stats move

    def loss_fn(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            t = teacher(x)
        return nn.functional.kl_div(
            torch.log_softmax(m(x), -1), torch.softmax(t, -1), reduction="batchmean"
        )

    return _world(model, loss_fn=loss_fn, extra={"teacher": teacher})


def world_list(item: bool) -> Callable[[], dict]:
    def make() -> dict:
        model = MLP()
        seen: list = []

        def loss_fn(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            loss = _ce(m, x, y)
            seen.append(loss.item() if item else loss.detach())
            return loss

        py = lambda: {"seen": list(seen)}  # noqa: E731
        return _world(model, loss_fn=loss_fn, py=py)

    return make


def world_closure_counter() -> dict:
    model = MLP()
    state = {"n": 0, "ema": 0.0}

    def loss_fn(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        state["n"] += 1
        return _ce(m, x, y)

    return _world(model, loss_fn=loss_fn, py=lambda: dict(state))


def world_py_attrs(attr: str) -> Callable[[], dict]:
    def make() -> dict:
        w = world_plain({"count": Counting, "cache": Caching}[attr])()
        m = w["model"]
        w["py"] = (
            (lambda: {"calls": m.calls})
            if attr == "count"
            else (lambda: {"n": m.cache["n"], "h": m.cache["h"]})
        )
        return w

    return make


class CountingLoss(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def forward(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.n += 1
        return nn.functional.cross_entropy(out, y)


def world_crit_counter() -> dict:
    model = MLP()
    crit = CountingLoss()
    return _world(model, loss_fn=lambda m, x, y: crit(m(x), y), py=lambda: {"n": crit.n})


def _hist_loss(m: nn.Module, x: torch.Tensor, y: torch.Tensor, _h: list = []) -> torch.Tensor:  # noqa: B006
    _h.append(1)
    return _ce(m, x, y)


def world_default_arg() -> dict:
    model = MLP()
    _hist_loss.__defaults__[0].clear()
    return _world(model, loss_fn=_hist_loss, py=lambda: {"h": len(_hist_loss.__defaults__[0])})


def world_global_dict() -> dict:
    STATS["n"] = 0
    HISTORY.clear()
    model = GlobalDict()
    return _world(model, py=lambda: {"n": STATS["n"], "h": list(HISTORY)})


def world_class_counter() -> dict:
    ClassCounter.calls = 0
    model = ClassCounter()
    return _world(model, py=lambda: {"n": ClassCounter.calls})


def world_generator_loss() -> dict:
    model = MLP()
    gen = torch.Generator().manual_seed(5)

    def loss_fn(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        noise = torch.randn(x.shape, generator=gen) * 0.1
        return _ce(m, x + noise, y)

    return _world(model, loss_fn=loss_fn, py=lambda: {"g": gen.get_state()})


def world_on_step() -> dict:
    model = MLP()
    calls = {"n": 0}

    def hook() -> None:
        calls["n"] += 1
        print("stepped")

    return _world(model, py=lambda: dict(calls), on_step=hook)


class Trainer:
    def __init__(self) -> None:
        self.n = 0
        self.history: list[int] = []

    def compute_loss(self, m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.n += 1
        self.history.append(self.n)
        return _ce(m, x, y)

    __call__ = compute_loss


def world_bound(kind: str) -> Callable[[], dict]:
    def make() -> dict:
        model = MLP()
        t = Trainer()
        if kind == "method":
            fn: Any = t.compute_loss
        elif kind == "callable":
            fn = t
        else:
            stats: dict[str, int] = {"n": 0}

            def base(m: nn.Module, x: torch.Tensor, y: torch.Tensor, stats: dict) -> torch.Tensor:
                stats["n"] += 1
                return _ce(m, x, y)

            fn = functools.partial(base, stats=stats)
            return _world(model, loss_fn=fn, py=lambda: dict(stats))
        return _world(model, loss_fn=fn, py=lambda: {"n": t.n, "h": list(t.history)})

    return make


def world_mixup() -> dict:
    model = MLP()

    def loss_fn(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        lam = float(np.random.beta(0.4, 0.4))
        perm = torch.randperm(x.shape[0])
        out = m(lam * x + (1 - lam) * x[perm])
        return lam * nn.functional.cross_entropy(out, y) + (1 - lam) * nn.functional.cross_entropy(
            out, y[perm]
        )

    return _world(model, loss_fn=loss_fn)


def world_iter() -> dict:
    model = IterCounter()
    start = next(TICKS)
    return _world(
        model,
        py=lambda: {"ids": next(copy.copy(model.ids)), "ticks": next(copy.copy(TICKS)) - start},
    )


def world_global_tensor() -> dict:
    GLOBAL_SUM.zero_()
    model = GlobalTensor()
    return _world(model, py=lambda: {"sum": GLOBAL_SUM.clone()})


def world_rk_ema() -> dict:
    model = MLP()
    return _world(model, ema=0.9)


WORLDS: dict[str, tuple[Callable[[], dict], dict]] = {
    "plain": (world_plain(MLP), {}),
    "dino_center_rebind": (world_plain(DinoHead), {}),
    "dino_loss_module": (world_dino_loss, {}),
    "byol_target_in_loss": (world_byol, {}),
    "teacher_bn_train": (world_teacher_bn, {}),
    "lookahead_counter": (world_plain(MLP, lambda m: Lookahead(m.parameters(), lr=0.1)), {}),
    "self_sched_float_lr": (world_plain(MLP, lambda m: SelfScheduling(m.parameters(), lr=0.1)), {}),
    "print_forward": (world_plain(Printing), {}),
    "logging_forward": (world_plain(Logging), {}),
    "list_append_tensor": (world_list(False), {}),
    "list_append_item": (world_list(True), {}),
    "closure_counter": (world_closure_counter, {}),
    "counter_attr": (world_py_attrs("count"), {}),
    "dict_cache": (world_py_attrs("cache"), {}),
    "host_random_branch": (world_plain(HostRandom), {}),
    "host_random_unused": (world_plain(HostRandomSame), {}),
    "batchnorm": (world_plain(lambda: MLP(bn=True)), {}),
    "running_norm": (world_plain(RunningNorm), {}),
    "nograd_ema_forward": (world_plain(ForwardEMA), {}),
    "accumulate2": (world_plain(lambda: MLP(bn=True)), {"accumulate": 2}),
    "accumulate4_dino": (world_plain(DinoHead), {"accumulate": 4}),
    "bf16_mixed": (world_plain(MLP), {"precision": "bf16-mixed"}),
    "bf16_bn_acc2": (
        world_plain(lambda: MLP(bn=True)),
        {"precision": "bf16-mixed", "accumulate": 2},
    ),
    "validate_between": (world_plain(lambda: MLP(bn=True)), {"validate": True}),
    "check_every2_dino": (world_plain(DinoHead), {"check_every": 2}),
    "check_every1_running": (world_plain(RunningNorm), {"check_every": 1}),
    "rk_ema": (world_rk_ema, {}),
    "adam_fused": (
        world_plain(MLP, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True)),
        {},
    ),
    "adam_default": (world_plain(MLP, lambda m: torch.optim.Adam(m.parameters(), lr=1e-2)), {}),
    "float_lr_sched": (world_plain(MLP, _sgd), {"sched": True}),
    "mkldnn_flip": (world_plain(lambda: RNN("lstm")), {"data": "seq", "switch": "mkldnn"}),
    "matmul_prec_flip": (world_plain(MLP), {"switch": "matmul"}),
    "deterministic_flip": (world_plain(MLP), {"switch": "det"}),
    "numpy_scalar": (world_plain(NumpyScale), {}),
    "numpy_scalar_change": (world_plain(NumpyScale), {"np_change": True}),
    "sparse_input": (world_plain(SparseIn), {"data": "sparse"}),
    "lstm": (world_plain(lambda: RNN("lstm")), {"data": "seq"}),
    "gru": (world_plain(lambda: RNN("gru")), {"data": "seq"}),
    "lstm_packed": (world_plain(lambda: RNN("lstm", packed=True)), {"data": "seq"}),
    "gru_packed_acc2": (
        world_plain(lambda: RNN("gru", packed=True)),
        {"data": "seq", "accumulate": 2},
    ),
    "print_stderr": (world_plain(PrintingErr), {}),
    "warn_forward": (world_plain(Warning_), {"warn": True}),
    "global_dict_forward": (world_global_dict, {}),
    "class_attr_counter": (world_class_counter, {}),
    "criterion_counter": (world_crit_counter, {}),
    "default_arg_list": (world_default_arg, {}),
    "generator_in_loss": (world_generator_loss, {}),
    "on_optimizer_step": (world_on_step, {}),
    "dropout_check1": (world_plain(Dropping), {"check_every": 1}),
    "dropout_acc2_bf16": (world_plain(Dropping), {"accumulate": 2, "precision": "bf16-mixed"}),
    "default_dtype_flip": (world_plain(DefaultDtype), {"switch": "dtype"}),
    "mkldnn_flip_bf16": (world_plain(MLP), {"switch": "mkldnn", "precision": "bf16-mixed"}),
    "mkldnn_flip_conv": (world_plain(Conv), {"switch": "mkldnn"}),
    "threads_flip": (world_plain(lambda: MLP(d=8, h=512)), {"switch": "threads"}),
    "trust_lookahead": (
        world_plain(MLP, lambda m: Lookahead(m.parameters(), lr=0.1)),
        {"trust": True},
    ),
    "trust_self_sched": (
        world_plain(MLP, lambda m: SelfScheduling(m.parameters(), lr=0.1)),
        {"trust": True},
    ),
    "bound_method_loss": (world_bound("method"), {}),
    "callable_obj_loss": (world_bound("callable"), {}),
    "partial_dict_loss": (world_bound("partial"), {}),
    "mixup_numpy": (world_mixup, {}),
    "stochastic_depth": (world_plain(StochasticDepth), {}),
    "itertools_counter": (world_iter, {}),
    "global_tensor_forward": (world_global_tensor, {}),
    "trusted_slow_weights": (
        world_plain(MLP, lambda m: SlowWeights(m.parameters(), lr=0.1)),
        {"trust": True},
    ),
    "teacher_bn_acc2": (world_teacher_bn, {"accumulate": 2}),
    "byol_acc4_check2": (world_byol, {"accumulate": 4, "check_every": 2}),
    "dino_loss_bf16": (world_dino_loss, {"precision": "bf16-mixed"}),
    "global_tensor_rebound": (world_plain(GlobalScaled), {"rebind": True}),
}


# ----------------------------------------------------------------------------- runs


def _switch(kind: str | None, i: int) -> None:
    """Flip a process-wide switch before call ``i`` (mid-run)."""
    if kind is None or i not in (3, 6):
        return
    on = i == 3
    if kind == "mkldnn":
        torch.backends.mkldnn.enabled = not on
    elif kind == "matmul":
        torch.set_float32_matmul_precision("medium" if on else "highest")
    elif kind == "det":
        torch.use_deterministic_algorithms(on)
    elif kind == "dtype":
        torch.set_default_dtype(torch.float64 if on else torch.float32)
    elif kind == "threads":
        torch.set_num_threads(1 if on else 2)


def _reset_switches() -> None:
    torch.backends.mkldnn.enabled = True
    torch.set_float32_matmul_precision("highest")
    torch.use_deterministic_algorithms(False)
    torch.set_default_dtype(torch.float32)
    torch.set_num_threads(2)


def _seed() -> None:
    global SCALE
    SCALE = torch.tensor(1.0)
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)


def _between(w: dict, opts: dict, i: int, batches: list) -> list:
    """What a user does between steps: validation, a scheduler, a changed attribute."""
    seen = []
    if opts.get("validate") and i % 3 == 2:
        w["model"].eval()
        with torch.no_grad():
            seen.append(w["model"](batches[0][0]).clone())
        w["model"].train()
    if opts.get("sched"):
        for g in w["opt"].param_groups:
            g["lr"] = g["lr"] * 0.5
    if opts.get("rebind"):
        global SCALE
        SCALE = torch.tensor(1.0 + i)
    if opts.get("np_change") and i == 4:
        w["model"].scale = np.float32(0.25)
    return seen


def run_eager(make: Callable[[], dict], opts: dict, entry: str) -> dict:
    _seed()
    w = make()
    batches = _batches(opts.get("data", "mlp"))
    acc = opts.get("accumulate", 1)
    ema = rk.EMA(w["model"], w["ema"]) if "ema" in w else None
    losses, vals = _hand_loop(w, opts, batches, ema, divide=entry == "step" and acc > 1)
    return _end(w, losses, vals, ema)


def _hand_loop(
    w: dict, opts: dict, batches: list, ema: Any, divide: bool = False
) -> tuple[list, list]:
    """The user's own loop (the eager reference, and the one ``rk.capture`` runs in): the loss
    (divided by the accumulation where the step divides it), an optimizer step every
    ``accumulate`` batches with the EMA and the world's ``on_step``; the losses and the values
    read between steps."""
    acc = opts.get("accumulate", 1)
    bf16 = opts.get("precision") == "bf16-mixed"
    losses, vals = [], []
    for i, batch in enumerate(batches):
        _switch(opts.get("switch"), i)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = w["loss_fn"](w["model"], *batch)
        (loss / acc if divide else loss).backward()
        if (i + 1) % acc == 0:
            w["opt"].step()
            if ema is not None:
                ema.update()
            if "on_step" in w:
                w["on_step"]()
            w["opt"].zero_grad(set_to_none=True)
        losses.append(loss.detach())
        vals += _between(w, opts, i, batches)
    return losses, vals


def run_rk(make: Callable[[], dict], opts: dict, entry: str, backend: str) -> tuple[dict, Any]:
    _seed()
    w = make()
    batches = _batches(opts.get("data", "mlp"))
    ema = rk.EMA(w["model"], w["ema"]) if "ema" in w else None
    losses, vals = [], []
    if entry == "step":
        kw = {k: opts[k] for k in ("accumulate", "precision", "check_every") if k in opts}
        if opts.get("trust"):
            kw["trust_optimizer"] = True
        if "on_step" in w:
            kw["on_optimizer_step"] = w["on_step"]
        st = rk.TrainStep(w["model"], w["loss_fn"], w["opt"], backend=backend, ema=ema, **kw)
        for i, batch in enumerate(batches):
            _switch(opts.get("switch"), i)
            losses.append(st(*batch).detach())
            vals += _between(w, opts, i, batches)
        return _end(w, losses, vals, ema), st
    kw = {k: opts[k] for k in ("check_every",) if k in opts}
    rec = rk.capture(w["model"], backend=backend, **kw)
    try:
        losses, vals = _hand_loop(w, opts, batches, ema)
    finally:
        rec.release()
    return _end(w, losses, vals, ema), rec


def _end(w: dict, losses: list, vals: list, ema: Any) -> dict:
    m = w["model"]
    out: dict[str, Any] = {f"sd {k}": v.clone() for k, v in m.state_dict().items()}
    out |= {f"grad {n}": p.grad for n, p in m.named_parameters()}
    out |= {f"attr {k}": v for k, v in vars(m).items() if not k.startswith("_") and k != "training"}
    for name, mod in w["extra"].items():
        out |= {f"{name} {k}": v.clone() for k, v in mod.state_dict().items()}
    sd = w["opt"].state_dict()
    for i, s in sd["state"].items():
        out |= {f"opt {i} {k}": v for k, v in s.items()}
    out["groups"] = [{k: v for k, v in g.items() if k != "params"} for g in sd["param_groups"]]
    if hasattr(w["opt"], "slow"):
        out |= {f"slow {i}": s for i, s in enumerate(w["opt"].slow)}
    if ema is not None:
        out |= {f"ema {i}": t for i, t in enumerate(ema.weights)} if hasattr(ema, "weights") else {}
    out |= {f"py {k}": v for k, v in w["py"]().items()}
    out["losses"] = losses
    out["vals"] = vals
    out["rng torch"] = torch.get_rng_state()
    out["rng random"] = random.getstate()
    out["rng numpy"] = str(np.random.get_state()[1][:4]) + str(np.random.get_state()[2])
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if a.is_sparse or b.is_sparse:
            return _same(a.to_dense(), b.to_dense())
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (a != a and b != b)
    if isinstance(a, itertools.count):
        return type(b) is itertools.count and repr(a) == repr(b)
    return type(a) is type(b) and a == b


def diff(a: dict, b: dict) -> list[str]:
    keys = list(dict.fromkeys([*a, *b]))
    return [k for k in keys if k not in a or k not in b or not _same(a[k], b[k])]


def _captured(fn: Callable[[], Any]) -> tuple[Any, int, int]:
    buf, err = io.StringIO(), io.StringIO()
    HANDLER.n = 0
    with (
        contextlib.redirect_stdout(buf),
        contextlib.redirect_stderr(err),
        warnings.catch_warnings(record=True) as ws,
    ):
        warnings.simplefilter("always")
        out = fn()
    n_warn = sum("fwd" in str(w.message) for w in ws)
    return (
        out,
        buf.getvalue().count("\n") + 1000 * err.getvalue().count("fwd") + 100000 * n_warn,
        HANDLER.n,
    )


def one(name: str, entry: str, backend: str, timeout: int = 120) -> str:
    make, opts = WORLDS[name]
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(timeout)
    try:
        (ref, p_e, l_e) = _captured(lambda: run_eager(make, opts, entry))
        _reset_switches()
        try:
            (got, p_r, l_r) = _captured(lambda: run_rk(make, opts, entry, backend))
        except Timeout:
            raise
        except Exception as e:
            tb = traceback.format_exc().strip().splitlines()[-1]
            return f"{name:22} {entry:4} {backend:8} CRASH {type(e).__name__}: {tb[:150]}"
        (res, obj) = got
        bad = diff(ref, res)
        if p_e != p_r:
            bad.append(f"prints {p_e}!={p_r}")
        if l_e != l_r:
            bad.append(f"logs {l_e}!={l_r}")
        counts = {k: v for k, v in dict(obj.counts).items() if v}
        reasons = dict(obj.eager_reasons)
        retired = getattr(obj, "retire_reason", None)
        ok = "Y" if not bad else "N"
        explained = {k for k in reasons if k != "warmup"} or retired  # warm-up explains nothing
        verdict = "exact" if not bad else ("DIFF+reason" if explained else "SILENT")
        tail = f" diff={bad[:6]}" if bad else ""
        return f"{name:22} {entry:4} {backend:8} exact={ok} {verdict:11} counts={counts} reasons={reasons} retired={retired!r}{tail}"
    except Timeout:
        return f"{name:22} {entry:4} {backend:8} TIMEOUT"
    finally:
        signal.alarm(0)
        _reset_switches()


# ----------------------------------------------------------------------------- Lightning


def lightning_cases() -> list[str]:
    """``ReplayCallback("net", optimizer_step=True)`` against a plain Trainer fit, same seed."""
    import lightning as L

    from replaykit.lightning import ReplayCallback

    for name in ("lightning", "lightning.pytorch"):
        logging.getLogger(name).setLevel(logging.ERROR)

    class Module(L.LightningModule):
        def __init__(self, net: nn.Module) -> None:
            super().__init__()
            self.net = net

        def training_step(self, batch: tuple, i: int) -> torch.Tensor:
            loss = _ce(self.net, *batch)
            self.log("loss", loss)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return _fsgd(self.net)

    def fit(make: Callable[[], nn.Module], cb: Any, prec: str, acc: int) -> list:
        GLOBAL_SUM.zero_()
        ClassCounter.calls = 0
        L.seed_everything(0, verbose=False)
        module = Module(make())
        ds = torch.utils.data.TensorDataset(*map(torch.cat, zip(*_batches(), strict=True)))
        trainer = L.Trainer(
            max_epochs=1,
            callbacks=[cb] if cb else [],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            precision=prec,
            accumulate_grad_batches=acc,
            accelerator="cpu",
            gradient_clip_val=1.0 if prec == "32" else None,
        )
        trainer.fit(module, torch.utils.data.DataLoader(ds, batch_size=6))
        end = [v.clone() for v in module.state_dict().values()]
        return [*end, GLOBAL_SUM.clone(), ClassCounter.calls]

    cases = {
        "L_bn": (lambda: MLP(bn=True), "32", 1),
        "L_bn_bf16_acc2": (lambda: MLP(bn=True), "bf16-mixed", 2),
        "L_global_tensor": (GlobalTensor, "32", 1),
        "L_class_counter": (ClassCounter, "32", 1),
    }
    lines = []
    for name, (make, prec, acc) in cases.items():
        ref = fit(make, None, prec, acc)
        cb = ReplayCallback("net", optimizer_step=True)
        got = fit(make, cb, prec, acc)
        bad = [i for i, (a, b) in enumerate(zip(ref, got, strict=True)) if not _same(a, b)]
        net = cb.summary()["net"]
        lines.append(
            f"{name:22} L    auto     exact={'N' if bad else 'Y'} diff_at={bad} record={net['record']}"
            f" replay={net['replay']} reasons={net['eager_reasons']} retired={net['retired']!r}"
            f" | {cb.optimizer_step.summary()}"
        )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="")
    ap.add_argument("--entry", default="step,cap")
    ap.add_argument("--backend", default="emulated,auto")
    ap.add_argument(
        "--lightning", action="store_true", help="also ReplayCallback against a plain fit"
    )
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    for name in WORLDS:
        if args.only and args.only not in name:
            continue
        for entry in args.entry.split(","):
            for backend in args.backend.split(","):
                print(one(name, entry, backend), flush=True)
    if args.lightning:
        for line in lightning_cases():
            print(line, flush=True)


if __name__ == "__main__":
    main()
