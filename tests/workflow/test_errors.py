"""Every error the workflow raises of its own derives from one root, and still from its built-in class."""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

import pytest

from replaykit.workflow.errors import WorkflowError

WORKFLOW = Path(__file__).resolve().parents[2] / "replaykit" / "workflow"
MODULES = sorted(p.stem for p in WORKFLOW.glob("*.py") if p.stem not in ("__init__", "__main__"))


def _own_errors() -> dict[str, type[BaseException]]:
    found = {}
    for stem in MODULES:
        module = importlib.import_module(f"replaykit.workflow.{stem}")
        for name, value in vars(module).items():
            if (
                inspect.isclass(value)
                and issubclass(value, BaseException)
                and value.__module__ == module.__name__
            ):
                found[f"{stem}.{name}"] = value
    return found


def test_every_workflow_error_derives_from_the_root() -> None:
    errors = _own_errors()
    assert {
        "bisect.EndpointError",
        "environments.EnvBuildError",
        "fingerprint.NeedsSourceTree",
        "git.GitError",
        "notebook.EnvironmentProblem",
    } <= errors.keys()
    assert not [
        name
        for name, cls in errors.items()
        # an interruption is not an error: RunInterrupted stays a KeyboardInterrupt so that it
        # stops whatever runs the workflow, as the Ctrl-C it reports
        if cls is not WorkflowError
        and not issubclass(cls, WorkflowError)
        and not issubclass(cls, KeyboardInterrupt)
    ]
    assert issubclass(errors["errors.RunInterrupted"], KeyboardInterrupt)


@pytest.mark.parametrize(
    ("name", "builtin"),
    [
        ("bisect.EndpointError", ValueError),
        ("fingerprint.NeedsSourceTree", ValueError),
        ("git.GitError", ValueError),
        ("environments.EnvBuildError", RuntimeError),
        ("notebook.EnvironmentProblem", RuntimeError),
    ],
)
def test_an_error_is_still_caught_as_before(name: str, builtin: type[Exception]) -> None:
    """Callers that catch ``ValueError`` (the commands' exit code 2) or ``RuntimeError`` keep working."""
    assert issubclass(_own_errors()[name], builtin)
