"""Process-wide switches that choose kernels, flipped after recording: oneDNN or cuDNN switched off
for one phase, an SDPA backend disabled by a callback mid-fit or chosen by ``sdpa_kernel`` around
some steps, the float32 matmul precision lowered.

Each pattern sets the switch it flips back where it found it, so the next arm starts alike.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from .pattern import Arm, Extras, Pattern, loop, step_loop
from .writing import HazardClass, built

HAZARD = "switches"
HC = HazardClass(HAZARD)


class ConvNet(nn.Module):
    """A convolution: oneDNN (CPU) or cuDNN (GPU) against the native kernel sum in another order."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.conv(x.view(-1, 3, 4, 4).repeat(1, 1, 3, 3)).mean((2, 3)))


class Attention(nn.Module):
    """One causal self-attention layer over ``scaled_dot_product_attention`` (flash on the CPU too)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)
        self.out = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x.view(x.shape[0], -1, 8)).view(x.shape[0], -1, 2, 3, 4).unbind(3)
        h = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.out(h.transpose(1, 2).flatten(2)).mean(1)


class Wide(nn.Module):
    """Matmuls wide enough for a reduced-precision kernel to give other bits."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(256, 256)
        self.fc2 = nn.Linear(256, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


@contextmanager
def _kept(get: Callable[[], object], put: Callable[[object], None]) -> Iterator[None]:
    """A switch set back where the pattern found it, whatever happens."""
    before = get()
    try:
        yield
    finally:
        put(before)


def _conv_kernels(enabled: bool) -> None:
    """What a user flips to leave oneDNN / cuDNN for one phase (a debugging or a memory callback)."""
    torch.backends.mkldnn.enabled = enabled
    torch.backends.cudnn.enabled = enabled


def _conv_off_at(step: int, api: str) -> Callable[[nn.Module, Arm], Extras]:
    def train(model: nn.Module, arm: Arm) -> Extras:
        with _kept(torch.backends.mkldnn.enabled.__bool__, _conv_kernels):
            _conv_kernels(True)
            if api == "step":
                return step_loop(
                    model, arm, steps=6, shape=(4, 48), before=lambda m, o, s: _off_at(s, step)
                )
            return loop(model, arm, steps=5, shape=(4, 48), before=lambda m, s: _off_at(s, step))

    return train


def _off_at(now: int, step: int) -> None:
    if now == step:
        _conv_kernels(False)


def _flash_off_at(step: int, api: str) -> Callable[[nn.Module, Arm], Extras]:
    """A Lightning callback's ``enable_flash_sdp(False)`` mid-fit."""

    def before(s: int) -> None:
        if s == step:
            torch.backends.cuda.enable_flash_sdp(False)

    def train(model: nn.Module, arm: Arm) -> Extras:
        with _kept(torch.backends.cuda.flash_sdp_enabled, torch.backends.cuda.enable_flash_sdp):
            torch.backends.cuda.enable_flash_sdp(True)
            if api == "step":
                return step_loop(
                    model, arm, steps=6, shape=(4, 32), before=lambda m, o, s: before(s)
                )
            return loop(model, arm, steps=5, shape=(4, 32), before=lambda m, s: before(s))

    return train


def _math_sdpa_every_other(model: nn.Module, arm: Arm) -> Extras:
    """``with sdpa_kernel(SDPBackend.MATH):`` around every other step (a phase that needs the math kernel)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step = arm.train_step(model, lambda m, x: m(x).pow(2).mean(), opt)
    kept: Extras = {}
    for i in range(6):
        x = arm.randn(4, 32)
        if i % 2:
            with sdpa_kernel(SDPBackend.MATH):
                kept[f"loss{i}"] = step(x).detach()
        else:
            kept[f"loss{i}"] = step(x).detach()
    return kept


def _precision_at(step: int, api: str) -> Callable[[nn.Module, Arm], Extras]:
    """``torch.set_float32_matmul_precision("medium")`` after recording (bf16 matmuls on a CPU with
    oneDNN's bf16 support; TF32 on a GPU)."""

    def before(s: int) -> None:
        if s == step:
            torch.set_float32_matmul_precision("medium")

    def train(model: nn.Module, arm: Arm) -> Extras:
        with _kept(torch.get_float32_matmul_precision, torch.set_float32_matmul_precision):
            torch.set_float32_matmul_precision("highest")
            if api == "step":
                return step_loop(
                    model, arm, steps=6, shape=(64, 256), before=lambda m, o, s: before(s)
                )
            return loop(model, arm, steps=5, shape=(64, 256), before=lambda m, s: before(s))

    return train


PATTERNS: list[Pattern] = [
    *HC.twins(
        "conv_kernels_switched_off",
        "oneDNN / cuDNN switched off mid-run (torch.backends.mkldnn/cudnn.enabled = False)",
        built(ConvNet),
        _conv_off_at(2, "capture"),
        _conv_off_at(3, "step"),
        step_what="oneDNN / cuDNN switched off mid-run, whole step",
        guard="switches",
    ),
    *HC.twins(
        "flash_sdp_disabled_mid_fit",
        "torch.backends.cuda.enable_flash_sdp(False) by a callback mid-fit (the CPU honours it too)",
        built(Attention),
        _flash_off_at(2, "capture"),
        _flash_off_at(3, "step"),
        step_what="enable_flash_sdp(False) mid-fit, whole step",
        guard="switches",
        cpu_only="this fp32 attention runs no flash kernel on CUDA (flash needs fp16/bf16), so turning "
        "flash off changes no kernel there: the unguarded arm replayed bitwise on the H200 "
        "(measured); the CPU's SDPA honours the switch",
    ),
    HC.pattern(
        "step_sdpa_kernel_math_every_other_step",
        "with sdpa_kernel(SDPBackend.MATH) around every other step, whole step",
        built(Attention),
        _math_sdpa_every_other,
        guard="switches",
        api="step",
    ),
    *HC.twins(
        "float32_matmul_precision_lowered",
        'torch.set_float32_matmul_precision("medium") after recording',
        built(Wide),
        _precision_at(2, "capture"),
        _precision_at(3, "step"),
        guard="switches",
        kernel_dependent=True,
    ),
]
"""The matmul-precision patterns are ``kernel_dependent``: a reduced float32 matmul precision changes
a CPU's matmul only where oneDNN has bf16 kernels (avx512_bf16, AMX); elsewhere eager and the
unsafe replay both run IEEE matmuls (on a GPU, TF32 on Ampere and later)."""

KNOWN_LIMITS: list[Pattern] = []
"""Still silent differences (README, Known limits): kept out of ``PATTERNS``."""
