"""``EpochLoader``: a DataLoader that counts its epochs and its place in them, resumably."""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, TypeVar

import torch
from torch.utils.data import DataLoader

from .._checks import is_int_at_least
from ._passes import Pass as Pass  # re-exported: a step reads Pass.latest
from ._passes import rng_as_at, rng_now
from ._seeding import KeyedBatches
from ._state_checks import check_state
from ._state_checks import resharded as resharded  # re-exported

T = TypeVar("T")


@dataclasses.dataclass
class _Progress:
    """Where the loader stands: all that ``load_state_dict`` sets and a refused resume puts back."""

    next_epoch: int = 0
    """The epoch the next pass will run (0 before the first)."""
    position: int = 0
    """Batches handed out in the current pass."""
    resume_at: int = 0
    """Batches the next pass skips: a resumed pass continues after them."""
    pass_epoch: int = 0
    """The epoch of the current pass (after a load, of the pass to run next)."""
    pass_generator_state: torch.Tensor | None = None
    """The loader's generator as the current pass began (it draws the workers' seeds)."""
    loads: int = 0
    """States loaded so far: a pass begun before a load no longer sets the place."""


LoaderSnapshot = tuple[_Progress, torch.Tensor | None]
"""What ``EpochLoader._snapshot`` returns: its progress and its generator's state."""


class EpochLoader:
    """A DataLoader that advances its sampler's epoch on every pass, so no rank forgets.

    It also knows how far the current pass got (``position``, in batches), which is what
    a checkpoint needs to continue the same data order mid-epoch. Each batch is fetched
    (and collated) with the python, numpy and torch RNGs set from (seed, epoch, rank,
    batch index), so random augmentation is the same whatever the workers and resumes.
    """

    def __init__(self, loader: DataLoader[Any], batches: KeyedBatches) -> None:
        self.loader = loader
        self.batches = batches
        self._progress = _Progress()
        # Called (and dropped) when the next pass starts, before its first batch is drawn:
        # a Checkpointer defers an end-of-epoch save to here, after the epoch's own code.
        self._before_next_pass: list[Callable[[], object]] = []
        self._recent: list[Pass] = []  # uncounted passes started since one counted
        self._trained = False  # training consumed one of its passes once (``_passes``)
        self._open: Pass | None = None  # the latest counted pass
        self._uncounted: Pass | None = None  # the latest uncounted pass whose draw is undone
        weakref.finalize(self, _stop_workers, loader)  # see _stop_workers

    @property
    def epoch(self) -> int:
        """The epoch the next pass will run (0 before the first)."""
        return self._progress.next_epoch

    @property
    def position(self) -> int:
        """Batches handed out in the current pass."""
        return self._progress.position

    def __iter__(self) -> Iterator[Any]:
        """A pass that counts once training consumes one of its batches (``_passes``): a peek
        or an evaluation pass leaves the loader as it was."""
        return self._start(counted=False)

    def training_pass(self) -> Iterator[Any]:
        """A pass that counts from its start: a step's ``iterate`` trains on it."""
        return self._start(counted=True)

    def _start(self, counted: bool) -> Iterator[Any]:
        self._settle()
        p = self._progress
        start = p.resume_at
        if not counted and start >= len(self.loader) > 0:
            # A pass resumed with no batch left (saved before its epoch's code ran) hands out
            # nothing for training to consume: it counts as it starts, as iterate's does.
            counted = True
        this = Pass(self, p.next_epoch, start, counted)
        if counted:
            self._run_before_next_pass()
            self._recent, self._trained = [], True
        else:
            self._recent = [*self._recent[-7:], this]  # (a few: passes opened and left)
            if self._before_next_pass:  # a save waits: it holds the RNGs the pass starts with
                this.rng = rng_now()
        self.batches.set_epoch(this.epoch)
        self.batches.skip = start
        generator = self.loader.generator
        if generator is not None:
            # The pass draws its worker seeds from this generator: remember its state at the
            # start of the pass so a resumed pass draws the same ones.
            this.before = generator.get_state()
        if counted:
            p.next_epoch, p.resume_at = this.epoch + 1, 0
            p.pass_epoch, p.position = this.epoch, start
            p.pass_generator_state = this.before
            self._open = this
        if start >= len(self.loader):
            # No batch left: no DataLoader iterator, which would draw a seed from the
            # generator the next pass starts from.
            this.ended = True
            return iter(())
        persistent = self.loader.persistent_workers
        starts_workers = persistent and self.loader._iterator is None
        in_one = self._counted_pass_open() or any(not q.ended for q in self._recent[:-1])
        if not counted and persistent and in_one:
            # A pass inside another (a training pass): its own workers (resetting the
            # persistent iterator would restart the pass it is in).
            starts_workers = False
            it: Iterator[Any] = self.loader._get_iterator()
        else:
            it = iter(self.loader)
        if generator is not None and not counted and not starts_workers:
            # Taken back if the pass never counts (persistent workers it started keep theirs:
            # later passes reuse them without drawing).
            this.after = generator.get_state()
            self._uncounted = this
        return self._counted(it, this)

    def _counted(self, it: Iterator[Any], this: Pass) -> Iterator[Any]:
        try:
            for batch in it:
                if this.counted:
                    self._progress.position += 1
                    Pass.latest = this
                else:
                    this.handed_out()
                yield batch
            if this.ran_out(self):  # a pass read whole where nothing trains: an epoch
                self._count(this)
        finally:
            this.ended = True

    def _run_before_next_pass(self) -> None:
        while self._before_next_pass:
            # Each hook leaves the list before it runs: one that raises is not run again,
            # and the ones after it still run at the next pass.
            self._before_next_pass.pop(0)()

    def _count(self, this: Pass) -> None:
        """Training consumed a batch of the uncounted pass ``this``: it is the loader's now,
        as if it had counted from its start (what waits for the next pass runs first, with
        the loader as it was before the pass)."""
        with rng_as_at(this.rng):
            self._run_before_next_pass()
        p = self._progress
        p.next_epoch, p.resume_at = this.epoch + 1, 0
        p.pass_epoch, p.position = this.epoch, this.start + this.handed
        p.pass_generator_state = this.before
        this.counted, this.rng = True, None
        self._open, Pass.latest = this, this
        self._uncounted, self._recent = None, []  # (later passes drew as it did: ``_settle``)

    def _counted_pass_open(self) -> bool:
        """Whether a counted pass is still being iterated (training is in its middle)."""
        return self._open is not None and not self._open.ended

    def _settle(self) -> None:
        """An uncounted pass is left (another starts, the place is set or loaded): the draw
        its DataLoader iterator made from the generator is taken back."""
        this, self._uncounted = self._uncounted, None
        generator = self.loader.generator
        if this is None or this.counted or generator is None or this.before is None:
            return
        if this.after is not None and torch.equal(generator.get_state(), this.after):
            generator.set_state(this.before)

    def _generator_state(self) -> torch.Tensor | None:
        """The generator as the next pass starts from it (an uncounted pass's draw left out)."""
        generator = self.loader.generator
        if generator is None:
            return None
        this = self._uncounted
        if this is not None and not this.counted and this.before is not None:
            return this.before
        state: torch.Tensor = generator.get_state()
        return state

    def set_epoch(self, epoch: int) -> None:
        """Make the next pass run ``epoch`` (for a resumed run); a pass started before that
        no longer counts."""
        if not is_int_at_least(epoch, 0):
            raise ValueError(f"epoch must be an int >= 0, got {epoch!r}")
        self._settle()
        self._recent = []
        self._progress.next_epoch = epoch

    def state_dict(self, consumed: int | None = None, epoch_open: bool = False) -> dict[str, Any]:
        """Where the current pass stands: its epoch and the batches ``consumed`` so far.

        ``epoch_open``: saved on the window that ends the pass, before the epoch's own code
        after it: a resume runs that epoch again with no batch left (so its code runs),
        where a finished pass otherwise resumes at the next epoch.

        Also records the data set's length, the batch size, the batches per pass, the seed,
        whether it shuffles, the number of processes and ``drop_last``, so a resume with
        other data, or mid-pass with another order, is refused instead of repeating some
        samples and skipping others. A resume on another number of processes continues the
        pass with the same global batches (``resharded``).
        """
        p = self._progress
        position = p.position if consumed is None else consumed
        state: dict[str, Any] = {
            "epoch": p.pass_epoch,
            "position": position,
            "next_epoch": p.next_epoch,
            "dataset_length": self.batches.dataset_length,
            "samples": self.batches.samples,
            "batch_size": self.batches.batch_size,
            "batches": len(self.loader),
            "seed": self.batches.seed,
            "shuffle": self.batches.shuffle,
            "world_size": self.batches.world_size,
            "drop_last": self.batches.drop_last,
        }
        if epoch_open and position >= len(self.loader):
            state["epoch_open"] = True
        generator = self.loader.generator
        if generator is not None:
            finished = position >= len(self.loader)
            if finished or p.pass_generator_state is None:
                # The next pass starts from the generator as it is now.
                state["generator"] = self._generator_state()
            else:
                # A resumed pass is rebuilt from its start: the state the pass began with.
                state["generator"] = p.pass_generator_state
        return state

    def _check_state(self, state: object) -> None:
        """Raise ValueError saying what is wrong if ``state`` cannot be loaded here."""
        check_state(state, self.batches, len(self.loader), self.loader.generator)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue where ``state_dict`` left off: the same epoch, the next batch.

        The state is checked first (data set length, batch size, batches per pass, the
        generator state); a refused state changes nothing.
        """
        self._check_state(state)
        self._settle()
        self._recent = []  # a pass started before the load no longer counts
        p = self._progress
        p.loads += 1
        position = int(state["position"])
        if position >= len(self.loader) and not state.get("epoch_open"):
            # The pass had finished: the next one is a new epoch, from its first batch.
            p.next_epoch, p.resume_at = int(state["next_epoch"]), 0
        else:
            p.next_epoch, p.resume_at = int(state["epoch"]), position
        # Described as "the pass to run next, with `resume_at` batches done", so that a
        # state_dict() taken before the next pass starts round-trips.
        p.pass_epoch, p.position = p.next_epoch, p.resume_at
        generator = self.loader.generator
        saved = state.get("generator")
        if saved is not None and generator is not None:
            generator.set_state(saved)
            p.pass_generator_state = generator.get_state()

    def _snapshot(self) -> LoaderSnapshot:
        """Everything ``load_state_dict`` changes, for ``_restore`` to put back."""
        generator = self.loader.generator
        state = self._generator_state() if generator is not None else None
        return dataclasses.replace(self._progress), state

    def _restore(self, snapshot: LoaderSnapshot) -> None:
        progress, generator_state = snapshot
        self._progress = dataclasses.replace(progress)  # the snapshot stays as it was taken
        if generator_state is not None and self.loader.generator is not None:
            self.loader.generator.set_state(generator_state)

    def __len__(self) -> int:
        return len(self.loader)

    @property
    def batch_size(self) -> int:
        """Samples per batch on this rank."""
        return self.batches.batch_size


def _stop_workers(loader: DataLoader[Any]) -> None:
    """Shut a DataLoader's persistent workers down while its iterator is whole: as the
    EpochLoader goes, before the garbage collector can take them (collected with a
    Checkpointer, a reference cycle, the iterator would find its queues closed and wait
    5 s per worker for them to time out)."""
    it, loader._iterator = loader._iterator, None
    shutdown = getattr(it, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()


def training_pass(loader: EpochLoader) -> tuple[Pass | None, int]:
    """The counted pass training runs on now (None before the first), and the loads so far."""
    return loader._open, loader._progress.loads


def hand_back(loader: EpochLoader, opened: tuple[Pass | None, int], handed: int) -> None:
    """A loop left the training pass ``opened`` (``training_pass``) after ``handed`` of its
    batches were handed to it (``break``, an exception, with a batch taken ahead or while
    taking one): what the loader counted beyond them was never the loop's and leaves the
    count, so a save after the loop holds the place after the batches the loop had. Not once
    another pass began or a state was loaded: the place is theirs."""
    this, loads = opened
    p = loader._progress
    if this is not None and this is loader._open and p.loads == loads:
        p.position = min(p.position, this.start + handed)


def training_iter(items: Iterable[T]) -> Iterator[T]:
    """``iter(items)`` for a step's ``iterate``: a ``distributed.loader``'s pass counts from
    its start (``EpochLoader.training_pass``)."""
    if isinstance(items, EpochLoader):
        return items.training_pass()
    return iter(items)
