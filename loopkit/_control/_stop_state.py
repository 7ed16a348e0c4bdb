"""What ``loopkit.until`` carries across a resume, as its checkpoint piece.

The training time of the earlier runs (so ``max_time`` counts the whole run), the epochs
it counts itself (no ``loader=``), the updates it counts without a clock, and
``early_stop``'s counters. After a load, the first boundary pools the ranks' signals and
clocks whatever its number, so a run resumed past ``max_time`` stops there.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from .._checkpoint._contract import expect, need
from .._errors import CheckpointError
from ._boundaries import Boundaries
from ._early_stop import early_stop as EarlyStop


class UntilState:
    """until's saved state; a checkpoint piece (check, snapshot, load, restore)."""

    def __init__(
        self, timer: Callable[[], float], boundaries: Boundaries, early_stop: EarlyStop | None
    ) -> None:
        self._timer = timer
        self._t0 = timer()
        self.before = 0.0
        """Seconds trained before this process's clock started (by the runs resumed from)."""
        self.epoch = 0
        """The epoch ``epochs()`` yields next, when until counts them itself (no loader)."""
        self.boundaries = boundaries
        self.early_stop = early_stop
        self.pool_next = True
        """The next boundary pools signals and clocks (the first one, and after a resume)."""
        self.by_epochs = False
        """``epochs()`` counts the epochs (``max_epochs`` is reached when it goes on, after
        the last epoch's code), not ``check()`` (on the last pass's last window)."""
        self.epoch_done: Callable[[], bool] = lambda: False
        """Whether ``epoch``'s body is past its pass's loop: a checkpoint counts it done."""

    @property
    def elapsed(self) -> float:
        """Seconds of training so far, runs resumed from included (this rank's clock)."""
        return self.before + (self._timer() - self._t0)

    def state_dict(self) -> dict[str, object]:
        """Elapsed training time, self-counted epochs and updates, early_stop's counters."""
        return {
            "elapsed": self.elapsed,
            "epoch": self.epoch + self.epoch_done(),
            "calls": self.boundaries.calls,
            "early_stop": None if self.early_stop is None else self.early_stop.state_dict(),
            "by_epochs": self.by_epochs,
        }

    def check_state_dict(self, saved: object) -> None:
        """Raise CheckpointError if ``saved`` cannot be loaded here; changes nothing."""
        state = expect(saved, Mapping, "'until'")
        if need(state, "elapsed", (float, int), "'until.elapsed'") < 0:
            raise CheckpointError("damaged checkpoint: 'until.elapsed' is negative")
        for key in ("epoch", "calls"):
            if need(state, key, int, f"'until.{key}'") < 0:
                raise CheckpointError(f"damaged checkpoint: 'until.{key}' is negative")
        if not isinstance(state.get("by_epochs", False), bool):
            raise CheckpointError("damaged checkpoint: 'until.by_epochs' is not a bool")
        es = state.get("early_stop")
        if (es is None) != (self.early_stop is None):
            raise CheckpointError(
                "the checkpoint's until was built "
                + ("without" if es is None else "with")
                + " an early_stop, this one "
                + ("with" if es is None else "without")
                + ": pass the same objects as when saving"
            )
        if self.early_stop is not None:
            self.early_stop.check_state_dict(es)

    def snapshot(self) -> tuple[float, float, int, int, bool, object]:
        es = None if self.early_stop is None else self.early_stop.snapshot()
        return self.before, self._t0, self.epoch, self.boundaries.calls, self.pool_next, es

    def load_state_dict(self, saved: Mapping[str, Any]) -> None:
        """Restore what ``state_dict`` returned; the clock goes on from the saved time."""
        self.check_state_dict(saved)
        if self.early_stop is not None:
            self.early_stop.load_state_dict(saved["early_stop"])
        self.before, self.epoch = float(saved["elapsed"]), saved["epoch"]
        self.boundaries.calls = saved["calls"]
        self._t0 = self._timer()
        self.pool_next = True

    def restore(self, snapshot: tuple[float, float, int, int, bool, Any]) -> None:
        self.before, self._t0, self.epoch, self.boundaries.calls, self.pool_next, es = snapshot
        if self.early_stop is not None:
            self.early_stop.restore(es)
