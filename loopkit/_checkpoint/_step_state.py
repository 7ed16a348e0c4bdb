"""The checkpoint pieces for ``step=``: a ``loopkit.step`` or ``accumulate``, a ``steps`` group.

Each checks a saved state against the step (accumulation, precision, what the step owns:
its scheduler, GradScaler, averages and log) and loads it.
"""

from __future__ import annotations

import warnings
from collections.abc import Collection, Mapping
from typing import Any, cast

from .._errors import CheckpointError
from .._step import _accumulate, _compose, _group
from .._types import Clock, Stateful
from ._amp_state import AmpState, check_precision
from ._contract import UserState, copied, expect, need


class StepState(UserState):
    """A ``loopkit.step``'s or ``accumulate``'s counters, its GradScaler, precision and own
    scheduler (the one given to the step, unless the Checkpointer saves it under
    ``scheduler=`` or ``extra=``); an ``accumulate``'s ``amp=`` likewise; a step's own
    ``log=`` (its cadence, unflushed values and trackers' runs), unless under ``extra=``.

    The log is not training state, so its entry is lenient both ways: a checkpoint without
    it resumes with the log afresh, and one with it where the step has no log ignores it;
    a log state for other sinks is refused before anything loads."""

    def __init__(
        self,
        step: _compose.step | _accumulate.accumulate,
        elsewhere: Collection[int] = (),
        who: str = "step",
    ) -> None:
        super().__init__(step)
        self.step, self.who = step, who
        self.accumulator = step.accumulator if isinstance(step, _compose.step) else step
        self.seen = step.seen if isinstance(step, _compose.step) else None
        log = step.log if isinstance(step, _compose.step) else None
        # The step's own log (it plots against this step), unless extra= saves it.
        own_log = log is not None and log.clock is step and id(log) not in elsewhere
        self.log = log if own_log else None
        self.clock: Clock = self.accumulator
        amp = step.amp if isinstance(step, _compose.step) else self.accumulator.amp
        self.precision = None if amp is None else amp.precision
        # What the step owns that no other piece saves (``elsewhere``: ids of those objects).
        own_amp = amp if isinstance(step, _accumulate.accumulate) else None
        self.amp = None if own_amp is None or id(own_amp) in elsewhere else own_amp
        scheduler = self.accumulator._rule.scheduler
        if scheduler is not None and not isinstance(scheduler, Stateful):
            # loopkit.step takes any object with step(); one whose lr is a function of what
            # the checkpoint restores (the optimizer's step count) needs no state of its own.
            warnings.warn(
                f"the {who}'s scheduler ({type(scheduler).__name__}) has no state_dict() and "
                "load_state_dict(), so checkpoints do not hold it: if it keeps state of its "
                "own (a step count), give it those two methods or a resumed run restarts it",
                stacklevel=4,
            )
            scheduler = None
        self.scheduler: Stateful | None = (
            None if scheduler is None or id(scheduler) in elsewhere else scheduler
        )
        # The step's ema= (one, or several decays), unless saved under extra=.
        self.emas = [e for e in self.accumulator._rule.emas if id(e) not in elsewhere]

    def _counters(self, saved: Mapping[str, object]) -> Mapping[str, object]:
        if isinstance(self.step, _compose.step):
            return need(saved, "accumulate", Mapping, "'step.accumulate'")
        return saved

    def owned_state(self) -> dict[str, object]:
        """The precision and what the step owns beyond its counters and GradScaler."""
        state: dict[str, object] = {}
        if self.log is not None:
            state["log"] = self.log.state_dict()
        if self.precision is not None:
            state["precision"] = self.precision
        if self.scheduler is not None:
            state["scheduler"] = self.scheduler.state_dict()
        if self.amp is not None:
            state["amp"] = self.amp.state_dict()
        if self.emas:  # one average saved as itself (as before several were taken)
            states = [e.state_dict() for e in self.emas]
            state["ema"] = states[0] if len(states) == 1 else states
        return state

    def state_dict(self) -> dict[str, object]:
        return {**self.step.state_dict(), **self.owned_state()}

    def check_state_dict(self, saved: object) -> None:
        state = expect(saved, Mapping, "'step'")
        counters = self._counters(state)
        amp = self.step.amp if isinstance(self.step, _compose.step) else self.amp
        if amp is not None:
            AmpState(amp, self.who).check_state_dict(need(state, "amp", Mapping, "'step.amp'"))
        elif "amp" in state:
            raise CheckpointError(
                f"the checkpoint's {self.who} holds an amp= state but this run's accumulate "
                "has none (or the Checkpointer saves it under amp=): build it as when saving"
            )
        check_precision(state.get("precision"), self.precision, self.who)
        if self.log is not None and "log" in state:
            self.log.check_state_dict(state["log"])  # its sinks: the same as when saving
        self._check_owned(state, "scheduler", self.scheduler, "scheduler=/extra=")
        self._check_owned(state, "ema", self.emas or None, "extra=")
        if self.emas:
            saved_emas = _ema_states(state["ema"])
            if len(saved_emas) != len(self.emas):
                raise CheckpointError(
                    f"the checkpoint's {self.who} holds {len(saved_emas)} ema(s) but this run's "
                    f"has {len(self.emas)}: give the step the same averages (ema=[...]) as when "
                    "saving"
                )
            for average, saved_ema in zip(self.emas, saved_emas, strict=True):
                average.check_state_dict(saved_ema)
        every = need(counters, "every", int, "the step's 'every'")
        if every != self.accumulator.every:
            raise CheckpointError(
                f"saved with accumulate every={every} but this run's {self.who} accumulates "
                f"every={self.accumulator.every}: build the step with accumulate={every} to "
                "resume it"
            )
        for key in ("updates", "skipped"):
            if need(counters, key, int, f"the step's {key!r}") < 0:
                raise CheckpointError(f"damaged checkpoint: the step's {key!r} is negative")

    def _check_owned(self, state: Mapping[str, object], key: str, piece: object,
                     elsewhere: str) -> None:  # fmt: skip
        """Refuse a checkpoint that has the step's ``key`` (scheduler, ema) where this run's
        step has none, or the other way round; ``elsewhere``: where else it could be saved."""
        if piece is not None and key not in state:
            raise CheckpointError(
                f"this run's {self.who} is built with {key}= but the checkpoint holds no "
                f"state for it (saved without one, or under the Checkpointer's {elsewhere}): "
                "build the step and the Checkpointer as when saving"
            )
        if piece is None and key in state:
            raise CheckpointError(
                f"the checkpoint holds the {self.who}'s {key} but this run's {self.who} has "
                f"none (or the Checkpointer saves it under {elsewhere}): build the step and "
                "the Checkpointer as when saving"
            )

    def snapshot(self) -> object:
        # What was seen, exactly: a load also marks the next pass as the saved one going on.
        return copied(self.state_dict()), None if self.seen is None else self.seen.snapshot()

    def load_state_dict(self, saved: object) -> None:
        state = expect(saved, Mapping, "'step'")
        self.step.load_state_dict(state)  # reads its own entries only
        self.load_owned(state)

    def load_owned(self, saved: Mapping[str, object]) -> None:
        """Load what ``owned_state`` saved (the step's own entries are loaded apart)."""
        log_state = saved.get("log")
        if self.log is not None and isinstance(log_state, Mapping):
            self.log.load_state_dict(log_state)
        if self.scheduler is not None:
            self.scheduler.load_state_dict(saved["scheduler"])
        if self.amp is not None:
            amp_state = saved["amp"]
            assert isinstance(amp_state, Mapping)  # check_state_dict made sure
            self.amp.load_state_dict(amp_state)
        if self.emas:  # check_state_dict made sure they fit
            for average, ema_state in zip(self.emas, _ema_states(saved["ema"]), strict=True):
                average.load_state_dict(ema_state)

    def restore(self, snapshot: object) -> None:
        state, seen = cast("tuple[object, Any]", snapshot)  # as snapshot() made it
        self.load_state_dict(state)
        if self.seen is not None:
            self.seen.restore(seen)

    def saved_updates(self, saved: object) -> int:
        """The update count in a checked saved state."""
        updates = self._counters(expect(saved, Mapping, "'step'"))["updates"]
        assert isinstance(updates, int)  # check_state_dict made sure
        return updates


def _ema_states(saved: object) -> list[Mapping[str, object]]:
    """A step's saved averages as a list (one average is saved as itself)."""
    if isinstance(saved, Mapping):
        return [saved]
    if isinstance(saved, list) and all(isinstance(e, Mapping) for e in saved):
        return saved
    raise CheckpointError(f"damaged checkpoint: the step's ema state is a {type(saved).__name__}")


class StepsState(UserState):
    """A ``loopkit.steps`` group: each member's state (as a single step's), the clock's windows."""

    def __init__(self, group: _group.steps, elsewhere: Collection[int] = ()) -> None:
        super().__init__(group)
        self.group = group
        self.clock: Clock = group
        self._members = [
            StepState(m, elsewhere, f"group's step {i}") for i, m in enumerate(group.members)
        ]

    def state_dict(self) -> dict[str, object]:
        state = dict(self.group.state_dict())
        state["steps"] = [
            {**saved, **piece.owned_state()}
            for saved, piece in zip(state["steps"], self._members, strict=True)
        ]
        return state

    def check_state_dict(self, saved: object) -> None:
        state = expect(saved, Mapping, "'step'")
        members = need(state, "steps", list, "'step.steps'")
        if len(members) != len(self._members):
            raise CheckpointError(
                f"saved with {len(members)} steps in the group but this run's group has "
                f"{len(self._members)}: build loopkit.steps(...) with the same steps, in order"
            )
        for piece, member in zip(self._members, members, strict=True):
            piece.check_state_dict(member)
        if need(state, "updates", int, "the group's 'updates'") < 0:
            raise CheckpointError("damaged checkpoint: the group's 'updates' is negative")

    def snapshot(self) -> object:
        return copied(self.state_dict()), [m.seen.snapshot() for m in self.group.members]

    def load_state_dict(self, saved: object) -> None:
        state = expect(saved, Mapping, "'step'")
        self.group.load_state_dict(state)  # every member's own entries, and the clock
        members = state["steps"]
        assert isinstance(members, list)  # check_state_dict made sure
        for piece, member in zip(self._members, members, strict=True):
            piece.load_owned(member)

    def restore(self, snapshot: object) -> None:
        state, seen = cast("tuple[object, list[Any]]", snapshot)  # as snapshot() made it
        self.load_state_dict(state)
        for member, member_seen in zip(self.group.members, seen, strict=True):
            member.seen.restore(member_seen)

    def saved_updates(self, saved: object) -> int:
        """The clock's windows in a checked saved state."""
        updates = expect(saved, Mapping, "'step'")["updates"]
        assert isinstance(updates, int)  # check_state_dict made sure
        return updates
