"""loopkit.steps: several steps (one per optimizer) on one clock over one loader.

A GAN's discriminator and generator, an actor and a critic, a student and its teacher: each
model has its own ``loopkit.step`` (its optimizer, precision, GradScaler, scheduler), and
the group drives them together. ``for batch in loopkit.steps(d_step, g_step).iterate(loader)``:

- one clock: every member's window ends on the same batches (every ``accumulate``-th, and
  the last one of the loader), also for a member not entered on that batch, whose open
  window the group closes after the batch;
- one sync state per batch: on a batch that does not end a window, every DDP member's
  model runs under ``no_sync`` for the whole iteration, so a forward outside the member's
  own micro-step (``fake = G(z)`` before D's step) does not all-reduce either;
- one checkpoint: ``Checkpointer(step=group)`` saves and resumes every member, and its
  ``updates`` are the windows the clock has closed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, TypeVar

from .._parallel._grad_sync import no_sync, sync_kind
from . import _compose

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
        _refuse_shared_parameters(members)
        self.members = members
        self.every: int = everies.pop()
        self.updates = 0
        """Windows the shared clock has closed (what checkpoints are numbered by)."""
        self.lookahead = 0
        """Batches ``iterate`` has taken from its loader but not yet handed out (0 or 1)."""
        self._syncs = [no_sync(m.model) for m in members if sync_kind(m.model) == "ddp"]

    @property
    def micro_step(self) -> int:
        """The longest open window of a member, in micro-steps (0 between windows)."""
        return max(m.micro_step for m in self.members)

    def iterate(self, iterable: Iterable[T]) -> Iterator[T]:
        """Yield the batches (moved to the first member's device), one window clock for all.

        Looks one batch ahead; a left-over open window (a loop left early) is closed first.
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
        it = iter(iterable)
        try:
            # Moved as soon as it is taken: the next batch's copy overlaps this one's compute.
            nxt = mover(next(it))
        except StopIteration:
            return
        index = 0
        try:
            while True:
                cur = nxt
                try:
                    nxt = mover(next(it))
                    last, self.lookahead = False, 1
                except StopIteration:
                    last, self.lookahead = True, 0
                ends = last or (index + 1) % self.every == 0
                if ends:  # counted as the window's batch begins, so a save in it has its number
                    self.updates += 1
                for m in self.members:
                    m.accumulator._final_pending = ends
                with contextlib.ExitStack() as iteration:
                    if not ends:  # the whole iteration, forwards outside the steps included
                        for s in self._syncs:
                            iteration.enter_context(s)
                    yield cur
                if ends:
                    self._close_windows()
                if last:
                    return
                index += 1
        finally:
            for m in self.members:
                m.accumulator._final_pending = False
            self.lookahead = 0

    def _close_windows(self) -> None:
        """The clock ends a window: close it for every member, entered on this batch or not."""
        for m in self.members:
            m.accumulator._final_pending = False
            if m.micro_step:
                m.accumulator.flush()

    def flush(self, logs: bool = True) -> bool:
        """Close every member's open window (and their logs); whether any made an update."""
        stepped = [m.accumulator.flush() for m in self.members]
        if logs:
            for m in self.members:
                if m.log is not None:
                    m.log.flush()
        if any(stepped):
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

    def __repr__(self) -> str:
        return f"loopkit.steps({len(self.members)} steps, accumulate={self.every})"


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
