"""The progress display of ``step.iterate(loader, progress=True)``, on rank zero.

It shows updates done of the total, the epoch, samples/s (tokens/s where tokens are
counted), an ETA and the metrics of the log's last flush. It reads only host-side
counters and the floats a flush already produced: no host-device sync. It draws with tqdm
when installed (the ``progress`` extra) and otherwise prints a plain line every
``interval`` seconds.
"""

from __future__ import annotations

import datetime
import importlib
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol, TextIO


class Watched(Protocol):
    """What the display reads: the step's updates, what it has seen, its log's last flush."""

    @property
    def updates(self) -> int: ...


def rate(count: float, seconds: float) -> str:
    """``1.23k samples/s``-style count per second, three significant digits."""
    per_s = count / seconds if seconds > 0 else 0.0
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if per_s >= scale:
            return f"{per_s / scale:.3g}{unit}"
    return f"{per_s:.3g}"


def eta(done: int, total: int | None, start_done: int, seconds: float) -> str | None:
    """Time left at the pace measured since the display began (``start_done`` updates: those
    of a resumed run before it are no part of its pace), as H:MM:SS; None if unknown."""
    if total is None or done <= start_done or seconds <= 0:
        return None
    left = max(total - done, 0) * seconds / (done - start_done)
    return str(datetime.timedelta(seconds=round(left)))


class ProgressDisplay:
    """One pass's display: ``tick()`` after each micro-step, ``close()`` at the pass's end."""

    def __init__(
        self,
        watched: Watched,
        axes: Callable[[], dict[str, float]],
        metrics: Callable[[], Mapping[str, float]],
        total: int | None,
        *,
        interval: float | None = None,
        file: TextIO | None = None,
        use_tqdm: bool | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._watched, self._axes, self._metrics = watched, axes, metrics
        self.total = total
        self._clock = clock
        self._file = file if file is not None else sys.stderr
        self._start = clock()
        self._start_updates = watched.updates
        self._start_axes = axes()
        self._shown = watched.updates
        self._bar: Any = None
        if use_tqdm is not False:
            try:
                tqdm = importlib.import_module("tqdm.auto").tqdm
            except ImportError:
                if use_tqdm:
                    raise ImportError(
                        "progress with tqdm needs it: pip install 'torch-loopkit[progress]'"
                    ) from None
            else:
                self._bar = tqdm(
                    total=total, initial=self._shown, unit="update", file=self._file,
                    dynamic_ncols=True, leave=True,
                )  # fmt: skip
        # tqdm redraws at its own pace; the postfix (rates, metrics) and the plain line are
        # refreshed at most once per interval.
        self.interval = (
            interval if interval is not None else (0.5 if self._bar is not None else 10.0)
        )
        self._next = self._start + self.interval
        self.lines: list[str] = []  # the plain lines printed (also what a test reads)

    def tick(self) -> None:
        """After a micro-step: at most once per interval, draw the updates made and status."""
        now = self._clock()  # the only cost of a micro-step between two refreshes
        if now >= self._next:
            self._next = now + self.interval
            self._refresh(now)

    def describe(self, now: float) -> str:
        """The status line: updates, epoch, rates, ETA, the last flushed metrics."""
        done, seconds, axes = self._watched.updates, now - self._start, self._axes()
        total = "?" if self.total is None else str(self.total)
        parts = [f"update {done}/{total}"]
        if "epoch" in axes:
            parts.append(f"epoch {int(axes['epoch'])}")
        for name in ("tokens", "samples"):
            if name in axes:
                seen = axes[name] - self._start_axes.get(name, 0.0)
                parts.append(f"{rate(seen, seconds)} {name}/s")
                break
        left = eta(done, self.total, self._start_updates, seconds)
        if left is not None:
            parts.append(f"ETA {left}")
        parts.extend(f"{k} {v:.4g}" for k, v in self._metrics().items())
        return " | ".join(parts)

    def _refresh(self, now: float) -> None:
        done = self._watched.updates
        if self._bar is not None and done != self._shown:
            self._bar.update(done - self._shown)
        self._shown = done
        line = self.describe(now)
        if self._bar is not None:
            # Everything after the update count goes to the bar's postfix.
            self._bar.set_postfix_str(line.split(" | ", 1)[1] if " | " in line else "")
        else:
            self.lines.append(line)
            print(line, file=self._file, flush=True)

    def close(self) -> None:
        """The pass ended (or was left): draw the final state."""
        if self._bar is not None:
            self._refresh(self._clock())
            self._bar.close()
            self._bar = None
        elif self._watched.updates != self._start_updates:
            self._refresh(self._clock())
