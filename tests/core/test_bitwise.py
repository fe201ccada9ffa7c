"""The comparator compares bits: -0.0 differs from 0.0, a NaN equals itself, None only None."""

from __future__ import annotations

import math

import torch

from replaykit.bitwise import bitwise_equal, diff, diff_states


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
