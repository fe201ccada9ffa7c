"""What a replay would not repeat: the Python effects of the code a recording ran once.

A replay runs kernels, not Python: a module attribute assigned (an auxiliary loss, a counter),
an input written in place (a replay writes its static copy), a container the model holds
changed (``self.log.append``), or a draw from Python's ``random``, numpy's RNG or, beside a GPU
model, torch's CPU generator would not happen again. :class:`SideEffects` watches one run for
all of these, for both entry points.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import nn

from ..guards.distributed import repeated_by_replay
from ..guards.keys import value_key
from ..guards.module import held_values
from ..guards.watch import listen_for_writes
from ..memory.attribute_outputs import MODULE_SLOTS, AttributeOutputs, held_entries
from ..memory.layout import copy_into
from ..memory.write_back import inexact
from .bitwise import bitwise_equal
from .snapshot import host_rng_state

_MISSING = object()


def _attribute(held: tuple[dict, ...], name: str) -> object:
    """An attribute's value as ``nn.Module.__setattr__`` stores it: a plain attribute, or a parameter,
    buffer or submodule."""
    for d in held:
        if name in d:
            return d[name]
    return _MISSING


def _attributes(m: nn.Module) -> tuple[dict, ...]:
    return (m.__dict__, *(m.__dict__.get(slot, {}) for slot in MODULE_SLOTS))


def _changed_keys(before: dict, now: dict) -> list[object]:
    """Keys added, removed, or bound to another value (by ``value_key``)."""
    keys = [k for k in now if k not in before or value_key(before[k]) != value_key(now[k])]
    return keys + [k for k in before if k not in now]


class SideEffects:
    """Watches one run of recorded code (``with SideEffects(model, inputs) as effects: ...``)."""

    def __init__(
        self,
        module: nn.Module,
        inputs: Sequence[torch.Tensor],
        host_rng: bool = True,
        drawn_to: torch.Tensor | None = None,
        host_to: tuple | None = None,
        callers: Sequence[torch.Tensor] | None = None,
    ) -> None:
        self._module = module
        # ``callers``: the caller's tensors ``inputs`` copy, where the entry point writes an input
        # written in place back after each replay (memory/write_back.py): no effect then, if exact
        self._callers = callers
        # ``host_to``: where the Python and numpy draws the entry point makes before a replay
        # leave those generators (guards/host_choices.py)
        self._rng = (host_to if host_to is not None else host_rng_state()) if host_rng else None
        # torch's CPU generator is the device's when the model is on the CPU (the emulated tape
        # replays its draws); beside a GPU model it is host state a CUDA graph never advances.
        # ``drawn_to``: where the draws the entry point makes before a replay leave it (input_reads)
        on_gpu = any(t.device.type != "cpu" for t in (*module.parameters(), *module.buffers()))
        self._on_gpu = on_gpu
        self._cpu_rng = (
            (drawn_to if drawn_to is not None else torch.default_generator.get_state())
            if host_rng and on_gpu
            else None
        )
        self._inputs = list(inputs)
        self._versions = [x._version for x in self._inputs]
        self._also: set[int] = set()  # inputs found written otherwise (also_written)
        self._held = held_values(module)
        # shallow copies of the held dicts and plain objects: which entries a run set
        self._contents = {
            id(v): dict(c) for _, v, _ in self._held if (c := held_entries(v)) is not None
        }
        self._listen = listen_for_writes()
        self.writes: list[tuple[nn.Module, str]] = []
        # attribute writes a replay repeats (recorded outputs, memory/attribute_outputs.py): no effect
        self._outputs: set[tuple[int, str]] = set()
        # shallow copies: a write that sets the value already there is no effect (a replay leaves it so too)
        self._before = {id(m): tuple(map(dict, _attributes(m))) for m in module.modules()}

    def __enter__(self) -> SideEffects:
        self.writes = self._listen.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._listen.__exit__(*exc)

    def written_inputs(self) -> list[int]:
        """Indices of the inputs written in place during the run."""
        versions = zip(self._inputs, self._versions, strict=True)
        moved = [i for i, (x, v) in enumerate(versions) if x._version != v]
        return sorted(self._also.union(moved)) if self._also else moved

    def version_moves(self) -> dict[int, int]:
        """Each input written in place, with how far its version moved (0 for a write through ``.data``)."""
        return {i: self._inputs[i]._version - self._versions[i] for i in self.written_inputs()}

    def also_written(self, found: Iterable[int]) -> None:
        """Inputs the entry point found written otherwise (their storage written under a dispatch
        mode, their values changed): a write through ``.data`` or a ``detach()`` alias moves no
        version counter."""
        self._also.update(found)

    def also_changed(self, copies: Sequence[torch.Tensor]) -> None:
        """The inputs whose values now differ from ``copies`` (of them before the run) are written."""
        pairs = enumerate(zip(self._inputs, copies, strict=True))
        self.also_written(i for i, (x, c) in pairs if x is not c and not bitwise_equal(x, c))

    def named_written(self) -> list[tuple[str, torch.Tensor]]:
        """The inputs written in place, named for a check that compares two runs."""
        return [(f"input {i} (written in place)", self._inputs[i]) for i in self.written_inputs()]

    def put_back(self, copies: Sequence[torch.Tensor]) -> bool:
        """The written inputs' values from ``copies`` (their versions stay moved); whether any was."""
        written = self.written_inputs()
        for i in written:
            copy_into(self._inputs[i], copies[i])
        return bool(written)

    def changed_attributes(self) -> list[tuple[nn.Module, str, object, object]]:
        """The writes whose value differs from the one before the run (by ``value_key``: floats by
        bits, tensors and modules by identity): ``(module, name, before, now)``, once each;
        ``before`` is :meth:`AttributeOutputs.missing` where the attribute did not exist."""
        out, seen = [], set()
        for m, attr in self.writes:
            if (id(m), attr) in seen or repeated_by_replay(m, attr):
                continue  # DDP's flag: a TrainStep's replay sets it as DDP does
            seen.add((id(m), attr))
            before = self._before.get(id(m))
            old = _attribute(before, attr) if before is not None else _MISSING
            new = _attribute(_attributes(m), attr)
            if old is _MISSING or new is _MISSING or value_key(old) != value_key(new):
                out.append((m, attr, AttributeOutputs.missing() if old is _MISSING else old, new))
        return out

    def changed_entries(self) -> list[tuple[object, object, object, object]]:
        """Entries of the held dicts and plain objects the run set to another value (``self.feats
        ["h"] = h``, ``self.state.last = out``): ``(container, key, before, now)``, as
        :meth:`changed_attributes` gives an attribute's."""
        out = []
        for _, value, _ in self._held:
            before, now = self._contents.get(id(value)), held_entries(value)
            if before is None or now is None:
                continue
            for k in _changed_keys(before, now):
                old = before.get(k, AttributeOutputs.missing())
                out.append((value, k, old, now.get(k, _MISSING)))
        return out

    def buffers_before(self) -> list[torch.Tensor]:
        """The tree's buffers as the run found them (one it re-binds is the old tensor here)."""
        return [
            t
            for dicts in self._before.values()
            for t in dicts[MODULE_SLOTS.index("_buffers") + 1].values()
            if isinstance(t, torch.Tensor)
        ]

    def exclude(self, targets: Iterable[tuple[nn.Module, str]]) -> None:
        """Attribute writes a replay repeats (recorded outputs): not effects."""
        self._outputs = {(id(m), name) for m, name in targets}

    def _changing_writes(self) -> list[tuple[nn.Module, str]]:
        outputs = self._outputs
        return [
            (m, attr) for m, attr, _, _ in self.changed_attributes() if (id(m), attr) not in outputs
        ]

    def writes_only(self) -> bool:
        """Whether every effect found is a write into the model (an attribute, a held object such as a
        config): once made by an eager call, later calls may find nothing left to write.

        A host draw beside such a write is taken as part of it: a submodule created at the first
        call (``self.head = nn.Linear(...).to(x.device)``) draws its weights from torch's CPU
        generator. The eager call makes both; a draw that recurs is found at the next call, alone.
        """
        return (not self.written_inputs() or self.inputs_written_back()) and bool(
            self._changing_writes() or self._changed_held()
        )

    def inputs_written_back(self) -> bool:
        """Whether a replay repeats the run's input writes: the entry point writes them back, each
        exactly (:func:`~replaykit.memory.write_back.inexact`)."""
        callers = self._callers
        return callers is not None and inexact(callers, self.written_inputs(), self._on_gpu) is None

    def _changed_held(self) -> list[str]:
        """The held containers the run changed, beyond the entries a replay repeats (outputs)."""
        outputs, out = self._outputs, []
        for name, value, key in self._held:
            if value_key(value) == key:
                continue
            before, now = self._contents.get(id(value)), held_entries(value)
            repeated = before is not None and now is not None and bool(outputs)
            if repeated and all((id(value), k) in outputs for k in _changed_keys(before, now)):  # type: ignore[arg-type]
                continue
            out.append(name)
        return out

    def host_draws(self) -> bool:
        """Whether the run left torch's CPU generator elsewhere than expected (beside a GPU model)."""
        return self._cpu_rng is not None and not torch.equal(
            torch.default_generator.get_state(), self._cpu_rng
        )

    def reason(
        self, who: str, host_draws: bool = True, writes: bool = True, python_draws: bool = True
    ) -> str | None:
        """Why replays of the run would differ from eager (``who`` names the code: "forward", "the
        step"), or None. ``host_draws=False``: all but the CPU generator's (:meth:`host_draws`).
        ``writes=False``: the host RNG's draws only, not the writes (attributes, inputs, held
        objects): the ``side_effects`` protection switched off, ``host_rng`` still on.
        ``python_draws=False``: all but Python's and numpy's draws."""
        if writes:
            why = self._write_reason(who)
            if why is not None:
                return why
        if python_draws and self._rng is not None and host_rng_state() != self._rng:
            return f"{who} draws from Python's random or numpy's global RNG; a replay would repeat the first draw"
        if host_draws and self.host_draws():
            return (
                f"{who} draws from torch's CPU generator beside a GPU model (torch.rand([]) on the "
                "host, as LayerDrop does); a replay would repeat the first draw. What you can "
                "change: draw with the model's device, in tensor ops. A draw only compared on the "
                "host (transformers' LayerDrop: Whisper, BART, ...) is learnt and drawn before "
                "each replay; this one was not (its value reached the computation, or the "
                "input_reads or host_rng protection is off)"
            )
        return None

    def _write_reason(self, who: str) -> str | None:
        """The first write a replay would not repeat: an attribute, an input, a held object."""
        names = {id(m): n or type(m).__name__ for n, m in self._module.named_modules()}
        written = sorted(
            {f"{names.get(id(m), type(m).__name__)}.{attr}" for m, attr in self._changing_writes()}
        )
        if written:
            return f"{who} assigns {', '.join(written)}; a replay would not repeat the assignment"
        mutated = self.written_inputs()
        if mutated and not self.inputs_written_back():
            callers = self._callers
            why = inexact(callers, mutated, self._on_gpu) if callers is not None else None
            more = f" ({why})" if why is not None else ""
            return (
                f"{who} writes input {mutated[0]} in place; a replay would write its own copy{more}"
            )
        changed = self._changed_held()
        if changed:
            return f"{who} changes {changed[0]} (a container or object the model holds); a replay would not"
        return None
