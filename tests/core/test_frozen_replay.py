"""Frozen replay on the emulated backend: a replay runs the recorded aten ops, not the module's Python.

Positive: record + replay are bitwise equal to eager (outputs, gradients, buffers).
Frozen: host values changed after recording (dropout p, a submodule's eval(), BatchNorm
momentum, a float attribute) are NOT seen by a replay, as on a CUDA graph.
Refused: what a graph capture cannot replay fails the record ("capture failed: ...").
"""

from __future__ import annotations

import copy
import ctypes

import pytest
import torch
from torch import nn
from torch.nn.utils.stateless import _reparametrize_module

import replaykit as rk
from replaykit.backends.base import Subject
from replaykit.backends.emulated import EmulatedBackend
from replaykit.protections import negative_control
from replaykit.testing.nets import DetectionNet, DropoutNet
from replaykit.testing.tasks import TASKS, make_task
from replaykit.testing.tasks.data import CHANNELS, IMAGE_SIZE
from replaykit.verify.snapshot import StateSnapshot


class Direct:
    """A recording made by the backend itself, as the recorder makes one (state restored after)."""

    def __init__(
        self, model: nn.Module, *inputs: torch.Tensor, warmup: int = 1, restore: bool = True
    ) -> None:
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        names = [n for n, _ in named]

        def fn(*xs: torch.Tensor, params: list[torch.Tensor] | None = None):
            if params is None:
                return model(*xs)
            with _reparametrize_module(
                model, dict(zip(names, params, strict=True)), tie_weights=True
            ):
                return model(*xs)

        statics = [x.detach().clone().requires_grad_(x.requires_grad) for x in inputs]
        snapshot = StateSnapshot(model)
        self.rec = EmulatedBackend().record(Subject(fn, statics, [p for _, p in named], warmup))
        if restore:
            snapshot.restore()

    def forward(self, *inputs: torch.Tensor) -> list[torch.Tensor]:
        for static, x in zip(self.rec.static_inputs, inputs, strict=True):
            static.data.copy_(x)
        self.rec.replay_forward()
        return [o.detach().clone() for o in self.rec.static_outputs]

    def backward(self, grads: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        result, _ = self.rec.backward(grads)
        return [None if g is None else g.clone() for g in result]


def _flat(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        return list(out.values())
    return list(out)


def _equal(a: list[torch.Tensor | None], b: list[torch.Tensor | None]) -> bool:
    return len(a) == len(b) and all(
        (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
        for x, y in zip(a, b, strict=True)
    )


def _check_parity(model: nn.Module, make_input, steps: int = 3, autocast: bool = False) -> None:
    """Replays equal eager: outputs, input and parameter gradients, buffers, across parameter updates."""
    torch.manual_seed(0)
    ref = copy.deepcopy(model)
    inputs = make_input(0)
    ctx = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if autocast else torch.enable_grad
    with ctx():
        direct = Direct(model, *inputs)
    params = [p for p in model.parameters() if p.requires_grad]
    ref_params = [p for p in ref.parameters() if p.requires_grad]
    for step in range(steps):
        inputs = make_input(step)
        torch.manual_seed(100 + step)
        with ctx():
            out = direct.forward(*inputs)
        torch.manual_seed(100 + step)
        with ctx():
            ref_out = _flat(ref(*inputs))
        assert _equal(out, [o.detach() for o in ref_out]), f"outputs differ at step {step}"
        torch.manual_seed(200 + step)
        grads = [torch.randn_like(o) for o in ref_out if o.requires_grad]
        got = direct.backward(grads)
        targets = [x for x in inputs if x.requires_grad] + ref_params
        want = torch.autograd.grad(
            [o for o in ref_out if o.requires_grad], targets, grads, allow_unused=True
        )
        assert _equal(got, list(want)), f"gradients differ at step {step}"
        with torch.no_grad():  # an optimizer step: the replay must read the parameters' new values
            for p, q, g in zip(params, ref_params, got[len(got) - len(params) :], strict=True):
                if g is not None:
                    p.sub_(0.01 * g)
                    q.sub_(0.01 * g)
        for (name, a), b in zip(model.state_dict().items(), ref.state_dict().values(), strict=True):
            assert torch.equal(a, b), f"{name} differs at step {step}"


def _images(channels: int = 3, size: int = 8, channels_last: bool = False):
    def make(step: int) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(step)
        x = torch.randn(2, channels, size, size, generator=g)
        return [x.to(memory_format=torch.channels_last) if channels_last else x]

    return make


class _RoundSTE(torch.autograd.Function):
    """Rounds; its backward is the user's (x3), not what differentiating round would give (zero)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(scale)
        return torch.round(x * scale)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        (scale,) = ctx.saved_tensors
        return 3 * g * scale, None


class Tricky(nn.Module):
    """Views, in-place ops on intermediates and buffers, a custom Function, tuple output, two inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(8, 8)
        self.register_buffer("count", torch.zeros((), dtype=torch.long))
        self.register_buffer("ema", torch.zeros(8))
        self.register_buffer("scale", torch.tensor(2.0))

    def forward(
        self, x: torch.Tensor, y: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = self.a(x)
        h.add_(y).relu_()  # in place on an intermediate; y requires grad
        v = h.view(2, 2, 8).transpose(0, 1)
        left, right = v.unbind(0)
        q = _RoundSTE.apply(left * right, self.scale)
        self.count.add_(1)
        self.ema.mul_(0.9).add_(h.detach().mean(0), alpha=0.1)
        z = self.b(torch.cat([q, right], dim=0)).sigmoid()
        return z, z.sum(1), h.detach().square()  # the last one carries no gradient


def _tricky_inputs(step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(4, 6, generator=g)  # no grad
    y = torch.randn(4, 8, generator=g).requires_grad_(True)
    return [x, y]


# ----------------------------------------------------------------------------- positive
@pytest.mark.parametrize("channels_last", [False, True], ids=["contiguous", "channels_last"])
def test_detection_net_replays_bitwise(channels_last: bool) -> None:
    torch.manual_seed(0)
    model = DetectionNet()
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    _check_parity(model, _images(channels_last=channels_last))


def test_dropout_net_draws_eager_masks() -> None:
    torch.manual_seed(0)
    _check_parity(
        DropoutNet(),
        lambda step: [torch.randn(5, 12, generator=torch.Generator().manual_seed(step))],
    )


@pytest.mark.parametrize("task", list(TASKS))
def test_task_nets_replay_bitwise(task: str) -> None:
    torch.manual_seed(0)
    _check_parity(make_task(task).net, _images(CHANNELS, IMAGE_SIZE))


def test_views_inplace_custom_function_and_buffers_replay_bitwise() -> None:
    _check_parity(Tricky(), _tricky_inputs, steps=4)


def test_autocast_bf16_on_cpu_replays_bitwise() -> None:
    torch.manual_seed(0)
    _check_parity(DetectionNet(), _images(), autocast=True)


class _Island(nn.Module):
    """A float32 head inside an autocast region: its matmul must not be cast again at replay."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(6, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.body(x).relu()
        with torch.autocast("cpu", enabled=False):
            return h, self.head(h.float())


def test_autocast_disabled_region_replays_in_float32() -> None:
    torch.manual_seed(0)
    _check_parity(
        _Island(),
        lambda step: [torch.randn(4, 6, generator=torch.Generator().manual_seed(step))],
        autocast=True,
    )


def test_the_replay_runs_no_module_python() -> None:
    calls = []
    model = DetectionNet()
    model.o2m_cls.register_forward_pre_hook(lambda *_: calls.append(1))
    direct = Direct(model, torch.randn(2, 3, 8, 8))
    calls.clear()
    direct.forward(torch.randn(2, 3, 8, 8))
    assert calls == []


def test_a_tensor_the_forward_keeps_is_rewritten_in_place() -> None:
    """What outlives the capture has a fixed address in a graph: each replay rewrites it."""

    class Stash(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.features = self.lin(x).tanh()
            return self.features * 2

    model = Stash()
    direct = Direct(
        model, torch.randn(3, 4), restore=False
    )  # the snapshot would undo the assignment
    kept = model.features
    x = torch.randn(3, 4)
    out = direct.forward(x)
    assert torch.equal(kept, model.lin(x).tanh().detach())
    assert torch.equal(out[0], 2 * kept)


def test_replay_bumps_no_version_counter() -> None:
    model = Tricky()
    direct = Direct(model, *_tricky_inputs(0))
    before = [o._version for o in direct.rec.static_outputs]
    direct.forward(*_tricky_inputs(1))
    assert [o._version for o in direct.rec.static_outputs] == before


def test_a_pending_backward_reads_the_latest_replay() -> None:
    """One set of activations per recording: the hazard the recorder's hold protects against."""
    torch.manual_seed(0)
    model = DetectionNet()
    ref = copy.deepcopy(model)
    x1, x2 = torch.randn(2, 3, 8, 8), torch.randn(2, 3, 8, 8)
    direct = Direct(model, x1)
    direct.forward(x1)
    direct.forward(x2)  # replaces the activations the first forward's backward would need
    grads = [torch.ones(o.shape) for o in direct.rec.static_outputs]
    got = direct.backward(grads)
    out2 = list(ref(x2).values())
    want = torch.autograd.grad(out2, list(ref.parameters()), grads)
    assert _equal(got, list(want))


def test_partial_backward_is_exact_and_fresh() -> None:
    torch.manual_seed(0)
    model = DetectionNet()
    ref = copy.deepcopy(model)
    x = torch.randn(2, 3, 8, 8)
    direct = Direct(model, x)
    direct.forward(x)
    outs = list(ref(x).values())
    g = torch.randn_like(outs[1])
    result, how = direct.rec.backward([None, g, None, None])
    assert how == "partial"
    want = torch.autograd.grad([outs[1]], list(ref.parameters()), [g], allow_unused=True)
    assert _equal(list(result), list(want))
    assert all(
        r is None or s is None or r.data_ptr() != s.data_ptr()
        for r, s in zip(result, direct.rec.static_grads, strict=True)
    )


def test_integer_index_tensors_are_not_refused() -> None:
    class Gather(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(5, 5)
            self.register_buffer("idx", torch.tensor([4, 0, 2]))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x)[:, self.idx]

    torch.manual_seed(0)
    _check_parity(
        Gather(), lambda step: [torch.randn(3, 5, generator=torch.Generator().manual_seed(step))]
    )


# ----------------------------------------------------------------------------- frozen
def _dropouts(model: nn.Module) -> list[nn.Dropout]:
    return [m for m in model.modules() if isinstance(m, nn.Dropout)]


def _frozen_case(
    model: nn.Module, x: torch.Tensor, change
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], nn.Module, nn.Module]:
    """Record, change a host value; replay, eager with the old value, eager with the new (same RNG)."""
    old = copy.deepcopy(model)
    direct = Direct(model, x)
    change(model)
    new = copy.deepcopy(model)
    torch.manual_seed(7)
    replayed = direct.forward(x)
    torch.manual_seed(7)
    with torch.no_grad():
        eager_old = [o.detach() for o in _flat(old(x))]
    torch.manual_seed(7)
    with torch.no_grad():
        eager_new = [o.detach() for o in _flat(new(x))]
    return replayed, eager_old, eager_new, old, new


def test_changed_dropout_p_is_frozen() -> None:
    torch.manual_seed(0)

    def change(m: nn.Module) -> None:
        for d in _dropouts(m):
            d.p = 0.7

    replayed, eager_old, eager_new, _, _ = _frozen_case(
        DropoutNet(p=0.3), torch.randn(6, 12), change
    )
    assert _equal(replayed, eager_old)
    assert not _equal(replayed, eager_new)


def test_eval_of_a_batchnorm_submodule_is_frozen() -> None:
    torch.manual_seed(0)
    model = DetectionNet()

    def change(m: nn.Module) -> None:
        m.backbone[1][1].eval()

    replayed, eager_old, eager_new, old, _ = _frozen_case(model, torch.randn(2, 3, 8, 8), change)
    assert _equal(replayed, eager_old)
    assert not _equal(replayed, eager_new)
    bn = model.backbone[1][1]  # the replay still updated its running stats, as in training mode
    assert torch.equal(bn.running_mean, old.backbone[1][1].running_mean)
    assert bn.num_batches_tracked.item() == old.backbone[1][1].num_batches_tracked.item()


def test_changed_batchnorm_momentum_is_frozen() -> None:
    torch.manual_seed(0)
    model = DetectionNet()

    def change(m: nn.Module) -> None:
        for bn in m.modules():
            if isinstance(bn, nn.BatchNorm2d):
                bn.momentum = 0.5

    _, _, _, old, new = _frozen_case(model, torch.randn(2, 3, 8, 8), change)
    mean = model.backbone[0][1].running_mean
    assert torch.equal(mean, old.backbone[0][1].running_mean)
    assert not torch.equal(mean, new.backbone[0][1].running_mean)


def test_changed_float_attribute_is_frozen() -> None:
    class Tempered(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 3)
            self.temperature = 2.0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (self.lin(x) / self.temperature).softmax(-1)

    torch.manual_seed(0)

    def change(m: nn.Module) -> None:
        m.temperature = 0.5

    replayed, eager_old, eager_new, _, _ = _frozen_case(Tempered(), torch.randn(5, 4), change)
    assert _equal(replayed, eager_old)
    assert not _equal(replayed, eager_new)


def test_through_the_recorder_without_its_guard_a_changed_dropout_p_silently_diverges() -> None:
    """With the module_state guard off, the replay keeps the recorded p (the guard's negative control)."""
    torch.manual_seed(0)
    model = DropoutNet(p=0.3)
    x = torch.randn(6, 12)
    rec = rk.capture(model, backend="emulated", unsafe_disable=negative_control("module_state"))
    model(x)  # records
    for d in _dropouts(model):
        d.p = 0.7
    old = copy.deepcopy(model)
    for d in _dropouts(old):
        d.p = 0.3
    new = copy.deepcopy(model)
    torch.manual_seed(3)
    replayed = [o.detach() for o in model(x)]
    assert rec.counts["replay"] == 1
    torch.manual_seed(3)
    eager_old = [o.detach() for o in old(x)]
    torch.manual_seed(3)
    eager_new = [o.detach() for o in new(x)]
    assert _equal(replayed, eager_old)
    assert not _equal(replayed, eager_new)
    rec.release()


# ----------------------------------------------------------------------------- refused
class _Net(nn.Module):
    def __init__(self, body) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.body = body

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(self, self.lin(x))


def _item(m: nn.Module, h: torch.Tensor) -> torch.Tensor:
    return h * h.abs().max().item()


def _nonzero(m: nn.Module, h: torch.Tensor) -> torch.Tensor:
    return h.sum() * torch.nonzero(h > 0).shape[0]


def _mask(m: nn.Module, h: torch.Tensor) -> torch.Tensor:
    return h[h > 0].sum()


def _tolist(m: nn.Module, h: torch.Tensor) -> torch.Tensor:
    return h * torch.tensor(h.sum(0).tolist())  # on a CPU this bypasses the dispatcher


_TWOS = torch.full((4,), 2.0)


def _filled_past_dispatcher(m: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """An empty tensor filled by a raw memory copy, as a composite op's C++ loop fills one."""
    buf = torch.empty(h.shape[1], dtype=h.dtype)
    ctypes.memmove(buf.data_ptr(), _TWOS.data_ptr(), buf.numel() * buf.element_size())
    return h * buf


def _default_generator(m: nn.Module, h: torch.Tensor) -> torch.Tensor:
    return h * torch.rand(h.shape, generator=torch.default_generator)


_PRIVATE = torch.Generator().manual_seed(1)


def _private_generator(m: nn.Module, h: torch.Tensor) -> torch.Tensor:
    keep = torch.rand(h.shape, generator=_PRIVATE) > 0.5  # a dropout-like mask on its own generator
    return h * keep


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (_item, "_local_scalar_dense"),
        (_nonzero, "nonzero"),
        (_mask, "boolean mask"),
        (_tolist, "tolist"),
        (_private_generator, "private torch.Generator"),
        (_filled_past_dispatcher, "past the dispatcher"),
    ],
    ids=["item", "nonzero", "bool_mask", "tolist", "private_generator", "filled_past_dispatcher"],
)
def test_what_a_capture_cannot_replay_fails_the_record(body, message: str) -> None:
    """The backend's own refusal (the recorder's probe, switched off here, refuses these first)."""
    torch.manual_seed(0)
    model = _Net(body)
    rec = rk.capture(model, backend="emulated", unsafe_disable=negative_control("record_probe"))
    x = torch.randn(3, 4)
    ref = copy.deepcopy(model)
    out = model(x)
    assert rec.retired
    assert rec.retire_reason.startswith("capture failed: ReplayError:"), rec.retire_reason
    assert message in rec.retire_reason
    if body is not _private_generator:  # the call itself ran eagerly and is exact
        assert torch.equal(out, ref(x))
    rec.release()


def test_the_default_generator_passed_explicitly_is_not_refused() -> None:
    torch.manual_seed(0)
    _check_parity(
        _Net(_default_generator),
        lambda step: [torch.randn(3, 4, generator=torch.Generator().manual_seed(step))],
    )


def test_sparse_gradients_fail_the_record_clearly() -> None:
    class Bag(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(10, 4, sparse=True)

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            return self.emb(idx).sum(1)

    model = Bag()
    rec = rk.capture(model, backend="emulated", unsafe_disable=negative_control("record_probe"))
    model(torch.tensor([[1, 2], [3, 4]]))
    assert rec.retired
    assert rec.retire_reason.startswith("capture failed: ReplayError:"), rec.retire_reason
    assert "sparse" in rec.retire_reason
    rec.release()


class _BiasTable(nn.Module):
    """Swin's relative position bias: a parameter table gathered by an integer index buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.table = nn.Parameter(torch.randn(7, 4))
        self.register_buffer(
            "index", torch.tensor([[0, 3, 6, 3], [1, 1, 5, 2], [2, 4, 0, 6], [5, 5, 5, 0]])
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + self.table[self.index].sum(1)


def test_an_integer_index_gather_records_and_replays(backend: str, device: str) -> None:
    """aten.index is tagged dynamic_output_shape for boolean masks only: integer indices replay (the probe
    retired torchvision's Swin for its relative position bias); a boolean mask is still refused (above)."""
    from replaykit.testing.parity.trial import Trial, compare

    diffs, _, replay = compare(
        Trial(steps=3, features=4, batch=4, device=device), _BiasTable, backend=backend
    )
    assert diffs == []
    assert replay.recorder["retired"] is None and replay.recorder["replay"] >= 2, replay.recorder


class _Resized(nn.Module):
    """Grows an empty buffer before filling it (``resize_`` frees the first block), then makes a
    result the allocator may place in that freed block."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.h = nn.Linear(8, 8), nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        buf = torch.empty(2, 8)
        buf.resize_(x.shape[0], 16).fill_(1.0)
        again = self.a(x)[:2] * 2.0
        return self.h(buf * 0.5).sum() + again.sum()


def test_a_freed_empty_block_reused_by_a_later_result_is_not_refused() -> None:
    """The tape follows unfilled empty tensors by their storage objects, not their data's
    address: a freed block given to a later result was refused as unfilled (about 1 time in 20)."""
    for seed in range(40):
        torch.manual_seed(seed)
        model = _Resized()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        step = rk.TrainStep(model, lambda m, x: m(x), opt, backend="emulated")
        for _ in range(3):
            step(torch.randn(4, 8))
        assert not step.retired, step.retire_reason
