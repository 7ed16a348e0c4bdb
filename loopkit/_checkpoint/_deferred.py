"""A save on the window that ends a pass of the loader, and the epoch's own code after it.

The epoch's code after its last window (a per-epoch ``scheduler.step()``, an evaluation, the
RNG it uses) is part of the epoch. A save made on that window, inside the loop over the
pass, comes before it: ``maybe_save`` defers its save to when the next pass starts (or the
loop ends), and a save written at once (``save()``, a stop's) says in its file that the
epoch's code is still to run, so a resumed run runs it (a pass with no batch left).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping

from .._data._epoch_loader import EpochLoader
from .._step import _accumulate, _group
from .._types import Clock
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


def iterating(clock: Clock | None) -> bool:
    """Whether a loop over the clock's ``iterate`` (a step's, an accumulate's, a group's)
    runs: its generator has neither run out nor been left (a ``break`` closes it, unless it
    is still referenced)."""
    if isinstance(clock, _group.steps):
        return any(m.accumulator.iterating for m in clock.members)
    return isinstance(clock, _accumulate.accumulate) and clock.iterating > 0


class EpochCode:
    """Where the epoch's code after its pass stands for a Checkpointer with ``loader=``.

    ``left``: the newest checkpoint, written or resumed, holds an epoch whose code after its
    pass is still to run. Once that code has run (the loader's next pass starts, or
    ``epochs()`` goes on), the run has ``moved`` past the checkpoint: ``save_if_needed``
    writes the state that holds it.
    """

    __slots__ = ("ended_at", "left", "loader", "moved", "saving_done")

    def __init__(self, loader: EpochLoader | None) -> None:
        self.loader = loader
        self.left = False
        self.moved = False
        """That code has run since the newest checkpoint: the run has moved past it."""
        self.ended_at: int | None = None
        """The loader's epoch when ``epochs()`` last went on: that pass's loop is over."""
        self.saving_done = False
        """A save being taken counts the epoch whose pass just ended done (its code runs)."""

    def in_loop(self, clock: Clock | None, ends_pass: bool) -> bool:
        """At a boundary that ends the loader's pass (``ends_pass``): whether the loop over
        the pass still runs (its ``iterate``, see ``iterating``, or a plain ``for x, y in
        loader:`` whose pass training counted and has not run out): the epoch's code after
        it has not run yet."""
        if not (ends_pass and self._current()):
            return False
        loader = self.loader
        return iterating(clock) or (loader is not None and loader._counted_pass_open())

    @contextlib.contextmanager
    def saving(
        self, pieces: Mapping[str, StatePiece], before_code: bool, ends_pass: bool
    ) -> Iterator[None]:
        """States taken inside are a save's: taken ``before_code`` of the epoch whose pass
        ``ends_pass`` (the loader's says so: a resume runs that epoch again with no batch
        left), or after its pass's loop (``saving_done``: until counts that epoch done)."""
        piece = pieces.get("loader")
        opened = piece if before_code and isinstance(piece, LoaderState) else None
        self.saving_done = ends_pass and not before_code and self._current()
        if opened is not None:
            opened.epoch_open = True
        try:
            yield
        finally:
            self.saving_done = False
            if opened is not None:
                opened.epoch_open = False

    def _current(self) -> bool:
        """The loader's pass just ended is the epoch's now: ``epochs()`` has not gone on."""
        return self.loader is not None and self.loader.epoch != self.ended_at

    def set(self, left: bool) -> None:
        """The newest checkpoint is written or resumed: its epoch's code is ``left`` or not."""
        self._unhook()
        self.left, self.moved = left and self.loader is not None, False
        if self.left:
            assert self.loader is not None
            self.loader._before_next_pass.append(self.ran)

    def ran(self) -> None:
        """The epoch's code after its pass has run (once: later calls change nothing)."""
        if self.left:
            self.left, self.moved = False, True
            self._unhook()

    def body_done(self) -> None:
        """``epochs()`` goes on after an epoch's body: the loop over its pass and its code
        after it are over."""
        self.ended_at = self.loader.epoch if self.loader is not None else None
        self.ran()

    def _unhook(self) -> None:
        if self.loader is not None and self.ran in self.loader._before_next_pass:
            self.loader._before_next_pass.remove(self.ran)
