"""Helpers the notebooks call: the device check, the optional widget form, saving results.

Notebooks stay thin: every cell calls into replaykit and shows the result. Headless
runs (papermill, nbval) never depend on widgets; interactive runs get a form whose
values the cells below read.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Any

from replaykit.workflow.errors import WorkflowError

PACKAGES = (
    "torch",
    "lightning",
    "pandas",
    "matplotlib",
    "papermill",
    "nbformat",
    "ipywidgets",
    "junitparser",
)


class EnvironmentProblem(WorkflowError, RuntimeError):
    """What a notebook needs and this runtime lacks, said plainly."""


def check_environment(
    device: str = "auto", need: tuple[str, ...] = ("torch", "lightning", "pandas", "matplotlib")
) -> str:
    """Resolve ``device`` ("auto", "cpu", "cuda") and fail clearly on anything missing.

    Returns the device to use. ``"cuda"`` without a visible GPU raises, with the
    Colab menu path to fix it; so does a missing package from ``need``.
    """
    missing = [p for p in need if importlib.util.find_spec(p) is None]
    if missing:
        raise EnvironmentProblem(
            f"missing packages: {', '.join(missing)}. Install the tree (pip install <tree>) or "
            f"pip install {' '.join(missing)}"
        )
    import torch

    if device not in ("auto", "cpu", "cuda"):
        raise EnvironmentProblem(f"device must be 'auto', 'cpu' or 'cuda', not {device!r}")
    has_gpu = torch.cuda.is_available()
    if device == "cuda" and not has_gpu:
        raise EnvironmentProblem(
            "device='cuda' but torch sees no GPU. In Colab: Runtime > Change runtime type > a GPU "
            "(T4, L4 or A100), then Run all again. Elsewhere: check nvidia-smi and that torch is a CUDA build "
            f"(this one is {torch.__version__})."
        )
    return "cuda" if device == "auto" and has_gpu else ("cpu" if device == "auto" else device)


def package_rows() -> list[dict[str, Any]]:
    """Which of the workflow's packages this runtime has, with versions."""
    from importlib import metadata

    rows = []
    for name in PACKAGES:
        try:
            version = metadata.version(name)
        except metadata.PackageNotFoundError:
            version = None
        rows.append({"package": name, "version": version or "MISSING"})
    return rows


@dataclass
class Form:
    """Widgets pre-filled from the notebook's parameters; ``value(name)`` reads the current choice."""

    defaults: dict[str, Any]
    widgets: dict[str, Any] = field(default_factory=dict)

    def value(self, name: str) -> Any:
        widget = self.widgets.get(name)
        if widget is None:
            return self.defaults[name]
        value = widget.value
        return list(value) if isinstance(value, tuple) else value


def form(choices: dict[str, tuple[list[Any], list[Any]]], interactive: bool) -> Form:
    """A multi-select per parameter (``{name: (options, defaults)}``) when ``interactive``.

    Headless, or without ipywidgets, it is a plain holder of the defaults: nothing
    waits for input and nothing fails.
    """
    holder = Form({name: list(default) for name, (_, default) in choices.items()})
    if not interactive:
        return holder
    try:
        import ipywidgets as w
        from IPython.display import display
    except ImportError:
        return holder
    for name, (options, default) in choices.items():
        holder.widgets[name] = w.SelectMultiple(
            options=options,
            value=tuple(v for v in default if v in options),
            description=name,
            rows=min(4, len(options)),
        )
    display(
        w.VBox(
            [
                w.HTML("<b>Choose, then run the cells below (Run after).</b>"),
                *holder.widgets.values(),
            ]
        )
    )
    return holder


def is_interactive(run_dir: str | None, interactive: str | bool = "auto") -> bool:
    """``"yes"``/``"no"`` as told; ``"auto"``: not under the runner (which sets ``run_dir``) and in a live kernel."""
    if isinstance(interactive, bool):
        return interactive
    if interactive not in ("auto", "yes", "no"):
        raise ValueError(f"interactive must be 'auto', 'yes' or 'no', not {interactive!r}")
    if interactive != "auto":
        return interactive == "yes"
    if run_dir:
        return False
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and type(shell).__name__ in ("ZMQInteractiveShell", "Shell")
