"""The hazard catalogue and its runner: realistic training patterns that a frozen replay can get wrong.

    python -m replaykit.testing.hazards --backend emulated [--unsafe] [--hazard inputs] [--json out.json]

Modules (no module imports one listed after it):

    pattern        Pattern, Arm, the shared MLP and training loops every hazard module writes with
    two_backwards  a second backward through one forward (retain_graph, autograd.grad, create_graph)
    host_values    Python values a graph freezes (modes, momentum, dropout p, flags, configs)
    parameters     parameters that are not the module's own at call time (functional_call, ...)
    inputs         inputs written in place, aliased, strided; odd float arguments
    side_effects   what a replay would not repeat (generators, attributes set in forward, .item())
    lifecycle      weights changed between forward and backward, a step in another thread
    hook_order     parameter hooks and optimizers stepping inside backward
    autocast       a parameter used several times under autocast
    catalogue      HAZARDS, PATTERNS (realistic), KNOWN_LIMITS (still silent), by_hazard, pattern
    runner         run a pattern eager vs replayed, classify, tables, summary, the command line

Each pattern runs twice from the same seed, eagerly and replayed, and the end states
(parameters, ``.grad``, buffers, what ``train`` keeps) are compared bit for bit. The tests
(``tests/core/hazards/test_<class>.py``) run every pattern of a class on each backend, and
each guarded pattern with its guard switched off, which must then diverge.

Adding a pattern: write its model and ``train(model, arm) -> extras`` in the module of its
hazard class (most are one line with :func:`~.pattern.loop`), and append a
:class:`~.pattern.Pattern` to that module's ``PATTERNS``. Name the protection that keeps it
exact in ``guard`` (the ``unsafe_disable`` name): its unsafe arm must then diverge on the
backends it does not exclude. A pattern that is still a silent difference goes to the
module's ``KNOWN_LIMITS`` (and the README's Known limits) instead. A new hazard class is a
new module with ``HAZARD``, ``PATTERNS`` (and ``KNOWN_LIMITS``), listed in
``catalogue.MODULES``, with its test module.

Imports only torch and the public core API (``import replaykit as rk``).
"""

from .catalogue import HAZARDS, KNOWN_LIMITS, PATTERNS, by_hazard, pattern
from .pattern import MLP, Arm, Extras, Pattern
from .runner import (
    BOTH_RAISE,
    CLEAR_ERROR,
    EAGER_ONLY_RAISED,
    FAILURES,
    REPLAYED,
    RETIRED,
    ROUTED,
    SILENT_DIFF,
    UNCLEAR_ERROR,
    ArmResult,
    Diff,
    Outcome,
    classify,
    compare_states,
    end_state,
    main,
    rows,
    run_all,
    run_pattern,
    shows_unsafe,
    summary,
    table,
    verdict,
)

__all__ = [
    "BOTH_RAISE", "CLEAR_ERROR", "EAGER_ONLY_RAISED", "FAILURES", "HAZARDS", "KNOWN_LIMITS", "MLP", "PATTERNS",
    "REPLAYED", "RETIRED", "ROUTED", "SILENT_DIFF", "UNCLEAR_ERROR", "Arm", "ArmResult", "Diff", "Extras", "Outcome",
    "Pattern", "by_hazard", "classify", "compare_states", "end_state", "main", "pattern", "rows", "run_all",
    "run_pattern", "shows_unsafe", "summary", "table", "verdict",
]
