"""Where ``loopkit.until`` can tell that a window boundary ends the epoch's pass over its data.

With a ``loopkit.distributed.loader`` known to it (``Checkpointer(loader=...)``), by the
loader's count: the batches handed out, less those a step's ``iterate`` holds back, reach
the pass's length, the same on every rank. Without one, only a step's ``iterate`` knows
where its iterable ends: it holds the next batch back while there is one, so a loop that
runs on it shows a held-back batch at its first micro-steps and none at its last. A loop
whose ``iterate`` was never seen holding a batch back (no ``iterate``, or a pass of a single
batch) cannot be told: its boundaries are taken as not ending the pass.
"""

from __future__ import annotations

from .._data._epoch_loader import EpochLoader
from .._types import Clock


class PassEnd:
    """What until knows of the current pass: the loader's count, or the clock's ``iterate``."""

    __slots__ = ("ahead", "clock", "last", "loader")

    def __init__(self, clock: Clock | None, loader: EpochLoader | None) -> None:
        self.clock = clock
        self.loader = loader
        self.ahead = False
        """The clock's ``iterate`` held a batch back earlier in this pass."""
        self.last = False
        """The last check was on the pass's last batch (``ends_by_iterate``)."""

    def watch(self) -> None:
        """At every check: a batch held back means the loop runs on ``iterate``, not at its end."""
        clock = self.clock
        if clock is not None and clock.lookahead:
            self.ahead = True
        self.last = self.ends_by_iterate()

    def new_pass(self) -> None:
        """A new epoch begins: nothing is known of its pass yet."""
        self.ahead = self.last = False

    def ends_by_iterate(self) -> bool:
        """The loop runs on the clock's ``iterate``, which has just handed out its last batch."""
        clock = self.clock
        return self.ahead and clock is not None and not clock.lookahead

    def epochs_done(self) -> int | None:
        """Passes of the loader finished at this boundary (None without a loader)."""
        loader = self.loader
        if loader is None:
            return None
        held = self.clock.lookahead if self.clock is not None else 0
        over = loader.position - held >= len(loader)
        return max(0, loader.epoch if over else loader.epoch - 1)
