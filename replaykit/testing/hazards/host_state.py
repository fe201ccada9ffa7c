"""Host state a replay does not read again: draws from numpy's or Python's ``random`` in the
forward or the loss, and containers or arrays the model holds that the training loop changes
in place (a ``deque`` of recent losses, a numpy array).

Torch's own generator is replayed (its offset advances as eager's does); a host RNG is not
an aten op, so a recording keeps the draw it made. A held container keeps its identity
while its contents change, so watching it by identity sees nothing.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable

import torch
from torch import nn

from .pattern import MLP, Arm, Extras, Pattern, loop, mlp, sgd, step_loop
from .writing import HazardClass, built, each_step, looped, stepped

#: why an unsafe step arm of the private-generator patterns diverges on the CPU only
_MASK_ON_HOST = (
    "the mask drawn on the host is copied to the GPU: without the watch the capture meets that "
    "copy of a host-computed tensor, never fed, and retires, exact (H200)"
)


def seeded(train: Callable[[nn.Module, Arm], Extras]) -> Callable[[nn.Module, Arm], Extras]:
    """The user's seeding of the host RNGs at the start of a run (both arms draw alike)."""

    def run(model: nn.Module, arm: Arm) -> Extras:
        import numpy as np  # here: numpy is no dependency of replaykit's core

        random.seed(0)
        np.random.seed(0)
        return train(model, arm)

    return run


# --------------------------------------------------------------------------- host RNG
class LayerDrop(nn.Module):
    """Residual blocks skipped at random in training (LayerDrop), decided by Python's ``random``."""

    def __init__(self, p: float = 0.5) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(6, 6) for _ in range(3)])
        self.head = nn.Linear(6, 3)
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            if self.training and random.random() < self.p:
                continue
            x = x + torch.relu(block(x))
        return self.head(x)


class TorchLayerDrop(LayerDrop):
    """transformers' LayerDrop (Whisper, BART): ``torch.rand([])`` drawn on the host, compared there."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            if self.training and torch.rand([]) < self.p:
                continue
            x = x + torch.relu(block(x))
        return self.head(x)


TORCH_RAND_CPU = (
    "on the CPU torch's generator is the device's and its host read is what the tape refuses (the "
    "step retires there, exact); beside a GPU model a CUDA graph freezes the first draw's branch"
)


class NumpyNoise(nn.Module):
    """Feature noise whose scale is drawn from numpy's global RNG in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.net = MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import numpy as np

        return self.net(x * float(np.random.uniform(0.5, 1.5)))


def _mixup_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Mixup inside loss_fn: lambda from numpy's Beta, the batch mixed with its reverse."""
    import numpy as np

    lam = float(np.random.beta(0.4, 0.4))
    mixed = lam * x + (1 - lam) * x.flip(0)
    return model(mixed).pow(2).mean()


class TwoHeads(nn.Module):
    """A shared trunk and two task heads (multi-task training)."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = MLP(d_out=6)
        self.heads = nn.ModuleList([nn.Linear(6, 3), nn.Linear(6, 2)])


def _random_task_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Task sampling in loss_fn: one head per step, chosen with Python's random."""
    task = 0 if random.random() < 0.5 else 1
    return model.heads[task](model.trunk(x)).pow(2).mean()


# --------------------------------------------------------------------------- private host generators
class PrivateMasked(nn.Module):
    """MAE-style masking from a generator the module holds (``random.Random`` or numpy's
    ``default_rng``), not the global one: the recording call's extra runs would advance it."""

    def __init__(self, kind: str = "random") -> None:
        super().__init__()
        import numpy as np

        self.net = MLP()
        self.rng = random.Random(7) if kind == "random" else np.random.default_rng(7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        draws = [float(self.rng.random()) for _ in range(6)]
        return self.net(x * torch.tensor([float(d > 0.3) for d in draws], device=x.device))


def _next_draw(train: Callable[[nn.Module, Arm], Extras]) -> Callable[[nn.Module, Arm], Extras]:
    """The loop, then one more draw from the model's generator: where the run left it."""

    def run(model: nn.Module, arm: Arm) -> Extras:
        kept = train(model, arm)
        kept["next_draw"] = torch.tensor(float(model.rng.random()))
        return kept

    return run


def _closure_task_step(model: nn.Module, arm: Arm) -> Extras:
    """loss_fn chooses the head with a ``random.Random`` it closes over."""
    rng = random.Random(0)

    def loss_fn(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        task = 0 if rng.random() < 0.5 else 1
        return m.heads[task](m.trunk(x)).pow(2).mean()

    kept = step_loop(model, arm, loss_fn=loss_fn, steps=6)
    kept["next_draw"] = torch.tensor(rng.random())
    return kept


# --------------------------------------------------------------------------- held containers
class RecentScaled(nn.Module):
    """Scales its output by the mean of the recent losses the loop appends to a deque it holds."""

    def __init__(self) -> None:
        super().__init__()
        self.net = MLP()
        self.recent: deque[float] = deque([1.0], maxlen=3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x) / (sum(self.recent) / len(self.recent))


def _deque_capture(model: nn.Module, arm: Arm) -> Extras:
    opt = sgd(model)
    kept: Extras = {}
    for i in range(5):
        opt.zero_grad(set_to_none=True)
        loss = model(arm.randn(4, 6)).pow(2).mean()
        loss.backward()
        opt.step()
        model.recent.append(loss.item() + 1.0)
        kept[f"loss{i}"] = loss.detach()
    return kept


def _deque_step(model: nn.Module, arm: Arm) -> Extras:
    opt = sgd(model)
    step = arm.train_step(model, lambda m, x: m(x).pow(2).mean(), opt)
    kept: Extras = {}
    for i in range(6):
        loss = step(arm.randn(4, 6))
        model.recent.append(loss.item() + 1.0)
        kept[f"loss{i}"] = loss
    return kept


class ArrayScaled(nn.Module):
    """Per-output scales kept in a numpy array the loop updates in place (a hand-made schedule)."""

    def __init__(self) -> None:
        super().__init__()
        import numpy as np

        self.net = MLP()
        self.scale = np.ones(3, dtype=np.float32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.net(x)
        return out * torch.tensor(self.scale, device=out.device)  # a copy of the array


class ArrayGain(ArrayScaled):
    """Reads one gain of its numpy array as a Python float (a per-stage setting)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x) * float(self.scale[0])


class DictConfigured(nn.Module):
    """Reads ``self.hparams["scale"]`` from a plain dict of hyperparameters it holds."""

    def __init__(self) -> None:
        super().__init__()
        self.net = MLP()
        self.hparams: dict[str, float] = {"scale": 1.0}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x) * self.hparams["scale"]


def _anneal_hparams(model: nn.Module, step: int) -> None:
    model.hparams["scale"] = 1.0 / (step + 1)  # the same dict, a new value


def _halve_scale(model: nn.Module, step: int) -> None:
    if step >= 3:
        model.scale *= 0.5  # in place: the same array object


HAZARD = "host_state"

ARRAY_COPY_LIVE = (
    "every backend reads the array's memory again at each replay: the CPU tapes replay "
    "torch.tensor(array), and a CUDA capture feeds the copy from the array's own memory "
    "(backends/host_feeds.py; rk.capture's unsafe arm replayed bitwise on the H200, and the step's "
    "retires there: without the verification no reference run shows it the copies to feed)"
)

HC = HazardClass(HAZARD)

PATTERNS: list[Pattern] = [
    # drawn before choosing a recording and keyed by the comparisons' results (host_choices.py)
    *HC.twins(
        "layerdrop_python_random",
        "LayerDrop decided by random.random() in forward",
        built(LayerDrop),
        seeded(looped(steps=8)),
        seeded(stepped(steps=6)),
        guard="host_choices",
        step={"guard": "host_rng"},
    ),
    HC.pattern(
        "step_layerdrop_torch_rand",
        "LayerDrop decided by torch.rand([]) on the host (transformers' Whisper, BART), whole step",
        built(TorchLayerDrop),
        # beside a GPU model the step learns the draws (two eager calls), then records each branch
        # pattern once (3 blocks: up to 8): enough steps to replay some
        seeded(stepped(steps=16)),
        guard="host_rng",
        api="step",
        cuda_only=TORCH_RAND_CPU,
    ),
    *HC.twins(
        "numpy_noise_in_forward",
        "a noise scale drawn from np.random in forward",
        built(NumpyNoise),
        seeded(looped(steps=5)),
        seeded(stepped(steps=6)),
        guard="host_rng",
    ),
    HC.pattern(
        "step_mixup_numpy_lambda",
        "mixup in loss_fn with lambda from np.random.beta",
        mlp(),
        seeded(stepped(loss_fn=_mixup_loss, steps=6)),
        guard="host_rng",
        api="step",
    ),
    HC.pattern(
        "step_random_task_in_loss",
        "loss_fn samples the task (head) with random.random()",
        built(TwoHeads),
        seeded(stepped(loss_fn=_random_task_loss, steps=8)),
        guard="host_rng",
        api="step",
    ),
    # put back by the recording call's state (call_state), and a draw retires, named (host_rng):
    # under TrainStep the reference run draws first and stands, so the watch is what keeps it exact
    *HC.twins(
        "private_random_masking",
        "MAE masking drawn from a random.Random the module holds",
        built(PrivateMasked),
        _next_draw(looped(steps=5)),
        _next_draw(stepped(steps=5)),
        guard="call_state",
        step={"guard": "host_rng", "cpu_only": _MASK_ON_HOST},
    ),
    *HC.twins(
        "private_numpy_generator_masking",
        "MAE masking drawn from np.random.default_rng the module holds",
        built(PrivateMasked, "numpy"),
        _next_draw(looped(steps=5)),
        _next_draw(stepped(steps=5)),
        guard="call_state",
        # the module's key and the held-object watch see a numpy Generator move too
        step={"guard": "host_rng+side_effects+module_state", "cpu_only": _MASK_ON_HOST},
    ),
    HC.pattern(
        "step_private_random_task_in_loss",
        "loss_fn samples the task with a random.Random it closes over",
        built(TwoHeads),
        _closure_task_step,
        guard="host_rng",
        api="step",
    ),
    *HC.twins(
        "deque_read_in_forward",
        "forward reads a deque of recent losses the loop appends to",
        built(RecentScaled),
        _deque_capture,
        _deque_step,
        step_what="forward reads a deque of recent losses, whole step",
        guard="module_state",
    ),
    # forward reads what the loop changes in place (the capture arm 5 steps, the twin 6)
    *(
        pattern
        for name, what, step_what, net, change, kw in (
            (
                "numpy_array_updated_in_place",
                "forward reads a numpy array the loop halves in place",
                "forward reads a numpy array changed in place, whole step",
                ArrayScaled,
                _halve_scale,
                {"unsafe_never": ARRAY_COPY_LIVE},
            ),
            (
                "hparams_dict_in_forward",
                "forward reads a dict of hyperparameters the loop anneals in place",
                "forward reads a dict of hyperparameters annealed in place, whole step",
                DictConfigured,
                _anneal_hparams,
                {},
            ),
            (
                "numpy_array_gain_float",
                "forward reads float(array[0]) of a numpy array halved in place",
                "forward reads float(array[0]) of a numpy array, whole step",
                ArrayGain,
                _halve_scale,
                {},
            ),
        )
        for pattern in HC.twins(
            name,
            what,
            built(net),
            looped(steps=5, before=change),
            stepped(steps=6, before=each_step(change)),
            step_what=step_what,
            guard="module_state",
            **kw,
        )
    ),
]

KNOWN_LIMITS: list[Pattern] = []
"""Still silent differences (README, Known limits): kept out of ``PATTERNS``."""


# --------------------------------------------------------------------------- caches filled on a new shape
class DynamicRope(nn.Module):
    """Rotary angles from an ``inv_freq`` re-assigned with a larger base when a longer sequence
    arrives (transformers' dynamic NTK RoPE, ``dynamic_rope_update``): a cache filled on a new
    shape, whose values for the short positions change too."""

    def __init__(self, max_len: int = 4) -> None:
        super().__init__()
        self.net = MLP()
        self.original_max = self.max_seq_len_cached = max_len
        self.inv_freq = self._inv_freq(max_len, "cpu")

    def _inv_freq(self, n: int, device: torch.device | str) -> torch.Tensor:
        base = 10.0 * (n / self.original_max) ** 1.5
        return 1.0 / base ** (torch.arange(0, 6, 2, device=device, dtype=torch.float32) / 6)

    def _apply(self, fn: Callable, recurse: bool = True) -> nn.Module:
        # a plain tensor attribute, moved with the module as a buffer would be
        self.inv_freq = fn(self.inv_freq)
        return super()._apply(fn, recurse)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        if n > self.max_seq_len_cached:
            self.inv_freq = self._inv_freq(n, x.device)
            self.max_seq_len_cached = n
        angles = torch.arange(n, device=x.device, dtype=torch.float32)[:, None] * self.inv_freq
        return self.net(x * torch.cos(angles).repeat(1, 2))


_LENGTHS = (4, 4, 4, 6, 4, 4, 6, 8, 4, 8, 6, 4)


def _rope_capture(model: nn.Module, arm: Arm) -> Extras:
    return loop(model, arm, steps=len(_LENGTHS), call=lambda m, x, i: m(arm.randn(_LENGTHS[i], 6)))


def _rope_step(model: nn.Module, arm: Arm) -> Extras:
    opt = sgd(model)
    step = arm.train_step(model, lambda m, x: m(x).pow(2).mean(), opt)
    return {f"loss{i}": step(arm.randn(n, 6)) for i, n in enumerate(_LENGTHS)}


_FILLS = "cache_fills+module_state"  # the drop of the old state's recordings, and the key that names the new state

PATTERNS += [
    Pattern(
        "rope_table_grown",
        HAZARD,
        "dynamic NTK RoPE: inv_freq re-assigned with a larger base when a longer sequence arrives",
        lambda d: DynamicRope().to(d),
        _rope_capture,
        guard=_FILLS,
    ),
    Pattern(
        "step_rope_table_grown",
        HAZARD,
        "dynamic NTK RoPE: inv_freq re-assigned when a longer sequence arrives, whole step",
        lambda d: DynamicRope().to(d),
        _rope_step,
        guard=_FILLS,
        api="step",
    ),
]


class StochasticDepth(LayerDrop):
    """Residual blocks kept or dropped by a numpy coin per block (stochastic depth), rescaled when kept."""

    def __init__(self) -> None:
        super().__init__(p=0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import numpy as np

        for block in self.blocks:
            if self.training and np.random.rand() < self.p:
                continue
            x = x + torch.relu(block(x)) / (1 - self.p)
        return self.head(x)


PATTERNS += HC.twins(
    "stochastic_depth_numpy_coin",
    "stochastic depth decided by np.random.rand() < p per block",
    lambda d: StochasticDepth().to(d),
    seeded(looped(steps=10)),
    seeded(lambda m, a: step_loop(m, a, steps=10)),
    guard="host_choices",
)
