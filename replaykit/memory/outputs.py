"""What a forward returns, split into what a replay recomputes and what it rebuilds.

A recording replays tensors. The rest of what a forward returns is rebuilt around the
replayed tensors from the recording: the tree's structure (tuples, lists, dicts, and any
type registered with torch's pytree, such as transformers' ``ModelOutput`` subclasses,
which come back as their own class) and its constant leaves (``None``, numbers, strings,
dtypes, ``torch.Size``). A constant is a host value the forward computed, frozen with the
recording like every other host value it read: the guards key what it may depend on, the
recording's own call and the probe must agree on it (else the signature runs eagerly,
``output_constant``), and the first replay's verification and ``check_every`` compare it
with eager's.

An object leaf (a ``DynamicCache`` holding the call's keys and values, an instance of a
plain class) is rebuilt too, as a new instance of its class per call, its attributes
(``__dict__``, walked like the tree: containers, constants, classes, tensors, further such
objects) filled with the replayed tensors: a cache is a pure function of the tensors the
recording replays and the constants it froze, which the checks above compare like any
other. What such a walk cannot reproduce exactly (an object keeping state outside its
``__dict__`` (``__slots__``), its own ``__new__``, a module, a function, a stream, an
object reached twice or from itself) runs its signature eagerly (``output_object``), with
the reason naming what it is, where it sits and what to change.
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


def _own_state(cls: type) -> bool:
    """Whether an instance's whole state is its ``__dict__`` and a bare ``__new__`` makes one."""
    if cls.__new__ is not object.__new__:
        return False
    slots = (vars(base).get("__slots__", ()) for base in cls.__mro__[:-1])
    return all(set([s] if isinstance(s, str) else s) <= {"__dict__", "__weakref__"} for s in slots)


def _attribute(path: tuple) -> str:
    """``.layers[0]`` for the pytree path of an attribute (``['layers'][0]``)."""
    text = keystr(path)
    name, bracket, rest = text[2:].partition("']")
    return f".{name}{rest}" if text.startswith("['") and bracket else text


def _unrebuildable(obj: object, seen: set[int]) -> str | None:
    """Why the object leaf ``obj`` cannot be rebuilt from its attributes (what, and where in it), or None."""
    cls = type(obj)
    if isinstance(obj, torch.nn.Module) or callable(obj) or not hasattr(obj, "__dict__"):
        return f"a {cls.__name__}"
    if not _own_state(cls):
        return f"a {cls.__name__} (state outside its __dict__)"
    if id(obj) in seen:
        return f"a {cls.__name__} reached twice"
    seen.add(id(obj))
    for path, leaf in tree_flatten_with_path(vars(obj))[0]:
        if isinstance(leaf, (torch.Tensor, *CONSTANT_TYPES, type)):
            continue
        why = _unrebuildable(leaf, seen)
        if why is not None:
            what, _, inner = why.partition(" at ")
            return f"{what} at {_attribute(path)}{inner}"
    return None


class ObjectLeaf:
    """An object among the outputs: its class and the tree of its attributes."""

    __slots__ = ("cls", "count", "tree")

    def __init__(self, cls: type, tree: OutputTree) -> None:
        self.cls = cls
        self.tree = tree
        self.count = tree.count

    def rebuild(self, tensors: Sequence[torch.Tensor]) -> object:
        obj = object.__new__(self.cls)
        obj.__dict__.update(self.tree.rebuild(tensors))
        return obj

    def difference(self, other: ObjectLeaf) -> str | None:
        if self.cls is not other.cls:
            return f"an output object is a {self.cls.__name__} at one call and a {other.cls.__name__} at another"
        return self.tree.difference(other.tree)


class OutputTree:
    """The structure and constant leaves of one forward's outputs; the tensors' slots among the
    leaves, and the objects rebuilt around some of them."""

    __slots__ = ("count", "leaves", "objects", "positions", "spec")

    def __init__(
        self,
        spec: TreeSpec,
        leaves: list[Any],
        positions: tuple[int, ...],
        objects: dict[int, ObjectLeaf] | None = None,
    ) -> None:
        self.spec = spec
        self.leaves = leaves  # the constants in place, None where a tensor or an object goes
        self.positions = positions  # where the tensors go, in flat order
        self.objects = objects or {}  # where objects go, each taking its tensors in flat order
        self.count = len(positions) + sum(o.count for o in self.objects.values())

    @property
    def constants(self) -> list[tuple[int, Any]]:
        slots = {*self.positions, *self.objects}
        return [(i, v) for i, v in enumerate(self.leaves) if i not in slots]

    def rebuild(self, tensors: Sequence[torch.Tensor]) -> Any:
        """The forward's output tree with ``tensors`` in the tensors' places."""
        return self.builder()(tensors)

    def builder(self) -> Callable[[Sequence[torch.Tensor]], Any]:
        """A fast ``rebuild`` for the replay path: made once per recording."""
        if self.objects:
            return self._build_with_objects
        if len(self.positions) == len(self.leaves):
            return output_builder(self.spec)
        template, positions, spec = list(self.leaves), self.positions, self.spec

        def build(tensors: Sequence[torch.Tensor]) -> Any:
            leaves = template.copy()
            for i, t in zip(positions, tensors, strict=True):
                leaves[i] = t
            return tree_unflatten(leaves, spec)

        return build

    def _build_with_objects(self, tensors: Sequence[torch.Tensor]) -> Any:
        leaves = list(self.leaves)
        slots, objects, at = set(self.positions), self.objects, 0
        for i in range(len(leaves)):
            if i in slots:
                leaves[i] = tensors[at]
                at += 1
            elif i in objects:
                obj = objects[i]
                leaves[i] = obj.rebuild(tensors[at : at + obj.count])
                at += obj.count
        return tree_unflatten(leaves, self.spec)

    def difference(self, other: OutputTree) -> str | None:
        """How ``other`` (another call's outputs) differs in structure or constants, or None."""
        if (
            self.spec != other.spec
            or self.positions != other.positions
            or self.objects.keys() != other.objects.keys()
        ):
            return f"the output structure differs: {self.spec} then {other.spec}"
        for i, obj in self.objects.items():
            difference = obj.difference(other.objects[i])
            if difference is not None:
                return difference
        for (i, a), (_, b) in zip(self.constants, other.constants, strict=True):
            if not _same(a, b):
                return f"output leaf {i} is {a!r} at one call and {b!r} at another"
        return None


def split_outputs(outputs: Any, strict: bool = True) -> tuple[list[torch.Tensor], OutputTree]:
    """The tensors of a forward's output tree (an object's among them, in place), and the rest of
    it; raises for an object that cannot be rebuilt unless not ``strict`` (an eager reference to
    compare with: such an object then differs from any leaf but itself)."""
    if strict:
        found = objects(outputs)
        if found:
            raise ReplayError(f"forward returned {found[0]}")
    return _split(outputs, strict)


def _split(outputs: Any, strict: bool) -> tuple[list[torch.Tensor], OutputTree]:
    flat, spec = tree_flatten(outputs)
    tensors: list[torch.Tensor] = []
    positions: list[int] = []
    leaves: list[Any] = []
    found: dict[int, ObjectLeaf] = {}
    for i, x in enumerate(flat):
        if isinstance(x, torch.Tensor):
            positions.append(i)
            tensors.append(x)
            leaves.append(None)
        elif isinstance(x, (*CONSTANT_TYPES, type)) or (
            not strict and _unrebuildable(x, set()) is not None
        ):
            leaves.append(x)
        else:
            inner, tree = _split(vars(x), strict)
            found[i] = ObjectLeaf(type(x), tree)
            tensors += inner
            leaves.append(None)
    return tensors, OutputTree(spec, leaves, tuple(positions), found)


def objects(outputs: Any) -> list[str]:
    """Each leaf a replay cannot rebuild, where it sits and what to change: ``"a Stream at
    ['past_key_values'] .prefetch_stream, which a replay cannot rebuild: pass use_cache=False ..."``."""
    flat, _ = tree_flatten(outputs)
    if all(isinstance(x, (torch.Tensor, CONSTANT_TYPES, type)) for x in flat):
        return []
    try:  # names where it sits, for a registered type that says how
        named = [
            (keystr(path) or "the output", leaf)
            for path, leaf in tree_flatten_with_path(outputs)[0]
        ]
    except ValueError:  # registered without flatten_with_keys_fn: its position
        named = [(f"output leaf {i}", leaf) for i, leaf in enumerate(flat)]
    found, seen = [], set()  # an object reached from two places would come back as two
    for where, leaf in named:
        if isinstance(leaf, (torch.Tensor, CONSTANT_TYPES, type)):
            continue
        why = _unrebuildable(leaf, seen)
        if why is not None:
            what, _, inner = why.partition(" at ")
            found.append(f"{what} at {where}{inner}, which a replay cannot rebuild: {_hint(leaf)}")
    return found


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
