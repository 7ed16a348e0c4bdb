"""Where a resumed run stands, and the loops that would silently train the wrong epochs.

After ``ckpt.resume()`` the loader continues its epoch, but a loop written ``for epoch in
range(E):`` restarts its own count at 0 and trains the resumed epochs again; a relaunch of a
finished run trains nothing. So a resume that a run starts from (the Checkpointer's first
use) says where the run stands in one line (``ckpt.standing``, logged at INFO to the
``loopkit`` logger), warns (``ResumeWarning``) when a limit already ended the run, and
watches the first pass after it: a loop counter behind the loader's epoch, or a pass of an
epoch the checkpoint had finished, is warned about, naming the fix, ``ckpt.epochs(E)``.
A save of a relaunched run that trained nothing says so too.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import FrameType
from typing import Protocol

from .. import _ranks
from .._checks import is_int_at_least
from .._data._epoch_loader import EpochLoader
from .._errors import ResumeWarning
from .._step._feed import LIMITS
from .._step._misuse import _warn, user_frame
from .._types import Clock
from ._contract import StatePiece
from ._deferred import EpochCode
from ._epoch_loop import epoch_counter
from ._resume import number_of

_LOG = logging.getLogger("loopkit")
_FIX = "ckpt.epochs(E)"


class Standing:
    """What a Checkpointer knows of the resume its run started from."""

    __slots__ = (
        "code_left", "epoch", "epochs_loop", "finished", "line", "path", "relaunch", "stop",
        "told", "windows",
    )  # fmt: skip

    def __init__(self) -> None:
        self.line: str | None = None
        """Where the run stands after the last resume (None before one)."""
        self.path: Path | None = None
        self.relaunch = False  # the resume was this Checkpointer's first use: a run starts here
        self.windows = 0  # windows closed at the resume (updates and skips)
        self.epoch = 0  # the loader's next epoch at the resume
        self.code_left = False  # that epoch's batches were done, its code after them not
        self.told = False  # a ResumeWarning about this resume was given
        self.epochs_loop = False  # ckpt.epochs() drives the loop: its epochs are right
        self.finished: str | None = None  # the limit that had ended the resumed run
        self.stop: weakref.ref[Stop] | None = None  # the loopkit.until saved with the run


class Stop(Protocol):
    """What the standing reads of the ``loopkit.until`` saved with the run, and tells it."""

    max_updates: int | None
    max_epochs: int | None
    reason: str | None

    def _resumed_finished(self, reason: str, updates: int) -> None: ...


def _stop_of(standing: Standing) -> Stop | None:
    return None if standing.stop is None else standing.stop()


class Checkpointer(Protocol):
    """What the Checkpointer's helpers (here and ``_adopt``) read and set of it."""

    last_saved_update: int | None
    _saved_windows: int | None
    _used: bool
    _epoch_code: EpochCode

    @property
    def directory(self) -> Path: ...
    @property
    def pieces(self) -> Mapping[str, StatePiece]: ...
    @property
    def loader(self) -> EpochLoader | None: ...
    @property
    def stream_loader(self) -> object: ...
    @property
    def step(self) -> object: ...
    @property
    def clock(self) -> Clock | None: ...
    @property
    def _standing(self) -> Standing: ...
    def save(self) -> Path | None: ...
    def save_if_needed(self) -> Path | None: ...
    def checkpoints(self) -> list[Path]: ...
    def _updates(self) -> int: ...
    def _windows_closed(self) -> int: ...


def announce(ckpt: Checkpointer, state: Mapping[str, object], path: Path, relaunch: bool) -> None:
    """A checked ``state`` is about to be loaded: say where the run stands (and, for a
    relaunch of a finished run, warn). Before the load, so that a warning made an error
    leaves everything as it was."""
    standing = ckpt._standing
    place = _Place(ckpt, state)
    reason, finished = _finished(ckpt, place) or (None, None)
    line = _describe(ckpt, place, path) + (f": finished ({finished})" if finished else "")
    if finished and relaunch:
        _warn(
            f"{line}: nothing is left to train (the until stays stopped: check() is True, "
            "stop.epochs() and ckpt.epochs(E) end after the epoch's code left to run, if "
            "any). A relaunch of a finished run: raise the limit to train further, or give the "
            "Checkpointer a new directory to start another run",
            ResumeWarning,
            user_frame(),
        )
    standing.line, standing.path, standing.relaunch = line, path, relaunch
    standing.finished = reason
    standing.told = bool(finished and relaunch)
    if _ranks.world()[0] == 0:
        _LOG.info("%s", line)


def skipped_damaged(target: Path | None, skipped: list[tuple[Path, str]]) -> None:
    """Say loudly (a ``ResumeWarning`` and a WARNING log line, on rank zero) which damaged
    checkpoints ``resume(skip_damaged=True)`` skipped, why, and which one it took."""
    if not skipped or _ranks.world()[0] != 0:
        return
    said = "; ".join(f"{path} ({why})" for path, why in skipped)
    line = (
        f"resume(skip_damaged=True): the newest checkpoint(s) cannot be read, so the run "
        f"resumes the newest readable one, {target}, and repeats the updates since: skipped "
        f"{said}. The skipped ones are moved to an abandoned-* folder (ckpt.damaged lists them)"
    )
    _LOG.warning("%s", line)
    _warn(line, ResumeWarning, user_frame())


def watch(ckpt: Checkpointer) -> None:
    """The state is loaded: remember it; a relaunch's first pass is checked as it starts."""
    standing, loader = ckpt._standing, ckpt.loader
    standing.windows = ckpt._windows_closed()
    standing.epoch = loader.epoch if loader is not None else 0
    standing.code_left = loader is not None and tail_left(loader)
    stop = _stop_of(standing)
    if standing.finished is not None and stop is not None:
        # The limit that ended the run still holds: the until stays stopped, so a loop that
        # asks it (stop.reason, check(), its epochs()) trains nothing more.
        stop._resumed_finished(standing.finished, ckpt._updates())
    if loader is not None and standing.relaunch:
        loader._before_next_pass.append(lambda: _first_pass(ckpt, loader))


class _Place:
    """Where a saved state stands: its updates (or saves), the loader's next epoch and the
    batches of it done, until's own epoch count and whether early_stop decided."""

    def __init__(self, ckpt: Checkpointer, state: Mapping[str, object]) -> None:
        self.updates = number_of(ckpt.pieces, state)
        loader, until = state.get("loader"), state.get("until")
        self.epoch: int | None = None
        self.done = 0  # batches of that epoch done
        self.passes = 0  # epochs whose batches are all done (their code after them or not)
        self.open = False  # saved on that epoch's last window, before its code after it
        if isinstance(loader, Mapping):
            position, batches = int(loader["position"]), int(loader["batches"])
            self.open = position >= batches and bool(loader.get("epoch_open"))
            if position >= batches and not self.open:
                self.epoch = self.passes = int(loader["next_epoch"])
            else:
                self.epoch, self.done = int(loader["epoch"]), position
                self.passes = self.epoch + (position >= batches)
        self.batches = len(ckpt.loader) if ckpt.loader is not None else 0
        until = until if isinstance(until, Mapping) else {}
        self.until_epoch = until.get("epoch")
        stop = until.get("early_stop")
        self.early_stopped = isinstance(stop, Mapping) and bool(stop.get("stopped"))
        self.by_epochs = bool(until.get("by_epochs", False))  # until's epochs() counts them


def _describe(ckpt: Checkpointer, place: _Place, path: Path) -> str:
    """``resumed <path>: update N, epoch K ...``: the counters and the loader's place."""
    where = f"resumed {path}: " + (
        f"update {place.updates}" if ckpt.clock is not None else f"save {place.updates}"
    )
    epoch, done, batches = place.epoch, place.done, place.batches
    if epoch is None:
        return where + " (no loader= given: where the data stood is not saved)"
    if done == 0:
        return where + f", epoch {epoch} next ({epoch} epoch(s) done)"
    if done < batches:
        return where + f", epoch {epoch} in progress ({done} of {batches} batches done)"
    return where + f", epoch {epoch}'s {batches} batches done (its code after them to run)"


def _finished(ckpt: Checkpointer, place: _Place) -> tuple[str, str] | None:
    """The limit that left the resumed run nothing to train (until's limits, early_stop) and
    why, or None. Epochs count once their batches are all done (a run that until stopped on
    its last window, saved before the epoch's code after it, is finished), but where until's
    epochs() counts them, once that code has run (the run was killed or stopped in it)."""
    clock, stop = ckpt.clock, _stop_of(ckpt._standing)
    if stop is not None:
        max_updates, max_epochs = stop.max_updates, stop.max_epochs
    else:
        max_updates, max_epochs = (None, None) if clock is None else LIMITS.get(clock, (None, None))
    if clock is not None and max_updates is not None and place.updates >= max_updates:
        return "max_updates", f"until(max_updates={max_updates}) reached at update {place.updates}"
    done = place.until_epoch if place.epoch is None else place.passes
    if place.open and place.by_epochs:
        done = place.epoch  # epochs() counts the open epoch done once its code has run
    if max_epochs is not None and isinstance(done, int) and done >= max_epochs:
        return "max_epochs", f"until(max_epochs={max_epochs}) reached: {done} epoch(s) done"
    if place.early_stopped:
        return "early_stop", "early_stop ended it"
    return None


def _tell(ckpt: Checkpointer, message: str, frame: FrameType | None = None) -> None:
    """One ResumeWarning per resume, at the user's line."""
    ckpt._standing.told = True
    _warn(message, ResumeWarning, frame if frame is not None else user_frame())


def idle_save(ckpt: Checkpointer) -> None:
    """A save (or ``save_if_needed``) of a relaunched run that trained nothing since: say so."""
    standing, loader = ckpt._standing, ckpt.loader
    if not standing.relaunch or standing.told or ckpt.clock is None:
        return
    if standing.code_left and loader is not None and loader.epoch > standing.epoch:
        return  # the resumed epoch's code after its pass has run since: this save holds it
    if ckpt._windows_closed() == standing.windows:
        _tell(
            ckpt,
            f"nothing was trained since ckpt.resume() ({standing.line}): this relaunch of a "
            "finished run trains nothing (its loop had no epoch left, or a limit had ended "
            f"it). Raise the number of epochs (`for epoch in {_FIX}:` says so at once) or the "
            "limits to train further, or give the Checkpointer a new directory for another run",
        )


# -- the epochs left ------------------------------------------------------------------------


def epochs(ckpt: Checkpointer, total: object) -> Iterator[int]:
    """``ckpt.epochs(total)``: checked now, then the epochs the loader has left of ``total``."""
    if not is_int_at_least(total, 1):
        raise ValueError(f"epochs(total) takes the run's number of epochs, an int >= 1, got "
                         f"{total!r}")  # fmt: skip
    if ckpt.loader is None and ckpt.stream_loader is not None:
        raise ValueError(
            f"ckpt.epochs(E) follows the epochs of a loopkit.distributed.loader; the "
            f"Checkpointer's loader= ({type(ckpt.stream_loader).__name__}) saves its place in "
            "its stream but has no epoch count loopkit can follow: stop the run with "
            "loopkit.until(step, max_updates=N) (a stream's usual measure), or read several epochs "
            "in one pass (passes= of loopkit.stream_shards or loopkit.shuffle_buffer)"
        )
    if ckpt.loader is None:
        raise ValueError(
            "ckpt.epochs(E) follows the epochs of the Checkpointer's loader=, which this one "
            "was not given: build it with loader=loopkit.distributed.loader(...) (its epoch "
            "and place in it are saved), or count the epochs yourself"
        )
    assert isinstance(total, int)
    return _epochs(ckpt, ckpt.loader, total)


def _epochs(ckpt: Checkpointer, loader: EpochLoader, total: int) -> Iterator[int]:
    standing = ckpt._standing
    standing.epochs_loop = True
    epoch = loader.epoch
    if epoch >= total and not standing.told:
        line = standing.line or f"the loader's next epoch is {epoch}"
        _tell(
            ckpt,
            f"{line}: all {total} epochs of ckpt.epochs({total}) are done, nothing is left to "
            "train. A relaunch of a finished run: raise the number of epochs to train "
            "further, or give the Checkpointer a new directory to start another run",
        )
    ran = False
    while epoch < total and not (_stopped(standing) and (ran or not tail_left(loader))):
        # Where the run's until stopped (in this run, or a resumed run it had ended) no epoch
        # is left, but for an epoch saved before its code after the last window: that runs.
        yield epoch
        ran = True
        ckpt._epoch_code.body_done()  # the body went on to its end: its code after the pass ran
        if loader.epoch == epoch:
            raise RuntimeError(
                f"epoch {epoch} of `for epoch in ckpt.epochs({total}):` ran no pass of the "
                "Checkpointer's loader: iterate it (for batch in step.iterate(loader)) once in "
                "each epoch, or the same epoch would come again"
            )
        epoch = loader.epoch
    if ran:
        # The run is complete: its final state, unless the newest checkpoint holds it (the
        # save maybe_save deferred to a next pass that never comes, or a cadence that did not
        # fall on the last update). A loop left by a break or an error writes nothing here.
        ckpt.save_if_needed()


def _stopped(standing: Standing) -> bool:
    stop = _stop_of(standing)
    return stop is not None and stop.reason is not None


def tail_left(loader: EpochLoader) -> bool:
    """Whether the loader's next pass is one resumed with no batch left: its epoch was saved
    on its last window, before the epoch's code after it, which the resumed run runs."""
    return 0 < len(loader) <= loader._progress.resume_at


# -- the first pass after a relaunch ----------------------------------------------------------


def _first_pass(ckpt: Checkpointer, loader: EpochLoader) -> None:
    """Run as the first pass after the resume starts: is the loop where the loader is?"""
    standing = ckpt._standing
    if standing.epochs_loop or standing.told:
        return
    epoch = loader.epoch  # the epoch this pass runs
    frame = user_frame()
    if epoch < standing.epoch:
        _tell(
            ckpt,
            f"this pass runs epoch {epoch}, which the checkpoint had finished ({standing.line}): "
            f"a loader.set_epoch() from a loop whose count restarted at 0 trains those epochs "
            f"again. Drop the set_epoch call (the loader counts its epochs) and loop with "
            f"`for epoch in {_FIX}:`, which starts at the resumed epoch",
            frame,
        )
        return
    found = epoch_counter(frame, epoch)
    if found is not None:
        where, name, value = found
        _tell(
            ckpt,
            f"{where}: the loop's `{name}` is {value} but the loader resumed at epoch {epoch} "
            f"({standing.line}): a loop that restarts its count trains {epoch - value} "
            f"epoch(s) more than it plans (and whatever follows `{name}`, a schedule, an "
            f"evaluation, restarts too). Loop with `for {name} in {_FIX}:` (the epochs left "
            f"of E, from the resumed one) or `range(loader.epoch, E)`",
            frame,
        )
