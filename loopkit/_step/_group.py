"""loopkit.steps: several steps (one per optimizer) on one clock over one loader.

A GAN's discriminator and generator, an actor and a critic, a student and its teacher: each
model has its own ``loopkit.step`` (its optimizer, precision, GradScaler, scheduler), and
the group drives them together. ``for batch in loopkit.steps(d_step, g_step).iterate(loader)``:

- one clock: every member's window ends on the same batches (every ``accumulate``-th, and
  the last one of the loader), also for a member not entered on that batch, whose open
  window the group closes right after the batch's micro-steps: when loop control first asks
  after them (``until.check()``, ``cadence.due()``, ``Checkpointer.maybe_save`` call
  ``group.settle()``), or when the loop asks for the next batch. On a batch where no member
  is entered there are no micro-steps to follow: the group learns where the loop asks (``_Asking``)
  and closes the windows at the read unless the loop asks before its micro-steps;
- one sync state per batch: every DDP member's model runs under ``no_sync`` for the whole
  iteration when its micro-step will (on a batch that does not end a window, or on any
  batch once its windows are reduced by hand), so a forward outside the member's own
  micro-step (``fake = G(z)`` before G's step) does not all-reduce either;
- one owner per parameter: a member's loss may not reach parameters that another member's
  optimizer trains (``_reach``), since both windows would claim their gradient;
- one checkpoint: ``Checkpointer(step=group)`` saves and resumes every member, and its
  ``updates`` are the windows the clock has closed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, TypeVar

from .. import _ranks
from .._parallel._grad_sync import no_sync, sync_kind
from . import _accumulate, _compose, _feed, _last_batch, _micro_batch, _reach
from ._accumulate import accumulate
from ._window import Window

T = TypeVar("T")


class steps:
    """Several ``loopkit.step`` instances driven by one clock over one loader."""

    def __init__(self, *members: _compose.step) -> None:
        if not members:
            raise TypeError("steps() needs at least one loopkit.step: steps(d_step, g_step)")
        for m in members:
            if not isinstance(m, _compose.step):
                raise TypeError(f"steps() takes loopkit.step objects, got {type(m).__name__}")
        if len({id(m) for m in members}) != len(members):
            raise ValueError("the same step is given twice: give each step once")
        everies = {m.accumulator.every for m in members}
        if len(everies) != 1:
            raise ValueError(
                f"the steps accumulate differently ({sorted(everies)} micro-batches per "
                "update): the steps of one group share one clock, build them with the same "
                "accumulate="
            )
        sizes = {m.chunks.size for m in members}
        # A frozen= member (a GAN) trains through another: each member splits the whole batch
        # itself (step.split), all of one member's chunks before the next member's.
        by_member = sizes != {None} and any(m._frozen.params for m in members)
        if len(sizes) != 1 and not by_member:
            raise ValueError(
                f"the steps split batches differently (micro_batch= {sorted(map(str, sizes))}): "
                "the members of a group share one clock, build them with the same micro_batch="
            )
        _refuse_shared_parameters(members)
        _refuse_shared_logs(members)
        ddps = [m.model for m in members if sync_kind(m.model) == "ddp"]
        for m in members:
            m.chunks.by_member = by_member
            m.chunks.others = [x for x in ddps if x is not m.model] if by_member else []
        self.members = members
        self.every: int = everies.pop()
        self.updates = 0
        """Windows the shared clock has closed (what checkpoints are numbered by)."""
        self.lookahead = 0
        """Batches ``iterate`` has taken from its loader but not yet handed out (0 or 1)."""
        self._syncs = [
            (m.accumulator, no_sync(m.model)) for m in members if sync_kind(m.model) == "ddp"
        ]
        self._ends = False  # the batch handed out now ends a window
        self._counted = False  # `updates` counts a window some member may still have open
        self._asking = _Asking([m.accumulator for m in members])
        self._loaded: tuple[int, int] | None = None  # (loads, `updates` as last loaded)
        _reach.arm(members)

    @property
    def micro_step(self) -> int:
        """The longest open window of a member, in micro-steps (0 between windows)."""
        return max(m.micro_step for m in self.members)

    def settle(self) -> int:
        """``micro_step`` as loop control reads it: on a window's last batch, after the
        batch's micro-steps, first close the windows of the members not entered on it.

        ``until.check()``, ``cadence.due()`` and ``Checkpointer.maybe_save``/``save`` call
        it after the batch's micro-steps, so they see the boundary. With no member entered
        on the batch, it closes every open window too, unless the loop asks before its
        micro-steps (at the top of its body: learned from the last batch that had both a
        call and a micro-step). Call it on every rank alike (a DDP member's window is then
        all-reduced). A member entered on that batch after it raises.
        """
        for m in self.members:  # a member's window whose ending micro-step raised
            _accumulate.close_overdue(m.accumulator)
        asking = self._asking
        if asking.batch is not None:  # inside a batch of iterate()
            entered = asking.read()
            if self._ends:
                self._close_skipped(entered)
        return self.micro_step

    def iterate(self, iterable: Iterable[T]) -> Iterator[T]:
        """Yield the batches (moved to the first member's device), one window clock for all.

        The last batch is found as ``step.iterate`` finds it (looked ahead, or counted);
        a left-over open window (a loop left early) is closed first.
        """
        if any(m.accumulator._inside for m in self.members):
            raise RuntimeError(
                "iterate() inside a member's `with step:`: loop over group.iterate(loader) "
                "and enter the steps inside the loop"
            )
        return self._iterate(iterable)

    def _iterate(self, iterable: Iterable[T]) -> Iterator[T]:
        self.flush(logs=False)
        mover = self.members[0]._mover
        index = 0
        accs = [m.accumulator for m in self.members]
        by_member = self.members[0].chunks.by_member
        for acc in accs:
            acc.iterating += 1
        world = _ranks.world()[1]
        try:
            done = _feed.resumed(self.members[0], iterable)
            for cur, last in _last_batch.marked(self, iterable, iterable, mover, done):
                # Every member's log axes: the epoch, and the samples of whole batches.
                samples = _micro_batch.leading_size(cur) * world
                for m in self.members:
                    if index == 0:
                        m.seen.begin_pass(iterable)
                    m.seen.samples += samples
                    m.seen.batches += 1
                ends = last or (index + 1) % self.every == 0
                if ends:  # counted as the window's batch begins, so a save in it has its number
                    self.updates += 1
                    self._counted = True
                parts = self._parts(cur, getattr(iterable, "batch_size", None))
                for j, (part, share) in enumerate(parts, start=1):
                    # With micro_batch= each chunk is a micro-step; the batch's last one ends.
                    item_ends = ends and j == len(parts)
                    for m, acc in zip(self.members, accs, strict=True):
                        acc._final_pending = item_ends
                        acc._closed_by_group = None
                        m.chunks.share = None if m.chunks.size is None or by_member else share
                        m.chunks.batch_last = j == len(parts)
                        if j == 1:  # a batch's record holds its own chunks' only
                            m.chunks.record = []
                        if m.doctor is not None:  # its FLOPs scale by each micro-step's samples
                            m.doctor.step_samples(_micro_batch.leading_size(part))
                    self._ends = item_ends
                    with contextlib.ExitStack() as iteration:
                        # The whole iteration, forwards outside the steps included, runs as
                        # the member's micro-step will: under no_sync unless it ends the window
                        # with DDP's own reduction (one reduced by hand never syncs in a forward).
                        for acc, sync in self._syncs:
                            if not item_ends or acc._sync.reduce_by_hand:
                                iteration.enter_context(sync)
                        self._asking.begin()
                        yield part
                    self._asking.end()
                    self._ends = False
                    if item_ends:
                        self._close_windows()
                index += 1
            for m in self.members:
                m.seen.end_pass()
            self.flush(logs=False)  # ended before the batch counted last: its window closes
        finally:
            for acc in accs:
                acc.iterating -= 1
            for m in self.members:
                m.seen.leave()
            for m, acc in zip(self.members, accs, strict=True):
                acc._final_pending = acc._by_marks = False
                acc._closed_by_group = None
                m.chunks.share, m.chunks.batch_last, m.chunks.record = None, True, []
            self._ends = False
            self._asking.batch = None
            self.lookahead = 0

    def _parts(self, batch: T, hint: object = None) -> list[tuple[T, float]]:
        """The batch as handed out: whole, or in chunks of the members' ``micro_batch``."""
        size = self.members[0].chunks.size
        if size is None and not self.members[0].chunks.by_member:
            return [(batch, 1.0)]
        for m in self.members:
            m.accumulator._by_marks = True  # windows end at the batch's last chunk
        if size is None or self.members[0].chunks.by_member:
            return [(batch, 1.0)]  # each member splits it (step.split)
        return _micro_batch.chunks(batch, size, self.members[0].chunks, hint)

    def _close_skipped(self, entered: bool) -> None:
        """On a window's last batch, after its micro-steps: close the members not entered.

        ``entered``: a member has been entered on this batch. With none, the read follows the
        batch's (absent) micro-steps unless the loop asks before them; then, and when no
        window is open, nothing is closed (and nothing refused).
        """
        accs = self._asking.accs
        pending = [k for k, acc in enumerate(accs) if acc._final_pending]
        if not pending or any(acc._inside for acc in accs):
            return  # every member ran on this batch (or was closed), or one is running now
        if not entered and (self._asking.first or not any(acc.micro_step for acc in accs)):
            return  # asked before the micro-steps, or no window to close
        why = (
            "after another member's micro-step on this batch"
            if entered
            else "on a batch no member had been entered on, where this loop asks after the "
            "micro-steps"
        )
        for k in pending:
            acc = accs[k]
            acc._final_pending = False
            acc._closed_by_group = (
                f"steps[{k}] entered on a window's last batch after the group closed its "
                f"window there: loop control asked {why} (until.check(), cadence.due() and "
                "Checkpointer.maybe_save/save call group.settle(), which close the windows "
                "of the members not entered on the batch). Enter every member a "
                "batch trains first, then ask those"
            )
            if acc.micro_step:
                acc.flush()
        self._asking.rebase()

    def _close_windows(self) -> None:
        """The clock ends a window: close it for every member, entered on this batch or not."""
        for m in self.members:
            m.accumulator._final_pending = False
            if m.micro_step:
                m.accumulator.flush()
        self._counted = False

    def flush(self, logs: bool = True) -> bool:
        """Close every member's open window (and their logs); whether any made an update.

        A window the clock has already counted (a loop left on a window's last batch before
        the group closed a member's window) is not counted again.
        """
        counted, self._counted = self._counted, False
        stepped = [m.accumulator.flush() for m in self.members]
        if logs:
            for m in self.members:
                if m.log is not None:
                    m.log.flush()
        if any(stepped) and not counted:
            self.updates += 1
        return any(stepped)

    def state_dict(self) -> dict[str, Any]:
        """Every member's state and the clock, for a checkpoint taken between windows."""
        return {"steps": [m.state_dict() for m in self.members], "updates": self.updates}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""
        saved = state["steps"]
        if len(saved) != len(self.members):
            raise ValueError(
                f"state of {len(saved)} steps, but this group has {len(self.members)}: build "
                "the group with the same steps, in the same order"
            )
        for m, s in zip(self.members, saved, strict=True):
            m.load_state_dict(s)
        self.updates = int(state["updates"])
        self._counted = False
        self._loaded = (self._loaded[0] + 1 if self._loaded else 1, self.updates)

    def __repr__(self) -> str:
        return f"loopkit.steps({len(self.members)} steps, accumulate={self.every})"


class _Asking:
    """Where loop control asks (``group.settle()``) relative to the loop's micro-steps.

    A window's last batch on which no member is entered has no micro-steps to follow: a
    read there comes after the loop body's micro-steps (close the open windows now, where
    the docs ask loop control) unless the loop asks before them, at the top of its body,
    where closing would refuse the members it enters next. Which one is learned from the
    last batch that had both a read and a member entered (``until``/``cadence`` read on
    every call); with no such batch yet, after (the docs' loop).
    """

    __slots__ = ("accs", "after", "batch", "before", "first", "some")

    def __init__(self, accs: list[accumulate]) -> None:
        self.accs = accs
        self.batch: list[tuple[Window, int]] | None = None  # the windows as the batch began
        self.some = False  # a member was entered on this batch before the last rebase
        self.before = False  # read on this batch before any member was entered
        self.after = False  # read on this batch after a member was entered
        self.first = False  # the loop asks before its micro-steps (learned)

    def begin(self) -> None:
        """A batch is handed out: entries count from here."""
        self.batch = self._windows()
        self.some = self.before = self.after = False

    def rebase(self) -> None:
        """The group closed windows itself: that is no member's entry."""
        self.some = self.entered()
        self.batch = self._windows()

    def entered(self) -> bool:
        """Whether a member has been entered on this batch (a micro-step opens or closes)."""
        assert self.batch is not None
        return self.some or any(
            acc._window is not w or acc._window.micro != m
            for acc, (w, m) in zip(self.accs, self.batch, strict=True)
        )

    def read(self) -> bool:
        """A ``settle()`` on this batch; whether a member has been entered."""
        entered = self.entered()
        if entered:
            self.after = True
        else:
            self.before = True
        return entered

    def end(self) -> None:
        """The loop asks for the next batch: learn where this one was read, if it tells."""
        if (self.before or self.after) and self.entered():
            self.first = self.before
        self.batch = None

    def _windows(self) -> list[tuple[Window, int]]:
        return [(acc._window, acc._window.micro) for acc in self.accs]


def _refuse_shared_parameters(members: tuple[_compose.step, ...]) -> None:
    """One parameter in two members' optimizers would get two updates from two windows."""
    owner: dict[int, int] = {}
    for k, m in enumerate(members):
        for group in m.optimizer.param_groups:
            for p in group["params"]:
                first = owner.setdefault(id(p), k)
                if first != k:
                    raise ValueError(
                        f"steps {first} and {k} have a parameter in both their optimizers: "
                        "say which step owns it by giving it only to that step's optimizer, "
                        "and freeze its module in the other step (frozen=[module])"
                    )


def _refuse_shared_logs(members: tuple[_compose.step, ...]) -> None:
    """One log in two members would average their losses (each records its own as "loss")."""
    owner: dict[int, int] = {}
    for k, m in enumerate(members):
        if m.log is None:
            continue
        first = owner.setdefault(id(m.log), k)
        if first != k:
            raise ValueError(
                f"steps {first} and {k} share one log (log=): each records its loss as 'loss', "
                "so every flush would average the two losses into one number; give each step "
                "its own detach_logging, with a sink that names its loss, e.g. "
                "log=loopkit.detach_logging(every=N, sink=lambda m: print({'d_loss': m['loss']}))"
            )
