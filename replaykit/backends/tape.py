"""A forward's aten call sequence, recorded once and replayed without the module's Python.

What a CUDA graph freezes, on any device: recording runs the forward under a dispatch mode that
appends every aten call; a tensor argument becomes a *slot* (a static input, a stand-in
parameter, an earlier op's result), any other tensor is kept by reference (a graph reads a fixed
address) and everything else by value, so a changed ``dropout.p`` or Python float is not seen by
a replay, exactly as on a GPU. Replay calls the same ops with the same arguments: eager's values.

Saved tensors unpack to the latest replay's slot values (one set of activations, as a graph
has; no version check, as under ``cuda.py``'s hooks). A result whose storage is still alive
after recording (an output, a stash on the module, a ``ctx`` attribute) is *static*: each replay
writes into that tensor; the rest are fresh each replay. Refused as a capture would fail or
freeze them: host reads of device data and data-dependent shapes (``.item()``, ``nonzero``,
masks; ``tolist()`` through a ``TorchFunctionMode``), random ops on a private generator not
registered with the recording (a registered one is drawn from anew at each replay, as a CUDA
graph's ``register_generator_state`` does), and a generator moved past the tape's events (a
``Generator.manual_seed`` in the step: a capture refuses it, a replay would not repeat it).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.random
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from ..errors import ReplayError
from ..guards.switches import Frozen
from ..guards.switches import key as switches_key
from ..verify.dispatch import WatchingMode, caller, written
from .collector import collector_paused
from .seeding import WHY_REFUSED

_aten = torch.ops.aten
_MASKED_INDEX = {
    _aten.index.Tensor,
    _aten.index_put.default,
    _aten.index_put_.default,
    _aten._index_put_impl_.default,
}
_DATA_DEPENDENT = (torch.Tag.data_dependent_output, torch.Tag.dynamic_output_shape)
_EMPTIES = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"})
#: ops that read only an argument's sizes, dtype and device
_SHAPE_ONLY = _EMPTIES | {"new_zeros", "new_ones", "new_full", "zeros_like", "ones_like"}
_SHAPE_ONLY |= {"full_like", "rand_like", "randn_like", "randint_like", "resize_", "set_"}


def _storage_of(t: torch.Tensor) -> StorageWeakRef:
    """The storage itself (hashed by its object, not its data's address: ``resize_`` moves the
    data, and a freed block's address is given to later results)."""
    return StorageWeakRef(t.untyped_storage())


def _set_version_counters(tensors: Sequence[torch.Tensor], versions: Sequence[int]) -> None:
    """Put version counters back: torch 2.5+ sets a list in one call, torch 2.4 one tensor a call."""
    if _BATCHED_VERSIONS:
        torch._C._autograd._unsafe_set_version_counter(tensors, versions)
    else:
        for tensor, version in zip(tensors, versions, strict=True):
            torch._C._autograd._unsafe_set_version_counter(tensor, version)


try:  # probed once: the signature changed in torch 2.5
    torch._C._autograd._unsafe_set_version_counter((), ())
    _BATCHED_VERSIONS = True
except TypeError:
    _BATCHED_VERSIONS = False


class _Slot:
    """A tensor argument: the value of slot ``i`` at replay time."""

    __slots__ = ("i",)

    def __init__(self, i: int) -> None:
        self.i = i


class _Seq:
    """A list or tuple argument holding at least one slot."""

    __slots__ = ("items", "kind")

    def __init__(self, kind: type, items: list) -> None:
        self.kind = kind
        self.items = items


def _resolve(a: Any, table: list) -> Any:
    if type(a) is _Slot:
        return table[a.i]
    return a.kind(_resolve(x, table) if type(x) in (_Slot, _Seq) else x for x in a.items)


class _Op:
    """One taped aten call and where its results go."""

    __slots__ = (
        "args",
        "dyn_args",
        "dyn_kwargs",
        "frees",
        "func",
        "grad",
        "kwargs",
        "out",
        "outs",
        "statics",
    )

    def __init__(self, func: Any, args: tuple, kwargs: dict) -> None:
        self.func = func
        self.grad = torch.is_grad_enabled()  # some kernels read it (an RNN's training workspace)
        self.args = args
        self.kwargs = kwargs
        self.dyn_args = tuple(i for i, a in enumerate(args) if type(a) in (_Slot, _Seq))
        self.dyn_kwargs = tuple(k for k, a in kwargs.items() if type(a) in (_Slot, _Seq))
        self.out: int | None = None  # the slot of a single tensor result
        self.outs: tuple[int | None, ...] | None = None  # slots of a tuple/list result's leaves
        self.statics: Any = None  # static tensor(s) the result(s) are written into, or None
        self.frees: tuple[int, ...] = ()  # scratch slots last read here


#: the op namespaces of torch.distributed's collectives (eager ProcessGroup ops, functional ones)
_COLLECTIVES = frozenset({"c10d", "_c10d_functional", "c10d_functional", "_dtensor"})


def untapeable(
    func: Any, args: tuple, kwargs: dict, generators: Sequence[torch.Generator] = ()
) -> str | None:
    """Why a CUDA graph capture could not replay this aten call faithfully, or None.
    ``generators``: private generators registered with the recording (a replay draws from them)."""
    name = str(func)
    if func in _MASKED_INDEX:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        if any(
            isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8)
            for t in indices or ()
        ):
            return f"{name} with a boolean mask has a data-dependent output shape (the host must read device data)"
        return None
    if getattr(func, "namespace", "") in _COLLECTIVES:
        return (
            f"{name} is a collective (torch.distributed) inside the recorded code: a replay would "
            "issue it again outside the process group's pairing and never wait for it; reduce "
            "outside the step (DDP's own gradient all-reduce runs between the step's graphs)"
        )
    if func is _aten._local_scalar_dense.default:
        return (
            f"{name} reads a tensor's value on the host (.item(), float(t), a tensor in an if)"
            f"{caller()}; a graph would freeze the value read at capture"
        )
    tags = func.tags
    if any(t in tags for t in _DATA_DEPENDENT):
        return f"{name} has a data-dependent output (the host must read device data){caller()}"
    if torch.Tag.nondeterministic_seeded in tags:
        for v in (*args, *kwargs.values()):
            if isinstance(v, torch.Generator) and not _is_default(v, generators):
                return (
                    f"{name} draws from a private torch.Generator; a graph would replay its first numbers "
                    "for ever (a replay advances the default generator and those registered with it)"
                )
    return None


def _is_default(g: torch.Generator, registered: Sequence[torch.Generator] = ()) -> bool:
    """Whether ``g`` is its device's default generator, or one of ``registered`` (a graph advances
    those too)."""
    if g.device.type == "cpu":
        default = torch.default_generator
    elif g.device.type == "cuda":
        default = torch.cuda.default_generators[
            g.device.index if g.device.index is not None else torch.cuda.current_device()
        ]
    else:
        return False
    return any(shares_state(g, other) for other in (default, *registered))


def shares_state(g: torch.Generator, other: torch.Generator) -> bool:
    """Whether ``g`` draws from ``other``'s state. The dispatcher hands a mode a new Python wrapper,
    so identity cannot tell: reseed ``other`` for a moment and see whether ``g``'s state moves."""
    if g.device != other.device:
        return False
    saved, seed = other.get_state(), other.initial_seed()
    try:
        before = g.get_state()
        other.manual_seed(seed ^ 0x5DEECE66D)
        return not torch.equal(before, g.get_state())
    finally:
        other.set_state(saved)


_HOST_READS = {torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.__array__}


_PAD_PACKED = torch._C._VariableFunctions._pad_packed_sequence


class _HostReads(TorchFunctionMode):
    """Refuses reads of tensor data that bypass the dispatcher (on a CPU they would be frozen
    silently); ``_pad_packed_sequence``'s lengths, which its C++ writes into an empty tensor past the
    dispatcher, are made by aten calls the tape records instead (the same values)."""

    def __torch_function__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        if func in _HOST_READS:
            raise ReplayError(
                f"Tensor.{func.__name__}() reads a tensor's values on the host; a graph would freeze the value read at capture"
            )
        if func is _PAD_PACKED:
            padded, _ = func(*args, **(kwargs or {}))
            batch_sizes, batch_first = args[1], args[2]
            rows = torch.arange(padded.shape[0 if batch_first else 1], device=batch_sizes.device)
            # lengths[b]: the steps whose batch holds row b (the C++ loop's count)
            return padded, (batch_sizes.unsqueeze(0) > rows.unsqueeze(1)).sum(1)
        return func(*args, **(kwargs or {}))


class _TapeMode(WatchingMode):
    """Appends each aten call to the tape; refuses what a capture could not replay."""

    def __init__(
        self, tape: Tape, generators: Sequence[torch.Generator], rng: _GeneratorEvents
    ) -> None:
        super().__init__()
        self.tape = tape
        self.generators = generators
        self.rng = rng
        self.unfilled: set[StorageWeakRef] = set()  # empty tensors' storages no op has written

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        why = untapeable(func, args, kwargs, self.generators)
        if why is not None:
            raise ReplayError(why)
        if torch.Tag.nondeterministic_seeded in func.tags:
            self.rng.check(lambda: f"{func}{caller()}")  # a draw: where the tape left them
            out = self.run(func, args, kwargs)
            self.rng.moved()
        else:
            out = self.run(func, args, kwargs)
        self._unfilled_reads(func, args, kwargs, out)
        self.tape._append(func, args, kwargs, out)
        return out

    def _unfilled_reads(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        """An empty tensor's memory read before any taped op wrote it was filled by C++ past the
        dispatcher (a composite op's pointer loop): a replay makes the tensor anew and reads it
        unfilled, so the recording is refused. Views and shape-only factories read no data."""
        name = func._schema.name.split("::")[-1] if hasattr(func, "_schema") else ""
        if name in _EMPTIES:
            if isinstance(out, torch.Tensor) and out.numel():
                self.unfilled.add(_storage_of(out))
            return
        if not self.unfilled:
            return
        wrote = {_storage_of(t) for t in written(func, args, kwargs)}
        if not getattr(func, "is_view", False) and name not in _SHAPE_ONLY:
            for t in tree_leaves((args, kwargs)):
                if isinstance(t, torch.Tensor) and t.numel():
                    s = _storage_of(t)
                    if s in self.unfilled and s not in wrote and not s.expired():
                        raise ReplayError(
                            f"{func} reads memory an empty tensor was given by code past the "
                            f"dispatcher (a composite op's C++ loop){caller()}; a replay would read "
                            "it unfilled"
                        )
        self.unfilled -= wrote
        self.unfilled = {
            s for s in self.unfilled if not s.expired()
        }  # freed: a later one may reuse


class Tape:
    """Slots ``0..n_fixed-1`` are the fixed tensors; the rest are results of taped ops. Use: ``with
    tape.recording(): outs = forward()``; then ``tape.seal(outs)`` once nothing recorded needs the
    trace's scratch values any more (a backward through the recorded graph may run before it); then
    ``replay()`` as often as wanted."""

    def __init__(self, fixed: Sequence[torch.Tensor]) -> None:
        self._fixed = list(fixed)
        self._ops: list[_Op] = []
        self._table: list[torch.Tensor | None] = list(fixed)  # current value of every slot
        self._by_id: dict[int, int] | None = {id(t): i for i, t in enumerate(fixed)}
        self._saved: set[int] = set()
        self._consts: list[torch.Tensor] = []  # keeps constants' ids unique while recording
        self._statics: list[torch.Tensor] = []
        self._versions: tuple[int, ...] = ()
        self._device_types: tuple[str, ...] = ()
        self._rng: _GeneratorEvents | None = None  # while recording: where the generators are
        #: the process-wide switches recorded under: a replay re-dispatches each op, and
        #: ``aten.convolution`` would choose oneDNN or the native kernel anew; a graph does not
        self.switches: tuple = switches_key()

    # ----------------------------------------------------------------- recording
    def recording(self, generators: Sequence[torch.Generator] = ()) -> _Taping:
        """The context that records: dispatch mode plus saved-tensor hooks. ``generators``: private
        generators registered with the recording: its ops draw from them anew at each replay."""
        self.switches = switches_key()
        return _Taping(self, generators)

    def _encode(self, a: Any) -> Any:
        if isinstance(a, torch.Tensor):
            i = self._by_id.get(id(a))  # type: ignore[union-attr]
            if i is not None:
                return _Slot(i)
            self._consts.append(a)  # by reference: a graph reads a fixed address
            return a
        if isinstance(a, (list, tuple)):
            items = [self._encode(x) for x in a]
            if any(type(x) in (_Slot, _Seq) for x in items):
                return _Seq(type(a), items)
            return type(a)(items)
        return a  # by value: this is the freezing

    def _slot_for(self, t: Any) -> int | None:
        if not isinstance(t, torch.Tensor):
            return None
        assert self._by_id is not None
        i = self._by_id.get(id(t))
        # a new result (or an in-place op on a constant: its later reads go through this slot)
        if i is None:
            i = len(self._table)
            self._table.append(t)
            self._by_id[id(t)] = i
        return i

    def _append(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        op = _Op(
            func,
            tuple(self._encode(a) for a in args),
            {k: self._encode(v) for k, v in kwargs.items()},
        )
        if isinstance(out, torch.Tensor):
            op.out = self._slot_for(out)
        elif out is not None:
            op.outs = tuple(self._slot_for(t) for t in tree_leaves(out))
        self._ops.append(op)

    def add_work(self, work: Callable[[], None]) -> None:
        """Host work a replay runs at this point of the sequence (:mod:`.gaps`): the tensors it
        touches are read by reference, like any the tape did not produce."""
        self._ops.append(_Op(work, (), {}))
        if self._rng is not None:  # it ran now and runs at each replay: its draws are on the tape
            self._rng.moved()

    def pack(self, t: torch.Tensor) -> Any:
        """A saved tensor: its slot (read at unpack from the latest replay), or itself (a constant)."""
        i = None if self._by_id is None else self._by_id.get(id(t))
        if i is None:
            return t  # a constant, or an alias the tape never saw: its storage is static (see seal)
        self._saved.add(i)
        return i

    def unpack(self, packed: Any) -> torch.Tensor:
        if type(packed) is not int:
            return packed
        t = self._table[packed]
        if t is None:
            raise ReplayError(
                "replaykit: a backward read activations no forward replay has produced"
            )
        return t

    def seal(self, outputs: Sequence[torch.Tensor]) -> None:
        """End recording: find the static results, plan frees, drop the trace's scratch values. A
        result is static when its storage outlives the trace (``outputs`` included); such a tensor
        must keep its address, so each replay writes into it."""
        n_fixed = len(self._fixed)
        table, self._table = self._table, []
        self._by_id = None
        del outputs  # the caller holds them: they are static like anything else still alive
        refs = [
            (StorageWeakRef(t.untyped_storage()), weakref.ref(t), _geometry(t))
            for t in table[n_fixed:]
        ]
        kinds = {t.device.type for t in table}
        self._device_types = tuple(sorted((kinds - {"meta"}) | {"cpu"}))  # meta: no autocast
        del table
        self._consts = []
        # what is still alive now is held by the outputs, the tape's constants, the recorded
        # graph's saved constants, a module attribute, a ctx: a fixed address in a graph
        statics: list[torch.Tensor | None] = []
        for storage, ref, geometry in refs:
            t = ref()
            if t is None and not storage.expired():  # the object died, an alias keeps its memory
                t = _rebuild(storage, geometry)
            statics.append(t)
        del refs
        last_read: dict[int, int] = {}
        for k, op in enumerate(self._ops):
            for a in (*[op.args[i] for i in op.dyn_args], *[op.kwargs[n] for n in op.dyn_kwargs]):
                for s in _slots_in(a):
                    last_read[s] = k
        produced_at: dict[int, int] = {}
        for k, op in enumerate(self._ops):
            for s in (op.outs or ()) if op.out is None else (op.out,):
                if s is not None and s >= n_fixed:
                    produced_at.setdefault(s, k)
        frees: dict[int, list[int]] = {}
        for s, k in produced_at.items():
            if statics[s - n_fixed] is None and s not in self._saved:
                frees.setdefault(max(k, last_read.get(s, k)), []).append(s)
        for k, op in enumerate(self._ops):
            op.frees = tuple(frees.get(k, ()))
            if op.out is not None:
                op.statics = statics[op.out - n_fixed] if op.out >= n_fixed else None
            elif op.outs is not None:
                st = tuple(
                    None if s is None or s < n_fixed else statics[s - n_fixed] for s in op.outs
                )
                op.statics = st if any(x is not None for x in st) else None
        self._statics = [t for t in statics if t is not None]
        self._versions = tuple(t._version for t in self._statics)
        self._n = n_fixed + len(statics)
        self._table = [None] * self._n
        self._table[:n_fixed] = self._fixed
        for s, t in enumerate(statics, n_fixed):
            self._table[s] = t  # static results hold the trace's values until the first replay

    # ----------------------------------------------------------------- replay
    def replay(self) -> None:
        """Run the taped ops over the fixed tensors; static results are rewritten in place."""
        table: list[Any] = [None] * self._n
        table[: len(self._fixed)] = self._fixed
        # below autograd (a replay builds no graph), each op in the grad mode it was recorded in,
        # under the switches it was recorded under (the kernels a graph froze)
        with (
            Frozen(self.switches),
            torch._C._AutoDispatchBelowAutograd(),
            torch.enable_grad(),
            _no_autocast(self._device_types),
        ):
            mode = True
            for op in self._ops:
                if op.grad is not mode:
                    mode = op.grad
                    torch._C._set_grad_enabled(mode)
                args, kwargs = op.args, op.kwargs
                if op.dyn_args:
                    args = list(args)
                    for i in op.dyn_args:
                        args[i] = _resolve(args[i], table)
                if op.dyn_kwargs:
                    kwargs = dict(kwargs)
                    for n in op.dyn_kwargs:
                        kwargs[n] = _resolve(kwargs[n], table)
                out = op.func(*args, **kwargs)
                if op.out is not None:
                    static = op.statics
                    table[op.out] = out if static is None else _settle(static, out)
                elif op.outs is not None:
                    leaves = tree_leaves(out)
                    statics = op.statics or (None,) * len(leaves)
                    for s, static, t in zip(op.outs, statics, leaves, strict=True):
                        if s is not None:
                            table[s] = t if static is None else _settle(static, t)
                for s in op.frees:
                    table[s] = None
        if self._statics:  # a graph's replay bumps no version counter
            _set_version_counters(self._statics, self._versions)
        self._table = table  # the one set of activations: replaces the last replay's

    def free(self) -> None:
        self._ops = []
        self._table = []
        self._statics = []
        self._fixed = []


def _settle(static: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """Put a replayed result into its static tensor (nothing to do when it is already there)."""
    if value is not static and value.data_ptr() != static.data_ptr():
        static.copy_(value)
    return static


def _geometry(t: torch.Tensor) -> tuple:
    return (t.dtype, t.device, t.size(), t.stride(), t.storage_offset())


def _rebuild(storage: StorageWeakRef, geometry: tuple) -> torch.Tensor:
    """A tensor on a live storage known only by a weak reference (cuda.py's ``_Saved`` does the same by address)."""
    dtype, device, size, stride, offset = geometry
    strong = torch.UntypedStorage._new_with_weak_ptr(storage.cdata)
    return torch.empty(0, dtype=dtype, device=device).set_(strong, offset, size, stride)


def _slots_in(a: Any) -> list[int]:
    if type(a) is _Slot:
        return [a.i]
    out: list[int] = []
    for x in a.items:
        if type(x) in (_Slot, _Seq):
            out += _slots_in(x)
    return out


class _no_autocast:
    """Taped ops are below autocast already (its casts are on the tape): replay them without it."""

    __slots__ = ("ctxs", "device_types")

    def __init__(self, device_types: tuple[str, ...]) -> None:
        self.device_types = device_types
        self.ctxs: list = []

    def __enter__(self) -> None:
        self.ctxs = [
            torch.autocast(d, enabled=False)
            for d in self.device_types
            if torch.is_autocast_enabled(d)
        ]
        for c in self.ctxs:
            c.__enter__()

    def __exit__(self, *exc: object) -> None:
        for c in reversed(self.ctxs):
            c.__exit__(*exc)


def _capturing() -> bool:
    return True


class _ReportCapturing:
    """While the tape records, ``torch.cuda.is_current_stream_capturing()`` answers True, as it does
    inside a CUDA capture: code that branches on it (transformers' ``is_tracing``, the optimizers'
    capture health check) takes on the CPU the branch a recording takes on a GPU."""

    def __enter__(self) -> None:
        self._original = torch.cuda.is_current_stream_capturing
        torch.cuda.is_current_stream_capturing = _capturing

    def __exit__(self, *exc: object) -> None:
        torch.cuda.is_current_stream_capturing = self._original


def _get_cpu_state() -> torch.Tensor:
    return torch.default_generator.get_state()


def _set_cpu_state(state: torch.Tensor) -> None:
    torch.default_generator.set_state(state)


_STATE_NAMES = ("get_rng_state", "set_rng_state")  # torch's and torch.random's: taped


class _GeneratorEvents:
    """The generators while the tape records. ``torch.get_rng_state``/``set_rng_state`` go on the
    tape: checkpoint's recompute sets back the state its forward read, and a replay reads and sets
    it as eager does (a CUDA graph through its graph-safe state). A generator moved otherwise
    (``Generator.manual_seed``, ``.set_state``: found moved since the tape's last draw, read or set)
    fails the recording, as a reseed fails a CUDA capture; a replay would not repeat it."""

    def __init__(self, tape: Tape, generators: Sequence[torch.Generator] = ()) -> None:
        self.tape = tape
        self.watched = [(torch.default_generator, "torch's default generator")]
        if torch.cuda.is_initialized():  # a model on a GPU draws from these
            cuda = torch.cuda.default_generators
            self.watched += [(g, f"{g.device}'s default generator") for g in cuda]
        self.watched += [(g, "the module's torch.Generator") for g in generators]
        self.states: list[torch.Tensor] = []  # each generator's state after the tape's last event
        self._saved: list[tuple[Any, str, Any]] = []

    def __enter__(self) -> None:
        tape = self.tape

        def get_rng_state() -> torch.Tensor:
            self.check(lambda: f"torch.get_rng_state(){caller()}")  # the state read: eager's
            state = _get_cpu_state()
            tape._append(_get_cpu_state, (), {}, state)
            return state

        def set_rng_state(new_state: torch.Tensor) -> None:
            _set_cpu_state(new_state)
            tape._append(_set_cpu_state, (new_state,), {}, None)
            self.moved()

        self.moved()
        for module in (torch, torch.random):
            self._saved += [(module, n, getattr(module, n)) for n in _STATE_NAMES]
            module.get_rng_state, module.set_rng_state = get_rng_state, set_rng_state
        tape._rng = self

    def __exit__(self, *exc: object) -> None:
        self.tape._rng = None
        for module, name, original in reversed(self._saved):
            setattr(module, name, original)
        self._saved = []

    def moved(self) -> None:
        """The tape moved the generators (a draw, a set, gap work): their states now are its."""
        self.states = [g.get_state() for g, _ in self.watched]

    def check(self, where: Callable[[], str]) -> None:
        """Refuse when a generator is not where the tape's last event left it."""
        with torch._C.DisableTorchFunction(), torch._C._DisableTorchDispatch():  # no mode sees it
            pairs = zip(self.watched, self.states, strict=True)
            moved = [which for (g, which), s in pairs if not torch.equal(g.get_state(), s)]
        if moved:
            raise ReplayError(
                f"{moved[0]} was seeded or set inside the recorded code (Generator.manual_seed, "
                f".seed or .set_state; found before {where()}){WHY_REFUSED}"
            )


class _Taping:
    """``with tape.recording():`` the dispatch mode, the saved-tensor hooks, the capture report and the
    generators' events together."""

    def __init__(self, tape: Tape, generators: Sequence[torch.Generator] = ()) -> None:
        self.tape = tape
        self.hooks = torch.autograd.graph.saved_tensors_hooks(tape.pack, tape.unpack)
        self.generator = _GeneratorEvents(tape, generators)
        self.mode = _TapeMode(tape, generators, self.generator)
        self.host = _HostReads()
        self.report = _ReportCapturing()
        self.collector = collector_paused()

    def __enter__(self) -> Tape:
        self.collector.__enter__()
        self.hooks.__enter__()
        self.host.__enter__()
        self.report.__enter__()
        self.generator.__enter__()
        self.mode.__enter__()
        return self.tape

    def __exit__(self, *exc: object) -> None:
        try:
            self.mode.__exit__(*exc)
        finally:
            try:
                self.generator.__exit__(*exc)
                self.report.__exit__(*exc)
                self.host.__exit__(*exc)
            finally:
                try:
                    self.hooks.__exit__(*exc)
                finally:
                    self.collector.__exit__(*exc)
        if not exc or exc[0] is None:  # a generator moved after the tape's last event
            self.generator.check(lambda: "the end of the recorded code")


def record(
    forward: Callable[[], list[torch.Tensor]],
    fixed: Sequence[torch.Tensor],
    generators: Sequence[torch.Generator] = (),
) -> tuple[Tape, list[torch.Tensor]]:
    """Record ``forward`` (unsealed: the caller seals it once it needs no scratch value)."""
    tape = Tape(fixed)
    with tape.recording(generators):
        outs = forward()
    return tape, outs
