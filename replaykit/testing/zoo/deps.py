"""The zoo's optional imports: torchvision, timm and transformers, imported only when a zoo model is built.

Where to look: the interpreter's own packages first, then a ``zoo-site`` folder beside
them (``<sys.prefix>/zoo-site``, or ``$REPLAYKIT_ZOO_SITE``), which the Makefile fills
with ``pip install --no-deps --target``. It stays off ``sys.path`` until a zoo model
asks for it: on a CPU-only torch, the only torchvision wheel on the package index is
the CUDA build, whose C++ ops cannot load, and torchmetrics (so Lightning) imports a
torchvision it can find, and fails with it, before the zoo could step in.

That wheel's Python models are all the zoo uses (its C++ ops are detection
post-processing: nms, roi_align); its import fails only where it registers fake
kernels for those missing ops. :func:`torchvision` imports it without that
registration when, and only when, its C++ extension did not load.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

import torch

SITE_ENV = "REPLAYKIT_ZOO_SITE"


class Unavailable(ImportError):
    """A zoo model's package is missing; the message says which and how to install it."""


def site_dir() -> Path:
    """Where the Makefile installs the zoo's packages for a CPU-only torch."""
    return Path(os.environ.get(SITE_ENV) or Path(sys.prefix) / "zoo-site")


def _in_site(name: str) -> bool:
    return (site_dir() / name).is_dir()


def _use_site() -> None:
    """Put the zoo-site folder on sys.path (after the interpreter's own packages), once."""
    site = str(site_dir())
    if site not in sys.path:
        sys.path.append(site)
        importlib.invalidate_caches()


def missing(name: str) -> str | None:
    """Why ``name`` cannot be imported (not installed), or None. Changes nothing: only building a zoo
    model puts zoo-site on sys.path (and then imports torchvision first, see the module docstring)."""
    if name in sys.modules or importlib.util.find_spec(name) is not None or _in_site(name):
        return None
    return f"{name} is not installed (pip install 'replaykit[zoo]', or `make venv`, which puts it in {site_dir()})"


def _without_missing_ops_fakes() -> ModuleType:
    """Import torchvision, skipping ``register_fake`` for its ops that do not exist (extension not loaded)."""
    for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
        del sys.modules[name]
    real = torch.library.register_fake

    def register_fake(op, func=None, /, **kw):
        if isinstance(op, str) and op.startswith("torchvision::"):
            try:
                torch._C._dispatch_find_schema_or_throw(op, "")
            except RuntimeError:  # the op is not there: nothing to register a fake kernel for
                return (lambda fn: fn) if func is None else func
        return real(op, func, **kw)

    torch.library.register_fake = register_fake
    try:
        return importlib.import_module("torchvision")
    finally:
        torch.library.register_fake = real


def torchvision() -> ModuleType:
    """The torchvision module; raises :class:`Unavailable` when it is not installed."""
    if "torchvision" in sys.modules:
        return sys.modules["torchvision"]
    why = missing("torchvision")
    if why:
        raise Unavailable(why)
    if importlib.util.find_spec("torchvision") is None:
        _use_site()
    try:
        return importlib.import_module("torchvision")
    except RuntimeError as exc:
        if "torchvision::" not in str(exc):
            raise
        return _without_missing_ops_fakes()


def timm() -> ModuleType:
    """The timm module (it imports torchvision: through :func:`torchvision` first)."""
    why = missing("timm")
    if why:
        raise Unavailable(why)
    torchvision()
    if importlib.util.find_spec("timm") is None:
        _use_site()
    return importlib.import_module("timm")


def transformers() -> ModuleType:
    """The transformers module, its logging quietened to errors (tiny configs warn about their token ids);
    raises :class:`Unavailable` when it is not installed."""
    why = missing("transformers")
    if why:
        raise Unavailable(why)
    if importlib.util.find_spec("transformers") is None:
        _use_site()
    module = importlib.import_module("transformers")
    module.logging.set_verbosity_error()
    return module
