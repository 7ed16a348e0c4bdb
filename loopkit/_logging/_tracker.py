"""What every experiment-tracker sink shares: rank zero only, a lazy start, hyperparameters
once, and a resume into the same run that writes no point twice and drops none.

A tracker sink is called like any sink (``sink(metrics, step=, axes=)``) and also has
``config(params)``, ``state_dict()``/``load_state_dict()`` (the run id, the last step
written and how many points were written at it: a ``Checkpointer`` carries them through
``detach_logging``) and ``close()``. The run starts at the first write, never at
construction, so a resume can hand it the run id first.

Each point has a position in the run: its step and its rank among the points at that step
(a log that flushes more often than the step updates writes several points per step). A
resumed run is bit-identical to the one that was stopped and replays its points from the
checkpoint's position on, so it drops exactly the points up to the last position the run
already holds (after a kill -9 that may be beyond the checkpoint: the backend says where,
when it can tell) and writes the rest. A state saved without the count (an older
checkpoint) drops every point up to the last step held, as it did then.
"""

from __future__ import annotations

import abc
import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .. import _ranks
from .._checks import is_int_at_least

Position = tuple[int, float]
"""(step, how many points at that step so far): ``inf`` where the count is unknown."""


class Tracker(abc.ABC):
    """Base of the tracker sinks; a subclass opens, writes to and finishes its run."""

    def __init__(self) -> None:
        self.run_id: str | None = None
        """The run this sink writes to (known once it has started, or after a resume)."""
        self.last_step: int | None = None
        """The step of the last point the run holds (written, or held when resumed)."""
        self.last_count: int | None = 0
        """How many points the run holds at ``last_step`` (None: unknown, an old state)."""
        self._config: dict[str, Any] = {}
        self._started = False
        self._closed = False
        self._resumed = False
        self._held: Position | None = None  # after a resume: the last position the run holds

    # -- what a tracker does (subclasses) -----------------------------------------------------

    @abc.abstractmethod
    def _start(self, run_id: str | None) -> str:
        """Open the run (resume ``run_id`` if given); return its id."""

    @abc.abstractmethod
    def _write(self, values: dict[str, float], step: int) -> None:
        """Write one point of every value at ``step``."""

    @abc.abstractmethod
    def _write_config(self, params: dict[str, Any]) -> None:
        """Record hyperparameters."""

    def _wrote(self, step: int, count: int) -> None:  # noqa: B027 - optional, no-op here
        """After a write: the run now holds ``count`` points at ``step`` (a side-car's cue)."""

    def _held_through(self) -> tuple[int, int] | int | None:
        """The last step the resumed run holds and how many points it holds at that step,
        where the backend can tell (else None); a bare step: the count is unknown."""
        return None

    @abc.abstractmethod
    def _finish(self) -> None:
        """End the run."""

    # -- the sink -----------------------------------------------------------------------------

    def __call__(
        self, metrics: dict[str, float], *, step: int, axes: Mapping[str, float] | None = None
    ) -> None:
        if _ranks.world()[0] != 0:
            return
        if self._closed:
            raise RuntimeError(f"{type(self).__name__} was closed: build a new one to log again")
        self._ensure_started()
        position = self._next(step)
        if self._held is not None:
            if position <= self._held:
                self._hold(position)  # the resumed run already holds this point
                return
            self._held = None
        values = {k: v for k, v in (axes or {}).items() if k != "updates"}
        values.update(metrics)
        self._write(values, step)
        self._hold(position)
        assert self.last_count is not None  # a written point's position is known
        self._wrote(step, self.last_count)

    def _next(self, step: int) -> Position:
        """The position of a point at ``step``, after the last one the run holds."""
        if step != self.last_step:
            return (step, 1)
        return (step, math.inf if self.last_count is None else self.last_count + 1)

    def _hold(self, position: Position) -> None:
        step, count = position
        self.last_step, self.last_count = step, None if math.isinf(count) else int(count)

    def config(self, params: Mapping[str, Any]) -> None:
        """Log hyperparameters once; a key given again must keep its value."""
        if _ranks.world()[0] != 0:
            return
        changed = [k for k, v in params.items() if k in self._config and self._config[k] != v]
        if changed:
            raise ValueError(
                f"hyperparameters are logged once: {changed} already hold "
                f"{[self._config[k] for k in changed]}; log a changing value as a metric"
            )
        new = {k: v for k, v in params.items() if k not in self._config}
        self._config.update(new)
        if self._started and new:
            self._write_config(new)

    def state_dict(self) -> dict[str, Any]:
        """The run's id, the last step it holds and how many points at it, for a checkpoint."""
        return {"run_id": self.run_id, "last_step": self.last_step, "count": self.last_count}

    def check_state_dict(self, state: object) -> None:
        """Raise what ``load_state_dict(state)`` would raise; changes nothing."""
        if not isinstance(state, Mapping) or not {"run_id", "last_step"} <= set(state):
            raise ValueError(f"not a tracker sink's state (run_id, last_step): {state!r}")
        step, count = state["last_step"], state.get("count")
        step_ok = step is None or (isinstance(step, int) and not isinstance(step, bool))
        if not step_ok or (count is not None and not is_int_at_least(count, 0)):
            raise ValueError(
                f"not a tracker sink's state: last_step must be an int or None and count an "
                f"int >= 0 or None, got {step!r} and {count!r}"
            )
        if self._started and dict(state) != self.state_dict():  # its own state: a no-op
            raise RuntimeError(
                f"{type(self).__name__} has already started run {self.run_id!r}: resume the "
                "checkpoint (ckpt.resume()) before the first log flush"
            )

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume the saved run (before this sink has written anything)."""
        self.check_state_dict(state)
        self.run_id, self.last_step = state["run_id"], state["last_step"]
        # A state saved before the count was kept: unknown, so the whole step counts as held.
        self.last_count = state.get("count") if self.last_step is not None else 0
        self._resumed = self.run_id is not None

    def close(self) -> None:
        """Finish the run (once; nothing if it never started)."""
        if self._started and not self._closed:
            self._finish()
        self._closed = True

    def _ensure_started(self) -> None:
        if self._started:
            return
        self.run_id = self._start(self.run_id if self._resumed else None)
        self._started = True
        if self._resumed:
            self._held = _last_held(self._position(), self._held_through())
        if self._config:
            self._write_config(dict(self._config))

    def _position(self) -> Position | None:
        """The position of the last point the run held at the checkpoint (None: none)."""
        if self.last_step is None:
            return None
        return (self.last_step, math.inf if self.last_count is None else self.last_count)


def _last_held(saved: Position | None, backend: tuple[int, int] | int | None) -> Position | None:
    """The later of the checkpoint's position and the backend's (a bare step: all of it)."""
    found = [saved] if saved is not None else []
    if isinstance(backend, tuple):
        found.append((backend[0], backend[1]))
    elif backend is not None:
        found.append((backend, math.inf))
    return max(found) if found else None


def write_record(path: Path, record: Mapping[str, Any]) -> None:
    """Replace a side-car file's record atomically (a kill leaves the old one or the new)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(dict(record)))
    os.replace(tmp, path)


def read_record(path: Path) -> dict[str, Any]:
    """A side-car file's record ({} if there is none)."""
    if not path.exists():
        return {}
    found = json.loads(path.read_text())
    return found if isinstance(found, dict) else {}


def held_in(record: Mapping[str, Any]) -> tuple[int, int] | int | None:
    """The last position a side-car record gives (a bare step if written before counts)."""
    step, count = record.get("last_step"), record.get("count")
    if step is None:
        return None
    return int(step) if count is None else (int(step), int(count))
