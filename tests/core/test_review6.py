"""Review of the verification speed-ups: ``all_equal``'s gathered byte chunks and the snapshot's one
walk of the module tree, tried as a user would break them.

``all_equal`` is the recording call's comparator: it must neither call different tensors equal
nor raise on a layout ``torch.equal`` takes. The snapshot must put back everything a recording
call's extra runs change, whatever the model's ``parameters()`` says. Each step test compares
losses and the state dict with the eager twin, bit for bit, and that the step really replayed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
from torch import nn

import replaykit as rk
from replaykit.verify import bitwise
from replaykit.verify.bitwise import CHUNK_BYTES, all_equal, bitwise_equal, diff_states

# ----------------------------------------------------------------------------- all_equal


def _layouts() -> dict[str, torch.Tensor]:
    base = torch.arange(24, dtype=torch.float32) - 7.5
    return {
        "1-D strided": base[::2],
        "1-D expanded (stride 0)": torch.tensor([3.0]).expand(5),
        "one element, stride 2": base[3:5:2],
        "storage offset": base[5:11],
        "overlapping windows": base.as_strided((4, 3), (2, 1), 1),
        "2-D expanded": base[:3].expand(4, 3),
        "transposed": base.view(4, 6).t(),
        "zero-size, strided": torch.empty(0, 3).t(),
    }


@pytest.mark.parametrize("name", list(_layouts()))
def test_all_equal_takes_every_layout_torch_equal_takes(name: str) -> None:
    """A 1-D strided or expanded tensor is its own ``reshape(-1)``, which a byte view refuses
    (a buffer ``register_buffer("mask", ones[::2])`` made every recording call raise)."""
    t = _layouts()[name]
    assert all_equal([(t, t.clone())]) and all_equal([(t.clone(), t)])
    if t.numel():
        other = t.clone(memory_format=torch.contiguous_format)
        other.view(-1)[-1] = other.view(-1)[-1].nextafter(torch.tensor(100.0))
        assert not all_equal([(t, other)]) and not all_equal([(other, t)])
        large = t.expand(CHUNK_BYTES // 4 // t.numel() + 1, *t.shape)  # past the chunk: alone
        assert all_equal([(large, large.clone())])
        assert not all_equal([(large, torch.cat([large[:-1], other[None]]))])


def test_all_equal_compares_conjugate_and_negative_views_by_the_values_they_show() -> None:
    z = torch.complex(torch.tensor([1.0, -2.0, 0.0]), torch.tensor([0.5, 0.0, -3.0]))
    assert all_equal([(z.conj(), z.conj().resolve_conj())])
    assert not all_equal([(z.conj(), z.clone())])
    neg = z.conj().imag  # a negative view of z's imaginary parts
    assert neg.is_neg()
    assert all_equal([(neg, -z.imag)]) and bitwise_equal(neg, -z.imag)
    assert not all_equal([(neg, z.imag.clone())]) and not bitwise_equal(neg, z.imag.clone())


def _flip(t: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """A contiguous copy of ``t`` with one random bit of one random byte flipped."""
    out = t.clone(memory_format=torch.contiguous_format)
    raw = out.reshape(-1).view(torch.uint8)
    i = int(torch.randint(raw.numel(), (), generator=g))
    raw[i] ^= 1 if t.dtype == torch.bool else 1 << int(torch.randint(8, (), generator=g))
    return out


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The brute-force reference's bytes: a fresh contiguous copy viewed as bytes, nothing shared
    with ``all_equal``'s integer views."""
    copy = t.resolve_conj().resolve_neg().clone(memory_format=torch.contiguous_format)
    return copy.reshape(-1).view(torch.uint8)


_DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.int64,
    torch.int32,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
]


def _randint(n: int, g: torch.Generator) -> int:
    return int(torch.randint(n, (), generator=g))


def _random_tensor(g: torch.Generator) -> torch.Tensor:
    """Random bits (NaN payloads, -0.0, subnormals) of a random dtype, shape and layout:
    contiguous, 1-D strided, transposed or expanded (stride 0)."""
    dtype = _DTYPES[_randint(len(_DTYPES), g)]
    shape = tuple(_randint(6, g) for _ in range(_randint(4, g)))
    n = torch.Size(shape).numel()
    raw = torch.randint(0, 256, ((2 * n + 1) * 16,), dtype=torch.uint8, generator=g)
    flat = raw % 2 == 1 if dtype == torch.bool else raw.view(dtype)
    layout = _randint(4, g)
    t = (flat[: 2 * n : 2] if layout == 1 else flat[:n]).view(shape)
    if layout == 2 and t.dim():
        t = t.transpose(0, -1)
    if layout == 3:
        t = t.expand(2, *t.shape)
    return t


def _counterpart(a: torch.Tensor, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``a`` and another tensor: equal (its clone, in ``a``'s strides or contiguous), one flipped
    bit, or, for float32, 0.0 against -0.0 and one NaN payload against another."""
    kind = _randint(6, g)
    if kind == 0 and a.numel():
        return a, _flip(a, g)
    if kind in (1, 2) and a.dtype == torch.float32 and a.numel():
        a, b = (a.clone(memory_format=torch.contiguous_format) for _ in range(2))
        ints_a, ints_b = a.view(torch.int32).view(-1), b.view(torch.int32).view(-1)
        ints_a[0], ints_b[0] = (0, -(1 << 31)) if kind == 1 else (0x7FC00001, 0x7FC00002)
        return a, b
    return a, a.clone(memory_format=torch.contiguous_format) if _randint(2, g) else a.clone()


@pytest.mark.parametrize("chunk", [16, 100, CHUNK_BYTES])
def test_all_equal_matches_a_brute_force_reference(
    monkeypatch: pytest.MonkeyPatch, chunk: int
) -> None:
    """Random lists of pairs (dtypes, shapes, layouts, flipped bits, -0.0, NaN payloads), against
    ``torch.equal`` on fresh byte copies and ``bitwise_equal`` one pair at a time."""
    monkeypatch.setattr(bitwise, "CHUNK_BYTES", chunk)
    g = torch.Generator().manual_seed(6)
    seen = {True: 0, False: 0}
    for _ in range(150):
        pairs = []
        for _ in range(1 + _randint(12, g)):
            a, b = _counterpart(_random_tensor(g), g)
            pairs.append((a, b) if _randint(2, g) else (b, a))
        expected = all(torch.equal(_bytes(a), _bytes(b)) for a, b in pairs)
        assert expected == all(bitwise_equal(a, b) for a, b in pairs)
        assert all_equal(pairs) == expected, [(a.dtype, a.shape, a.stride()) for a, _ in pairs]
        seen[expected] += 1
    assert min(seen.values()) > 20, seen  # both outcomes are exercised


def test_all_equal_at_the_chunk_size_and_over_many_tiny_tensors() -> None:
    """A tensor of exactly CHUNK_BYTES is compared alone, one byte less gathered; 5000 tiny tensors
    fill one chunk: a flipped last byte is found in each."""
    for size in (CHUNK_BYTES, CHUNK_BYTES - 1, CHUNK_BYTES + 1):
        t = torch.zeros(size, dtype=torch.uint8)
        tiny = [torch.full((3,), float(i)) for i in range(4)]
        pairs = [*((u, u.clone()) for u in tiny), (t, t.clone()), *((u, u.clone()) for u in tiny)]
        assert all_equal(pairs)
        flipped = t.clone()
        flipped[-1] = 1
        assert not all_equal([*pairs[:4], (t, flipped), *pairs[5:]]), size
    tiny = [torch.full((1,), float(i)) for i in range(5000)]
    assert all_equal([(u, u.clone()) for u in tiny])
    other = tiny[-1].clone().neg_()
    assert not all_equal([*((u, u.clone()) for u in tiny[:-1]), (tiny[-1], other)])


# ----------------------------------------------------------------------------- the snapshot


class _Zoo(nn.Module):
    """A module twice in the tree, tied weights, a parameter and a buffer set to None, a
    ParameterList and ParameterDict, BatchNorm statistics, a counter and a 1-D strided buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6, bias=False)
        self.b = self.a
        self.emb = nn.Linear(6, 6)
        self.head = nn.Linear(6, 6)
        self.head.weight = self.emb.weight
        self.head.bias = None
        self.register_buffer("nothing", None)
        self.register_buffer("count", torch.zeros(()))
        self.plist = nn.ParameterList([nn.Parameter(torch.ones(6)), nn.Parameter(torch.zeros(6))])
        self.pdict = nn.ParameterDict({"s": nn.Parameter(torch.ones(6))})
        self.bn = nn.BatchNorm1d(6)
        self.register_buffer("mask", torch.linspace(0.5, 1.5, 12)[::2])  # strided

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count += 1
        h = self.bn(self.b(self.a(x)))
        return self.head(self.emb(h) * self.plist[0] + self.plist[1]) * self.pdict["s"] * self.mask


class _ListedScale(nn.Module):
    """A per-feature scale held in a plain list, which ``parameters()`` adds; the forward
    anneals it in place (a schedule)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 3)
        self.scales = [nn.Parameter(torch.ones(3))]

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        yield from super().parameters(recurse)
        yield from self.scales

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.scales[0].mul_(1.5)
        return self.lin(x) * self.scales[0]


class _TrainableOnly(nn.Module):
    """``parameters()`` yields only the trainable ones; the forward decays a frozen weight."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Linear(6, 6)
        self.frozen.requires_grad_(False)
        self.lin = nn.Linear(6, 3)

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        return (p for p in super().parameters(recurse) if p.requires_grad)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.frozen.weight.mul_(0.99)
        return self.lin(self.frozen(x))


class _Lazy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.LazyLinear(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


class _UnlistedScale(_ListedScale):
    """The scale in a plain list that ``parameters()`` does not add: the optimizer gets it in a
    group of its own."""

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        return nn.Module.parameters(self, recurse)


class _HeldNorm(nn.Module):
    """A BatchNorm held in a plain list (not registered); the optimizer gets its parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.extra = [nn.BatchNorm1d(6)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.extra[0](self.lin(x))


def _loss(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return m(x).pow(2).mean()


def _train(make: Callable[[], nn.Module], replay: bool) -> tuple[dict, rk.TrainStep]:
    torch.manual_seed(0)
    model = make()
    model(torch.zeros(2, 6))  # a lazy module's shapes
    params = [*model.parameters()]
    if isinstance(model, _UnlistedScale):
        params += model.scales
    if isinstance(model, _HeldNorm):
        params += model.extra[0].parameters()
    opt = torch.optim.SGD(params, lr=0.05, momentum=0.9)
    step = rk.TrainStep(model, _loss, opt, replay=replay, backend="emulated", warmup=1)
    g = torch.Generator().manual_seed(3)
    state: dict[str, torch.Tensor | None] = {}
    try:
        for i in range(5):
            state[f"loss{i}"] = step(torch.randn(4, 6, generator=g)).detach()
    finally:
        step.release()
    state |= {f"state/{k}": v for k, v in model.state_dict().items()}
    if isinstance(model, _HeldNorm):
        state |= {f"held/{k}": v for k, v in model.extra[0].state_dict().items()}
    state |= {f"param {i}": p.detach() for i, p in enumerate(params)}
    return state, step


@pytest.mark.parametrize(
    "make",
    [_Zoo, _ListedScale, _TrainableOnly, _Lazy, _UnlistedScale, _HeldNorm],
    ids=[
        "zoo",
        "parameters_adds_one",
        "parameters_leaves_out_frozen",
        "lazy",
        "optimizer_group_outside",
        "module_in_a_plain_list",
    ],
)
def test_a_step_replays_as_eager_whatever_the_model_lists(make: Callable[[], nn.Module]) -> None:
    """zoo: all_equal raised on the strided buffer; parameters_adds_one: the one walk missed the
    listed scale (the warm-up's write stayed, the check diverged from a state eager never had);
    parameters_leaves_out_frozen: dd706e5's ``parameters()`` missed the frozen weight;
    optimizer_group_outside: a parameter only the optimizer lists kept its grad but not its value;
    module_in_a_plain_list: a BatchNorm ``modules()`` does not reach kept the warm-up's statistics."""
    eager, _ = _train(make, False)
    replayed, step = _train(make, True)
    assert diff_states(eager, replayed) == [], step.journal.format()
    assert step.counts["replay"] == 3, step.journal.format()


def test_capture_of_a_model_whose_parameters_add_one_leaves_no_trace() -> None:
    """rk.capture's warm-up annealed the listed scale and its snapshot did not put it back."""

    def run(replay: bool) -> dict[str, torch.Tensor | None]:
        torch.manual_seed(0)
        model = _ListedScale()
        rec = rk.capture(model, backend="emulated", warmup=2) if replay else None
        g = torch.Generator().manual_seed(1)
        out: dict[str, torch.Tensor | None] = {}
        try:
            for i in range(4):
                y = model(torch.randn(4, 6, generator=g))
                y.pow(2).mean().backward()
                out[f"y{i}"] = y.detach().clone()
        finally:
            if rec is not None:
                rec.release()
        for i, p in enumerate(model.parameters()):
            out[f"p{i}"], out[f"g{i}"] = p.detach().clone(), p.grad
        return out

    assert diff_states(run(False), run(True)) == []
