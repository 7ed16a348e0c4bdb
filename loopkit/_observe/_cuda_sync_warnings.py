"""The doctor's sync count on CUDA, from the warnings of ``torch.cuda.set_sync_debug_mode``.

On CUDA the driver knows every synchronizing call, whatever op made it; the CPU counter
(``count_host_syncs``) knows only the ops it recognizes. The price: the driver says it
only as a warning, so this counter records warnings.
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Callable

import torch

from .._sync_points import add_watcher

# The text of the warning torch.cuda.set_sync_debug_mode("warn") gives at each sync.
_SYNC_WARNING = "synchroniz"


class CudaSyncCounter:
    """Count CUDA syncs inside ``with``: each under its message, or under ``expected[reason]``.

    A sync warning from inside ``expected_sync(reason)`` is loopkit's own. The previous
    sync debug mode comes back on exit. Only the sync warnings are forced through: the
    user's filters still decide every other warning (an "error" filter raises where the
    warning is made), and those shown meanwhile are shown again on exit.
    """

    def __init__(self) -> None:
        self.events: Counter[str] = Counter()
        self.expected: Counter[str] = Counter()
        self._catch: warnings.catch_warnings[list[warnings.WarningMessage]] | None = None
        self._records: list[warnings.WarningMessage] = []
        self._previous_mode = 0
        self._unwatch: Callable[[], None] | None = None

    def __enter__(self) -> CudaSyncCounter:
        if self._unwatch is not None:
            raise RuntimeError("this CUDA sync counter is already counting: enter it once")
        catch = warnings.catch_warnings(record=True)
        self._records = catch.__enter__()
        warnings.filterwarnings("always", message=f".*{_SYNC_WARNING}")
        self._catch = catch
        if torch.cuda.is_available():
            self._previous_mode = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("warn")
        self._unwatch = add_watcher(self)
        return self

    def __exit__(self, *exc: object) -> None:
        unwatch, catch = self._unwatch, self._catch
        if unwatch is None or catch is None:
            raise RuntimeError("the CUDA sync counter exited without being entered")
        self._unwatch = self._catch = None
        unwatch()
        try:
            if torch.cuda.is_available():
                torch.cuda.set_sync_debug_mode(self._previous_mode)
        finally:
            catch.__exit__(None, None, None)
        others = []
        for w in self._records:
            if _is_sync(w):
                self.events[str(w.message).split("\n")[0][:60]] += 1
            else:
                others.append(w)
        self._records = []
        for w in others:
            # Already through the user's filters when it was made: shown now, not filtered again.
            warnings.showwarning(w.message, w.category, w.filename, w.lineno, w.file, w.line)

    @property
    def user_events(self) -> dict[str, int]:
        """The sync warnings outside loopkit's own necessary reads, by message."""
        return dict(self.events)

    def mark(self) -> int:
        """How many warnings are recorded so far."""
        return len(self._records)

    def claim(self, start: int, reason: str) -> None:
        """File the sync warnings recorded since ``start`` under ``expected[reason]``."""
        claimed = self._records[start:]
        del self._records[start:]
        for w in claimed:
            if _is_sync(w):
                self.expected[reason] += 1
            else:
                self._records.append(w)


def _is_sync(w: warnings.WarningMessage) -> bool:
    return _SYNC_WARNING in str(w.message)
