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
    """Reports each window boundary once; without a clock each call is one update.

    A boundary is a window that closed since the last report: none at first, where the
    tracker is built (a group's window counted as its last batch began closes in that
    batch, so is still to come), nor where the clock was last resumed (its loaded windows
    closed in the run it was saved from).
    """

    def __init__(self, clock: Clock | None) -> None:
        self.clock = clock
        # An accumulate (a step's): its counters read directly on the common path below.
        self._acc = clock if isinstance(clock, _accumulate.accumulate) else None
        self.calls = 0
        """Calls made without a clock (each one an update; saved by ``until``)."""
        self._last = 0
        self._load: object = None
        if clock is not None:
            self._load = _last_load(clock)[0]
            self._last = _closed(clock) - bool(getattr(clock, "_counted", False))

    @property
    def updates(self) -> int:
        """Updates made so far, by the clock or by the calls."""
        return self.clock.updates if self.clock is not None else self.calls

    def new(self) -> int | None:
        """The update count if a window has closed since the last report, else None.

        A window whose update was skipped is reported too, with the unchanged count.
        """
        acc = self._acc
        if (
            acc is not None
            and acc._window.micro
            and not acc._window.overdue  # (closed by settle() below)
            and acc._progress is self._load
        ):
            # Asked mid-window, not resumed since: the common answer, with no call (what
            # follows would find the same: the load seen, settle() a nonzero micro-step).
            return None
        clock = self.clock
        if clock is None:
            self.calls += 1
            return self.calls
        load, loaded = _last_load(clock)
        if load is not self._load:  # resumed since: only windows closed after it are new
            self._load = load
            if loaded is not None:
                self._last = loaded
        # Asked first, on every call: a group learns from these calls where the loop asks
        # loop control (before or after its micro-steps), and closes a window's last batch
        # there. Then the common answer: no window has closed since the last report
        # (mid-window, or asked twice at one boundary).
        if clock.settle():
            return None
        updates = clock.updates
        closed = _closed(clock)
        if closed == self._last:
            return None
        self._last = closed
        return updates


def _closed(clock: Clock) -> int:
    """Windows closed, skipped ones included (fp16 inf/nan, skip_nonfinite).

    A skipped update still ends its window, and every rank skips alike.
    """
    return clock.updates + int(getattr(clock, "skipped", 0))


def _last_load(clock: Clock) -> tuple[object, int | None]:
    """The clock's last load (a new object per load) and the windows closed as it loaded.

    An accumulate's counters (``Progress``) are replaced by a load; a group keeps a tuple.
    """
    progress = getattr(clock, "_progress", None)
    if progress is not None:
        loaded: int | None = progress.loaded
        return progress, loaded
    mark: tuple[int, int] | None = getattr(clock, "_loaded", None)
    return mark, None if mark is None else mark[1]
