"""Bitwise comparison of tensors and of whole states: the parity contract's comparator.

Two tensors are equal when their bits are: NaN payloads and the sign of zero count,
so ``-0.0`` differs from ``0.0`` and ``NaN`` equals the same ``NaN``. ``None`` equals
only ``None`` (the ``.grad`` None pattern).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _as_ints(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements as integers of the same width, where ``t`` is (no copy but of a conjugate
    or negative view: its bits are those of the values it shows, which only a copy holds)."""
    t = t.detach()
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    if t.is_complex():
        t = torch.view_as_real(t)
    if t.dtype == torch.bool:
        return t.view(torch.uint8)
    return t.view(_INT_OF_SIZE[t.element_size()]) if t.is_floating_point() else t


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's elements reinterpreted as integers of the same width, on the CPU."""
    return _as_ints(t).cpu().contiguous()


#: bytes of small tensors compared by one kernel pair: a recording call compares the whole training
#: state (a 4-layer LM's: 156 tensors), and a ``ne``/``any`` per tensor cost it ~4 ms on the H200.
#: At most 1 MiB, so the gathered copies come from the caching allocator's small pool: a 4 MiB chunk
#: took a 20 MiB segment of its own and raised an 8-bucket run's peak reserved 1.04 -> 1.17x eager's.
CHUNK_BYTES = 1 << 20


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    flat = _as_ints(t).reshape(-1)
    if flat.stride(0) != 1:  # a 1-D strided or expanded tensor is its own reshape: copied
        flat = flat.clone(memory_format=torch.contiguous_format)
    return flat.view(torch.uint8)


class _Gathered:
    """Small tensor pairs on one device, gathered into two byte buffers and compared a chunk at a time."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.flags: list[torch.Tensor] = []
        self._pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._size = 0

    def add(self, a: torch.Tensor, b: torch.Tensor) -> None:
        x, y = _flat_bytes(a), _flat_bytes(b)
        if self._size + x.numel() > CHUNK_BYTES:
            self.flush()
        self._pairs.append((x, y))
        self._size += x.numel()

    def _gather(self, parts: list[torch.Tensor]) -> torch.Tensor:
        if all(p.device == self.device for p in parts):
            return torch.cat(parts)
        out = torch.empty(self._size, dtype=torch.uint8, device=self.device)
        offset = 0
        for part in parts:  # a reference kept in (pinned) host memory is copied in stream order
            out[offset : offset + part.numel()].copy_(part, non_blocking=True)
            offset += part.numel()
        return out

    def flush(self) -> None:
        if self._pairs:
            xs, ys = zip(*self._pairs, strict=True)
            self.flags.append(torch.ne(self._gather(list(xs)), self._gather(list(ys))).any())
            self._pairs, self._size = [], 0


def all_equal(pairs: Iterable[tuple[torch.Tensor | None, torch.Tensor | None]]) -> bool:
    """Whether every pair is bitwise equal (both None, or one dtype, shape and bits), compared
    on the GPU where either side is there (a reference kept in host memory is copied over): small
    tensors a chunk at a time (:data:`CHUNK_BYTES`), a large one alone, and one host sync per
    device, not one per tensor (per-tensor syncs cost a recording call tens of ms)."""
    gathered: dict[torch.device, _Gathered] = {}
    for a, b in pairs:
        if a is None or b is None:
            if a is None and b is None:
                continue
            return False
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        device = b.device if a.device.type == "cpu" else a.device
        group = gathered.get(device)
        if group is None:
            group = gathered[device] = _Gathered(device)
        if a.numel() * a.element_size() < CHUNK_BYTES:
            group.add(a, b)
            continue
        a, b = a.to(device, non_blocking=True), b.to(device, non_blocking=True)
        group.flags.append(torch.ne(_as_ints(a), _as_ints(b)).any())
    for group in gathered.values():
        group.flush()
    return not any(bool(torch.stack(g.flags).any()) for g in gathered.values() if g.flags)


def bitwise_equal(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """True when both are None, or both are tensors of one dtype and shape with equal bits."""
    if a is None or b is None:
        return a is None and b is None
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(_bits(a), _bits(b))


@dataclass(frozen=True)
class TensorDiff:
    """One row of a diff table: how two tensors under one name differ."""

    name: str
    problem: str  # "values", "none_pattern", "dtype", "shape", "missing"
    max_abs: float = math.nan
    max_ulp: int = 0
    mismatched: int = 0
    numel: int = 0

    def as_dict(self) -> dict:
        return {
            "name": self.name,
            "problem": self.problem,
            "max_abs": self.max_abs,
            "max_ulp": self.max_ulp,
            "mismatched": self.mismatched,
            "numel": self.numel,
        }


def _ordered_int(t: torch.Tensor) -> torch.Tensor:
    """Map float bits to int64 whose order and distance follow the float line (ULPs); -0.0 maps to 0."""
    i = _bits(t).to(torch.int64)  # sign-extends narrower widths
    magnitude = i & ((1 << (t.element_size() * 8 - 1)) - 1)
    return torch.where(i < 0, -magnitude, i)


def diff(name: str, a: torch.Tensor | None, b: torch.Tensor | None) -> TensorDiff | None:
    """The difference between ``a`` (reference) and ``b``, or None when they are bitwise equal."""
    if a is None or b is None:
        if a is None and b is None:
            return None
        return TensorDiff(name, "none_pattern", numel=(a if a is not None else b).numel())
    if a.dtype != b.dtype:
        return TensorDiff(name, "dtype", numel=a.numel())
    if a.shape != b.shape:
        return TensorDiff(name, "shape", numel=a.numel())
    if a.device != b.device:  # a reference kept in host memory
        a, b = a.cpu(), b.cpu()
    ba, bb = _bits(a), _bits(b)
    neq = ba != bb
    if a.is_complex():
        neq = neq.any(-1)
    mismatched = int(neq.sum())
    if mismatched == 0:
        return None
    ad, bd = a.detach().cpu(), b.detach().cpu()
    if ad.is_floating_point() or ad.is_complex():
        delta = (
            (ad.double() - bd.double()).abs() if not ad.is_complex() else (ad - bd).abs().double()
        )
        max_abs = float(torch.nan_to_num(delta, nan=math.inf).max())
    else:
        max_abs = float((ad.long() - bd.long()).abs().max())
    max_ulp = 0
    if ad.is_floating_point():
        max_ulp = int((_ordered_int(ad) - _ordered_int(bd)).abs().max())
    return TensorDiff(name, "values", max_abs, max_ulp, mismatched, a.numel())


def diff_states(
    reference: Mapping[str, torch.Tensor | None], other: Mapping[str, torch.Tensor | None]
) -> list[TensorDiff]:
    """Rows for every name whose tensors differ bitwise; names present on one side only are 'missing'."""
    rows: list[TensorDiff] = []
    for name in reference.keys() | other.keys():
        if name not in reference or name not in other:
            rows.append(TensorDiff(name, "missing"))
            continue
        row = diff(name, reference[name], other[name])
        if row is not None:
            rows.append(row)
    return sorted(rows, key=lambda r: r.name)
