"""The hazard catalogue and its runner: realistic training patterns that a frozen replay can get wrong.

    python -m replaykit.testing.hazards --backend emulated [--unsafe] [--hazard inputs] [--api whole_step] [--json out.json]

Modules (no module imports one listed after it):

    pattern        Pattern, Arm, the shared MLP and training loops every hazard module writes with
    writing        HazardClass (a module's pattern maker, capture/step twins), built, looped, stepped
    two_backwards  a second backward through one forward (retain_graph, autograd.grad, create_graph)
    host_values    Python values a graph freezes (modes, momentum, dropout p, flags, configs)
    parameters     parameters that are not the module's own at call time (functional_call, ...)
    inputs         inputs written in place, aliased, strided; odd float arguments
    side_effects   what a replay would not repeat (generators, attributes set in forward, .item())
    lifecycle      weights changed between forward and backward, a step in another thread
    hook_order     parameter hooks and optimizers stepping inside backward
    autocast       a parameter used several times under autocast
    step_python    Python a replay does not run around a whole step: hooks, what loss_fn reads, an optimizer's Python, the step's settings
    host_state     host RNG draws (numpy, random) and held containers or arrays changed in place
    autograd_modes anomaly detection, saved-tensor hooks, torch.func, checkpointing, an input written before backward
    leaving_grads  a loss that reaches trainable parameters outside the model (a GAN's discriminator)
    crashes        what eager accepts and a replay must run or refuse clearly (checkpoints, LSTM, LBFGS, non-Modules)
    backend_diffs  what one backend showed and the other did not (gradient sums, Adagrad, interrupts, checkpointed dropout)
    under_capture  code that computes differently while a graph is being captured
    recurrent      LSTM/GRU/RNN: the flat-weight cache, packed sequences' lengths, cuDNN's dropout state
    kept_outputs   outputs the caller keeps (an epoch metric's predictions, a view, a cache object)
    kept_grads     gradients the caller keeps across zero_grad(set_to_none=False) or micro-batches (views, .data)
    lightning_whole_step  the classes above under replaykit.lightning.whole_step, fitted by a Lightning Trainer
    catalogue      HAZARDS, PATTERNS (realistic), KNOWN_LIMITS (still silent), by_hazard, pattern
    outcome        the outcome kinds, the bitwise comparison, the classification of one run
    report         the table, one verdict per outcome, rows, the summary with the replay coverage
    deadline       a time limit per run: an in-process alarm, or a child process killed at the deadline
    runner         run a pattern (eager arm vs replay arm, under its deadline), the command line

Each pattern runs twice from the same seed, eagerly and replayed, and the end states
(parameters, ``.grad``, buffers, what ``train`` keeps) are compared bit for bit. The tests
(``tests/core/hazards/test_<class>.py``) run every pattern of a class on each backend, and
each guarded pattern with its guard switched off, which must then diverge.

Adding a pattern: write its model and ``train(model, arm) -> extras`` in the module of its
hazard class, and append a :class:`~.pattern.Pattern` to that module's ``PATTERNS`` (most
modules write them with their :class:`~.writing.HazardClass`, ``HC.pattern(...)``, or
``*HC.twins(...)`` for a capture pattern and its whole-step twin). Name
the protection that keeps it exact in ``guard`` (its ``unsafe_disable`` name): its unsafe
arm must then diverge on the backends it does not exclude (``cuda_only``, ``cpu_only``,
``unsafe_never`` say why not). A pattern that is still a silent difference goes to the
module's ``KNOWN_LIMITS`` (and the README's Known limits) instead. A new hazard class is a
new module with ``HAZARD``, ``PATTERNS`` (and ``KNOWN_LIMITS``), listed in
``catalogue.MODULES``, with its test module ``tests/core/hazards/test_<class>.py``.

- A **capture** pattern (``api="capture"``, the default) trains its model as plain PyTorch
  (most are one line with :func:`~.pattern.loop`); the runner captures the model (or
  ``target(model)``) with ``rk.capture`` in the replay arm::

      Pattern("submodule_bn_eval", "host_values", "model.bn.eval() after recording",
              mlp(bn=True), lambda m, a: loop(m, a, steps=4, before=set_at(2, lambda m: m.bn.eval())),
              guard="module_state")

- A **step** pattern (``api="step"``) builds its training step with ``arm.train_step(model,
  loss_fn, optimizer, **TrainStep_kwargs)``: ``rk.TrainStep`` replaying in the replay arm,
  its eager twin (``replay=False``) in the eager arm, from the same seed; the optimizer's
  state joins the end state, and ``guard`` names a ``TrainStep`` protection.
  :func:`~.pattern.step_loop` is the plain loop (``loss = step(x)`` per batch, ``before(model,
  optimizer, step)`` for what the user does between steps). From ``host_values.py``::

      Pattern("step_plain_sgd", "host_values", "a plain SGD step (momentum, float lr): the control",
              mlp(), lambda m, a: step_loop(m, a), api="step")            # replayed bitwise

      def _lr_scaled_at(at, factor):                                      # the user's hand on the lr
          def before(model, opt, step):
              if step == at:
                  for group in opt.param_groups:
                      group["lr"] = group["lr"] * factor
          return before

      Pattern("step_float_lr_changed", "host_values", "a float lr halved by hand after recording",
              mlp(), lambda m, a: step_loop(m, a, steps=6, before=_lr_scaled_at(3, 0.5)),
              guard="host_values", api="step")   # records anew at the new lr; unsafe: SILENT DIFF

- A **whole_step** pattern (``api="whole_step"``, in :mod:`.lightning_whole_step`) fits a
  LightningModule in manual optimization whose ``training_step`` calls
  ``replaykit.lightning.whole_step``, with a small ``Trainer``: replaying in the replay arm, the
  step's eager twin in the eager arm. Its ``hazard`` is the class it belongs to (it runs with
  that class's tests); :func:`~.lightning_whole_step.fit` is its loop, a ``Plan`` says what the
  user's ``training_step`` does::

      Pattern("whole_step_global_loss_weight", "step_python", "a module-level loss weight set to 0 after 3 steps",
              fitted(), lambda m, a: fit(m, a, loss_fn=_global_weighted_loss, before=at(3, off)),
              guard="loss_inputs", api="whole_step")

  Lightning is imported only when such a pattern runs; the catalogue lists them where it is
  installed.

- A pattern that can hang in native code (a CUDA capture, a lock in the autograd engine)
  says ``may_hang=True``: it runs in a child process killed at its deadline (``timeout_s``,
  default ``runner.TIMEOUT_S``); every other pattern has an in-process deadline
  (:mod:`.deadline` says why the two). A child finds its pattern by module and name, so
  such a pattern must be in the catalogue or a module-level ``Pattern`` (or list).

Imports only torch and the public core API (``import replaykit as rk``).
"""

from .catalogue import HAZARDS, KNOWN_LIMITS, PATTERNS, by_hazard, pattern
from .outcome import (
    BOTH_RAISE,
    CLEAR_ERROR,
    CRASHED,
    DIVERGENCES,
    EAGER_ONLY_RAISED,
    FAILURES,
    HANG,
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
)
from .pattern import APIS, MLP, Arm, Extras, Pattern, loop, step_loop
from .report import coverage, rows, summary, table, verdict
from .runner import TIMEOUT_S, end_state, main, run_all, run_pattern, runs_in_child, shows_unsafe

__all__ = [
    "APIS",
    "BOTH_RAISE",
    "CLEAR_ERROR",
    "CRASHED",
    "DIVERGENCES",
    "EAGER_ONLY_RAISED",
    "FAILURES",
    "HANG",
    "HAZARDS",
    "KNOWN_LIMITS",
    "MLP",
    "PATTERNS",
    "REPLAYED",
    "RETIRED",
    "ROUTED",
    "SILENT_DIFF",
    "TIMEOUT_S",
    "UNCLEAR_ERROR",
    "Arm",
    "ArmResult",
    "Diff",
    "Extras",
    "Outcome",
    "Pattern",
    "by_hazard",
    "classify",
    "compare_states",
    "coverage",
    "end_state",
    "loop",
    "main",
    "pattern",
    "rows",
    "run_all",
    "run_pattern",
    "runs_in_child",
    "shows_unsafe",
    "step_loop",
    "summary",
    "table",
    "verdict",
]
