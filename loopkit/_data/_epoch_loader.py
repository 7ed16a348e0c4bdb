"""``EpochLoader``: a DataLoader that counts its epochs and its place in them, resumably."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any, ClassVar

import torch
from torch.utils.data import DataLoader

from .._checks import is_int_at_least
from ._seeding import KeyedBatches


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


class Pass:
    """One pass over an ``EpochLoader``; ``Pass.latest`` is the last to hand out a batch.

    A step reads it to notice a window that spans two passes of one loader.
    """

    __slots__ = ("loader_id",)
    latest: ClassVar[Pass | None] = None

    def __init__(self, loader_id: int) -> None:
        self.loader_id = loader_id


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

    @property
    def epoch(self) -> int:
        """The epoch the next pass will run (0 before the first)."""
        return self._progress.next_epoch

    @property
    def position(self) -> int:
        """Batches handed out in the current pass."""
        return self._progress.position

    def __iter__(self) -> Iterator[Any]:
        while self._before_next_pass:
            # Each hook leaves the list before it runs: one that raises is not run again,
            # and the ones after it still run at the next pass.
            self._before_next_pass.pop(0)()
        p = self._progress
        epoch, p.next_epoch = p.next_epoch, p.next_epoch + 1
        self.batches.set_epoch(epoch)
        generator = self.loader.generator
        if generator is not None:
            # The pass draws its worker seeds from this generator: remember its state at the
            # start of the pass so a resumed pass draws the same ones.
            p.pass_generator_state = generator.get_state()
        start, p.resume_at = p.resume_at, 0
        self.batches.skip = start
        p.pass_epoch = epoch
        p.position = start
        if start >= len(self.loader):
            # A pass resumed with no batch left (saved before its epoch's code ran): no
            # DataLoader iterator, which would draw a seed from the generator the next
            # pass starts from.
            return iter(())
        return self._counted(iter(self.loader), Pass(id(self)))

    def _counted(self, it: Iterator[Any], this: Pass) -> Iterator[Any]:
        for batch in it:
            self._progress.position += 1
            Pass.latest = this
            yield batch

    def set_epoch(self, epoch: int) -> None:
        """Make the next pass run ``epoch`` (for a resumed run)."""
        if not is_int_at_least(epoch, 0):
            raise ValueError(f"epoch must be an int >= 0, got {epoch!r}")
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
                state["generator"] = generator.get_state()
            else:
                # A resumed pass is rebuilt from its start: the state the pass began with.
                state["generator"] = p.pass_generator_state
        return state

    def _check_state(self, state: object) -> None:
        """Raise ValueError saying what is wrong if ``state`` cannot be loaded here."""
        if not isinstance(state, Mapping):
            raise ValueError(f"a loader state must be a dict, got {type(state).__name__}")
        for key in ("epoch", "position", "next_epoch", "dataset_length", "samples", "batches"):
            if key not in state:
                raise ValueError(f"the loader state has no {key!r} entry (incomplete)")
            if not is_int_at_least(state[key], 0):
                raise ValueError(
                    f"the loader state's {key!r} must be an int >= 0, got {state[key]!r}"
                )
        if "batch_size" not in state:
            raise ValueError("the loader state has no 'batch_size' entry (incomplete)")
        if not isinstance(state.get("epoch_open", False), bool):
            raise ValueError(
                f"the loader state's 'epoch_open' must be a bool, got {state['epoch_open']!r}"
            )
        if state["dataset_length"] != self.batches.dataset_length:
            raise ValueError(
                f"the data set has {self.batches.dataset_length} samples but the state was "
                f"saved with {state['dataset_length']}: resuming would repeat some samples and "
                "skip others; resume with the data set the run was saved with"
            )
        saved_world = state.get("world_size", self.batches.world_size)
        if saved_world != self.batches.world_size:
            resharded(state, self.batches, len(self.loader))
        elif state["batch_size"] != self.batches.batch_size:
            raise ValueError(
                f"the loader's batch size is {self.batches.batch_size} but the state was saved "
                f"with {state['batch_size']}: build the loader with the same batch size"
            )
        here = (self.batches.samples, len(self.loader))
        if saved_world == self.batches.world_size and (state["samples"], state["batches"]) != here:
            raise ValueError(
                f"this loader's pass has {here[0]} samples in {here[1]} batches but the state "
                f"was saved from one with {state['samples']} in {state['batches']}: resume with "
                "the same number of processes, drop_last and batch size"
            )
        if state["position"] > state["batches"]:
            raise ValueError(
                f"the loader state's position {state['position']} is past the end of a pass of "
                f"{state['batches']} batches"
            )
        if 0 < state["position"] < state["batches"]:
            self._check_order(state)
        generator = self.loader.generator
        saved = state.get("generator")
        if saved is not None and generator is not None:
            if not isinstance(saved, torch.Tensor) or saved.dtype != torch.uint8:
                raise ValueError(
                    "the loader state's 'generator' must be a uint8 tensor from "
                    f"torch.Generator.get_state(), got {type(saved).__name__}"
                )
            try:  # on a scratch generator: this loader's stays untouched if it is refused
                torch.Generator(device=generator.device).set_state(saved)
            except (RuntimeError, ValueError, TypeError) as err:
                raise ValueError(
                    f"the loader state's 'generator' is not a valid state: {err}"
                ) from err

    def _check_order(self, state: Mapping[str, Any]) -> None:
        """Refuse a mid-pass state whose pass was drawn in another order than this loader's."""
        here = {"seed": self.batches.seed, "shuffle": self.batches.shuffle}
        # A state saved before these were recorded says nothing of them: not checked.
        saved = {k: state[k] for k in here if k in state}
        for key, value in saved.items():
            if key == "seed" and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"the loader state's 'seed' must be an int, got {value!r}")
            if key == "shuffle" and not isinstance(value, bool):
                raise ValueError(f"the loader state's 'shuffle' must be a bool, got {value!r}")
        differ = [k for k in saved if saved[k] != here[k]]
        if differ:
            said = ", ".join(f"{k}={saved[k]!r}" for k in differ)
            now = ", ".join(f"{k}={here[k]!r}" for k in differ)
            raise ValueError(
                f"the state was saved mid-pass ({state['position']} of {state['batches']} "
                f"batches) by a loader with {said}, but this loader has {now}: the rest of the "
                f"pass would come in another order (repeating some samples, skipping others) "
                f"or with other random augmentation. Build the loader with {said} to resume "
                "(another order can start at a pass's boundary)"
            )

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue where ``state_dict`` left off: the same epoch, the next batch.

        The state is checked first (data set length, batch size, batches per pass, the
        generator state); a refused state changes nothing.
        """
        self._check_state(state)
        p = self._progress
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
        return (
            dataclasses.replace(self._progress),
            generator.get_state() if generator is not None else None,
        )

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


def resharded(state: Mapping[str, Any], here: KeyedBatches, batches: int) -> None:
    """Raise ValueError unless a pass saved by another number of processes continues here
    with the same global batches (``batches``: this loader's per pass).

    Batch ``i`` of a pass, taken on every rank together, is the permutation's samples
    ``[i * G, (i + 1) * G)`` for the global batch ``G = batch_size * world_size`` (the
    sampler deals rank ``r`` every ``world_size``-th sample from ``r``; the permutation
    depends on the seed and epoch only). So with the same ``G`` the saved position, in
    batches, is the same place in the pass on any number of processes, provided the pass
    holds the same samples: with ``drop_last`` always (``n // G`` whole batches), without
    it when both pad the data set to the same length (a multiple of each number of processes).
    """
    world = here.world_size
    saved_world = state["world_size"]
    if not is_int_at_least(saved_world, 1):
        raise ValueError(
            f"the loader state's 'world_size' must be an int >= 1, got {saved_world!r}"
        )
    if not is_int_at_least(state["batch_size"], 1):
        raise ValueError(
            f"the loader state's 'batch_size' must be an int >= 1, got {state['batch_size']!r}"
        )
    saved_global = state["batch_size"] * saved_world
    if saved_global != here.batch_size * world:
        raise ValueError(
            f"the state was saved by {saved_world} process(es) with a global batch of "
            f"{saved_global} samples ({state['batch_size']} each), but this loader's is "
            f"{here.batch_size * world} ({here.batch_size} on each of {world}): build it with "
            f"loopkit.distributed.loader(..., global_batch_size={saved_global}) so that the "
            "rest of the pass takes every sample once"
            + (
                ""
                if saved_global % world == 0
                else f" (which needs a number of processes dividing {saved_global})"
            )
        )
    drop_last = state.get("drop_last")
    if drop_last is not here.drop_last:
        raise ValueError(
            f"the state was saved by {saved_world} process(es) with drop_last={drop_last!r}, "
            f"this loader has drop_last={here.drop_last}: build it with the same drop_last "
            "to resume on another number of processes"
        )
    padded = (state["samples"] * saved_world, here.samples * world)
    if not drop_last and padded[0] != padded[1]:
        n = here.dataset_length
        raise ValueError(
            f"a pass over {n} samples is padded to {padded[0]} by {saved_world} process(es) "
            f"but to {padded[1]} by {world} (the sampler repeats samples to give each "
            "process as many): the rest of the pass would hold other samples. Build the "
            "loader with drop_last=True, or resume on a number of processes that pads as "
            f"{saved_world} did (one dividing {n})"
        )
    if state["batches"] != batches:  # follows from the above; a damaged state otherwise
        raise ValueError(
            f"the state's pass has {state['batches']} batches but this loader's has "
            f"{batches}: resume with the loader the run was saved with"
        )
