"""The hazard catalogue's third entry point, ``replaykit.lightning.whole_step``: its patterns run
with their classes (tests/core/hazards/test_<class>.py, each guard's negative control too);
here what is particular to it: which classes it covers, its replay coverage, the float-lr
warning, and that the rest of the catalogue imports without Lightning."""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import replaykit as rk
from replaykit.protections import in_scope
from replaykit.testing.hazards import KNOWN_LIMITS, PATTERNS, REPLAYED, run_all, run_pattern
from replaykit.testing.hazards import lightning_whole_step as lws

ROOT = Path(__file__).resolve().parents[2]
WHOLE_STEP = [p for p in PATTERNS if p.api == "whole_step"]


def test_the_catalogue_lists_the_whole_step_patterns_in_the_classes_they_belong_to() -> None:
    assert WHOLE_STEP == lws.PATTERNS
    assert {p.hazard for p in WHOLE_STEP} >= {
        "host_values",
        "step_python",
        "host_state",
        "leaving_grads",
        "autograd_modes",
        "crashes",
        "autocast",
    }
    assert {p.name for p in lws.KNOWN_LIMITS} <= {p.name for p in KNOWN_LIMITS}
    guards = {g for p in WHOLE_STEP if p.guard for g in p.guard.split("+")}
    assert guards <= set(in_scope("step")), guards - set(in_scope("step"))
    assert {"hooks", "loss_inputs", "host_rng", "module_state", "optimizer_trust"} <= guards
    assert {"foreign_grads", "autograd_modes", "host_values"} <= guards


@pytest.mark.slow  # every whole-step pattern, Lightning Trainers included
def test_the_whole_step_patterns_replay_most_of_the_time_and_never_fail() -> None:
    """Replay coverage of the new entry point on the emulated backend: routing everything eager
    would keep the contract and replay nothing."""
    outcomes = run_all("emulated", WHOLE_STEP)
    assert not [o.line() for o in outcomes if o.failed]
    replayed = {o.pattern for o in outcomes if o.kind == REPLAYED}
    assert replayed >= {
        "whole_step_plain_sgd",
        "whole_step_focal_gamma_schedule",  # re-recorded per gamma, within the budget
        "whole_step_global_loss_weight",
        "whole_step_numpy_array_gain_float",
        "whole_step_max_norm_changed",
        "whole_step_saved_tensors_compression",  # replays until the hooks come
        "whole_step_resume_sgd_checkpoint",
        "whole_step_bf16_mixed",
        "whole_step_trainer_bf16_mixed",
        "whole_step_unfreeze_mid_fit",  # re-recorded when the layer thaws
        "whole_step_head_replaced_mid_fit",  # re-recorded for the new head's parameters
    }, replayed


def test_a_float_lr_changed_every_step_replays_the_network_with_the_optimizer_step_eager() -> None:
    """A float lr set at every step no longer spends the recording budget (all eager): after the
    second value the optimizer step runs eagerly after each replay, and nothing warns."""
    pat = next(p for p in WHOLE_STEP if p.name == "whole_step_lambda_lr_float")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always", rk.ReplayWarning)
        outcome = run_pattern(pat, "emulated")
    assert outcome.kind == REPLAYED and not outcome.failed, outcome.line()
    assert "budget" not in outcome.journal["eager_reasons"], outcome.journal
    assert not [w for w in seen if issubclass(w.category, rk.ReplayWarning)]


def test_the_rest_of_the_catalogue_imports_without_lightning() -> None:
    code = (
        "import sys; sys.modules['lightning'] = None\n"
        "from replaykit.testing.hazards import PATTERNS\n"
        "apis = {p.api for p in PATTERNS}\n"
        "assert apis == {'capture', 'step'}, apis"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_importing_the_catalogue_imports_no_lightning() -> None:
    """A may_hang pattern's child process and the notebook import the catalogue: Lightning is
    imported only when a whole_step pattern runs."""
    code = (
        "import sys\n"
        "from replaykit.testing.hazards import PATTERNS, runner\n"
        "assert any(p.api == 'whole_step' for p in PATTERNS)\n"
        "assert 'lightning' not in sys.modules and 'replaykit.lightning' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
