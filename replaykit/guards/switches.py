"""Process-wide switches that choose which kernel runs, read on every call.

A graph freezes the kernels chosen at capture (an SDPA backend, cuDNN or oneDNN, TF32 matmuls,
reduced-precision reductions, deterministic algorithms); a switch flipped later (a callback's
``enable_flash_sdp(False)``, ``sdpa_kernel(...)`` around validation) must not replay them.
:func:`key` is one tuple of every switch's value, part of every entry point's key. Read from
torch's own getters; one this torch lacks is left out, as are those with no getter
(``set_flush_denormal``) or no graph's choice (thread count, cuFFT plan cache).

:class:`Frozen` is the emulated backend's side: a tape re-dispatches each op at replay and would
choose kernels from the switches of the moment; under it a replay uses the recording's.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

_C = torch._C


class Switch(NamedTuple):
    """One process-wide switch: its user-facing name and torch's getter and setter."""

    name: str
    get: Callable[[], Any]
    set: Callable[[Any], None]


def _c(name: str, getter: str, setter: str) -> Switch | None:
    get, put = getattr(_C, getter, None), getattr(_C, setter, None)
    if get is None or put is None:
        return None
    return Switch(name, get, put)


#: A legacy TF32 getter's answer where it raises: the legacy API and ``fp32_precision`` were both
#: used (torch >= 2.9 then refuses to answer); the ``fp32_precision`` switches hold the state.
MIXED = "mixed legacy and fp32_precision settings"


def _legacy(name: str, getter: str, setter: str) -> Switch | None:
    """A legacy TF32 switch (``allow_tf32``, ``set_float32_matmul_precision``), whose getter raises
    when the new API was used too: a key must never raise where eager would run."""
    switch = _c(name, getter, setter)
    if switch is None:
        return None
    get, put = switch.get, switch.set

    def read() -> Any:
        try:
            return get()
        except RuntimeError:
            return MIXED

    def write(value: Any) -> None:
        if value != MIXED:
            put(value)

    return Switch(name, read, write)


def _splat(setter: Callable[..., None]) -> Callable[[Any], None]:
    """A setter given a getter's tuple (cuBLAS reduced-precision: ``(allow, allow_splitk)`` since 2.10)."""

    def put(value: Any) -> None:
        if isinstance(value, tuple):
            setter(*value)
        else:
            setter(value)

    return put


def _reduced(kind: str) -> Switch | None:
    get = getattr(_C, f"_get_cublas_allow_{kind}_reduced_precision_reduction", None)
    put = getattr(_C, f"_set_cublas_allow_{kind}_reduced_precision_reduction", None)
    if get is None or put is None:
        return None
    return Switch(f"cuda.matmul.allow_{kind}_reduced_precision_reduction", get, _splat(put))


def _fp32(backend: str, op: str) -> Switch | None:
    """``torch.backends.<backend>.<op>.fp32_precision`` (torch >= 2.9): a combination this torch refuses is left out."""
    get, put = (
        getattr(_C, "_get_fp32_precision_getter", None),
        getattr(_C, "_set_fp32_precision_setter", None),
    )
    if get is None or put is None:
        return None
    try:
        get(backend, op)
    except (RuntimeError, TypeError, ValueError):
        return None
    return Switch(
        f"{backend}.{op}.fp32_precision",
        functools.partial(get, backend, op),
        functools.partial(put, backend, op),
    )


def _deterministic() -> Switch:
    """``torch.use_deterministic_algorithms(mode, warn_only=...)``: one switch of two values."""

    def get() -> tuple[bool, bool]:
        return (_C._get_deterministic_algorithms(), _C._get_deterministic_algorithms_warn_only())

    def put(value: tuple[bool, bool]) -> None:
        _C._set_deterministic_algorithms(value[0], warn_only=value[1])

    return Switch("use_deterministic_algorithms", get, put)


def _mha_fastpath() -> Switch | None:
    """``torch.backends.mha.set_fastpath_enabled``: a module global (its getter asks the JIT first)."""
    mha = getattr(torch.backends, "mha", None)
    if mha is None or not hasattr(mha, "_is_fastpath_enabled"):
        return None
    namespace = vars(mha)
    return Switch(
        "mha.fastpath_enabled",
        functools.partial(namespace.get, "_is_fastpath_enabled"),
        mha.set_fastpath_enabled,
    )


def _global(module: Any, name: str, label: str) -> Switch:
    """A module global read and written in place (``torch.backends.opt_einsum``'s ``enabled`` and
    ``strategy`` sit behind a property module whose attribute read costs about 2 us)."""
    namespace = vars(module)
    return Switch(
        label,
        functools.partial(namespace.get, name),
        functools.partial(namespace.__setitem__, name),
    )


def _opt_einsum(name: str) -> Switch | None:
    """einsum's contraction order (``torch.backends.opt_einsum.enabled`` / ``strategy``)."""
    oe = getattr(torch.backends, "opt_einsum", None)
    module = getattr(oe, "m", None)  # the module behind torch's property module
    if module is None or "enabled" not in vars(module):
        return None
    return _global(module, name, f"opt_einsum.{name}")


def _sdp_priority() -> Switch | None:
    """``sdpa_kernel(..., set_priority=True)``'s order: a list, keyed as a tuple."""
    get, put = (
        getattr(_C, "_get_sdp_priority_order", None),
        getattr(_C, "_set_sdp_priority_order", None),
    )
    if get is None or put is None:
        return None
    return Switch("cuda.sdp_priority_order", lambda: tuple(get()), lambda v: put(list(v)))


_FP32 = ("generic", "all"), ("cuda", "all"), ("cuda", "matmul"), ("cuda", "conv"), ("cuda", "rnn")
_FP32 += ("mkldnn", "all"), ("mkldnn", "matmul"), ("mkldnn", "conv"), ("mkldnn", "rnn")

#: Every process-wide switch a recording keys and freezes, one row each: (maker, its arguments).
#: A table read top to bottom is easy to check against torch's switches; a maker answers None
#: where this torch lacks the switch.
# fmt: off
_TABLE: tuple[tuple[Any, ...], ...] = (
    # cuDNN (convolutions, RNNs, batch norm)
    (_c, "cudnn.enabled", "_get_cudnn_enabled", "_set_cudnn_enabled"),
    (_c, "cudnn.benchmark", "_get_cudnn_benchmark", "_set_cudnn_benchmark"),
    (_c, "cudnn.benchmark_limit", "_get_cudnn_benchmark_limit", "_set_cudnn_benchmark_limit"),
    (_c, "cudnn.deterministic", "_get_cudnn_deterministic", "_set_cudnn_deterministic"),
    (_legacy, "cudnn.allow_tf32", "_get_cudnn_allow_tf32", "_set_cudnn_allow_tf32"),
    (_c, "cudnn.depthwise_kernel", "_get_cudnn_depthwise_kernel", "_set_cudnn_depthwise_kernel"),
    # cuBLAS matmuls
    (_legacy, "cuda.matmul.allow_tf32", "_get_cublas_allow_tf32", "_set_cublas_allow_tf32"),
    (_reduced, "fp16"),
    (_reduced, "bf16"),
    (_c, "cuda.matmul.allow_fp16_accumulation", "_get_cublas_allow_fp16_accumulation",
     "_set_cublas_allow_fp16_accumulation"),
    (_c, "cpu.allow_fp16_reduced_precision_reduction",
     "_get_cpu_allow_fp16_reduced_precision_reduction",
     "_set_cpu_allow_fp16_reduced_precision_reduction"),
    (_legacy, "float32_matmul_precision", "_get_float32_matmul_precision",
     "_set_float32_matmul_precision"),
    *((_fp32, backend, op) for backend, op in _FP32),
    (_c, "preferred_blas_library", "_get_blas_preferred_backend", "_set_blas_preferred_backend"),
    (_c, "preferred_linalg_library", "_get_linalg_preferred_backend",
     "_set_linalg_preferred_backend"),
    (_c, "sm_carveout", "_get_sm_carveout_experimental", "_set_sm_carveout_experimental"),
    # deterministic algorithms
    (_deterministic,),
    (_c, "deterministic.fill_uninitialized_memory", "_get_deterministic_fill_uninitialized_memory",
     "_set_deterministic_fill_uninitialized_memory"),
    # scaled_dot_product_attention's backends (sdpa_kernel sets these)
    (_c, "cuda.flash_sdp", "_get_flash_sdp_enabled", "_set_sdp_use_flash"),
    (_c, "cuda.mem_efficient_sdp", "_get_mem_efficient_sdp_enabled", "_set_sdp_use_mem_efficient"),
    (_c, "cuda.math_sdp", "_get_math_sdp_enabled", "_set_sdp_use_math"),
    (_c, "cuda.cudnn_sdp", "_get_cudnn_sdp_enabled", "_set_sdp_use_cudnn"),
    (_c, "cuda.overrideable_sdp", "_get_overrideable_sdp_enabled", "_set_sdp_use_overrideable"),
    (_c, "cuda.fa3_sdp", "_get_fa3_sdp_enabled", "_set_sdp_use_fa3"),
    (_c, "cuda.math_sdp_fp16_bf16_reduction", "_get_math_sdp_allow_fp16_bf16_reduction",
     "_set_math_sdp_allow_fp16_bf16_reduction"),
    (_sdp_priority,),
    # oneDNN, NNPACK, MIOpen (CPU and ROCm kernels)
    (_c, "mkldnn.enabled", "_get_mkldnn_enabled", "_set_mkldnn_enabled"),
    (_c, "mkldnn.deterministic", "_get_mkldnn_deterministic", "_set_mkldnn_deterministic"),
    (_legacy, "mkldnn.allow_tf32", "_get_onednn_allow_tf32", "_set_onednn_allow_tf32"),
    (_c, "nnpack.enabled", "_get_nnpack_enabled", "_set_nnpack_enabled"),
    # Python-level choices a forward makes once and a graph freezes
    (_mha_fastpath,),
    (_opt_einsum, "enabled"),
    (_opt_einsum, "strategy"),
    (Switch, "default_dtype", torch.get_default_dtype, torch.set_default_dtype),
    # ROCm's own choices: read only where they can matter
    *(((_c, "preferred_rocm_fa_library", "_get_rocm_fa_preferred_backend",
        "_set_rocm_fa_preferred_backend"),
       (_c, "miopen.immediate", "_get_miopen_immediate", "_set_miopen_immediate"))
      if torch.version.hip else ()),
)
# fmt: on

#: Every switch this torch exposes, in :func:`key`'s order.
SWITCHES: tuple[Switch, ...] = tuple(
    s for s in (make(*args) for make, *args in _TABLE) if s is not None
)
NAMES: tuple[str, ...] = tuple(s.name for s in SWITCHES)


def _compile_key() -> Callable[[], tuple]:
    """``key`` as one tuple display of getter calls: about half the cost of a generator over a list
    (the per-call cost every entry point pays; measured in ``tests/core/test_switches.py``'s notes)."""
    namespace = {f"g{i}": s.get for i, s in enumerate(SWITCHES)}
    body = ", ".join(f"g{i}()" for i in range(len(SWITCHES)))
    exec(f"def key():\n    return ({body},)\n", namespace)
    fn = namespace["key"]
    fn.__doc__ = "The current value of every switch of :data:`SWITCHES`, as one tuple."
    return fn  # type: ignore[return-value]


key: Callable[[], tuple] = _compile_key()


def changed(recorded: tuple, now: tuple | None = None) -> list[str]:
    """The names of the switches whose value differs from ``recorded`` (for a journal's cause)."""
    now = key() if now is None else now
    return [n for n, a, b in zip(NAMES, recorded, now, strict=True) if a != b]


class Frozen:
    """``with Frozen(state):`` runs under the switches of ``state`` (a :func:`key`), then puts back
    the current ones: the emulated backend's replay, which re-dispatches each op, chooses the
    kernels its recording chose, as a graph replays them. Nothing is set when nothing changed."""

    __slots__ = ("_restore", "state")

    def __init__(self, state: tuple) -> None:
        self.state = state
        self._restore: list[tuple[int, Any]] = []

    def __enter__(self) -> None:
        now = key()
        if now == self.state:
            self._restore = []
            return
        self._restore = [
            (i, b) for i, (a, b) in enumerate(zip(self.state, now, strict=True)) if a != b
        ]
        for i, _ in self._restore:
            SWITCHES[i].set(self.state[i])

    def __exit__(self, *exc: object) -> None:
        for i, value in reversed(self._restore):
            SWITCHES[i].set(value)
        self._restore = []
