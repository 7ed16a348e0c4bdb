"""Signals a loop stops on: names resolved, handlers that only raise a flag, put back after.

A handler never stops or saves by itself (the process may be anywhere in a step): it
records the first signal received, and ``loopkit.until`` acts at its next check, at a
window boundary, after the ranks have pooled what each received.
"""

from __future__ import annotations

import os
import signal
import threading
import warnings
from collections.abc import Iterable
from types import FrameType
from typing import Any

SignalLike = str | int | signal.Signals

PREEMPTED = 75
"""The exit status of a run a signal stopped before its end, saved: sysexits.h's EX_TEMPFAIL
("try again later"), a status neither Python (1, argparse's 2), nor shells (126, 127,
128 + signal) nor srun use for anything else."""


def exit_status(preempted: bool) -> int:
    """``PREEMPTED`` for a run a signal stopped, else 0; 0 under a launcher that takes any
    other status for a failure (torchrun's agent, ``accelerate launch``), with a warning."""
    if not preempted:
        return 0
    launcher = _failing_launcher()
    if launcher is not None:
        # The launcher turns a worker's non-zero status into a failure; the scheduler never
        # sees it. The launch script knows it sent (or trapped) the signal.
        warnings.warn(
            f"until.exit_status is 0 under {launcher}: it takes any other status for a "
            "failure, so 75 would never reach the scheduler. Decide the requeue in the "
            "launch script from the signal it trapped (trap 'requeue=1' USR1 TERM, then "
            "requeue when it is set and the launcher exited 0; docs/clusters.md)",
            stacklevel=3,
        )
        return 0
    return PREEMPTED


def _failing_launcher() -> str | None:
    """The launcher of this process that takes any non-zero status for a failure, if any.

    torchrun's agent sets ``TORCHELASTIC_RUN_ID`` (a non-zero status restarts the group with
    ``--max-restarts``, else it exits 1). ``accelerate launch`` runs one process directly,
    not under torchrun, and raises ``CalledProcessError`` (exit 1) on any non-zero status;
    it sets ``ACCELERATE_MIXED_PRECISION`` in the child in every mode (one process, several
    through torchrun, DeepSpeed, multi-CPU).
    """
    if "TORCHELASTIC_RUN_ID" in os.environ:
        return "torchrun (TORCHELASTIC_RUN_ID is set)"
    if "ACCELERATE_MIXED_PRECISION" in os.environ:
        return "accelerate launch (ACCELERATE_MIXED_PRECISION is set)"
    return None


def resolve_signals(signals: Iterable[SignalLike]) -> tuple[signal.Signals, ...]:
    """``("SIGTERM", "USR1", 10)`` as signal numbers; ValueError naming an unknown one."""
    if isinstance(signals, (str, int)):
        raise TypeError(f'signals must be a sequence, e.g. ("SIGTERM",), got {signals!r}')
    out: list[signal.Signals] = []
    for s in signals:
        try:
            if isinstance(s, str):
                name = s.upper() if s.upper().startswith("SIG") else "SIG" + s.upper()
                sig = signal.Signals[name]
            elif isinstance(s, int) and not isinstance(s, bool):
                sig = signal.Signals(s)
            else:
                raise KeyError(s)
        except (KeyError, ValueError):
            raise ValueError(
                f"unknown signal {s!r}: give names such as 'SIGTERM' or 'SIGUSR1'"
            ) from None
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            raise ValueError(f"{sig.name} cannot be caught: no process can save on it")
        if sig not in out:
            out.append(sig)
    return tuple(out)


def check_can_catch(signals: tuple[signal.Signals, ...], who: str) -> None:
    """Raise if handlers for ``signals`` cannot be installed here (not the main thread)."""
    if signals and threading.current_thread() is not threading.main_thread():
        raise RuntimeError(
            f"{who}(signals=...) must be built in the main thread (only it can install "
            "signal handlers); build it there, or pass signals=()"
        )


class SignalFlag:
    """Handlers for ``signals`` that record the first one received, until ``restore()``."""

    __slots__ = ("_previous", "received", "signals")

    def __init__(self, signals: tuple[signal.Signals, ...]) -> None:
        self.signals = signals
        self.received = 0
        """The first signal received (0: none)."""
        self._previous: dict[signal.Signals, Any] = {}
        for sig in signals:
            self._previous[sig] = signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if not self.received:
            self.received = signum

    def restore(self) -> None:
        """Put back the handlers that were installed before (once; later calls do nothing)."""
        previous, self._previous = self._previous, {}
        for sig, handler in previous.items():
            signal.signal(sig, handler)
