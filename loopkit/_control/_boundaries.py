"""Window boundaries as loop control sees them: "a window just closed, at update u", once.

``loopkit.until`` and ``loopkit.cadence`` are asked after every micro-step (or, in a loop
without loopkit, after every optimizer step) and may act only where a window has just
closed: never in the middle of one, and once per update however often they are asked.
Both see the same boundaries on every rank, since a clock's counters are the same there.
"""

from __future__ import annotations

from .._step import _accumulate, _compose, _group
from .._types import Clock


def clock_of(stepper: object, who: str) -> Clock | None:
    """The clock of a ``step``/``steps``/``accumulate`` (None for None); TypeError otherwise."""
    if stepper is None:
        return None
    if isinstance(stepper, _compose.step):
        return stepper.accumulator
    if isinstance(stepper, (_group.steps, _accumulate.accumulate)):
        return stepper
    raise TypeError(
        f"{who} takes a loopkit.step, loopkit.steps or loopkit.accumulate (whose windows it "
        f"follows), or None in a loop without them, got {type(stepper).__name__}"
    )


class Boundaries:
    """Reports each window boundary once; without a clock each call is one update."""

    def __init__(self, clock: Clock | None) -> None:
        self.clock = clock
        self.calls = 0
        """Calls made without a clock (each one an update; saved by ``until``)."""
        self._last: int | None = None

    @property
    def updates(self) -> int:
        """Updates made so far, by the clock or by the calls."""
        return self.clock.updates if self.clock is not None else self.calls

    def new(self) -> int | None:
        """The update count if a window has closed since the last report, else None.

        A window whose update was skipped is reported too, with the unchanged count.
        """
        clock = self.clock
        if clock is None:
            self.calls += 1
            return self.calls
        updates = clock.updates
        # Windows closed, skipped ones included (fp16 inf/nan, skip_nonfinite): a skipped
        # update still ends its window, and every rank skips alike.
        closed = updates + getattr(clock, "skipped", 0)
        # The common answer first, with one read: no window has closed since the last ask
        # (mid-window, or asked twice at one boundary). Called after every micro-step.
        if closed == self._last or clock.micro_step:
            return None
        self._last = closed
        return updates
