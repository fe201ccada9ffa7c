"""Network replay returns the structure eager returns: tensors replayed, the tree, its constant
leaves and its objects (a cache) rebuilt; an object it cannot rebuild routes its signature eagerly
with the reason."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, NamedTuple

import pytest
import torch
from torch import nn
from torch.utils._pytree import register_pytree_node, tree_flatten

import replaykit as rk
from replaykit.memory.outputs import split_outputs
from replaykit.protections import negative_control
from replaykit.verify.bitwise import diff_states


class ModelOut(OrderedDict):
    """Like transformers' ModelOutput: an OrderedDict subclass registered with torch's pytree."""


register_pytree_node(
    ModelOut,
    lambda o: (list(o.values()), list(o.keys())),
    lambda values, keys: ModelOut(zip(keys, values, strict=True)),
)


class Pair(NamedTuple):
    logits: torch.Tensor
    count: int


class Heads(nn.Module):
    """Returns a registered output class holding None, ints, a string, a dtype, a NamedTuple and a tuple."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(6, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> ModelOut:
        h = torch.relu(self.body(x))
        logits = self.head(h)
        return ModelOut(
            loss=logits.pow(2).mean(),
            logits=Pair(logits, x.shape[0]),
            hidden=(h, None, "relu"),
            dtype=logits.dtype,
            attentions=None,
        )


class Cache:
    """An object holding the call's tensors, like transformers' DynamicCache."""

    def __init__(self, k: torch.Tensor) -> None:
        self.keys = [k]


class DynamicCache(Cache):
    pass


class PrefetchingCache(Cache):
    """A cache holding what no replay can rebuild (transformers' offloading cache holds a stream)."""

    def __init__(self, k: torch.Tensor) -> None:
        super().__init__(k)
        self.lock = threading.Lock()


class WithCache(nn.Module):
    def __init__(self, use_cache: bool = True, cache: type[Cache] = DynamicCache) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.use_cache = use_cache
        self.cache = cache

    def forward(self, x: torch.Tensor) -> dict[str, Any]:
        y = self.lin(x)
        return {"loss": y.square().mean(), "cache": self.cache(y) if self.use_cache else None}


def _prefetching() -> WithCache:
    return WithCache(cache=PrefetchingCache)


class Capturing(nn.Module):
    """Returns a host value that differs under capture (transformers' ``is_tracing()`` reads the same)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, bool]:
        try:
            capturing = torch.cuda.is_current_stream_capturing()
        except RuntimeError:  # a CPU-only build has no CUDA runtime to ask
            capturing = False
        return self.lin(x).sum(), capturing


def _train(make: type[nn.Module], device: str, calls: int = 4, **capture: Any):
    """Train from one seed; the outputs of every call, flattened, and the end state."""
    torch.manual_seed(0)
    model = make().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rec = rk.capture(model, **capture) if capture else None
    outputs, state = [], {}
    g = torch.Generator().manual_seed(1)
    for i in range(calls):
        out = model(torch.randn(3, *_shape(make), generator=g).to(device))
        loss = out["loss"] if isinstance(out, dict) else out[0]
        loss.backward()
        state.update({f"grad{i}/{n}": p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad(set_to_none=True)
        outputs.append(out)
    state.update({n: p.detach().clone() for n, p in model.named_parameters()})
    return outputs, state, rec


def _shape(make: type[nn.Module]) -> tuple[int, ...]:
    return (6,) if make is Heads else (4,)


def _same_tree(a: Any, b: Any) -> bool:
    """Same structure and types all the way down, equal constants, bitwise equal tensors."""
    fa, sa = tree_flatten(a)
    fb, sb = tree_flatten(b)
    if sa != sb or len(fa) != len(fb):
        return False
    for x, y in zip(fa, fb, strict=True):
        if type(x) is not type(y):
            return False
        if isinstance(x, torch.Tensor):
            if not torch.equal(x.detach(), y.detach()):
                return False
        elif x != y:
            return False
    return True


def test_a_registered_output_class_with_constants_replays_as_its_own_class(
    backend: str, device: str
) -> None:
    eager_out, eager, _ = _train(Heads, device)
    replay_out, replayed, rec = _train(Heads, device, backend=backend)
    assert diff_states(eager, replayed) == []
    assert rec.counts["record"] == 1 and rec.counts["replay"] == 3 and rec.retire_reason is None
    for e, r in zip(eager_out, replay_out, strict=True):
        assert type(r) is ModelOut and type(r["logits"]) is Pair
        assert list(r) == ["loss", "logits", "hidden", "dtype", "attentions"]
        assert r["hidden"][1:] == (None, "relu") and r["logits"].count == 3
        assert _same_tree(e, r)


def test_an_object_among_the_outputs_is_rebuilt_around_the_replayed_tensors(
    backend: str, device: str
) -> None:
    eager_out, eager, _ = _train(WithCache, device)
    out, replayed, rec = _train(WithCache, device, backend=backend)
    assert diff_states(eager, replayed) == []
    assert rec.counts["record"] == 1 and rec.counts["replay"] == 3, rec.journal.format()
    caches = [o["cache"] for o in out]
    assert all(type(c) is DynamicCache and list(vars(c)) == ["keys"] for c in caches)
    assert len({id(c) for c in caches}) == 4  # each call's own object, as eager
    for c, e in zip(caches, eager_out, strict=True):  # kept: each keeps its call's values
        assert torch.equal(c.keys[0], e["cache"].keys[0])


def test_an_object_it_cannot_rebuild_routes_its_signature_eagerly_with_the_fix(
    backend: str, device: str
) -> None:
    eager_out, eager, _ = _train(_prefetching, device)
    routed_out, routed, rec = _train(_prefetching, device, backend=backend)
    assert diff_states(eager, routed) == []
    assert rec.retire_reason is None and rec.counts["record"] == 0
    assert dict(rec.eager_reasons) == {"output_object": 4}
    [refusal] = [e for e in rec.journal if e.kind == "refuse"]
    assert "a lock at ['cache'].lock" in refusal.detail, refusal.detail
    assert "use_cache=False" in refusal.detail
    caches = [o["cache"] for o in routed_out]
    assert len({id(c) for c in caches}) == 4
    assert all(
        torch.equal(c.keys[0], e["cache"].keys[0]) for c, e in zip(caches, eager_out, strict=True)
    )


def test_without_the_object_the_same_model_replays(backend: str, device: str) -> None:
    _, eager, _ = _train(lambda: WithCache(use_cache=False), device)
    out, replayed, rec = _train(lambda: WithCache(use_cache=False), device, backend=backend)
    assert diff_states(eager, replayed) == [] and rec.counts["replay"] == 3
    assert all(o["cache"] is None for o in out)


def test_a_constant_computed_differently_under_capture_is_not_frozen(
    backend: str, device: str
) -> None:
    """The probe's call returns False, the recording's True: the signature runs eagerly. With the
    guard and the verification switched off, every replay hands back the recorded True."""
    eager_out, eager, _ = _train(Capturing, device)
    assert [o[1] for o in eager_out] == [False] * 4
    out, state, rec = _train(Capturing, device, backend=backend)
    assert [o[1] for o in out] == [False] * 4 and diff_states(eager, state) == []
    assert rec.counts["replay"] == 0 and dict(rec.eager_reasons) == {"output_constant": 4}
    # the guard off: the first replay's verification still catches it
    out, state, rec = _train(
        Capturing, device, backend=backend, unsafe_disable=("output_constants",)
    )
    assert [o[1] for o in out] == [False] * 4 and rec.counts["replay"] == 0
    assert "diverged" in rec.eager_reasons
    # negative control: both off, the recorded constant replays
    out, _, rec = _train(
        Capturing, device, backend=backend, unsafe_disable=negative_control("output_constants")
    )
    assert rec.counts["replay"] == 3 and [o[1] for o in out] == [True] * 4  # eager: False


def test_an_object_leaf_without_the_probe_is_a_failed_capture_that_says_which(
    backend: str, device: str
) -> None:
    with pytest.warns(rk.ReplayWarning):
        _, eager, _ = _train(_prefetching, device)
        _, state, rec = _train(
            _prefetching, device, backend=backend, unsafe_disable=("record_probe",)
        )
    assert diff_states(eager, state) == []
    assert rec.retired and "a lock at ['cache'].lock" in rec.retire_reason


def test_output_trees_compare_structure_and_constants_bitwise() -> None:
    """What verification compares besides tensors: -0.0 is not 0.0, NaN is NaN, an object (eager's
    reference may hold one) differs from anything but itself, and the structure must match."""
    t = torch.zeros(1)

    def tree(x: Any) -> Any:
        return split_outputs({"y": t, "c": x}, strict=False)[1]

    assert tree(0.0).difference(tree(0.0)) is None
    assert tree(float("nan")).difference(tree(float("nan"))) is None
    assert "-0.0" in tree(0.0).difference(tree(-0.0))
    assert tree(1).difference(tree(True)) is not None  # 1 == True, but another type
    assert tree(Cache(t)).difference(tree(Cache(t))) is None  # rebuilt: compared by its fields
    assert "DynamicCache" in tree(Cache(t)).difference(tree(DynamicCache(t)))
    lock = PrefetchingCache(t)
    assert tree(lock).difference(tree(lock)) is None
    assert tree(lock).difference(tree(PrefetchingCache(t))) is not None
    assert "structure" in tree(None).difference(split_outputs((t, None))[1])
    with pytest.raises(rk.ReplayError, match=r"a lock at \['c'\]\.lock"):
        split_outputs({"y": t, "c": PrefetchingCache(t)})
