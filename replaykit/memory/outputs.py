"""What a forward returns, split into what a replay recomputes and what it rebuilds.

Tensors are replayed; the rest is rebuilt around them: the tree's structure (containers and
pytree-registered types such as transformers' ``ModelOutput``) and its constant leaves (None,
numbers, strings, dtypes, sizes), host values frozen like every other (the recording and the
probe must agree on them, else ``output_constant``). Any other leaf (a ``DynamicCache``) is an
object whose identity and state a replay cannot reproduce: that signature runs eagerly
(``output_object``), the reason naming the object and what to change.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils._pytree import (
    LeafSpec,
    TreeSpec,
    keystr,
    tree_flatten,
    tree_flatten_with_path,
    tree_unflatten,
)

from ..errors import ReplayError
from ..guards.signature import PLAIN_VALUES

#: Leaf types a recording keeps as they were: immutable host values, compared by value.
CONSTANT_TYPES: tuple[type, ...] = (
    *PLAIN_VALUES,  # the values a signature keys by value
    float,
    complex,
    torch.Size,
    type(Ellipsis),
)

#: What a user can change when a forward returns an object (the one model families return).
OBJECT_HINTS: dict[str, str] = {
    "Cache": "pass use_cache=False (or set model.config.use_cache = False): training needs no cache",
}


def _same(a: Any, b: Any) -> bool:
    """Bitwise equality of two constant leaves (``-0.0`` is not ``0.0``; NaN equals NaN)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return a.hex() == b.hex()
    if isinstance(a, complex):
        return a.real.hex() == b.real.hex() and a.imag.hex() == b.imag.hex()
    try:
        return bool(a == b)
    except Exception:  # an object whose == is not a truth value (an array): not the same
        return False


def _hint(obj: object) -> str:
    for base in type(obj).__mro__:
        for marker, hint in OBJECT_HINTS.items():
            if base.__name__.endswith(marker):
                return hint
    return "return tensors (or None, numbers, strings) from forward instead"


class OutputTree:
    """The structure and constant leaves of one forward's outputs; the tensors' slots among the leaves."""

    __slots__ = ("leaves", "positions", "spec")

    def __init__(self, spec: TreeSpec, leaves: list[Any], positions: tuple[int, ...]) -> None:
        self.spec = spec
        self.leaves = leaves  # the constants in place, None where a tensor goes
        self.positions = positions  # where the tensors go, in flat order

    @property
    def constants(self) -> list[tuple[int, Any]]:
        slots = set(self.positions)
        return [(i, v) for i, v in enumerate(self.leaves) if i not in slots]

    def rebuild(self, tensors: Sequence[torch.Tensor]) -> Any:
        """The forward's output tree with ``tensors`` in the tensors' places."""
        return self.builder()(tensors)

    def builder(self) -> Callable[[Sequence[torch.Tensor]], Any]:
        """A fast ``rebuild`` for the replay path: made once per recording."""
        if len(self.positions) == len(self.leaves):
            return output_builder(self.spec)
        template, positions, spec = list(self.leaves), self.positions, self.spec

        def build(tensors: Sequence[torch.Tensor]) -> Any:
            leaves = template.copy()
            for i, t in zip(positions, tensors, strict=True):
                leaves[i] = t
            return tree_unflatten(leaves, spec)

        return build

    def difference(self, other: OutputTree) -> str | None:
        """How ``other`` (another call's outputs) differs in structure or constants, or None."""
        if self.spec != other.spec or self.positions != other.positions:
            return f"the output structure differs: {self.spec} then {other.spec}"
        for (i, a), (_, b) in zip(self.constants, other.constants, strict=True):
            if not _same(a, b):
                return f"output leaf {i} is {a!r} at one call and {b!r} at another"
        return None


def split_outputs(outputs: Any, strict: bool = True) -> tuple[list[torch.Tensor], OutputTree]:
    """The tensors of a forward's output tree, and the rest of it; raises for an object leaf unless
    not ``strict`` (an eager reference to compare with: an object then differs from any leaf but itself)."""
    flat, spec = tree_flatten(outputs)
    positions = tuple(i for i, x in enumerate(flat) if isinstance(x, torch.Tensor))
    if strict and len(positions) != len(flat):
        found = objects(outputs)
        if found:
            raise ReplayError(f"forward returned {found[0]}")
    tensors = [flat[i] for i in positions]
    leaves = [None if isinstance(x, torch.Tensor) else x for x in flat]
    return tensors, OutputTree(spec, leaves, positions)


def objects(outputs: Any) -> list[str]:
    """Each leaf a replay cannot rebuild, where it sits and what to change: ``"a DynamicCache at
    ['past_key_values'], which a replay cannot rebuild: pass use_cache=False ..."``."""
    flat, _ = tree_flatten(outputs)
    if all(isinstance(x, (torch.Tensor, CONSTANT_TYPES)) for x in flat):
        return []
    try:  # names where it sits, for a registered type that says how
        named = [
            (keystr(path) or "the output", leaf)
            for path, leaf in tree_flatten_with_path(outputs)[0]
        ]
    except ValueError:  # registered without flatten_with_keys_fn: its position
        named = [(f"output leaf {i}", leaf) for i, leaf in enumerate(flat)]
    return [
        f"a {type(leaf).__name__} at {where}, which a replay cannot rebuild: {_hint(leaf)}"
        for where, leaf in named
        if not isinstance(leaf, (torch.Tensor, CONSTANT_TYPES))
    ]


def output_builder(spec: TreeSpec) -> Callable[[Sequence[torch.Tensor]], Any]:
    """A fast inverse of flattening a tree of tensors, for the common shapes (tensor, tuple, flat dict)."""
    children = spec.children() if hasattr(spec, "children") else spec.children_specs
    if isinstance(spec, LeafSpec) or spec.is_leaf():
        return lambda outs: outs[0]
    if all(c.is_leaf() for c in children):
        if spec.type is tuple:
            return tuple
        if spec.type is dict:
            keys = tuple(spec.context)
            return lambda outs: dict(zip(keys, outs, strict=True))
    return lambda outs: tree_unflatten(list(outs), spec)
