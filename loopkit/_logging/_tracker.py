"""What every experiment-tracker sink shares: rank zero only, a lazy start, hyperparameters
once, and a resume into the same run that writes no point twice.

A tracker sink is called like any sink (``sink(metrics, step=, axes=)``) and also has
``config(params)``, ``state_dict()``/``load_state_dict()`` (the run id and the last step
written: a ``Checkpointer(extra={"log": log})`` carries them through ``detach_logging``) and
``close()``. The run starts at the first write, never at construction, so a resume can hand
it the run id first. A resumed run is bit-identical to the one that was stopped, so the
points it replays up to the last step the run already holds (which, after a kill -9, may be
beyond the checkpoint) are dropped rather than written twice.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from typing import Any

from .. import _ranks


class Tracker(abc.ABC):
    """Base of the tracker sinks; a subclass opens, writes to and finishes its run."""

    def __init__(self) -> None:
        self.run_id: str | None = None
        """The run this sink writes to (known once it has started, or after a resume)."""
        self.last_step: int | None = None
        """The last step written to the run."""
        self._config: dict[str, Any] = {}
        self._started = False
        self._closed = False
        self._resumed = False
        self._skip_through: int | None = None  # after a resume: the steps the run holds

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

    def _held_through(self) -> int | None:
        """The last step the resumed run holds, where the backend can tell (else None)."""
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
        if self._skip_through is not None:
            if step <= self._skip_through:
                return  # the resumed run already holds this point
            self._skip_through = None
        values = {k: v for k, v in (axes or {}).items() if k != "updates"}
        values.update(metrics)
        self._write(values, step)
        self.last_step = step

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
        """The run's id and the last step written, for a checkpoint."""
        return {"run_id": self.run_id, "last_step": self.last_step}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume the saved run (before this sink has written anything)."""
        if not isinstance(state, Mapping) or not {"run_id", "last_step"} <= set(state):
            raise ValueError(f"not a tracker sink's state (run_id, last_step): {state!r}")
        if self._started:
            raise RuntimeError(
                f"{type(self).__name__} has already started run {self.run_id!r}: resume the "
                "checkpoint (ckpt.resume()) before the first log flush"
            )
        self.run_id, self.last_step = state["run_id"], state["last_step"]
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
            held = [s for s in (self.last_step, self._held_through()) if s is not None]
            self._skip_through = max(held) if held else None
        if self._config:
            self._write_config(dict(self._config))
