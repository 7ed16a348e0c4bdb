"""loopkit.early_stop: stop when a watched metric has stopped improving.

The decision is taken at an observation, from the state as it is then: before
``min_updates`` no stop is taken, and a run of bad observations before it is not carried
past it as a stop already decided (Lightning#19966): an improvement in between resets the
count, and without one the first observation at or after ``min_updates`` decides. Every
rank observes the same values (checked in the one exchange per observation), so every rank
decides alike. The counters are a checkpoint piece: pass the object to
``Checkpointer(extra={"early_stop": es})``, or to ``loopkit.until(early_stop=...)``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Literal

import torch

from .. import _ranks
from .._checkpoint._contract import expect, need
from .._checks import is_int_at_least
from .._errors import CheckpointError
from .._sync_points import expected_sync
from ._boundaries import Boundaries, clock_of

Mode = Literal["min", "max"]
OnNan = Literal["stop", "raise"]


def improves(value: float, best: float | None, mode: Mode, min_delta: float) -> bool:
    """Whether ``value`` beats ``best`` by more than ``min_delta`` (any value beats None)."""
    if best is None:
        return True
    return value < best - min_delta if mode == "min" else value > best + min_delta


@dataclasses.dataclass
class _Record:
    """What resets together and is saved: the best value and the run of bad observations."""

    best: float | None = None
    wait: int = 0
    """Observations in a row that did not improve on ``best``."""
    observed: int = 0
    stopped: bool = False
    reason: str | None = None


class early_stop:
    """Stop when ``metric`` has not improved for ``patience`` observations in a row.

    ``es.observe(metrics)`` after each evaluation (every rank, the same values, e.g. a
    ``loopkit.evaluate`` result) returns whether to stop. ``mode="min"`` (a loss) or
    ``"max"`` (an accuracy); an improvement must beat the best by more than ``min_delta``.
    No stop is taken before ``min_updates`` updates of ``step`` (it needs ``step``). A NaN
    metric stops the run at once (``on_nan="stop"``) or raises ``FloatingPointError``
    (``on_nan="raise"``), on every rank alike.
    """

    def __init__(
        self,
        step: object = None,
        metric: str | None = "loss",
        *,
        patience: int,
        mode: Mode = "min",
        min_delta: float = 0.0,
        min_updates: int = 0,
        on_nan: OnNan = "stop",
    ) -> None:
        clock = clock_of(step, "early_stop")
        if metric is not None and not isinstance(metric, str):
            raise TypeError(f"metric must be the metric's name (a str) or None, got {metric!r}")
        if not is_int_at_least(patience, 1):
            raise ValueError(
                f"patience must be an int >= 1 (observations without improvement), got {patience!r}"
            )
        if mode not in ("min", "max"):
            raise ValueError(f'mode must be "min" (a loss) or "max" (an accuracy), got {mode!r}')
        if (
            not isinstance(min_delta, (int, float))
            or isinstance(min_delta, bool)
            or not math.isfinite(min_delta)
            or min_delta < 0
        ):
            raise ValueError(f"min_delta must be a finite number >= 0, got {min_delta!r}")
        if not is_int_at_least(min_updates, 0):
            raise ValueError(f"min_updates must be an int >= 0, got {min_updates!r}")
        if min_updates and clock is None:
            raise ValueError(
                "min_updates counts the updates of a step: pass it, "
                "early_stop(step, ..., min_updates=N)"
            )
        if on_nan not in ("stop", "raise"):
            raise ValueError(f'on_nan must be "stop" or "raise", got {on_nan!r}')
        self._boundaries = Boundaries(clock)
        self.metric, self.patience, self.mode = metric, patience, mode
        self.min_delta, self.min_updates, self.on_nan = float(min_delta), min_updates, on_nan
        self._record = _Record()

    # -- what a user reads ------------------------------------------------------------------

    @property
    def stopped(self) -> bool:
        """Whether an observation decided to stop."""
        return self._record.stopped

    @property
    def reason(self) -> str | None:
        """Why it stopped (``"no improvement"`` or ``"nan"``), None while it has not."""
        return self._record.reason

    @property
    def best(self) -> float | None:
        """The best value observed so far."""
        return self._record.best

    @property
    def wait(self) -> int:
        """Observations in a row without an improvement."""
        return self._record.wait

    # -- observing --------------------------------------------------------------------------

    def observe(self, metrics: Mapping[str, object] | torch.Tensor | float) -> bool:
        """Record one evaluation's value; whether the run should stop now.

        Call it on every rank with the same value: one small exchange checks that they
        agree (and reads the value to the host: one host read).
        """
        value = self._agreed(self._value_of(metrics))
        r = self._record
        if r.stopped:
            return True
        if math.isnan(value):
            if self.on_nan == "raise":
                raise FloatingPointError(
                    f"early_stop: the watched metric {self.metric or ''} is NaN"
                    " (on_nan='raise'; pass on_nan='stop' to stop the run instead)"
                )
            r.observed += 1
            r.stopped, r.reason = True, "nan"
            return True
        r.observed += 1
        if improves(value, r.best, self.mode, self.min_delta):
            r.best, r.wait = value, 0
        else:
            r.wait += 1
        if r.wait >= self.patience and self._boundaries.updates >= self.min_updates:
            r.stopped, r.reason = True, "no improvement"
        return r.stopped

    def _value_of(self, metrics: Mapping[str, object] | torch.Tensor | float) -> object:
        if isinstance(metrics, Mapping):
            if self.metric is None:
                raise TypeError(
                    "observe() got a mapping but early_stop was built with metric=None: "
                    "pass the value itself, or build it with metric='<name>'"
                )
            if self.metric not in metrics:
                raise KeyError(
                    f"observe() got no {self.metric!r} among {sorted(map(str, metrics))}: "
                    "pass the metrics early_stop watches, or build it with that metric= name"
                )
            return metrics[self.metric]
        return metrics

    def _agreed(self, value: object) -> float:
        """The value every rank passed (one exchange); ValueError on all ranks if they differ."""
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise ValueError(
                    f"observe() needs one number, got a tensor of shape {tuple(value.shape)}"
                )
            with expected_sync("early_stop's observation"):
                value = float(value.detach().reshape(()).item())  # host sync: one per observation
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"observe() needs a number or a 0-d tensor, got {type(value).__name__}")
        v = float(value)
        nan = math.isnan(v)
        finite = 0.0 if nan else v
        is_nan, high, neg_low = _ranks.max_values([float(nan), finite, -finite])
        if is_nan:
            return math.nan
        if high != -neg_low:
            raise ValueError(
                f"early_stop.observe() got different values on the ranks (from {-neg_low!r} "
                f"to {high!r}): observe a metric every rank agrees on, such as a "
                "loopkit.evaluate() result, so that every rank takes the same decision"
            )
        return v

    # -- checkpoint piece ---------------------------------------------------------------------

    def state_dict(self) -> dict[str, object]:
        """The best value, the patience count and the decision, for a checkpoint."""
        return dataclasses.asdict(self._record)

    def check_state_dict(self, saved: object) -> None:
        """Raise CheckpointError if ``saved`` is not an early_stop state; changes nothing."""
        state = expect(saved, Mapping, "'early_stop'")
        best = state.get("best")
        if best is not None:
            expect(best, (float, int), "'early_stop.best'")
        for key in ("wait", "observed"):
            if need(state, key, int, f"'early_stop.{key}'") < 0:
                raise CheckpointError(f"damaged checkpoint: 'early_stop.{key}' is negative")
        if not isinstance(state.get("stopped"), bool):
            raise CheckpointError("damaged checkpoint: 'early_stop.stopped' is not a bool")
        reason = state.get("reason")
        if reason is not None:
            expect(reason, str, "'early_stop.reason'")

    def snapshot(self) -> _Record:
        return dataclasses.replace(self._record)

    def load_state_dict(self, saved: Mapping[str, object]) -> None:
        """Restore what ``state_dict`` returned (checked first: nothing changes on error)."""
        try:
            self.check_state_dict(saved)
        except CheckpointError as err:
            raise ValueError(str(err)) from None
        best = saved.get("best")
        self._record = _Record(
            best=None if best is None else float(expect(best, (float, int), "'best'")),
            wait=need(saved, "wait", int, "'wait'"),
            observed=need(saved, "observed", int, "'observed'"),
            stopped=bool(saved["stopped"]),
            reason=None if saved.get("reason") is None else str(saved["reason"]),
        )

    def restore(self, snapshot: _Record) -> None:
        self._record = dataclasses.replace(snapshot)

    def __repr__(self) -> str:
        r = self._record
        return (
            f"loopkit.early_stop({self.metric!r}, patience={self.patience}, mode={self.mode!r}, "
            f"best={r.best}, wait={r.wait}, stopped={r.stopped})"
        )
