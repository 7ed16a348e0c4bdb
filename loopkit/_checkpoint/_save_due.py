"""When a save is due: ``maybe_save``'s decision, whether the newest checkpoint holds the
run's state already, a background write that failed in a one-process run."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from .._checks import is_int_at_least
from .._types import Clock
from ._background import Background
from ._deferred import DeferredSave, EpochCode


class Checkpointer(Protocol):
    """What these read of a Checkpointer."""

    last_saved_update: int | None
    _saved_windows: int | None
    _epoch_code: EpochCode
    _deferred: DeferredSave
    _background: Background | None

    @property
    def _acc(self) -> Clock | None: ...
    def ends_pass(self) -> bool: ...
    def save(self) -> Path | None: ...
    def wait(self) -> None: ...
    def _windows_closed(self) -> int: ...


def maybe_save(ckpt: Checkpointer, every: int) -> Path | None:
    """``Checkpointer.maybe_save``: a save when one is due (deferred to the next pass at a
    pass's end)."""
    if not is_int_at_least(every, 1):
        raise ValueError(f"every must be an int >= 1 (updates between saves), got {every!r}")
    acc = ckpt._acc
    if acc is None:
        raise RuntimeError("maybe_save needs step= (to count updates); call save() instead")
    raise_failed_write(ckpt)
    if acc.settle():  # (first: it may close a window, an update counted below)
        return None
    updates = acc.updates
    # Saved already: this update, unless a window skipped since (inf/nan) changed the
    # state without changing the count (its counters, the GradScaler, the data's place).
    saved = updates == ckpt.last_saved_update and holds_state(ckpt)
    if not updates or updates % every or saved:
        return None
    if updates == ckpt._deferred.update:
        return None
    if ckpt.ends_pass():
        # The epoch's code after its last window has not run yet: a checkpoint now would
        # resume without it.
        ckpt._deferred.defer(updates)
        return None
    return ckpt.save()


def holds_state(ckpt: Checkpointer) -> bool:
    """Whether the newest checkpoint holds the run's state: no window closed since (a skipped
    one included), nor has the epoch's code it left to run run since."""
    return ckpt._saved_windows == ckpt._windows_closed() and not ckpt._epoch_code.moved


def raise_failed_write(ckpt: Checkpointer) -> None:
    """In one process, raise a background write that failed (``wait``) as soon as it did:
    ranks must raise alike, so a job of several learns it at the next save or wait."""
    if ckpt._background is not None and ckpt._background.failed_alone():
        ckpt.wait()
