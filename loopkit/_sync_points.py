"""Host-device sync points: loopkit marks the host reads it cannot avoid, counters tally them.

On an accelerator every host read of a tensor (``.item()``, ``float(t)``, ...) stalls the
CPU until the device catches up. loopkit's own code wraps the reads it needs (fp16's
overflow check, the ``skip_nonfinite`` decision) in ``expected_sync(reason)``; the
counters of ``loopkit.count_host_syncs`` and the doctor's CUDA watcher (in ``_observe``)
register here, per thread, so that those reads are filed under their reason. With nothing
counting, ``expected_sync`` costs one global read.

A foundation module: every capability may mark its syncs, and none needs the counters.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections import Counter
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Protocol


class Tallies:
    """One counter's tallies."""

    __slots__ = ("depth", "events", "expected", "ignore", "lines", "locate", "user")

    def __init__(self, ignore: frozenset[int], locate: bool = False) -> None:
        self.ignore = ignore
        self.events: Counter[str] = Counter()  # every read, by operation
        self.expected: Counter[str] = Counter()  # loopkit's own, by reason
        self.user: Counter[str] = Counter()  # the others, by operation
        self.depth = 0  # >0 while inside a counted Python-level read: its inner ops are its own
        self.locate = locate  # also find the user's line of each of their reads (slow)
        self.lines: Counter[str] = Counter()  # "file:line" of the user's reads, if located

    def record(self, name: str, reason: str | None) -> None:
        self.events[name] += 1
        if reason is None:
            self.user[name] += 1
            if self.locate:
                self.lines[user_line()] += 1
        else:
            self.expected[reason] += 1


def _not_user() -> tuple[str, ...]:
    """Where loopkit, torch and contextlib live (torch only if imported: no import here)."""
    places = [os.path.dirname(os.path.abspath(__file__)) + os.sep, str(contextlib.__file__)]
    torch_file = getattr(sys.modules.get("torch"), "__file__", None)
    if isinstance(torch_file, str):
        places.append(os.path.dirname(os.path.abspath(torch_file)) + os.sep)
    return tuple(places)


def user_line() -> str:
    """``file:line`` of the innermost frame of the user's code (outside loopkit and torch)."""
    skip = _not_user()
    frame: Any = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(skip):
        frame = frame.f_back
    return "?" if frame is None else f"{frame.f_code.co_filename}:{frame.f_lineno}"


class SyncWatcher(Protocol):
    """A counter that sees syncs some other way (the CUDA one): told which were expected."""

    def mark(self) -> int:
        """A position in what it has seen so far."""
        ...

    def claim(self, start: int, reason: str) -> None:
        """What it saw since ``start`` came from inside ``expected_sync(reason)``."""
        ...


class Hub:
    """The counters active in one thread, behind one pair of modes shared by all of them.

    One pair, not one per counter, so each op passes one mode however many counters nest;
    the pair is removed by identity, so counters and other modes exit in any order.
    """

    __slots__ = ("modes", "reasons", "states", "watchers")

    def __init__(self) -> None:
        self.states: list[Tallies] = []
        self.watchers: list[SyncWatcher] = []
        self.reasons: list[str] = []  # the open expected_sync blocks, innermost last
        self.modes: Any = None  # the counting modes, installed by ``_observe``

    def reason(self) -> str | None:
        return self.reasons[-1] if self.reasons else None


_local = threading.local()
_lock = threading.Lock()
# Counters and CUDA watchers active in any thread: expected_sync's whole cost when it is 0.
_active = 0


def this_thread_hub() -> Hub:
    hub: Hub | None = getattr(_local, "hub", None)
    if hub is None:
        hub = _local.hub = Hub()
    return hub


def count_active(delta: int) -> None:
    global _active
    with _lock:
        _active += delta


_NOTHING: AbstractContextManager[None] = nullcontext()


class _Expected:
    __slots__ = ("hub", "marks", "reason")

    def __init__(self, hub: Hub, reason: str) -> None:
        self.hub, self.reason = hub, reason
        self.marks: list[tuple[SyncWatcher, int]] = []

    def __enter__(self) -> None:
        self.hub.reasons.append(self.reason)
        self.marks = [(w, w.mark()) for w in self.hub.watchers]

    def __exit__(self, *exc: object) -> None:
        self.hub.reasons.pop()
        for watcher, start in self.marks:
            watcher.claim(start, self.reason)
        self.marks = []


def add_watcher(watcher: SyncWatcher) -> Callable[[], None]:
    """Tell ``watcher`` of this thread's expected_sync blocks; returns what removes it."""
    hub = this_thread_hub()
    hub.watchers.append(watcher)
    count_active(1)

    def remove() -> None:
        hub.watchers.remove(watcher)
        count_active(-1)

    return remove


def expected_sync(reason: str) -> AbstractContextManager[None]:
    """Mark the host reads inside ``with`` as loopkit's own, needed for ``reason``.

    Active counters still count them, and also file them under ``expected[reason]``.
    With no counter active (a normal run) it returns a shared no-op context: one global
    read, no allocation.
    """
    if not isinstance(reason, str) or not reason:
        raise TypeError(
            f"expected_sync needs the reason as a non-empty str (e.g. \"fp16's overflow "
            f'check"), got {reason!r}'
        )
    if not _active:
        return _NOTHING
    hub: Hub | None = getattr(_local, "hub", None)
    if hub is None or not (hub.states or hub.watchers):
        return _NOTHING
    return _Expected(hub, reason)
