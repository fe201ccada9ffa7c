"""Host reads that depend only on a call's inputs: a guard that keys the recording, not a retirement.

``if mask.all():`` reads device data on the host; a graph would freeze the capture's answer and
a capture cannot even make the read. When the value is a function of the call's input tensors
alone (a padding mask's ``.all()``, a length), it is computed again for each batch before a
recording is chosen and keys it: padded and unpadded batches get one recording each.

:class:`Provenance` (a dispatch mode around the probe's eager pass and a capture) marks results
computed only from inputs and tensor-free factories (``arange``) *input-derived*, keeping the
aten program that made each; parameters, buffers, state, random ops and in-place writes are
*state*. A host read (``aten._local_scalar_dense``) of an input-derived tensor is answered from
this call's values (no sync inside a capture), or read and its program noted in an eager pass;
a read of state passes through to the backends' refusal. Reads inside C++ with no ``.item()``
(``pack_padded_sequence``'s lengths) count as reads of the whole tensor; so does a copy to the
GPU of an integer tensor computed on the host from inputs (the sort indices of an unsorted packed
batch), or back (their inverse, for the lengths): a capture refuses such copies from pageable
memory, so one to the GPU copies from a pinned snapshot that the recording keeps and one to the
host is answered from the key. An input's own memory is not read so: it is copied anew at each
replay (``backends/host_feeds.py``).

:class:`InputReads` keeps per key the programs and the variants recorded; a call evaluates its
key's programs (one sync for all) and picks the matching variant; a key with no reads pays one
dict lookup.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_leaves

from ..errors import ReplayError
from ..verify.dispatch import WatchingMode, written, written_positions

_READ = torch.ops.aten._local_scalar_dense.default
_TO_COPY = torch.ops.aten._to_copy.default
_PASS = object()  # Provenance._copy: not a copy it makes itself
#: In-place ops that fill an empty tensor with values of their arguments (no draw: a random fill,
#: ``bernoulli_``, is a draw a replay's evaluation would repeat, not a function of the inputs)
_FILLS = frozenset(
    {"scatter_", "index_copy_", "copy_", "fill_", "zero_", "index_put_", "index_fill_", "put_"}
    | {"masked_fill_", "masked_scatter_"}
)


class _Tag:
    """A marker inside a program (compared by identity: no argument value can be mistaken for it)."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


_IN = _Tag("input")  # a program's leaf: (_IN, position of the call's tensor)
_LIST = _Tag("list")  # a list argument (a schema may want a list, not a tuple)
_UNTRACKED = _Tag("untracked")
# a host draw's place in a program's node: (_DRAW, its order among the run's draws)
_DRAW = _Tag("draw")
_WHOLE = _Tag("whole")  # a program's third part: its tensor is read whole, by a kernel on the host
#: Kernels that read an integer tensor argument on the host inside C++ (no ``.item()`` the mode
#: could see), by the argument's position: the whole tensor is the value read. A packed sequence's
#: lengths decide its batch sizes, which the recurrent kernels then read the same way (unseen):
#: keying by the lengths keys those reads too.
_WHOLE_READS = {torch.ops.aten._pack_padded_sequence.default: 1}
#: Reads per recording key beyond which a step stops learning them (each one found costs a capture attempt).
MAX_READS = 32
_DATA_DEPENDENT = (torch.Tag.data_dependent_output, torch.Tag.dynamic_output_shape)


class NewInputRead(ReplayError):
    """A recording met a host read of input-derived data that its key has no value for."""

    def __init__(self, program: tuple) -> None:
        super().__init__(
            "the recorded code reads an input-derived value on the host that was not known before the recording"
        )
        self.program = program


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class Provenance(WatchingMode):
    """Follows which tensors are functions of the call's inputs alone, and answers their host reads.
    ``sources``: the call's input tensors (positions as in the call). ``answers``: a value per
    program known for this call. ``discover``: an eager pass (not capturing) may make an unknown
    read itself and note it; otherwise an unknown input-derived read raises :class:`NewInputRead`.
    After the run, ``reads`` lists ``(program, value)`` for each input-derived read, in order."""

    def __init__(
        self,
        sources: Sequence[torch.Tensor],
        answers: dict[tuple, Any] | None = None,
        discover: bool = False,
        draws: bool = False,
    ) -> None:
        super().__init__()
        self._sources = list(sources)
        self._answers = answers or {}
        self._discover = discover
        self._host_draws = draws
        self.reads: list[tuple[tuple, Any]] = []
        # pinned copies of input-derived host tensors a capture moved to the GPU (``_staged``): the
        # graph reads them at every replay, so the recording keeps them (not cleared on exit)
        self.staged: list[torch.Tensor] = []
        self.draws: list[tuple] = []  # host draws (``draws=True``), in the order the run made them
        self.escaped = False  # a host draw's value reached anything but input-derived computations
        self._nodes: dict[int, tuple] = {}
        self._keep: list[torch.Tensor] = []  # the ids above stay theirs while the mode runs
        self._storages: dict[int, int] = {}
        self._input_storages: set[int] = set()
        # storages of empty tensors made from input-derived arguments, unfilled: (program, numel)
        self._fresh: dict[int, tuple[tuple, int]] = {}

    def wrap(self, fn: Any) -> Any:
        """``fn`` run under this mode at each call (a backend calls its forward several times)."""

        def within(*args: Any, **kwargs: Any) -> Any:
            with self:
                return fn(*args, **kwargs)

        return within

    def __enter__(self) -> Provenance:
        self._nodes, self._keep, self._storages, self.reads = {}, [], {}, []
        self._input_storages = {_storage(t) for t in self._sources}
        self._fresh = {}
        self.draws, self.escaped, self._drawn = [], False, set()
        for i, t in enumerate(self._sources):
            self._track(t, (_IN, i))
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        self._nodes, self._keep, self._storages, self._drawn = {}, [], {}, set()
        self._fresh = {}

    def _track(self, t: torch.Tensor, node: tuple) -> None:
        self._nodes[id(t)] = node
        self._keep.append(t)
        s = _storage(t)
        self._storages[s] = self._storages.get(s, 0) + 1

    def _untrack_storage(self, storage: int) -> None:
        if storage not in self._storages:
            return
        for t in self._keep:
            if id(t) in self._nodes and _storage(t) == storage:
                del self._nodes[id(t)]
        del self._storages[storage]

    def _filled(self, func: Any, args: tuple, kwargs: dict, out: Any) -> bool:
        """An in-place op that fills a whole fresh tensor (``empty_like(p).scatter_(0, p,
        arange)``: ``invert_permutation``) from input-derived arguments: the tensor is
        input-derived after it, its program the op's (which makes the empty tensor anew when
        evaluated)."""
        targets = written(func, args, kwargs)
        # any write ends a tensor's freshness: a fill after another op's write (an ``out=``
        # result) would keep that op's values, which its program would not make
        mades = [self._fresh.pop(_storage(t), None) for t in targets]
        if (
            func._schema.name.split("::")[-1] not in _FILLS
            or torch.Tag.nondeterministic_seeded in func.tags
            or len(targets) != 1
            or targets[0] is not args[0]
        ):
            return False
        made = mades[0]
        if made is None or args[0].storage_offset() != 0 or args[0].numel() != made[1]:
            return False
        enc_args = (made[0], *(self._encode(a) for a in args[1:]))
        enc_kwargs = self._encode(tuple(sorted(kwargs.items())))
        if any(a is _UNTRACKED for a in enc_args) or enc_kwargs is _UNTRACKED:
            return False
        node = (func, enc_args, enc_kwargs, None)
        self._track(args[0], node)
        if out is not args[0] and isinstance(out, torch.Tensor):
            self._track(out, node)
        return True

    def _encode(self, a: Any) -> Any:
        if isinstance(a, torch.Tensor):
            node = self._nodes.get(id(a))
            return _UNTRACKED if node is None else node
        if isinstance(a, (list, tuple)):
            items = tuple(self._encode(x) for x in a)
            if any(x is _UNTRACKED for x in items):
                return _UNTRACKED
            return (_LIST, items) if isinstance(a, list) else items
        if isinstance(a, torch.Generator):
            return _UNTRACKED
        return a

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is _READ and args and id(args[0]) in self._nodes:
            return self._read(func, args[0])
        read = args[_WHOLE_READS[func]] if func in _WHOLE_READS else None
        if id(read) in self._nodes and read.device.type == "cpu":
            self._read_whole(read)
        out = self._copy(func, args, kwargs)
        if out is _PASS:
            out = self.run(func, args, kwargs)
        drawn = bool(self._drawn) and any(
            id(t) in self._drawn for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)
        )
        if written_positions(func):
            if not drawn and self._filled(func, args, kwargs, out):
                return out
            for t in written(func, args, kwargs):
                self._untrack_storage(_storage(t))
            self.escaped |= drawn
            return out
        if self._host_draws and _host_draw(func, args, kwargs, out):
            kw = self._encode(tuple(sorted(kwargs.items())))
            node = (func, self._encode(args), kw, (_DRAW, len(self.draws)))
            self.draws.append(node)
            self._track(out, node)
            self._drawn.add(id(out))
            return out
        empty = func._schema.name.split("::")[-1].startswith(("empty", "new_empty"))
        if empty and not drawn and isinstance(out, torch.Tensor):
            enc_args, enc_kwargs = self._encode(args), self._encode(tuple(sorted(kwargs.items())))
            if enc_args is not _UNTRACKED and enc_kwargs is not _UNTRACKED:
                # no value yet: input-derived once an in-place op fills it (found by storage:
                # the caller's tensor object may not be the one returned here)
                self._keep.append(out)
                self._fresh[_storage(out)] = ((func, enc_args, enc_kwargs, None), out.numel())
            return out
        if (
            torch.Tag.nondeterministic_seeded in func.tags
            or any(tag in func.tags for tag in _DATA_DEPENDENT)
            or empty
        ):
            self.escaped |= drawn
            return out
        enc_args = self._encode(args)
        enc_kwargs = self._encode(tuple(sorted(kwargs.items())))
        if enc_args is _UNTRACKED or enc_kwargs is _UNTRACKED:
            self.escaped |= drawn  # a draw mixed with the model's state: a replay would repeat it
            return out
        outs = [out] if isinstance(out, torch.Tensor) else tree_leaves(out)
        for k, t in enumerate(outs):
            if isinstance(t, torch.Tensor):
                self._track(t, (func, enc_args, enc_kwargs, None if t is out else k))
                if drawn:
                    self._drawn.add(id(t))
        return out

    def _read(self, func: Any, t: torch.Tensor) -> Any:
        program = (self._nodes[id(t)], t.dtype)
        try:
            hash(program)
        except TypeError:  # an argument that cannot key (an object): a read of state, as before
            return func(t)
        if t.dtype.is_complex:
            return func(t)
        if program in self._answers:
            value = self._answers[program]
        elif self._discover:
            with _disable_current_modes():
                value = func(t)
        else:
            raise NewInputRead(program)
        self.reads.append((program, value))
        return value

    def _copy(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """A copy between the host and the GPU of an input-derived integer tensor (an unsorted
        packed batch's sort indices go over, its inverse comes back for the lengths) is a read of
        the whole tensor, which keys the recording. A capture refuses such copies from pageable
        memory: one to the GPU copies from a pinned snapshot the recording keeps (the graph reads it
        at every replay, its value fixed by the key), one to the host is answered from the key.
        Returns the copy's result, or ``_PASS`` (run the op as it is)."""
        t, to = args[0] if args else None, kwargs.get("device")
        if func is not _TO_COPY or to is None or id(t) not in self._nodes:
            return _PASS
        to = torch.device(to)
        if t.device.type == "cpu" and to.type == "cuda":
            if _storage(t) in self._input_storages:  # an input's own memory: fed (host_feeds.py)
                return _PASS
            if self._read_whole(t) is None or not torch.cuda.is_current_stream_capturing():
                return _PASS
            with _disable_current_modes():
                staged = t.pin_memory()
            self.staged.append(staged)
            return self.run(func, (staged, *args[1:]), {**kwargs, "non_blocking": True})
        if t.device.type == "cuda" and to.type == "cpu" and _plain_copy(t, kwargs):
            value = self._read_whole(t)
            if value is None or not torch.cuda.is_current_stream_capturing():
                return _PASS
            with _disable_current_modes():
                return torch.tensor(value, dtype=t.dtype).reshape(t.shape)
        return _PASS

    def _read_whole(self, t: torch.Tensor) -> tuple | None:
        """A read of all of ``t`` (a kernel's own on the host, a packed sequence's lengths; or a
        copy's): noted as one read whose value is the tuple of its elements. A kernel reads ``t``
        itself, so a known program only needs its value noted for the key. None: not a read this
        key can hold exactly (floats: each batch would be a key of its own)."""
        if t.dtype.is_floating_point or t.dtype.is_complex:
            return None
        program = (self._nodes[id(t)], t.dtype, _WHOLE)
        if program in self._answers:
            value = self._answers[program]
        elif self._discover:
            with _disable_current_modes():
                value = tuple(t.reshape(-1).tolist())
        else:
            raise NewInputRead(program)
        self.reads.append((program, value))
        return value


def _plain_copy(t: torch.Tensor, kwargs: dict) -> bool:
    """A ``.cpu()`` or ``.to("cpu")``: the same dtype and a layout a tuple of values rebuilds."""
    return (
        kwargs.get("dtype") in (None, t.dtype)
        and kwargs.get("layout") in (None, torch.strided)
        and not kwargs.get("pin_memory")
        and t.layout == torch.strided
    )


def _host_draw(func: Any, args: tuple, kwargs: dict, out: Any) -> bool:
    """A draw from torch's default CPU generator made from no tensor (``torch.rand([])`` on the
    host): the source of a value a forward may read (LayerDrop's decision)."""
    return (
        torch.Tag.nondeterministic_seeded in func.tags
        and isinstance(out, torch.Tensor)
        and out.device.type == "cpu"
        and kwargs.get("generator") is None
        and not any(
            isinstance(a, (torch.Tensor, torch.Generator)) for a in tree_leaves((args, kwargs))
        )
    )


def _decode(a: Any, table: Sequence[torch.Tensor], memo: dict[Any, torch.Tensor]) -> Any:
    if type(a) is tuple:
        if a and a[0] is _IN:
            return table[a[1]]
        if a and a[0] is _LIST:
            return [_decode(x, table, memo) for x in a[1]]
        if len(a) == 4 and isinstance(a[0], torch._ops.OpOverload):
            return _run(a, table, memo)
        return tuple(_decode(x, table, memo) for x in a)
    return a


def _run(node: tuple, table: Sequence[torch.Tensor], memo: dict[Any, torch.Tensor]) -> Any:
    func, args, kwargs, index = node
    draw = type(index) is tuple  # (_DRAW, k): one draw per k, whichever program names it
    key = index if draw else id(node)
    found = memo.get(key)
    if found is not None:
        return found
    out = func(*_decode(args, table, memo), **dict(_decode(kwargs, table, memo)))
    if index is not None and not draw:
        out = tree_leaves(out)[index]
    memo[key] = out
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Each element as int64: integers and bools by value, floats by their float64 bits (exact)."""
    t = t.reshape(-1)
    if t.dtype.is_floating_point:
        return t.to(torch.float64).view(torch.int64)
    return t.to(torch.int64)


def _value(raw: int, dtype: torch.dtype) -> Any:
    """What ``aten._local_scalar_dense`` returns for that element."""
    if dtype == torch.bool:
        return bool(raw)
    if dtype.is_floating_point:
        return struct.unpack("<d", struct.pack("<q", raw))[0]
    return raw


def value_key(value: Any) -> Any:
    """A read value as a key: floats by their bits (``-0.0`` is not ``0.0``, a NaN equals itself)."""
    return value.hex() if isinstance(value, float) else value


def evaluate(
    programs: Sequence[tuple], tensors: Sequence[torch.Tensor], draws: Sequence[tuple] = ()
) -> list[Any]:
    """Each program's host value on ``tensors``: the aten calls again, below autograd and autocast,
    then one synchronisation for all of them. ``draws`` (host draws) are made first, in their
    order: torch's CPU generator advances as the recorded code's draws advanced it."""
    memo: dict[Any, torch.Tensor] = {}
    devices = {t.device.type for t in tensors} | {"cpu"}
    with torch.no_grad(), torch._C._AutoDispatchBelowAutograd():
        ctxs = [torch.autocast(d, enabled=False) for d in devices if torch.is_autocast_enabled(d)]
        for c in ctxs:
            c.__enter__()
        try:
            for node in draws:
                _run(node, tensors, memo)
            results = [_decode(program[0], tensors, memo) for program in programs]
        finally:
            for c in reversed(ctxs):
                c.__exit__(None, None, None)
        wholes = [len(program) > 2 for program in programs]
        if any(r.numel() != 1 for r, w in zip(results, wholes, strict=True) if not w):
            raise ReplayError("an input read's program no longer yields one element")
        device = results[0].device if results else torch.device("cpu")
        flat = torch.cat([_bits(r).to(device) for r in results]).tolist() if results else []
    values, at = [], 0
    for r, w, program in zip(results, wholes, programs, strict=True):
        n = r.numel() if w else 1
        raw = [_value(x, program[1]) for x in flat[at : at + n]]
        values.append(tuple(raw) if w else raw[0])
        at += n
    return values


class _Site:
    """One recording key's input reads: the programs found, and the variants recorded."""

    __slots__ = ("draws", "programs", "variants")

    def __init__(self) -> None:
        self.programs: list[tuple] = []
        self.variants: list[dict[int, Any]] = []  # per variant: program index -> value key
        self.draws: list[tuple] = []  # the host draws every variant makes, in order

    def add(self, program: tuple) -> int:
        if program not in self.programs:
            self.programs.append(program)
        return self.programs.index(program)


_NEW = "new input reads"


class InputReads:
    """Per recording key: evaluates the input-derived host reads on each call and keys by their
    values. ``key(base, tensors)`` is called on every call (before a recording is chosen); after a
    recording, ``settle(reads)`` gives the key it is stored under. ``keyed=False`` (the protection
    switched off) still answers reads at recording, but does not key by them: the recording call's
    values are frozen into the recording (the negative control)."""

    def __init__(self, keyed: bool = True) -> None:
        self._sites: dict[tuple, _Site] = {}
        self._keyed = keyed
        self._last: tuple[tuple, list[Any]] = ((), [])
        self._drawn_to: torch.Tensor | None = None  # the CPU generator after the last key's draws

    def key(self, base: tuple, tensors: Sequence[torch.Tensor]) -> tuple:
        """``base`` and, for a key with input reads, the variant this call's values match."""
        site = self._sites.get(base) if self._sites else None
        self._drawn_to = None
        if site is None:
            self._last = (base, [])
            return base
        start = torch.default_generator.get_state() if site.draws else None
        try:
            values = (
                evaluate(site.programs, tensors, site.draws) if site.programs or site.draws else []
            )
        # a program that does not hold for these inputs: no recording matches them
        except Exception:
            self._last = (base, [])
            return (*base, _NEW)
        finally:
            if start is not None:  # the call itself draws (eager) or advance() moves it (a replay)
                self._drawn_to = torch.default_generator.get_state()
                torch.default_generator.set_state(start)
        self._last = (base, values)
        if not self._keyed:
            return (*base, 0)
        keys = [value_key(v) for v in values]
        for i, variant in enumerate(site.variants):
            if all(keys[p] == v for p, v in variant.items()):
                return (*base, i)
        return (*base, _NEW)

    def answers(self) -> dict[tuple, Any]:
        """The values computed for the last ``key`` call, by program: what a recording is answered."""
        base, values = self._last
        site = self._sites.get(base)
        return {} if site is None else dict(zip(site.programs, values, strict=False))

    @property
    def drawn_to(self) -> torch.Tensor | None:
        """torch's CPU generator state after the last key's host draws (None: it has none): where
        eager's draws leave it, so where a replay must."""
        return self._drawn_to

    def advance(self) -> None:
        """After a replay: torch's CPU generator where eager's host draws would have left it."""
        if self._drawn_to is not None:
            torch.default_generator.set_state(self._drawn_to)

    def learn_draws(self, reads: Sequence[tuple[tuple, Any]], draws: Sequence[tuple]) -> bool:
        """An eager run's host draws and the reads made of them: drawn and evaluated before
        choosing a recording from now on. False past ``MAX_READS``."""
        base, _ = self._last
        site = self._sites.setdefault(base, _Site())
        programs = [p for p, _ in reads if p not in site.programs]
        if len(site.programs) + len(programs) > MAX_READS:
            return False
        site.programs += programs
        site.draws = list(draws)
        return True

    def draws_match(self, draws: Sequence[tuple]) -> bool:
        """Whether a run made exactly the host draws the last key evaluated (none if it has none)."""
        site = self._sites.get(self._last[0])
        return list(draws) == (site.draws if site is not None else [])

    def rekey(self, tensors: Sequence[torch.Tensor]) -> tuple:
        """The last call's key again, with what was learnt since (a recording call that met a new read)."""
        return self.key(self._last[0], tensors)

    def learn(self, program: tuple) -> bool:
        """A program a recording met unknown: evaluate it from now on. False past ``MAX_READS``."""
        base, _ = self._last
        site = self._sites.setdefault(base, _Site())
        if program in site.programs or len(site.programs) >= MAX_READS:
            return False
        site.programs.append(program)
        return True

    def settle(self, key: tuple, reads: Sequence[tuple[tuple, Any]]) -> tuple:
        """The key a recording that made ``reads`` is stored under (``key`` when it made none and none are known)."""
        base, _ = self._last
        site = self._sites.get(base)
        if site is None and not reads:
            return key
        if site is None:
            site = self._sites[base] = _Site()
        variant = {site.add(program): value_key(value) for program, value in reads}
        if not self._keyed:
            return (*base, 0)
        if variant not in site.variants:
            site.variants.append(variant)
        return (*base, site.variants.index(variant))

    @property
    def active(self) -> bool:
        """Whether any key has input reads (only those keys pay the per-call evaluation)."""
        return bool(self._sites)
