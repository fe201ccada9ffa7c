"""What a whole-step graph freezes beyond the network: optimizer, scaler and EMA host values.

A recorded step bakes in every Python value its optimizer read (float ``lr``, ``betas``), the
scaler's settings and the clip threshold, and reads every state tensor at its address. So host
values form the *hyper key* (a scheduler's float ``lr`` records anew; a tensor ``lr`` updated in
place is read by the graph); state tensors are watched by address (:class:`OptimizerWatch`); what
can never replay is refused up front (:func:`optimizer_refusal`), and a step no graph can hold
runs eagerly after the replayed network instead (:class:`OptimizerTail`).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from itertools import chain
from typing import Any

import torch
from torch.optim import optimizer as optim_module

_PTR = torch.Tensor.data_ptr
_PARAMS = operator.itemgetter("params")
_IS = operator.is_


def host_value(value: Any) -> Any:
    """A hashable stand-in for one hyperparameter: floats by their bits, tensors by identity."""
    if isinstance(value, torch.Tensor):
        return ("tensor", id(value))  # kept alive by the recording (see ``tensors_of``)
    if isinstance(value, float):
        return ("float", value.hex())
    if isinstance(value, (list, tuple)):
        return tuple(host_value(v) for v in value)
    return value


#: hyperparameter types keyed as they are (a step reads them every call: no call per value)
_AS_IS = frozenset({bool, int, str, type(None)})


def hyper_key(optimizer: torch.optim.Optimizer, extra: tuple = ()) -> tuple:
    """Every host value the optimizer's step reads, group by group, plus ``extra``: each value as
    :func:`host_value` keys it (read on every call: the common types are keyed inline)."""
    groups = []
    for g in optimizer.param_groups:
        values = []
        for k, v in g.items():
            kind = type(v)
            if kind is float:
                values.append(("float", v.hex()))
            elif kind in _AS_IS:
                values.append(v)
            elif k != "params":
                values.append(host_value(v))
        groups.append(tuple(values))
    return (*groups, *extra)


def tensors_of(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Tensor hyperparameters (a tensor ``lr``): a recording keeps them alive so their ids stay theirs."""
    return [
        v
        for g in optimizer.param_groups
        for k, v in g.items()
        if k != "params" and isinstance(v, torch.Tensor)
    ]


def state_tensors(
    optimizer: torch.optim.Optimizer, scaler: Any = None, extra: Sequence[torch.Tensor] = ()
) -> list[torch.Tensor]:
    """The tensors a recorded step reads and writes by address, besides the model's."""
    out = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    out += tensors_of(optimizer)
    if scaler is not None:
        out += [
            t
            for t in (getattr(scaler, "_scale", None), getattr(scaler, "_growth_tracker", None))
            if t is not None
        ]
    return out + list(extra)


_MISSING = object()


class _WatchedState(dict):
    """One parameter's optimizer state dict that notes a value replaced by another object. A moment
    reset (``state[p]["exp_avg"] = zeros_like(p)``) leaves the recorded tensor alive at its address,
    unseen by a pointer check; re-assigning the same object is no change. Pickles and deep-copies as
    a plain dict."""

    __slots__ = ("_flag",)

    def __init__(self, values: dict, flag: list[bool]) -> None:
        dict.__init__(self, values)
        self._flag = flag

    def __setitem__(self, key: Any, value: Any) -> None:
        if dict.get(self, key, _MISSING) is not value:
            self._flag[0] = True
        dict.__setitem__(self, key, value)

    def __delitem__(self, key: Any) -> None:
        self._flag[0] = True
        dict.__delitem__(self, key)

    def __ior__(self, other: Any) -> Any:
        self._flag[0] = True
        return dict.__ior__(self, other)

    def pop(self, *args: Any) -> Any:
        self._flag[0] = True
        return dict.pop(self, *args)

    def popitem(self) -> Any:
        self._flag[0] = True
        return dict.popitem(self)

    def clear(self) -> None:
        self._flag[0] = True
        dict.clear(self)

    def update(self, *args: Any, **kwargs: Any) -> None:
        self._flag[0] = True
        dict.update(self, *args, **kwargs)

    def setdefault(self, key: Any, default: Any = None) -> Any:
        if key not in self:
            self._flag[0] = True
        return dict.setdefault(self, key, default)

    def __reduce__(self) -> tuple:
        return (dict, (dict(self),))


class OptimizerWatch:
    """Notices state tensors replaced or new state (``load_state_dict``, ``add_param_group``,
    ``opt.state[p][k] = ...``), a group's ``params`` edited (a parameter moved to another group,
    replaced, removed) and EMA tensors re-assigned (``ema.version`` moved). ``groups=False``
    leaves the groups' parameters to the owner's ``param_identity`` switch being off (a parameter
    replaced in the model and in its group is that protection's hazard)."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        scaler: Any = None,
        ema: Any = None,
        groups: bool = True,
    ) -> None:
        self._optimizer, self._scaler, self._ema = optimizer, scaler, ema
        self._watch_groups = groups
        self._flag = [False]
        optimizer.register_state_dict_post_hook(plain_state_dict)
        self.rebaseline()

    def rebaseline(self) -> None:
        """Take the state as it is now (before a first recording, again after a re-record)."""
        self._extra = self._ema.tensors() if self._ema is not None else []
        self._state = self._optimizer.state
        for p, s in list(self._state.items()):
            if type(s) is dict:  # watched from now on (see _WatchedState)
                self._state[p] = _WatchedState(s, self._flag)
        self._flag[0] = False
        self._dicts = list(map(id, self._state.values()))
        self._groups = len(self._optimizer.param_groups)
        params = list(map(_PARAMS, self._optimizer.param_groups))
        self._members = list(chain.from_iterable(params))  # held: compared by identity
        self._sizes = list(map(len, params))
        self._tensors = state_tensors(self._optimizer, self._scaler, self._extra)
        self._ptrs = list(map(_PTR, self._tensors))
        self._counts = [len(s) for s in self._state.values()]
        self._ema_version = None if self._ema is None else self._ema.version

    def reason(self) -> str | None:
        """Why recordings read stale state now, or None."""
        opt = self._optimizer
        if opt.state is not self._state or len(opt.param_groups) != self._groups:
            return (
                "optimizer state or parameter groups replaced (load_state_dict / add_param_group)"
            )
        if self._watch_groups and self._regrouped():
            return "param groups edited: a parameter moved, added or removed (g['params'])"
        if self._flag[0] or list(map(id, self._state.values())) != self._dicts:
            return "an optimizer state entry was assigned another tensor (opt.state[p][k] = ...)"
        if (
            list(map(_PTR, self._tensors)) != self._ptrs
            or [len(s) for s in self._state.values()] != self._counts
        ):
            return "an optimizer, scaler or EMA state tensor was replaced"
        if self._ema is not None and self._ema.version != self._ema_version:
            return "EMA tensors re-assigned (ema.params / source / weights)"
        return None

    def _regrouped(self) -> bool:
        """Whether which parameters each group steps changed (in place, ``g["params"] = [...]``):
        a recorded step keeps the grouping, so each group's lr, it was recorded with. By identity
        (a tensor's ``==`` compares values); per call, a few microseconds for 200 parameters."""
        params = list(map(_PARAMS, self._optimizer.param_groups))
        return list(map(len, params)) != self._sizes or not all(
            map(_IS, chain.from_iterable(params), self._members)
        )


#: the eager route of a call that steps the optimizer while a frozen parameter it steps holds a
#: gradient (frozen between two micro-batches)
FROZEN_GRAD = "frozen_grad"


class FrozenGrads:
    """The parameters the optimizer steps that require no grad. One frozen between two
    micro-batches keeps the first one's ``.grad`` and eager's step moves it; a whole-step
    recording keys and hands over the trainable gradients only, so its step would read the
    tensor of its recording call. ``on=False``: nothing is watched (``param_identity`` off)."""

    def __init__(self, on: bool) -> None:
        self._on = on
        self._stepped: frozenset[int] = frozenset()
        self.params: list[torch.Tensor] = []

    def stepping(self, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        """The optimizer's parameters, noted (a re-record may follow a group edit)."""
        stepped = [p for g in optimizer.param_groups for p in g["params"]]
        self._stepped = frozenset(map(id, stepped)) if self._on else frozenset()
        return stepped

    def refresh(self, params: Sequence[torch.Tensor]) -> None:
        """Those of ``params`` frozen now (when ``requires_grad`` changed: cached, not per call)."""
        self.params = [p for p in params if id(p) in self._stepped and not p.requires_grad]

    def reason(self) -> str | None:
        """:data:`FROZEN_GRAD` while one holds a ``.grad`` (one read per frozen parameter)."""
        frozen = self.params
        if frozen and list(map(GRAD, frozen)).count(None) != len(frozen):
            return FROZEN_GRAD
        return None


def optimizer_hooks(optimizer: torch.optim.Optimizer) -> bool:
    """Step hooks run Python around ``step()``; a replay would skip them (checked every call)."""
    return bool(
        optimizer._optimizer_step_pre_hooks
        or optimizer._optimizer_step_post_hooks
        or optim_module._global_optimizer_pre_hooks
        or optim_module._global_optimizer_post_hooks
    )


def known_step(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer's ``step`` is torch's own (a subclass overriding it may keep Python
    state). Lightning's and Fabric's wrappers forward ``step`` to the optimizer they wrap: that one
    decides."""
    cls = type(optimizer)
    if cls.__module__.startswith(("lightning.", "lightning_fabric.", "pytorch_lightning.")):
        inner = getattr(optimizer, "optimizer", None)
        return (
            isinstance(inner, torch.optim.Optimizer)
            and inner is not optimizer
            and known_step(inner)
        )
    return getattr(cls.step, "__module__", "").startswith("torch.optim.")


def optimizer_refusal(
    optimizer: torch.optim.Optimizer, scaler: Any, device: torch.device, trust: bool = False
) -> str | None:
    """Why this optimizer/scaler pair can never replay as a graph, or None (checked at construction
    and at each re-record). ``trust``: the user declares a foreign ``step`` capture-safe."""
    name = type(optimizer).__name__
    if not trust and not known_step(optimizer):
        return (
            f"{name}.step is not a torch.optim step known to be capture-safe: Python state it keeps (a counter "
            "on self) would not move under a replay. Pass trust_optimizer=True if its step only launches kernels"
        )
    groups = optimizer.param_groups
    if (
        scaler is not None
        and getattr(scaler, "is_enabled", lambda: True)()
        and not getattr(optimizer, "_step_supports_amp_scaling", False)
    ):
        return (
            f"GradScaler.step with a non-fused {name} reads found_inf on the host (.item()) to skip the step; "
            "use fused=True so the skip stays on the device"
        )
    for g in groups:
        lr = g.get("lr")
        if isinstance(lr, torch.Tensor) and not (g.get("fused") or g.get("capturable")):
            return f"{name} with a tensor lr reads it on the host unless fused=True (or capturable=True where offered)"
    for g in groups:
        if (
            "capturable" in g
            and not g["capturable"]
            and (device.type == "cuda" or not g.get("fused"))
        ):
            # its step counter is read on the host (.item()); on CUDA, step() also refuses a capture
            # without capturable=True, fused or not
            return f"{name} reads its step counter on the host unless capturable=True (with fused=True for speed)"
    return None


def host_state(optimizer: torch.optim.Optimizer, device: torch.device) -> str | None:
    """Why a CUDA graph would freeze optimizer state kept on the CPU (Adagrad's step counter), or
    None. A capture records device kernels only: an op on a CPU tensor runs once, at capture."""
    if device.type != "cuda":
        return None
    for group in optimizer.param_groups:
        for p in group["params"]:
            for k, t in optimizer.state.get(p, {}).items():
                if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                    return (
                        f"{type(optimizer).__name__} keeps state {k!r} on the CPU: a CUDA graph would never update it "
                        "(use an optimizer with capturable=True)"
                    )
    return None


def plain_state_dict(optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
    """A state-dict post hook: watched per-parameter state dicts leave as plain dicts, so a
    checkpoint loads with ``torch.load(weights_only=True)``."""
    state_dict["state"] = {
        k: dict(v) if isinstance(v, _WatchedState) else v for k, v in state_dict["state"].items()
    }
    return state_dict


GRAD = operator.attrgetter("grad")


def scaler_key(scaler: Any) -> Any:
    """The GradScaler's host settings a recorded ``update`` bakes in (a disabled scaler has none)."""
    if scaler is None or not scaler.is_enabled():
        return None if scaler is None else False
    return (
        True,
        float(scaler._growth_factor).hex(),
        float(scaler._backoff_factor).hex(),
        scaler._growth_interval,
    )


def scaler_state(scaler: Any) -> Any:
    """What a failed recording's ``scaler.step``/``unscale_`` may have noted per optimizer (to put back)."""
    return None if scaler is None or not scaler.is_enabled() else dict(scaler._per_optimizer_states)


def restore_scaler(scaler: Any, state: Any) -> None:
    if state is not None:
        scaler._per_optimizer_states.clear()
        scaler._per_optimizer_states.update(state)


#: Distinct sets of host values recorded before the optimizer step leaves the graph.
HOST_VALUE_SETS = 2
VARYING = (
    "the optimizer's host values change from step to step (a float lr a scheduler sets): its step "
    "runs eagerly after each replay (a tensor lr, lr=torch.tensor(...), keeps it in the graph)"
)


class OptimizerTail:
    """Where a whole step's optimizer step runs: recorded after the backward, or eagerly after each
    replayed forward+backward (``eager``: why).

    A graph cannot hold a step that reads its state on the host (``capturable=False``'s step
    counter, a non-fused GradScaler's ``found_inf``, Adagrad's CPU state) or keeps Python state (a
    ``step`` of its own); run eagerly on the replay's gradients it is eager's step, and the network
    still replays. A recorded step bakes in the host values (:func:`hyper_key`), which key the
    recordings; when they keep changing (a scheduler's float lr) the step leaves the graph too:
    one re-record instead of a recording per value."""

    def __init__(self) -> None:
        self.eager: str | None = None
        self._sets: set[tuple] = set()
        self._sticky: str | None = None  # the host values varied, or the step failed a capture

    def place(
        self, optimizer: torch.optim.Optimizer, scaler: Any, device: torch.device, trust: bool
    ) -> str | None:
        """Decide (at construction and each re-record): ``eager`` set or cleared."""
        self.eager = (
            optimizer_refusal(optimizer, scaler, device, trust)
            or host_state(optimizer, device)
            or self._sticky
        )
        return self.eager

    def key(self, optimizer: torch.optim.Optimizer, extra: tuple, fixed: bool) -> tuple | None:
        """The host values a recording bakes in (``extra``: the scaler's and clip's); an eager
        step keys only the scaler's (its ``scale()`` is recorded). None: they just varied past
        :data:`HOST_VALUE_SETS` (the caller re-records). ``fixed``: never leave the graph."""
        if self.eager is not None:
            return extra[1:]
        hyper = hyper_key(optimizer, extra)
        if hyper in self._sets:
            return hyper
        self._sets.add(hyper)
        if len(self._sets) <= HOST_VALUE_SETS or fixed:
            return hyper
        self._sticky = self.eager = VARYING
        return None

    def failed(self, exc: BaseException) -> str:
        """The step raised inside a capture (a host read of its state: Adagrad's step counter on a
        CPU): from now on it runs eagerly after the replay."""
        first = str(exc).splitlines()[0][:160] if str(exc) else ""
        self._sticky = self.eager = (
            f"the optimizer step failed in a capture ({type(exc).__name__}: {first}): it runs "
            "eagerly after each replay"
        )
        return self._sticky
