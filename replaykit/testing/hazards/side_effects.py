"""Side effects a replay would not repeat: private generators, attributes set in forward,
held containers, data-dependent shapes, ``.item()``, sparse gradients.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .pattern import MLP, Arm, Extras, Pattern, loop, loss_steps, mlp, sgd
from .writing import HazardClass, built, looped, stepped

HAZARD = "side_effects"
HC = HazardClass(HAZARD)


class Noisy(nn.Module):
    """Feature noise from the module's own Generator."""

    def __init__(self, device: str) -> None:
        super().__init__()
        self.net = MLP()
        self.gen = torch.Generator(device=device).manual_seed(7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        noise = torch.randn(x.shape, generator=self.gen, device=x.device)
        return self.net(x + 0.1 * noise)


@functools.lru_cache(maxsize=8)
def _positions(n: int, device: str) -> torch.Tensor:
    """A sinusoid table per length, cached across calls (a global cache the model never holds)."""
    return torch.sin(torch.arange(n, device=device, dtype=torch.float32))[:, None] * 0.1


class CachedPositions(nn.Module):
    """Adds a cached per-length table: a new length's first call leaves a tensor in the cache."""

    def __init__(self) -> None:
        super().__init__()
        self.net = MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x + _positions(x.shape[0], str(x.device)))


def _two_lengths(model: nn.Module, arm: Arm) -> Extras:
    """Lengths 4 and 6 interleaved: 6's recording call leaves its table in the cache, and 4's
    recording, older, replays after it."""
    _positions.cache_clear()  # every arm makes its tables inside its own run
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    step = arm.train_step(model, lambda m, x: m(x).pow(2).mean(), opt, warmup=1)
    kept: Extras = {}
    for i, n in enumerate((4, 4, 4, 6, 4, 6, 4, 6, 6)):
        kept[f"loss{i}"] = step(arm.randn(n, 6)).detach()
    return kept


def _noisy(model: nn.Module, arm: Arm) -> Extras:
    kept = loop(model, arm, steps=4)
    kept["generator_state"] = model.gen.get_state()  # advanced exactly once per call, as in eager
    return kept


def _new_generator_per_epoch(model: nn.Module, step: int) -> None:
    """Reproducible noise per epoch: a generator made anew (not reseeded in place) every 2 steps."""
    if step % 2 == 0:
        model.gen = torch.Generator(device=model.gen.device).manual_seed(100 + step)


def _noisy_epochs(model: nn.Module, arm: Arm) -> Extras:
    kept = loop(model, arm, steps=6, before=_new_generator_per_epoch)
    kept["generator_state"] = model.gen.get_state()
    return kept


class RunningCentre(nn.Module):
    """A plain tensor attribute (not a buffer) updated in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 3)
        self.centre = torch.zeros(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        self.centre = 0.9 * self.centre.to(h.device) + 0.1 * h.detach().mean(0)
        return h - self.centre


class MoE(nn.Module):
    """Two experts and a gate; the load-balancing loss is stored on the module."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(6, 2)
        self.experts = nn.ModuleList([nn.Linear(6, 3), nn.Linear(6, 3)])
        self.balance = nn.Parameter(torch.ones(2))  # read by the auxiliary loss alone
        self.aux_loss = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.gate(x), dim=1)
        self.aux_loss = 2 * (probs.mean(0) * self.balance).pow(2).sum()
        return sum(probs[:, i : i + 1] * e(x) for i, e in enumerate(self.experts))


def _moe(model: nn.Module, arm: Arm) -> Extras:
    kept: Extras = {}

    def loss(out: torch.Tensor) -> torch.Tensor:
        return out.pow(2).mean() + 0.1 * model.aux_loss

    kept.update(loop(model, arm, steps=4, loss=loss))
    kept["aux_loss"] = model.aux_loss.detach()
    return kept


def _moe_logged(model: nn.Module, arm: Arm) -> Extras:
    """The auxiliary loss logged each step, left out of the loss: the gate's balance gets no gradient."""
    kept: Extras = {}

    def call(m: nn.Module, x: torch.Tensor, step: int) -> torch.Tensor:
        out = m(x)
        kept[f"aux_loss{step}"] = m.aux_loss  # kept as is: the next replay must not overwrite it
        return out

    kept.update(loop(model, arm, steps=4, call=call))
    return kept


def _step_moe(model: nn.Module, arm: Arm) -> Extras:
    """The same loss in a whole step: loss_fn reads the attribute the forward assigned."""
    step = arm.train_step(
        model, lambda m, x: m(x).pow(2).mean() + 0.1 * m.aux_loss, sgd(model), warmup=1
    )
    kept: Extras = {}
    for i in range(4):
        kept[f"loss{i}"] = step(arm.randn(4, 6)).detach()
        kept[f"aux_loss{i}"] = model.aux_loss.detach()  # kept as logged: not a copy
    return kept


class LoggedAttention(nn.Module):
    """Keeps its attention weights for logging (``self.last_attn = attn.detach()``)."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.o = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 3)
        self.last_attn = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        attn = torch.softmax(self.q(x) @ self.k(x).T, dim=-1)
        self.last_attn = attn.detach()
        return self.o(attn @ x)


class MoEStack(nn.Module):
    """Two MoE layers around a logging attention block, captured at the root."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.attn, self.b = MoE(), LoggedAttention(), MoE()
        self.up1, self.up2 = nn.Linear(3, 6), nn.Linear(3, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.up2(self.attn(self.up1(self.a(x)))))


class KeepsOutput(nn.Module):
    """``self.last = out; return out``: one tensor object, the attribute and the output."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 3)
        self.last = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.fc(x)
        self.last = out
        return out


class FirstBatchCentre(nn.Module):
    """A centre set from the first batch, then read and re-bound (``self.centre is None`` first)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 3)
        self.centre = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        mean = h.detach().mean(0)
        self.centre = mean if self.centre is None else 0.9 * self.centre + 0.1 * mean
        return h - self.centre


def _first_batch_centre(model: nn.Module, arm: Arm) -> Extras:
    kept = loop(model, arm, steps=4)
    kept["centre"] = model.centre  # None where no call set it (a replay that does not assign)
    return kept


def _stack_losses(model: nn.Module, arm: Arm) -> Extras:
    kept = loop(model, arm, steps=4, loss=lambda out: out.pow(2).mean() + _stack_aux(model))
    kept["attn"] = model.attn.last_attn
    return kept


def _stack_aux(model: nn.Module) -> torch.Tensor:
    return 0.1 * (model.a.aux_loss + model.b.aux_loss)


def _kept_output(model: nn.Module, arm: Arm) -> Extras:
    kept: Extras = {}

    def call(m: nn.Module, x: torch.Tensor, step: int) -> torch.Tensor:
        out = m(x)
        kept[f"same{step}"] = torch.tensor(float(m.last is out))  # eager: the same object
        return out

    kept.update(loop(model, arm, steps=4, call=call))
    return kept


def _attention_logged(model: nn.Module, arm: Arm) -> Extras:
    kept: Extras = {}

    def call(m: nn.Module, x: torch.Tensor, step: int) -> torch.Tensor:
        out = m(x)
        kept[f"attn{step}"] = m.last_attn
        return out

    kept.update(loop(model, arm, steps=4, call=call))
    return kept


class Masked(nn.Module):
    """Returns only the rows a data-dependent mask keeps (boolean indexing)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.net(x)
        return h[h.sum(dim=1) > 0]


class Nonzero(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = (x[:, 0] > 0).nonzero().squeeze(1)
        return self.net(x.index_select(0, rows))


class ItemNorm(nn.Module):
    """Normalises by a host-side maximum read with .item()."""

    def __init__(self) -> None:
        super().__init__()
        self.net = MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.net(x)
        return h / (h.detach().abs().max().item() + 1.0)


class _DampedSTE(torch.autograd.Function):
    """A straight-through estimator whose backward damps large gradients, deciding on the host."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return torch.round(x * 4) / 4

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        if grad.abs().max() > 0.01:  # a host read inside the backward
            return grad * 0.5
        return grad


class Quantized(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 6)
        self.fc2 = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(_DampedSTE.apply(torch.tanh(self.fc1(x))))


class SparseEmb(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 6, sparse=True)
        self.fc = nn.Linear(6, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.fc(self.emb(ids).mean(dim=1))


def _sparse(model: nn.Module, arm: Arm) -> Extras:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kept: Extras = {}
    for step in range(3):
        opt.zero_grad(set_to_none=True)
        ids = torch.randint(0, 20, (4, 5), device=arm.device)
        loss = model(ids).pow(2).mean()
        loss.backward()
        kept[f"emb_grad{step}"] = model.emb.weight.grad.to_dense()
        opt.step()
    model.emb.weight.grad = None  # a sparse .grad has no dense end state to compare
    return kept


class Warmup(nn.Module):
    """A Python counter incremented in forward drives a warm-up factor."""

    def __init__(self) -> None:
        super().__init__()
        self.net = MLP()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.net(x) * min(1.0, self.calls / 4)


def _with_attr(attr: str) -> Callable[[nn.Module, Arm], Extras]:
    def train(model: nn.Module, arm: Arm) -> Extras:
        kept = loop(model, arm, steps=4)
        value = getattr(model, attr)
        kept[attr] = value if isinstance(value, torch.Tensor) else torch.tensor(float(value))
        return kept

    return train


class Cache(nn.Module):
    """Writes a feature into a dict it holds; the loss reads it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 8), nn.Linear(8, 3)
        self.feats: dict[str, torch.Tensor] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc1(x))
        self.feats["h"] = h
        return self.fc2(h)


class Stats(nn.Module):
    """Appends a statistic to a list it holds."""

    def __init__(self) -> None:
        super().__init__()
        self.net = MLP()
        self.log: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.net(x)
        self.log.append(out.detach().mean())
        return out


def _stats(model: nn.Module, arm: Arm) -> Extras:
    kept = loop(model, arm, steps=4)
    kept["entries"] = torch.tensor(float(len(model.log)))
    return kept


class TensorAttrWithGrad(nn.Module):
    """A trainable temperature kept as a plain tensor attribute (CLIP's logit_scale, not a Parameter)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = MLP()
        self.logit_scale = torch.tensor(1.5, requires_grad=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x) * self.logit_scale.exp()


def _tensor_attr(model: nn.Module, arm: Arm) -> Extras:
    opt = torch.optim.SGD([*model.parameters(), model.logit_scale], lr=0.1)
    kept = loss_steps(model, arm, lambda m, a: m(a.randn(4, 6)).pow(2).mean(), opt=opt)
    kept["scale"] = model.logit_scale.detach().clone()
    return kept


class HeldState(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = MLP()
        self.state = types.SimpleNamespace(last=None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.net(x)
        self.state.last = out
        return out


class Seeded(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = MLP(p=0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch.manual_seed(123)  # not an aten op: a tape (and a graph) does not repeat it
        return self.net(x)


class Checkpointed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = MLP(d_out=6, p=0.3)
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(checkpoint(self.block, x, use_reentrant=False))


class MomentumEncoder(nn.Module):
    """MoCo's key encoder, moved toward the query encoder inside forward as its reference code does:
    ``pk.data = pk.data * m + pq.data * (1 - m)`` (a rebind: no version moves, the Parameter stays);
    ``inplace``: the same update written in place, which replays."""

    def __init__(self, inplace: bool = False) -> None:
        super().__init__()
        self.inplace = inplace
        self.q = nn.Linear(6, 6)
        self.k = nn.Linear(6, 6).requires_grad_(False)
        self.k.load_state_dict(self.q.state_dict())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = nn.functional.normalize(self.q(x), dim=1)
        with torch.no_grad():
            for pq, pk in zip(self.q.parameters(), self.k.parameters(), strict=True):
                if self.inplace:
                    pk.mul_(0.99).add_(pq, alpha=0.01)
                else:
                    pk.data = pk.data * 0.99 + pq.data * 0.01
            k = nn.functional.normalize(self.k(x), dim=1)
        return (q * k).sum(1)


class ReturnsState(nn.Module):
    """Returns one of its own tensors beside its output: an EMA codebook buffer it updates (a
    VQ-VAE's, for a usage plot) or a parameter the loss uses outside (CLIP's ``logit_scale``)."""

    def __init__(self, what: str) -> None:
        super().__init__()
        self.what = what
        self.fc = nn.Linear(6, 6)
        self.logit_scale = nn.Parameter(torch.tensor(1.0))
        self.register_buffer("codebook", torch.zeros(6))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.fc(x)
        if self.what == "buffer":
            with torch.no_grad():
                self.codebook.mul_(0.9).add_(y.mean(0), alpha=0.1)
            return y, self.codebook
        return y, self.logit_scale


def _kept_state(model: nn.Module, arm: Arm) -> Extras:
    """The loop keeps what the model returned beside ``y`` (a log of it): eager's entries are all
    the module's own tensor, so each follows every later update."""
    log: list[torch.Tensor] = []

    def step(m: nn.Module, a: Arm) -> torch.Tensor:
        y, own = m(a.randn(4, 6))
        log.append(own)
        return (y * own).pow(2).mean()

    kept = loss_steps(model, arm, step)
    return kept | {f"logged{i}": t.detach() for i, t in enumerate(log)}


def _alternating_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Flips a task flag in a dict the model holds and weights the loss by it (Python a replay would not run)."""
    history = model.__dict__.setdefault("history", {})
    history["task"] = 1 - history.get("task", 0)
    return model(x).pow(2).mean() * (1.0 + history["task"])


PATTERNS: list[Pattern] = [
    # the probe finds the module's own generator; the recording registers it (a CUDA graph's
    # register_generator_state, the tape's live draw): each replay draws from it as eager does
    HC.pattern(
        "private_generator",
        "noise from the module's own torch.Generator",
        lambda d: Noisy(d).to(d),
        _noisy,
        guard="record_probe",
        unsafe_never="without the probe nothing registers the generator, and both backends refuse "
        "it by themselves (the tape; on the H200, torch's 'increase offset for a CUDA generator not "
        "in capture mode'): the capture fails, the generator is put back with the rest of the state, "
        "and the call retires exactly; tensor_attribute_with_grad is the probe's control",
    ),
    HC.pattern(
        "private_generator_replaced",
        "noise from the module's own torch.Generator, made anew every epoch",
        lambda d: Noisy(d).to(d),
        _noisy_epochs,
        guard="module_state",  # a recording registered the old generator: the new one records anew
    ),
    Pattern(
        "tensor_attribute_updated",
        "side_effects",
        "a plain tensor attribute updated in forward",
        lambda d: RunningCentre().to(d),
        _with_attr("centre"),
        guard="attribute_outputs",  # a state: read from a slot fed before each replay
        may_fault=True,  # unguarded, the replay reads the centre the last call replaced (freed)
    ),
    # a tensor assigned to an attribute and never read is an output of the recording, assigned
    # after each replay (memory/attribute_outputs.py); without that, the first call's stays
    HC.pattern(
        "moe_aux_loss_attribute",
        "an auxiliary loss stored on the module, added to the loss",
        built(MoE),
        _moe,
        guard="attribute_outputs",
    ),
    HC.pattern(
        "step_moe_aux_loss_attribute",
        "an auxiliary loss stored on the module, added to the loss, whole step",
        built(MoE),
        _step_moe,
        guard="attribute_outputs",
        api="step",
    ),
    HC.pattern(
        "moe_aux_loss_logged",
        "an auxiliary loss stored on the module, logged each step but left out of the loss",
        built(MoE),
        _moe_logged,
        guard="attribute_outputs",
    ),
    HC.pattern(
        "moe_stack_aux_losses",
        "two MoE layers' auxiliary losses and a logging attention block, captured at the root",
        built(MoEStack),
        _stack_losses,
        guard="attribute_outputs",
    ),
    HC.pattern(
        "output_kept_on_module",
        "the output kept on the module too (self.last = out; return out)",
        built(KeepsOutput),
        _kept_output,
        guard="attribute_outputs",
    ),
    HC.pattern(
        "centre_from_first_batch",
        "a centre set from the first batch (None), then read and re-bound every call",
        built(FirstBatchCentre),
        _first_batch_centre,
        guard="attribute_outputs",
    ),
    HC.pattern(
        "attention_kept_for_logging",
        "attention weights kept on the module for logging (self.last_attn = attn.detach())",
        built(LoggedAttention),
        _attention_logged,
        guard="attribute_outputs",
    ),
    # data-dependent shapes and host reads: both backends refuse them at capture too
    *(
        HC.pattern(name, what, built(net), looped(steps=4), guard=None)
        for name, what, net in (
            ("boolean_mask_output", "a data-dependent output shape (boolean masking)", Masked),
            ("nonzero_rows", "rows picked with nonzero(): data-dependent shapes inside", Nonzero),
            ("item_in_forward", ".item() read inside forward", ItemNorm),
        )
    ),
    HC.pattern(
        "host_branch_in_function_backward",
        "a custom autograd.Function whose backward branches on a host read (a damped straight-through estimator)",
        built(Quantized),
        looped(steps=4),
    ),
    HC.pattern(
        "sparse_embedding_grad",
        "nn.Embedding(sparse=True): sparse gradients",
        built(SparseEmb),
        _sparse,
        guard=None,
    ),  # both backends refuse it at capture too
    HC.pattern(
        "python_counter",
        "a Python counter incremented in forward (warm-up factor)",
        built(Warmup),
        _with_attr("calls"),
        guard="record_probe",
    ),
    HC.pattern(
        "feature_dict_in_forward",
        "forward writes a feature into a dict the loss reads",
        built(Cache),
        lambda m, a: loss_steps(
            m, a, lambda m, a: m(a.randn(4, 6)).pow(2).mean() + 0.1 * m.feats["h"].pow(2).mean()
        ),
        guard="attribute_outputs",
    ),
    HC.pattern(
        "list_append_in_forward",
        "forward appends a statistic to a list it holds",
        built(Stats),
        _stats,
        guard="record_probe",
    ),
    HC.pattern(
        "object_attribute_set_in_forward",
        "forward stores its output on an object it holds",
        built(HeldState),
        lambda m, a: loss_steps(
            m, a, lambda m, a: (m(a.randn(4, 6)), m.state.last)[1].pow(2).mean()
        ),
        guard="attribute_outputs",
    ),
    HC.pattern(
        "tensor_attribute_with_grad",
        "a trainable plain tensor attribute (logit_scale)",
        built(TensorAttrWithGrad),
        _tensor_attr,
        guard="record_probe",
    ),
    HC.pattern(
        "step_loss_changes_held_dict",
        "loss_fn flips a flag in a dict the model holds",
        mlp(),
        stepped(loss_fn=_alternating_loss, steps=6, warmup=2),
        guard="side_effects",
        api="step",
    ),
    HC.pattern(
        "step_cached_table_per_length",
        "forward adds a per-length table from a global lru_cache; a second length appears",
        built(CachedPositions),
        _two_lengths,
        guard="pool_survivors",
        api="step",
    ),
    # each of the recording call's runs would apply the rebind again: the call runs eagerly with
    # the weight bound back to its storage, and the rebind recurring retires naming it
    HC.pattern(
        "momentum_encoder_data_rebind",
        "MoCo's key encoder moved in forward by `pk.data = pk.data * m + pq.data * (1 - m)`",
        built(MomentumEncoder),
        looped(steps=4),
        guard="data_rebind",
    ),
    # eager hands back the module's own tensor: the loop's log of it follows every update
    *(
        HC.pattern(name, what, built(ReturnsState, kind), _kept_state, guard="output_state")
        for name, what, kind in (
            (
                "returns_its_ema_buffer_kept",
                "returns its EMA codebook buffer; the loop logs it",
                "buffer",
            ),
            (
                "returns_its_parameter_kept",
                "returns its logit_scale parameter; the loop logs it",
                "parameter",
            ),
        )
    ),
    # both backends refuse a seed inside recorded code (backends/seeding.py), as a CUDA capture
    # does for another seed: the recording fails, the entry point retires, exact
    Pattern(
        "manual_seed_in_forward",
        "side_effects",
        "torch.manual_seed inside forward (not an aten op)",
        lambda d: Seeded().to(d),
        lambda m, a: loop(m, a, steps=4),
        guard="verify_recording+host_rng",
        unsafe_never=(
            "the backends refuse the seed themselves (backends/seeding.py: a CUDA capture refuses "
            "another seed, and lets the same seed through as a no-op that eager's reset is not), "
            "with or without the guards; tests/core/test_reseed_in_step.py checks the refusal"
        ),
    ),
    # the tape replays the recompute's generator rewind as a CUDA graph does
    HC.pattern(
        "checkpointed_dropout",
        "torch.utils.checkpoint around a block with dropout",
        built(Checkpointed),
        looped(steps=4),
    ),
]

KNOWN_LIMITS: list[Pattern] = []
"""Still silent differences (README, Known limits): kept out of ``PATTERNS``."""
