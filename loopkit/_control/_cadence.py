"""loopkit.cadence: when to validate (or log, or save), at window boundaries only.

"Every N updates" and "K times per epoch" (the guides' ``val_check_interval``) and "every
E epochs" (``check_val_every_n_epoch``) are functions of counts every rank shares (the
updates, the batches of the pass taken), so every rank fires on the same update with no
exchange, and never in the middle of a window.
"""

from __future__ import annotations

import math

from .._checks import is_int_at_least
from .._data._epoch_loader import EpochLoader
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


class cadence:
    """Fires at window boundaries on a schedule: ``if val.due(): evaluate(...)``.

    Exactly one of ``updates=N`` (every N-th update), ``per_epoch=K`` (K times per pass of
    ``loader``, evenly spread, the last at the pass's end) or ``epochs=E`` (at the end of
    every E-th pass). ``per_epoch``/``epochs`` need ``loader=`` a
    ``loopkit.distributed.loader``, which knows its place in the pass. Call ``due()`` after
    each micro-step (or, without a loopkit step, after each optimizer step).
    """

    def __init__(
        self,
        step: object = None,
        *,
        updates: int | None = None,
        per_epoch: int | None = None,
        epochs: int | None = None,
        loader: EpochLoader | None = None,
    ) -> None:
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
        ((name, value),) = given.items()
        if not is_int_at_least(value, 1):
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        self._marks: tuple[int, ...] = ()
        if name != "updates":
            if not isinstance(loader, EpochLoader):
                raise TypeError(
                    f"cadence({name}=...) needs loader= a loopkit.distributed.loader (it knows "
                    "its place in the pass); with a plain DataLoader use updates=N"
                )
            every = clock.every if clock is not None else 1
            batches = len(loader)
            if name == "per_epoch" and value > windows_per_pass(batches, every):
                raise ValueError(
                    f"per_epoch={value} but a pass has only {windows_per_pass(batches, every)} "
                    f"windows ({batches} batches, {every} per window): at most one check fits "
                    "in a window"
                )
            if name == "per_epoch":
                self._marks = per_epoch_marks(batches, every, value)
        elif loader is not None:
            raise TypeError("loader= is only for per_epoch= or epochs=")
        self.kind, self.value, self.loader = name, value, loader
        self._boundaries = Boundaries(clock)
        self._fired_at: int | None = None  # a skipped window repeats the update count

    def due(self) -> bool:
        """Whether the schedule fires here: a window has just closed at one of its points."""
        updates = self._boundaries.new()
        if updates is None:
            return False
        if self.kind == "updates":
            due = updates > 0 and updates % self.value == 0 and updates != self._fired_at
            if due:
                self._fired_at = updates
            return due
        loader = self.loader
        assert loader is not None  # checked in __init__
        clock = self._boundaries.clock
        taken = loader.position - (clock.lookahead if clock is not None else 0)
        if clock is not None and taken % clock.every and taken != len(loader):
            raise RuntimeError(
                f"a window ended {taken} batches into the pass, not at a multiple of "
                f"{clock.every} nor at its end: the windows are not aligned with the loader's "
                "passes, so per-epoch points would be missed; loop over step.iterate(loader)"
            )
        if self.kind == "per_epoch":
            return taken in self._marks
        # epochs=E: the end of every E-th pass (loader.epoch is the pass's number + 1)
        return taken >= len(loader) and loader.epoch % self.value == 0

    def __repr__(self) -> str:
        return f"loopkit.cadence({self.kind}={self.value})"
