"""The comparator compares bits: -0.0 differs from 0.0, a NaN equals itself, None only None."""

from __future__ import annotations

import math

import pytest
import torch

from replaykit.verify import bitwise
from replaykit.verify.bitwise import all_equal, bitwise_equal, diff, diff_states


def test_signed_zero_and_nan() -> None:
    assert not bitwise_equal(torch.tensor([0.0]), torch.tensor([-0.0]))
    assert torch.equal(torch.tensor([0.0]), torch.tensor([-0.0]))  # why bits: torch.equal says yes
    nan = torch.tensor([math.nan])
    assert bitwise_equal(nan, nan.clone())
    assert bitwise_equal(None, None) and not bitwise_equal(None, torch.zeros(1))


def test_diff_rows() -> None:
    a = torch.tensor([1.0, 2.0, 3.0])
    b = a.clone()
    b[1] = torch.nextafter(b[1], torch.tensor(10.0))
    row = diff("w", a, b)
    assert row is not None and row.mismatched == 1 and row.max_ulp == 1 and row.max_abs > 0
    assert diff("w", a, a.clone()) is None
    assert diff("w", a.half(), a.half()) is None
    assert diff("g", None, a).problem == "none_pattern"
    assert diff("w", a, a.double()).problem == "dtype"
    rows = diff_states({"a": a, "b": a}, {"a": a, "c": a})
    assert [(r.name, r.problem) for r in rows] == [("b", "missing"), ("c", "missing")]
    ints = diff("n", torch.tensor([3]), torch.tensor([5]))
    assert ints is not None and ints.max_abs == 2


def test_all_equal_compares_bits_none_patterns_dtypes_and_shapes() -> None:
    x = torch.tensor([1.0, -0.0, float("nan")])
    z = torch.complex(torch.ones(2), torch.zeros(2))
    same = [(x, x.clone()), (None, None), (z, z.clone()), (torch.tensor(True), torch.tensor(True))]
    assert all_equal(same)
    assert all_equal([])
    for a, b in [
        (torch.tensor([0.0]), torch.tensor([-0.0])),  # equal values, other bits
        (torch.tensor([1.0]), torch.tensor([1.0]).nextafter(torch.tensor([2.0]))),  # one ulp
        (x, None),
        (torch.zeros(2), torch.zeros(2, dtype=torch.float64)),
        (torch.zeros(2), torch.zeros(1, 2)),
        (z, torch.complex(torch.ones(2), torch.tensor([0.0, 1e-30]))),
        (torch.tensor(True), torch.tensor(False)),
    ]:
        assert not all_equal([*same, (a, b)]), (a, b)


def test_all_equal_finds_one_flipped_bit_in_any_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    """Small tensors are compared gathered a chunk at a time, large ones alone: a chunk boundary
    that dropped or shifted bytes would miss the flipped bit or see one that is not there."""
    monkeypatch.setattr(bitwise, "CHUNK_BYTES", 24)
    g = torch.Generator().manual_seed(0)
    shapes = [(3,), (2, 2), (), (7,), (1,), (5, 2), (0,), (3,)]
    dtypes = [torch.float32, torch.float16, torch.int64, torch.bool, torch.float64]
    state = [
        (torch.randn(s, generator=g) * 10).to(dtypes[i % len(dtypes)]) for i, s in enumerate(shapes)
    ]
    state.append(torch.randn(4, 5, generator=g).t())  # non-contiguous, past the chunk: alone
    assert all_equal([(t, t.clone()) for t in state])
    for i, t in enumerate(state):
        if t.numel() == 0:
            continue
        flipped = t.clone(memory_format=torch.contiguous_format)
        ints = bitwise._as_ints(flipped)
        ints.view(-1)[-1] ^= 1 if t.dtype == torch.bool else 1 << 3
        pairs = [(u, u.clone()) for u in state]
        pairs[i] = (t, flipped)
        assert not all_equal(pairs), i
