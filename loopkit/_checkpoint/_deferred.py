"""A save that waits for the loader's next pass, so it holds what the epoch's own code did.

A save due on the window that ends a pass of the loader would miss the code the epoch runs
after its last window (a per-epoch ``scheduler.step()``, an evaluation, the RNG it uses):
it is written when the next pass starts, before its first batch, or when the loop ends.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from .._data._epoch_loader import EpochLoader
from ._contract import StatePiece
from ._pieces import LoaderState


class DeferredSave:
    """At most one save of one update, waiting for the start of ``loader``'s next pass."""

    __slots__ = ("_write", "loader", "update")

    def __init__(self, loader: EpochLoader | None, write: Callable[[], object]) -> None:
        self.loader = loader
        self._write = write
        self.update: int | None = None
        """The update whose save waits (None: none waits)."""

    def pass_is_over(self, lookahead: int) -> bool:
        """Whether the loader has handed out its pass's last batch (the loop saw it)."""
        loader = self.loader
        return loader is not None and loader.position - lookahead >= len(loader)

    def defer(self, update: int) -> None:
        """Write the save of ``update`` when the loader's next pass starts (replacing any)."""
        assert self.loader is not None, "only a Checkpointer with loader= defers"
        self.cancel()
        self.update = update
        self.loader._before_next_pass.append(self.write)

    def write(self) -> None:
        """Write the waiting save now, if one waits."""
        if self.update is not None:
            self.update = None
            self._write()

    def cancel(self) -> None:
        """Drop the waiting save (a newer save was written, or the run was resumed)."""
        self.update = None
        if self.loader is not None and self.write in self.loader._before_next_pass:
            self.loader._before_next_pass.remove(self.write)


def written_before_epoch_code(
    pieces: dict[str, StatePiece], deferred: DeferredSave, save: Callable[[], Path | None]
) -> Path | None:
    """A save on the window that ends the loader's pass, written now (not deferred), whose
    loader state says the epoch is still open: a resume runs its code after the last window
    (a pass with no batch left). For a loop that nothing ends for loopkit, where a deferred
    save would never be written."""
    piece = pieces["loader"]
    assert isinstance(piece, LoaderState)  # ends_pass() is only true with loader=
    deferred.cancel()
    piece.epoch_open = True
    try:
        return save()
    finally:
        piece.epoch_open = False
