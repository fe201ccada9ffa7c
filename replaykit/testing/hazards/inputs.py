"""Inputs a recording must see as eager does: written in place, aliased, strided, signed
zeros and NaNs as arguments, an output that is a view of the input.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .pattern import MLP, Arm, Extras, Pattern, loop, loss_steps, mlp, sgd
from .writing import HazardClass, built

HAZARD = "inputs"
HC = HazardClass(HAZARD)


class Centering(nn.Module):
    """Centres its input in place (a user's preprocessing inside forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.sub_(x.mean(dim=0, keepdim=True))
        return self.net(x)


def _inplace_input(model: nn.Module, arm: Arm) -> Extras:
    kept: Extras = {}

    def call(m: nn.Module, x: torch.Tensor, step: int) -> torch.Tensor:
        out = m(x)
        kept[f"caller_x{step}"] = x.clone()  # eager changed the caller's tensor
        return out

    kept.update(loop(model, arm, call=call))
    return kept


class PairScore(nn.Module):
    """Self-attention-like scores; a shortcut projects once when q is k."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(6, 5)

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        if q is k:
            h = self.proj(q)
            return h @ h.t()
        return self.proj(q) @ self.proj(k).t()


def _q_is_k(model: nn.Module, arm: Arm) -> Extras:
    def call(m: nn.Module, x: torch.Tensor, step: int) -> torch.Tensor:
        return m(x, x) if step in (1, 2) else m(x, x.clone())

    return loop(model, arm, steps=4, call=call)


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.attn(q, k, v, need_weights=False)[0]


def _mha(model: nn.Module, arm: Arm) -> Extras:
    def call(m: nn.Module, x: torch.Tensor, step: int) -> torch.Tensor:
        y = x.clone()
        return m(x, y, y) if step == 0 else m(x, x, x)  # record cross-style, then self-attention

    return loop(model, arm, steps=3, shape=(2, 3, 8), call=call)


def _layout(kind: str) -> Callable[[nn.Module, Arm], Extras]:
    def call(m: nn.Module, x: torch.Tensor, step: int) -> torch.Tensor:
        if kind == "transposed":
            return m(x.t().contiguous().t())
        if kind == "sliced":
            return m(torch.cat([x, x], dim=1)[:, ::2])
        if kind == "offset":
            return m(torch.cat([x[:1], x])[1:])
        row = x[:1].clone().requires_grad_()
        out = m(row.expand(4, 6))
        kept[f"row_grad_src{step}"] = row
        return out

    kept: Extras = {}

    def train(model: nn.Module, arm: Arm) -> Extras:
        kept.clear()
        result = loop(model, arm, call=call)
        for name in list(kept):
            kept[name] = kept[name].grad
        return {**result, **kept}

    return train


class Gated(nn.Module):
    """Uses its input twice inside; the caller also adds it around (a skip connection)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.gate = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * torch.sigmoid(self.gate(x)) + x.pow(2)


class Upstream(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(3, 6)
        self.block = Gated()


def _used_twice(model: nn.Module, arm: Arm) -> Extras:
    opt = sgd(model)
    kept: Extras = {}
    for step in range(3):
        opt.zero_grad(set_to_none=True)
        x = model.emb(arm.randn(4, 3))
        y = model.block(x) + x  # skip connection around the captured block
        loss = y.pow(2).mean()
        x.retain_grad()
        loss.backward()
        opt.step()
        kept[f"x_grad{step}"] = x.grad
    return kept


class Angle(nn.Module):
    """An orientation head: atan2 of a signed offset against the features."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor, offset: float) -> torch.Tensor:
        h = self.fc(x)
        return h + torch.atan2(torch.full_like(h, offset), h)


class Clipped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor, clip: float) -> torch.Tensor:
        h = self.fc(x)
        return torch.nan_to_num(h.clamp(-clip, clip), nan=0.5) + h


_SAME_BITS_ON_CPU = (
    "a contiguous copy of this layout gives the same bits on the CPU kernels (clone keeps dense strides; "
    "CPU matmul packs strided operands first), and on the H200 with torch 2.11 too (measured); "
    "offset_input is the layout guard's negative control"
)
_SAME_BITS_ON_H200 = (
    "on the H200 with torch 2.11 these CUDA kernels gave the same bits either way (measured)"
)


class ReturnsInputView(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.fc(x[:, :3] * 1.0), x[:, 3:]


def _view_then_inplace(model: nn.Module, arm: Arm) -> Extras:
    def step(m: nn.Module, a: Arm) -> torch.Tensor:
        x = a.randn(4, 6)
        y, view = m(x)
        view.mul_(0.0)  # eager zeroes the caller's x[:, 3:]
        return y.pow(2).mean() + x.pow(2).mean()

    return loss_steps(model, arm, step)


def _step_writes_input(model: nn.Module, arm: Arm) -> Extras:
    """loss_fn halves its input in place; one batch trained on repeatedly, so the caller's x compounds."""

    def loss_fn(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        x.mul_(0.5)
        return m(x).pow(2).mean()

    step = arm.train_step(model, loss_fn, sgd(model), warmup=2)
    x = arm.randn(4, 6)
    kept: Extras = {f"loss{i}": step(x).detach() for i in range(6)}
    kept["caller_x"] = x
    return kept


def _rewritten_before_backward(how: str) -> Callable[[nn.Module, Arm], Extras]:
    """A loader writes the next batch into the current batch's memory before backward, moving no
    version: eager's saved input reads it (the first weight's gradient mixes two batches, no error)."""

    def train(model: nn.Module, arm: Arm) -> Extras:
        opt = sgd(model)
        kept: Extras = {}
        buf = arm.randn(4, 6).cpu().numpy().copy()  # the loader's reused buffer
        x = torch.from_numpy(buf).to(arm.device) if how == "numpy" else arm.randn(4, 6)
        for i in range(4):
            opt.zero_grad(set_to_none=True)
            loss = model(x).pow(2).mean()
            nxt = arm.randn(4, 6)
            if how == "numpy":
                buf[:] = nxt.cpu().numpy()  # the prefetch refills the buffer x was made from
            else:
                x.data.copy_(nxt)  # a staging tensor written through .data
            loss.backward()
            opt.step()
            kept[f"loss{i}"] = loss.detach()
        return kept

    return train


PATTERNS: list[Pattern] = [
    HC.pattern(
        "inplace_input_mutation",
        "forward centres its input in place (the caller sees it)",
        built(Centering),
        _inplace_input,
        guard="write_back",
    ),
    HC.pattern(
        "same_tensor_q_is_k",
        "model(x, x) takes an `is` shortcut; model(x, x.clone()) does not",
        built(PairScore),
        _q_is_k,
        guard="input_aliasing",
        kernel_dependent=True,
    ),
    HC.pattern(
        "mha_self_attention",
        "nn.MultiheadAttention(x, x, x) vs distinct key/value tensors",
        built(Attention),
        _mha,
        guard="input_aliasing",
        cpu_only=_SAME_BITS_ON_H200,
        kernel_dependent=True,
    ),
    HC.pattern(
        "transposed_input",
        "a transposed (column-major) input",
        mlp(),
        _layout("transposed"),
        guard="input_layout",
        unsafe_never=_SAME_BITS_ON_CPU,
    ),
    HC.pattern(
        "sliced_input",
        "a strided slice as input",
        mlp(),
        _layout("sliced"),
        guard="input_layout",
        unsafe_never=_SAME_BITS_ON_CPU,
    ),
    HC.pattern(
        "offset_input",
        "an input view with a storage offset",
        mlp(),
        _layout("offset"),
        guard="input_layout",
        cpu_only=_SAME_BITS_ON_H200,
        kernel_dependent=True,
    ),
    HC.pattern(
        "expanded_input",
        "an expanded (stride-0) input requiring grad",
        mlp(),
        _layout("expanded"),
        guard="input_layout",
        unsafe_never=_SAME_BITS_ON_CPU,
    ),
    HC.pattern(
        "input_used_twice_and_skip",
        "an input used twice inside and around a skip connection",
        built(Upstream),
        _used_twice,
        guard="record_probe",
        target=lambda m: m.block,
    ),
    HC.pattern(
        "negative_zero_argument",
        "a float argument -0.0 after 0.0 (atan2 sees the sign)",
        built(Angle),
        lambda m, a: loop(m, a, steps=4, call=lambda m, x, s: m(x, -0.0 if s % 2 else 0.0)),
        guard="argument_values",
    ),
    HC.pattern(
        "nan_argument",
        "a fresh NaN float argument per call (NaN != NaN as a key), then a number",
        built(Clipped),
        lambda m, a: loop(m, a, steps=4, call=lambda m, x, s: m(x, float("nan") if s < 2 else 1.0)),
    ),
    HC.pattern(
        "output_view_of_input_mutated",
        "forward returns x[:, 3:]; the caller zeroes it in place",
        built(ReturnsInputView),
        _view_then_inplace,
        guard="record_probe",
    ),
    HC.pattern(
        "numpy_buffer_refilled_before_backward",
        "the numpy buffer a batch was torch.from_numpy'd from is refilled before backward",
        mlp(),
        _rewritten_before_backward("numpy"),
        guard="input_rewrites",
        cpu_only="on CUDA the batch is a device copy of the numpy buffer: the refill does not reach it",
    ),
    HC.pattern(
        "input_data_rewritten_before_backward",
        "a staging input written through .data (no version bump) before backward",
        mlp(),
        _rewritten_before_backward("data"),
        guard="input_rewrites",
    ),
    HC.pattern(
        "step_loss_writes_input",
        "loss_fn scales its input in place (the caller's tensor)",
        mlp(),
        _step_writes_input,
        guard="write_back",
        api="step",
    ),
]
