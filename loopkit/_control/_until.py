"""loopkit.until: when a training loop stops, decided alike on every rank, at a boundary.

Limits on updates and epochs are counts every rank shares, so they need no exchange and
stop exactly. A signal (preemption) reaches the ranks it reaches, and every rank's clock
reads its own time: those are pooled in one small all-reduce every ``check_every``
updates (at updates that are a multiple of it, so every rank checks at the same update),
and every rank stops if any rank got a signal or any rank's clock is past ``max_time``.
A stop is only ever taken where a window has just closed, so no half window is dropped;
with a Checkpointer it writes one checkpoint there.
"""

from __future__ import annotations

import signal
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from types import TracebackType
from typing import Any

from .. import _ranks
from .._checkpoint._deferred import iterating
from .._checkpoint._save_resume import Checkpointer
from .._checkpoint._standing import tail_left
from .._checks import is_int_at_least
from .._data._epoch_loader import EpochLoader
from .._step._feed import LIMITS
from ._boundaries import Boundaries, clock_of
from ._durations import parse_duration
from ._early_stop import early_stop as EarlyStop
from ._pass_end import PassEnd
from ._signals import SignalFlag, SignalLike, check_can_catch, exit_status, resolve_signals
from ._stop_state import UntilState


class until:
    """Stop a training loop on a limit or a signal, on every rank at the same update.

    ``stop = loopkit.until(step, max_updates=, max_epochs=, max_time=, signals=)``, then
    ``for epoch in stop.epochs(loader):`` around the epoch loop and
    ``if stop.check(): break`` after each micro-step. ``check()`` answers True only where a
    window has just closed. ``max_time`` (``"HH:MM:SS"``, ``"DD:HH:MM:SS"``, a timedelta)
    counts the training time of the whole run, resumes included. A signal in ``signals``
    (default SIGTERM, as a preempting scheduler sends) no longer kills the process: the
    loop stops at the next check, saves, and the script ends normally; end it with
    ``sys.exit(stop.exit_status)`` to tell a requeue script it has work left. Signals and
    time are checked every ``check_every`` updates (one small all-reduce under DDP); limits
    on updates and epochs, and ``early_stop``'s decision, at every boundary.

    ``checkpointer=ckpt`` (which must save the same step, or none for none): the stop
    writes one checkpoint at its boundary, and the stop's own state (elapsed time,
    ``early_stop``'s counters, the epochs it counts) is saved with every checkpoint. On a
    pass's last window it says the epoch's code after it is still to run (a resume runs it);
    ``epochs()`` writes the state after that code where the loop runs it (without
    ``loader=``, only then). ``epochs()`` and ``with loopkit.until(...) as stop:`` put the
    signal handlers back. Build it before ``ckpt.resume()``.

    ``max_epochs`` is counted by ``epochs()``; in a loop without it, ``check()`` counts the
    passes of the Checkpointer's ``loader=`` and stops on the window that ends the last
    one; with neither, the first ``check()`` raises (the limit would be ignored).
    ``timer``: the clock ``max_time`` reads, in seconds (``time.monotonic``).
    """

    def __init__(
        self,
        step: object = None,
        *,
        max_updates: int | None = None,
        max_epochs: int | None = None,
        max_time: object = None,
        signals: Iterable[SignalLike] = ("SIGTERM",),
        early_stop: EarlyStop | None = None,
        check_every: int = 10,
        checkpointer: Checkpointer | None = None,
        timer: Callable[[], float] = time.monotonic,
    ) -> None:
        # Everything is checked before a handler is installed or the Checkpointer changed.
        clock = clock_of(step, "until")
        _check_limits(max_updates, max_epochs, check_every)
        seconds = None if max_time is None else parse_duration(max_time)
        sigs = resolve_signals(signals)
        _check_objects(early_stop, checkpointer, timer, clock)
        check_can_catch(sigs, "until")
        boundaries = Boundaries(clock)
        state = UntilState(timer, boundaries, early_stop)
        if checkpointer is not None:
            checkpointer.check_can_add("until", state)
        self.max_updates, self.max_epochs, self.max_time = max_updates, max_epochs, seconds
        self.signals, self.early_stop, self.check_every = sigs, early_stop, check_every
        self.checkpointer = checkpointer
        self._boundaries, self._state = boundaries, state
        self._pass = PassEnd(clock, None if checkpointer is None else checkpointer.loader)
        state.epoch_done = lambda: _epoch_done(self)
        # Without a loader, a stop's save can wait for the epoch's code only where the step's
        # iterate shows the pass's end: watched at every check (one attribute read).
        self._watch = checkpointer is not None and checkpointer.loader is None and clock is not None
        self._epochs_used = False  # epochs() counts the epochs (check() leaves max_epochs to it)
        self._in_epoch = False  # epochs() has yielded and its epoch's code is running
        self._waits_for_epoch = False  # the stop's save waits for the epoch's code (no loader)
        self.reason: str | None = None
        """Why the loop stopped (``"max_updates"``, ``"SIGTERM"``, ...); None until it does."""
        self.stopped_at: int | None = None
        """The update the loop stopped at."""
        self._stop_saved = False  # the stop's checkpoint is written (close() need not)
        # The first boundary pools signals and clocks whatever its number: a run resumed
        # past max_time stops there, not check_every updates later (every rank alike).
        self._state.pool_next = True
        self._flag = SignalFlag(sigs)
        self._restored = False  # the run resumed had been ended by a limit that still holds
        if checkpointer is not None:
            checkpointer.add("until", self._state)
            checkpointer._standing.stop = weakref.ref(self)  # told of a finished run's resume
        if clock is not None:  # the totals a progress display's ETA needs
            LIMITS[clock] = (max_updates, max_epochs)

    # -- deciding ---------------------------------------------------------------------------

    @property
    def elapsed(self) -> float:
        """Seconds of training so far, runs resumed from included (this rank's clock)."""
        return self._state.elapsed

    @property
    def preempted(self) -> bool:
        """Whether the loop stopped on a signal."""
        return self.reason is not None and self.reason.startswith("SIG")

    @property
    def exit_status(self) -> int:
        """75 (EX_TEMPFAIL: saved, requeue me) after a signal's stop, else 0; 0 (and a
        warning) under torchrun or ``accelerate launch``, which take 75 for a failure."""
        return exit_status(self.preempted)

    def check(self) -> bool:
        """Whether to stop now; True only where a window has just closed (and after).

        Call it on every rank after each micro-step (or, without a loopkit step, after
        each optimizer step). Every ``check_every``-th update it exchanges the signals
        and clocks of the ranks (a host sync under nccl).
        """
        if self.reason is not None:
            return True
        if self._watch:
            self._pass.watch()
        if self.max_epochs is not None and not self._epochs_used and self._pass.loader is None:
            raise RuntimeError(_UNSEEN_EPOCHS.format(self.max_epochs))
        updates = self._boundaries.new()
        if updates is None:
            return False
        reason = _limit_reached(self, updates)
        if reason is None and self.max_epochs is not None and not self._epochs_used:
            done = self._pass.epochs_done()  # not None: checked above
            if done is not None and done >= self.max_epochs:
                reason = "max_epochs"  # the window that ends the last allowed pass
        pooled = bool(self.signals) or self.max_time is not None
        if reason is None and pooled and (self._state.pool_next or updates % self.check_every == 0):
            self._state.pool_next = False
            reason = _agreed_reason(self)
        if reason is None:
            return False
        self._stop(reason, final=False)
        return True

    def _resumed_finished(self, reason: str, updates: int) -> None:
        """``ckpt.resume()`` found a run that ``reason`` (a limit that holds still) had ended."""
        if self.reason is None:  # stopped as it was, its checkpoint written
            self.reason, self.stopped_at = reason, updates
            self._stop_saved = self._restored = True

    def _stop(self, reason: str, final: bool) -> None:
        self.reason, self.stopped_at = reason, self._boundaries.updates
        ckpt = self.checkpointer
        if ckpt is None:
            return
        # After the loop: whatever is not saved yet. In the loop, at once (a loop may break
        # on stop.reason past the epoch's code, or run it: the file says it is to run).
        if final:
            ckpt.save_if_needed()
        elif ckpt.loader is None and self._in_epoch and self._pass.ends_by_iterate():
            # No loader's place to say so, but epochs() knows where the epoch's code ends: it
            # writes the save there, with the next epoch's number (the same on every rank).
            self._waits_for_epoch = True
        else:
            ckpt.save_at_boundary(defer=False)
        # Written now unless it waits for the epoch's end (the same on every rank).
        self._stop_saved = not self._waits_for_epoch

    # -- the epoch loop ---------------------------------------------------------------------

    def epochs(self, loader: EpochLoader | None = None) -> Iterator[int]:
        """Yield epoch numbers until a stop or ``max_epochs``; then save and close.

        With ``loader=`` (a ``loopkit.distributed.loader``) the epochs are the loader's, so
        a resumed run continues its interrupted epoch; without, until counts them.
        """
        _check_epochs_loader(loader, self.checkpointer)
        return self._epochs(loader)

    def _epochs(self, loader: EpochLoader | None) -> Iterator[int]:
        self._epochs_used = self._state.by_epochs = True
        epoch = 0
        try:
            while True:
                epoch = loader.epoch if loader is not None else self._state.epoch
                self._state.epoch = epoch  # with a loader, its epochs: alike in every launch
                if self.reason is None:
                    updates = self._boundaries.updates
                    if self.max_epochs is not None and epoch >= self.max_epochs:
                        self._stop("max_epochs", final=True)
                    elif (reason := _limit_reached(self, updates)) is not None:
                        self._stop(reason, final=True)
                    elif self._state.pool_next and (self.signals or self.max_time is not None):
                        # A run resumed past max_time (or signalled) stops before training:
                        # every rank enters epochs() at the same update, so pools alike.
                        self._state.pool_next = False
                        if (reason := _agreed_reason(self)) is not None:
                            self._stop(reason, final=True)
                # A resumed stop runs the epoch saved before its code after the last window
                # (the Checkpointer's loader's, also where until counts the epochs itself).
                tail = self._restored and _tail_left(self._pass.loader)
                if self.reason is not None and not tail:
                    self.close()
                    return
                self._pass.new_pass()
                self._in_epoch = True
                yield epoch
                self._in_epoch = self._restored = False
                if self.checkpointer is not None:  # the epoch's code after its pass has run
                    self.checkpointer._epoch_code.body_done()
                self._state.epoch = epoch + 1  # (with a loader, set from it again above)
        except GeneratorExit:
            # The epoch loop was left early: by a break or by an exception in its body,
            # which cannot be told apart here, so nothing is saved (a failed epoch's state
            # must not be); the handlers go back.
            self._in_epoch = False
            if self.reason is not None and not self._stop_saved:
                # Its save waited for an epoch's end that did not come: none is written.
                self._waits_for_epoch, self._stop_saved = False, True
            self._flag.restore()
            raise

    def close(self) -> None:
        """Write a stop's checkpoint if it is not written yet, or the state after the epoch's
        code that the newest checkpoint left to run; put the signal handlers back."""
        try:
            ckpt = self.checkpointer
            if self.reason is not None and ckpt is not None and not self._stop_saved:
                ckpt.save()  # the stop's, which waited for the epoch's code (no loader=)
                self._stop_saved = True
            elif self.reason is not None and ckpt is not None and ckpt._epoch_code.moved:
                ckpt.save()  # that code ran since the stop's (or the resumed) checkpoint
        finally:
            self._flag.restore()

    def __enter__(self) -> until:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.close()
        else:  # a failed loop saves nothing more: only the handlers go back
            self._flag.restore()

    # -- checkpoint piece (``_stop_state``) ------------------------------------------------

    def state_dict(self) -> dict[str, object]:
        """Elapsed training time, self-counted epochs and updates, early_stop's counters."""
        return self._state.state_dict()

    def load_state_dict(self, saved: Mapping[str, Any]) -> None:
        """Restore what ``state_dict`` returned; the clock goes on from the saved time."""
        self._state.load_state_dict(saved)

    def __repr__(self) -> str:
        limits = (("max_updates", self.max_updates), ("max_epochs", self.max_epochs),
                  ("max_time", self.max_time))  # fmt: skip
        said = ", ".join(f"{k}={v}" for k, v in limits if v is not None)
        sigs = tuple(s.name for s in self.signals)
        return f"loopkit.until({said}, signals={sigs}, reason={self.reason!r})"


def _epoch_done(stop: until) -> bool:
    """In an epoch's body that ``epochs()`` counts itself: whether the loop over its pass is
    left (its batches done), so that the epoch's code runs: a checkpoint written now resumes
    at the next epoch, as the loader's place in it says (the same on every rank)."""
    ckpt = stop.checkpointer
    if not stop._in_epoch or ckpt is None:
        return False
    if ckpt.loader is not None:  # as the loader's state in the same save says
        return ckpt._epoch_code.saving_done
    return stop._pass.last and not iterating(ckpt.clock)


def _limit_reached(stop: until, updates: int) -> str | None:
    """A stop every rank sees alike without an exchange (shared counts, agreed metric)."""
    if stop.max_updates is not None and updates >= stop.max_updates:
        return "max_updates"
    if stop.early_stop is not None and stop.early_stop.stopped:
        return "early_stop"
    return None


def _agreed_reason(stop: until) -> str | None:
    """Signals and clocks pooled over the ranks: every rank gets the same answer."""
    received, elapsed = _ranks.max_values([float(stop._flag.received), stop.elapsed])
    if received:
        return signal.Signals(int(received)).name
    if stop.max_time is not None and elapsed >= stop.max_time:
        return "max_time"
    return None


def _tail_left(loader: EpochLoader | None) -> bool:
    return loader is not None and tail_left(loader)


def _check_limits(max_updates: object, max_epochs: object, check_every: object) -> None:
    for name, value in (("max_updates", max_updates), ("max_epochs", max_epochs)):
        if value is not None and not is_int_at_least(value, 1):
            raise ValueError(f"{name} must be an int >= 1 or None, got {value!r}")
    if not is_int_at_least(check_every, 1):
        raise ValueError(
            f"check_every must be an int >= 1 (updates between signal/time checks), "
            f"got {check_every!r}"
        )


def _check_objects(early_stop: object, checkpointer: object, timer: object, clock: object) -> None:
    if early_stop is not None and not isinstance(early_stop, EarlyStop):
        raise TypeError(f"early_stop must be a loopkit.early_stop, got {early_stop!r}")
    if checkpointer is not None and not isinstance(checkpointer, Checkpointer):
        raise TypeError(f"checkpointer must be a loopkit.Checkpointer, got {checkpointer!r}")
    if not callable(timer):
        raise TypeError("timer must be a callable returning seconds (time.monotonic)")
    if checkpointer is not None and checkpointer.clock is not clock:
        if clock is None:
            which = "until was given no step but its checkpointer saves one"
        elif checkpointer.clock is None:
            which = "until follows a step but its checkpointer saves none"
        else:
            which = "until and its checkpointer follow different steps"
        raise ValueError(
            f"{which}: pass the same step to both (loopkit.until(step, ..., checkpointer=ckpt) "
            "with Checkpointer(..., step=step)), or none to either in a loop without "
            "loopkit.step; the stop's checkpoint would miss the counters it stopped at, or "
            "fall in the middle of a window"
        )


def _check_epochs_loader(loader: object, ckpt: Checkpointer | None) -> None:
    if loader is not None and ckpt is not None and ckpt.stream_loader is loader:
        raise TypeError(
            "epochs(loader) follows a loopkit.distributed.loader's epochs; this loader "
            f"({type(loader).__name__}) saves its place in its stream but counts no epochs: "
            "stop the run with until(max_updates=N), or read several epochs in one pass "
            "(passes= of loopkit.stream_shards or loopkit.shuffle_buffer)"
        )
    if loader is not None and ckpt is not None and ckpt.loader is not loader:
        raise ValueError(
            "epochs(loader) follows this loader's epochs, but the Checkpointer does not "
            "save it: pass it as Checkpointer(loader=...) too, or a resumed run would "
            "start its epochs over"
        )
    if loader is not None and not isinstance(loader, EpochLoader):
        raise TypeError(
            "epochs(loader) takes a loopkit.distributed.loader (which counts its epochs), "
            f"got {type(loader).__name__}; call epochs() to let until count them"
        )


_UNSEEN_EPOCHS = (
    "until(max_epochs={}) cannot see this loop's epochs: loop over `for epoch in "
    "stop.epochs(loader):` (or stop.epochs() to let until count them), or give the "
    "loopkit.distributed.loader to its Checkpointer (Checkpointer(loader=...)) so check() "
    "sees where the passes end; the limit would otherwise be ignored"
)
