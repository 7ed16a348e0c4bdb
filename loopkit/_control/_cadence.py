"""loopkit.cadence: when to validate (or log, or save), at window boundaries only.

"Every N updates" and "K times per epoch" (the guides' ``val_check_interval``) and "every
E epochs" (``check_val_every_n_epoch``) are functions of counts every rank shares (the
updates, the batches of the pass taken), so every rank fires on the same update with no
exchange, and never in the middle of a window.

What a cadence remembers (the update it last fired at, which a skipped window repeats, and
the calls it counts in a loop without a step) goes into the checkpoints of the
Checkpointer it is given, as a piece named by the cadence (``CadenceState``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from .._checkpoint._contract import expect, need
from .._checkpoint._save_resume import Checkpointer
from .._checks import is_int_at_least
from .._data._epoch_loader import EpochLoader
from .._errors import CheckpointError
from .._types import Clock
from ._boundaries import Boundaries, clock_of


def per_epoch_marks(batches: int, every: int, times: int) -> tuple[int, ...]:
    """Batches taken in a pass after which ``times`` evenly spread checks fire.

    Each mark is moved on to the end of its window (a multiple of ``every``, or the pass's
    last batch), so a check never falls inside a window; the last mark ends the pass.
    """
    marks = []
    for i in range(1, times + 1):
        target = math.ceil(i * batches / times)
        marks.append(min(batches, math.ceil(target / every) * every))
    return tuple(sorted(set(marks)))


def windows_per_pass(batches: int, every: int) -> int:
    """Windows in a pass of ``batches`` (the last may be short)."""
    return math.ceil(batches / every)


class CadenceState:
    """A cadence's saved state; a checkpoint piece (check, snapshot, load, restore).

    The schedule is saved to be compared: a resume with another one is refused before
    anything loads, since the update it last fired at would mean another thing.
    """

    per_rank = False

    def __init__(self, name: str, kind: str, value: int, boundaries: Boundaries) -> None:
        self.name, self.kind, self.value, self.boundaries = name, kind, value, boundaries
        self.fired_at: int | None = None
        """The update count ``updates=N`` last fired at (a skipped window repeats a count)."""

    def state_dict(self) -> dict[str, object]:
        """The schedule, the update last fired at, the calls counted without a step."""
        return {
            "kind": self.kind,
            "value": self.value,
            "fired_at": self.fired_at,
            "calls": self.boundaries.calls,
        }

    def check_state_dict(self, saved: object) -> None:
        """Raise CheckpointError if ``saved`` cannot be loaded here; changes nothing."""
        label = self.name
        state = expect(saved, Mapping, f"'{label}'")
        kind = need(state, "kind", str, f"'{label}.kind'")
        value = need(state, "value", int, f"'{label}.value'")
        if (kind, value) != (self.kind, self.value):
            raise CheckpointError(
                f"the checkpoint's cadence {label!r} was {kind}={value}, this one is "
                f"{self.kind}={self.value}: build it with the schedule it was saved with (a "
                "new schedule is a new cadence: start it in a new run)"
            )
        if "fired_at" not in state:
            raise CheckpointError(f"incomplete checkpoint: '{label}.fired_at' is missing")
        fired = state["fired_at"]
        if fired is not None and expect(fired, int, f"'{label}.fired_at'") < 1:
            raise CheckpointError(f"damaged checkpoint: '{label}.fired_at' is below 1")
        if need(state, "calls", int, f"'{label}.calls'") < 0:
            raise CheckpointError(f"damaged checkpoint: '{label}.calls' is negative")

    def snapshot(self) -> tuple[int | None, int]:
        return self.fired_at, self.boundaries.calls

    def load_state_dict(self, saved: Mapping[str, Any]) -> None:
        """Restore what ``state_dict`` returned (checked first)."""
        self.check_state_dict(saved)
        self.fired_at, self.boundaries.calls = saved["fired_at"], saved["calls"]

    def restore(self, snapshot: tuple[int | None, int]) -> None:
        self.fired_at, self.boundaries.calls = snapshot


class cadence:
    """Fires at window boundaries on a schedule: ``if val.due(): evaluate(...)``.

    Exactly one of ``updates=N`` (every N-th update), ``per_epoch=K`` (K times per pass of
    ``loader``, evenly spread, the last at the pass's end) or ``epochs=E`` (at the end of
    every E-th pass). ``per_epoch``/``epochs`` need ``loader=`` a
    ``loopkit.distributed.loader``, which knows its place in the pass. Call ``due()`` after
    each micro-step (or, without a loopkit step, after each optimizer step).

    ``checkpointer=ckpt`` (which must save the same step, or none for none) saves what the
    cadence remembers with every checkpoint, under ``name`` (default ``"cadence"``; give
    each cadence of a Checkpointer its own): the update it last fired at, so a resumed
    run whose first window is skipped (fp16 overflow, ``skip_nonfinite``) does not fire
    again at the update it resumed from, and without a step the updates it counts. Build
    it before ``ckpt.resume()``, and save after ``due()`` (the checkpoint then holds a fire
    at its boundary); a resume with a cadence added, removed, renamed or on another
    schedule is refused before anything loads. Without ``checkpointer=`` an
    ``updates=N`` cadence starts afresh after a resume: it may fire again at the update
    resumed from (if the first window after it is skipped) and, without a step, counts
    from the resume.
    """

    def __init__(
        self,
        step: object = None,
        *,
        updates: int | None = None,
        per_epoch: int | None = None,
        epochs: int | None = None,
        loader: EpochLoader | None = None,
        checkpointer: Checkpointer | None = None,
        name: str = "cadence",
    ) -> None:
        # Everything is checked before the Checkpointer is changed.
        clock = clock_of(step, "cadence")
        given = {
            k: v
            for k, v in (("updates", updates), ("per_epoch", per_epoch), ("epochs", epochs))
            if v is not None
        }
        if len(given) != 1:
            raise TypeError(
                "cadence needs exactly one of updates=N, per_epoch=K or epochs=E, got "
                + (", ".join(given) or "none")
            )
        ((kind, value),) = given.items()
        if not is_int_at_least(value, 1):
            raise ValueError(f"{kind} must be an int >= 1, got {value!r}")
        self._marks: tuple[int, ...] = ()
        if kind != "updates":
            if not isinstance(loader, EpochLoader):
                raise TypeError(
                    f"cadence({kind}=...) needs loader= a loopkit.distributed.loader (it knows "
                    "its place in the pass); with a plain DataLoader use updates=N"
                )
            every = clock.every if clock is not None else 1
            batches = len(loader)
            if kind == "per_epoch" and value > windows_per_pass(batches, every):
                raise ValueError(
                    f"per_epoch={value} but a pass has only {windows_per_pass(batches, every)} "
                    f"windows ({batches} batches, {every} per window): at most one check fits "
                    "in a window"
                )
            if kind == "per_epoch":
                self._marks = per_epoch_marks(batches, every, value)
        elif loader is not None:
            raise TypeError("loader= is only for per_epoch= or epochs=")
        if not isinstance(name, str) or not name:
            raise ValueError(f"name must be a non-empty str (the cadence's key in checkpoints), "
                             f"got {name!r}")  # fmt: skip
        boundaries = Boundaries(clock)
        state = CadenceState(name, kind, value, boundaries)
        if checkpointer is not None:
            _check_checkpointer(checkpointer, clock, name)
            checkpointer.check_can_add(name, state)
        self.kind, self.value, self.loader, self.name = kind, value, loader, name
        self.checkpointer = checkpointer
        self._boundaries, self._state = boundaries, state
        if checkpointer is not None:
            checkpointer.add(name, state)

    def due(self) -> bool:
        """Whether the schedule fires here: a window has just closed at one of its points."""
        updates = self._boundaries.new()
        if updates is None:
            return False
        if self.kind == "updates":
            # A skipped window ends with the count of the window before it: fired already.
            state = self._state
            due = updates > 0 and updates % self.value == 0 and updates != state.fired_at
            if due:
                state.fired_at = updates
            return due
        loader = self.loader
        assert loader is not None  # checked in __init__
        clock = self._boundaries.clock
        taken = loader.position - (clock.lookahead if clock is not None else 0)
        if clock is not None and taken % clock.every and taken != len(loader):
            raise RuntimeError(
                f"a window ended {taken} batches into the pass, not at a multiple of "
                f"{clock.every} nor at its end: the windows are not aligned with the loader's "
                "passes, so per-epoch points would be missed; loop over step.iterate(loader) "
                "(a loop that skips a bad batch: ask loop control after its failed micro-step "
                "too, `except ...: pass`, not `continue`, so its window ends in its place)"
            )
        if self.kind == "per_epoch":
            return taken in self._marks
        # epochs=E: the end of every E-th pass (loader.epoch is the pass's number + 1)
        return taken >= len(loader) and loader.epoch % self.value == 0

    def __repr__(self) -> str:
        named = "" if self.name == "cadence" else f", name={self.name!r}"
        return f"loopkit.cadence({self.kind}={self.value}{named})"


def _check_checkpointer(checkpointer: object, clock: Clock | None, name: str) -> None:
    """Refuse a Checkpointer that cannot carry this cadence's state; changes nothing."""
    if not isinstance(checkpointer, Checkpointer):
        raise TypeError(f"checkpointer must be a loopkit.Checkpointer, got {checkpointer!r}")
    if checkpointer.clock is not clock:
        if clock is None:
            which = "cadence was given no step but its checkpointer saves one"
        elif checkpointer.clock is None:
            which = "cadence follows a step but its checkpointer saves none"
        else:
            which = "cadence and its checkpointer follow different steps"
        raise ValueError(
            f"{which}: pass the same step to both (loopkit.cadence(step, ..., "
            "checkpointer=ckpt) with Checkpointer(..., step=step)), or none to either in a "
            "loop without loopkit.step; the update it last fired at would be restored "
            "against another count"
        )
    if isinstance(checkpointer.pieces.get(name), CadenceState):
        raise ValueError(
            f"this Checkpointer already saves a cadence named {name!r}: give each cadence "
            "its own name= (loopkit.cadence(..., checkpointer=ckpt, name='log'))"
        )
