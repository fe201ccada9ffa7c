"""What must match for a replay to be valid, computed once per call.

A hashable key: the arguments' structure, each tensor's shape, dtype, strides, offset, device and
``requires_grad``, which arguments are the same tensor (``q is k`` takes other paths), the
non-tensor arguments by type and value (floats by their bits), and the autocast state. An object
argument routes eager; grad mode and the training flag are routes of their own.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum
from types import BuiltinFunctionType, FunctionType
from typing import Any

import torch
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten


class CallArgs:
    """One call's arguments split into tensors and a structure to rebuild them from. A slotted
    class, not a frozen dataclass: one is made per call, and a frozen dataclass's ``__init__`` costs
    four ``object.__setattr__`` calls. Not to be modified."""

    __slots__ = ("leaves", "spec", "tensor_slots", "tensors")

    def __init__(
        self,
        tensors: list[torch.Tensor],
        leaves: list[Any],
        spec: TreeSpec | None,
        tensor_slots: tuple[int, ...],
    ) -> None:
        self.tensors = tensors
        self.leaves = leaves
        self.spec = spec  # None: positional tensors only (the fast path)
        self.tensor_slots = tensor_slots

    def rebuild(self, tensors: list[torch.Tensor] | tuple[torch.Tensor, ...]) -> tuple[tuple, dict]:
        """The (args, kwargs) of this call with its tensors replaced by ``tensors``."""
        if self.spec is None:
            return tuple(tensors), {}
        leaves = list(self.leaves)
        for slot, t in zip(self.tensor_slots, tensors, strict=True):
            leaves[slot] = t
        args, kwargs = tree_unflatten(leaves, self.spec)
        return args, kwargs


def arguments_written(
    call: CallArgs, args: tuple, kwargs: dict, tensors: Sequence[torch.Tensor]
) -> bool:
    """Whether code wrote into the containers of the arguments it was called with (``(args,
    kwargs)``, rebuilt from ``call`` around ``tensors``): a list appended to, a dict filled (a
    ``sink`` for features, an ``out`` dict for the loss). A replay runs no Python: the caller's
    container would stay as it was, so such a call is eager's alone."""
    if call.spec is None:
        return False
    leaves, spec = tree_flatten((args, kwargs))
    if spec != call.spec:
        return True
    expected = list(call.leaves)
    for slot, t in zip(call.tensor_slots, tensors, strict=True):
        expected[slot] = t
    return not all(a is b for a, b in zip(leaves, expected, strict=True))


class UnhashableArgument(TypeError):
    """A non-tensor argument that cannot be part of a signature; ``reason`` is the eager route."""

    def __init__(self, message: str, reason: str = "unhashable_argument") -> None:
        super().__init__(message)
        self.reason = reason


#: plain values keyed by value (a float by its bits, beside them): here and in the module guard's keys
PLAIN_VALUES = (
    type(None),
    bool,
    int,
    str,
    bytes,
    torch.dtype,
    torch.device,
    torch.layout,
    torch.memory_format,
    Enum,
)
_BY_IDENTITY = (FunctionType, BuiltinFunctionType, type)


def _tensor_key(t: torch.Tensor) -> tuple:
    stride = t.stride()
    if 0 in stride:  # broadcast, or a sparse COO tensor (its strides read as zeros): look closer
        _dense_only((t,))
    return (
        t.shape,
        stride,
        t.storage_offset(),
        t.dtype,
        t.device,
        t.requires_grad,
    )  # a Size is a tuple


def _leaf_key(x: Any) -> tuple:
    if isinstance(x, float):
        return (float, x.hex())
    if isinstance(x, PLAIN_VALUES):
        return (type(x), x)
    if isinstance(x, complex):
        return (complex, x.real.hex(), x.imag.hex())
    if isinstance(x, _BY_IDENTITY):
        return ("id", id(x))
    try:
        hash(x)
    except TypeError as exc:
        raise UnhashableArgument(f"argument of type {type(x).__name__} is not hashable") from exc
    raise UnhashableArgument(
        f"argument of type {type(x).__name__} is an object whose attributes a recording would freeze",
        "object_argument",
    )


def _tagged(tensors: list[torch.Tensor]) -> tuple:
    """Python attributes set on an input tensor (``x.weight = 0.5``, a batch's tag) that code
    may read: keyed by value as a plain argument is (a graph would freeze them). Usually none:
    one ``__dict__`` look per tensor."""
    return tuple(
        (i, tuple((k, _leaf_key(v)) for k, v in t.__dict__.items()))
        for i, t in enumerate(tensors)
        if t.__dict__
    )


def aliasing(tensors: list[torch.Tensor]) -> tuple[int, ...]:
    """For each tensor argument, the index of the first argument that is the same tensor."""
    if len(tensors) < 2:
        return ()
    first: dict[int, int] = {}
    return tuple(first.setdefault(id(t), i) for i, t in enumerate(tensors))


def autocast_key(device_type: str) -> tuple[bool, torch.dtype | None]:
    """Autocast's state for ``device_type``: enabled, and its dtype when enabled."""
    if torch.is_autocast_enabled(device_type):
        return True, torch.get_autocast_dtype(device_type)
    return False, None


# isinstance(x, torch.Tensor) as one callable, for map()
_is_tensor = torch.Tensor.__instancecheck__


def split_call(args: tuple, kwargs: dict) -> CallArgs:
    """Flatten a call's arguments into tensors and the rest."""
    if not kwargs and all(map(_is_tensor, args)):
        tensors = list(args)
        return CallArgs(tensors, tensors, None, tuple(range(len(args))))
    leaves, spec = tree_flatten((args, kwargs))
    slots = tuple(i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor))
    return CallArgs([leaves[i] for i in slots], leaves, spec, slots)


#: What each part of :func:`signature` keys, as a new recording's reason names it (route.py).
SIGNATURE_PARTS = ("arguments", "shapes", "aliasing", "argument_values", "autocast")


def signature(
    call: CallArgs, device_type: str, exact_arguments: bool = True, tensor_key: Any = None
) -> tuple:
    """The hashable key under which a recording of this call is kept. ``exact_arguments=False``
    (unsafe, diagnosis only) keys non-tensor arguments by ``==`` and ignores aliasing, as plain
    CUDA-graph wrappers do. ``tensor_key`` replaces the per-tensor key (the whole step keys storage
    offsets by alignment: :func:`replaykit.memory.layout.aligned_key`)."""
    try:
        tensors = tuple(map(tensor_key or _tensor_key, call.tensors))
    except RuntimeError:  # a sparse input has no strides: said once here, not checked per tensor
        _dense_only(call.tensors)
        raise
    aliases = aliasing(call.tensors) if exact_arguments else ()
    tagged = _tagged(call.tensors) if exact_arguments else ()
    if call.spec is None:  # the same five parts (SIGNATURE_PARTS)
        return (len(tensors), tensors, aliases, tagged, autocast_key(device_type))
    slots = set(call.tensor_slots)
    leaf = _leaf_key if exact_arguments else _loose_key
    constants = (*(leaf(x) for i, x in enumerate(call.leaves) if i not in slots), *tagged)
    return (
        str(call.spec),
        tensors,
        aliases,
        constants,
        autocast_key(device_type),
    )


_SPARSE = (torch.sparse_coo, torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc)


def _dense_only(tensors: Sequence[torch.Tensor]) -> None:
    """Route eager for an input that is not a dense (strided) tensor: a graph's static inputs are
    dense buffers of fixed size, and a sparse tensor's number of values is its own."""
    for t in tensors:
        if t.layout != torch.strided:
            reason = "sparse_input" if t.layout in _SPARSE else "non_strided_input"
            raise UnhashableArgument(
                f"an input of layout {t.layout} (a graph's static inputs are dense buffers of fixed "
                "size): pass it dense, or hold a fixed one as a buffer of the module",
                reason,
            )


def _loose_key(x: Any) -> tuple:
    try:
        hash(x)
    except TypeError as exc:
        raise UnhashableArgument(f"argument of type {type(x).__name__} is not hashable") from exc
    return (type(x), x)
