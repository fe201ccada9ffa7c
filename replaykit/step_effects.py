"""Why a whole step's recording call must let a run stand: the effects a replay would not repeat.

A recording call runs the step's body twice (the eager reference, then the capture). After each
run, the effects it had outside the tensors it computed decide what happens: nothing a replay
would miss (go on), something learnt that later keys or recordings include (:class:`Learning`:
the run stands as the call, not a retirement), a write into the model an eager call makes once
(:class:`Wrote`: it stands, ``guards/fills.py`` decides what comes next), or a reason to retire.
A mixin of :class:`~replaykit.step.TrainStep` (through ``RecordingSteps``): its state is the step's.
"""

from __future__ import annotations

import torch

from .guards.host_choices import Watch
from .guards.input_reads import Provenance
from .guards.signature import CallArgs, arguments_written
from .verify.call_state import CallState
from .verify.dispatch import StorageReads
from .verify.output import HeldOutput
from .verify.side_effects import SideEffects

__all__ = ["HOST_DRAWS_CHANGED", "Learning", "RunEffects", "Wrote"]


class RunEffects:
    """The judgments of a recording call's runs, mixed into ``TrainStep``."""

    def _attribute_outputs(
        self, effects: SideEffects, reads: StorageReads | None, inputs: list[torch.Tensor]
    ) -> str | None:
        """The tensors the run assigned to attributes (an MoE's ``aux_loss``, DINO's re-bound
        centre) are recorded outputs, not effects (``memory/attribute_outputs.py``); a new one
        is learnt and this run stands as the call."""
        if reads is None:
            return None
        writes = [*effects.changed_attributes(), *effects.changed_entries()]
        own = (*self.params, *effects.buffers_before(), *inputs)
        outputs, why, new = self._attrs.learn(writes, reads.read, own)
        if why is not None:
            return why
        effects.exclude(outputs)
        if not new:
            return None
        names = ", ".join(f"{type(m).__name__}.{n}" for m, n in new)
        return Learning(
            f"the step assigns {names}: recorded from the next recording call", "first_write"
        )

    def _attribute_reads(self) -> StorageReads:
        """A watch over which of the model's tensor attributes a run's ops read (one that holds
        none, an aux loss set to None by the loop, needs no watching: nothing is read)."""
        return StorageReads(self._attrs.watched())

    def _reference_why(
        self,
        effects: SideEffects,
        found: Provenance | None,
        held: list,
        versions: list,
        state: CallState,
        choices: Watch | None,
    ) -> str | None:
        """Why the reference run must stand as the call (a replay would not repeat what it did), or None."""
        private = self._host_state_changed(state)
        if private is not None:
            return private
        why = effects.reason("the step", writes=self.on.side_effects)
        if why is not None and effects.reason("the step", python_draws=False) is None:
            why = self._learn_choices(why, choices)
        if why is not None and self.on.side_effects and effects.writes_only():
            return Wrote(why) if self._beyond_the_model() is None else why
        if (
            why is not None
            and self._input_reads.drawn_to is None
            and effects.reason("the step", host_draws=False, writes=self.on.side_effects) is None
        ):
            why = self._host_draws(found) or why
        if why is None:
            why = self._second_network(state) or self._beyond_the_model()
        if why is not None:
            return why
        known = set(map(id, self._written))
        written = [
            t for t, v in zip(held, versions, strict=True) if t._version != v and id(t) not in known
        ]
        if not written:
            return None
        # loose tensors are watched, not copied (maybe a dataset): it stands; later call states keep them
        self._written += written
        return Learning(
            f"loss_fn writes {len(written)} tensor(s) it holds in place: kept in the "
            "step's snapshots from the next recording call",
            "held_writes",
        )

    def _arguments_why(self, call: CallArgs, args: tuple, kwargs: dict) -> str | None:
        """The run wrote into a container the caller passed (``out["loss"] = ...``): a replay runs
        no Python, so the caller's container would stay empty. It stands, retired."""
        if not (self.on.side_effects and arguments_written(call, args, kwargs, call.tensors)):
            return None
        return (
            "loss_fn writes into a container it is passed (a list appended to, a dict filled): "
            "a replay runs no Python, the caller's container would stay as it was"
        )

    def _files_why(self, run: HeldOutput) -> str | None:
        """The run's own code opened a file for writing (a loss appended to a CSV): a replay runs
        no Python, and no later run can take a write back. It stands, retired."""
        if not (self.on.side_effects and run.written_files):
            return None
        return (
            f"the step opens {run.written_files[0]!r} for writing: a replay runs no Python, "
            "the file would not be written"
        )

    def _host_state_changed(self, state: CallState) -> str | None:
        """Python state the run changed that a replay would not: a private host generator the call
        reaches drawn from (``random.Random``, numpy's: ``verify/host_generators.py``), a tensor
        attribute of a module ``loss_fn`` holds re-bound (a teacher's centre). It stands, retired."""
        if self.on.host_rng:
            drawn = state.host_generators.drawn("the step")
            if drawn is not None:
                return drawn
        name = state.rebound() if self.on.side_effects else None
        if name is None:
            return None
        return f"loss_fn re-binds {name} (a module outside the model); a replay would not"

    def _learn_choices(self, why: str, choices: Watch | None) -> str:
        """The run's only effect was drawing from Python's or numpy's RNG: draws that only chose
        are keyed from the next call (``guards/host_choices.py``); others keep ``why``."""
        learnt = self._choices.learnt(choices)
        return why if learnt is None else Learning(learnt, "host_choices")

    def _choices_why(self, choices: Watch | None) -> str | None:
        """A run whose draws are not those its key learnt (another count, another comparison, a
        value used): a replay of this key would not make them."""
        return self._choices.changed("the step", choices)

    def _capture_why(
        self,
        effects: SideEffects,
        reads: Provenance | None,
        choices: Watch | None,
        state: CallState,
        run: HeldOutput,
    ) -> str | None:
        """Why replays of the captured run would differ from eager outside the tensors it computes."""
        private = self._files_why(run) or self._host_state_changed(state)
        if private is not None:
            return private
        why = effects.reason("the step", writes=self.on.side_effects)
        if why is not None and effects.reason("the step", python_draws=False) is None:
            return self._learn_choices(why, choices)
        if (
            why is None
            and reads is not None
            and (reads.escaped or not self._input_reads.draws_match(reads.draws))
        ):
            why = HOST_DRAWS_CHANGED
        if why is None:
            why = self._choices_why(choices)
        if why is not None:
            return why
        return self._second_network(state) or self._beyond_the_model()

    def _beyond_the_model(self) -> str | None:
        """Why replays of the run just watched (a recording's capture or its reference) would
        differ from eager outside what ``SideEffects`` sees: a second network, what loss_fn changes."""
        if self._foreign:
            return (
                f"loss_fn reaches {len(self._foreign)} tensor(s) requiring grad outside the model and the optimizer (a second "
                "network): a replay would not give them this call's gradients"
            )
        if self._loss_inputs is not None:
            changed = self._loss_inputs.changed(self._loss_key)
            if changed is not None:
                return f"loss_fn changes {changed}; a replay would not"
        return self._forward_changes() or self._class_writes()

    def _second_network(self, state: CallState) -> Learning | None:
        """The reference run's loss reached trainable parameters of a module loss_fn holds (a GAN's
        discriminator, a teacher trained too): their gradients are recorded from the next recording
        call (``memory/foreign.py``). None: none, or some owned by no such module (retires)."""
        found = self._foreign
        if not found:
            return None
        # the modules loss_fn holds outside the model, and one above it (a LightningModule's critic)
        above = [v for v in self._code()[0].values() if isinstance(v, torch.nn.Module)]
        if not self._foreign_leaves.learn(found, [*state.modules, *above]):
            return None
        self._foreign = []
        return Learning(
            f"loss_fn reaches {len(found)} parameter(s) of a second network: their gradients are "
            "recorded from the next recording call",
            "foreign_grads",
        )

    def _forward_changes(self) -> str | None:
        """Why replays would differ: the model's forward changed a value it names outside the model
        (``STATS["n"] += 1`` in a global dict; the call state put it back before this run, so this
        run's change is the call's one)."""
        if self._forward_inputs is None:
            return None
        changed = self._forward_inputs.changed(self._forward_key)
        if changed is not None:
            return f"the model's forward changes {changed}; a replay would not"
        if any(t._version != v for t, v in self._host_held):
            return (
                "the model's forward writes a CPU tensor it names (a global, a cell) beside a GPU "
                "model: a CUDA graph would not replay that host op"
            )
        return None

    def _class_writes(self) -> str | None:
        """A class attribute the forward changed (``type(self).calls += 1``): a replay would not
        (loss_fn's are its sources, found above)."""
        if not self.on.side_effects:
            return None
        changed = self._code()[1].changed(self._forward_key, classes=True)
        if changed is None:
            return None
        return f"forward changes class attribute {changed}; a replay would not"

    def _host_draws(self, found: Provenance | None) -> Learning | None:
        """The reference run's only effect was a draw from torch's CPU generator: learn the draws
        (``found``, this run's) and the reads made of them, or, at first sight, watch the next
        recording call's run for them. None: they cannot be keyed (a draw reaching the computation)."""
        if not self.on.input_reads or not self.on.host_rng:
            return None
        if found is None:
            if self._learn_draws:
                return None
            self._learn_draws = True
            return Learning("host draws: the next recording call learns them")
        if found.escaped or not found.draws:
            return None
        if not self._input_reads.learn_draws(found.reads, found.draws):
            return None
        self._watch_reads = True  # the capture answers their reads
        return Learning(
            f"{len(found.draws)} host draw(s), {len(found.reads)} read(s) of them: drawn before "
            "choosing a recording from now on"
        )


class Wrote(str):
    """The reference run wrote into the model (and did nothing else a replay would not): it stands as the call."""


class Learning(str):
    """A recording call's reference run stands as the call while something is learnt (host
    draws, tensors loss_fn writes): not a retirement. ``reason``: the journal's."""

    reason: str

    def __new__(cls, text: str, reason: str = "host_draws") -> Learning:
        self = super().__new__(cls, text)
        self.reason = reason
        return self


HOST_DRAWS_CHANGED = (
    "the step's draws from torch's CPU generator changed, or a drawn value reached its computation; "
    "a replay would repeat the first draw"
)
