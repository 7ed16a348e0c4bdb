"""The data side of a run: ``loopkit.distributed.loader`` and the ``EpochLoader`` it returns.

Data randomness is a pure function of (seed, epoch, rank, batch index): before a batch is
fetched and collated, the python, numpy and torch RNGs it sees are set from that key, in
the main process and in a worker alike. So the batches, and their random augmentation,
are the same whatever ``num_workers`` is, with or without ``iterate``'s lookahead, before
and after a resume, with or without persistent workers. In the main process
(``num_workers=0``) the RNG states are put back after each batch: the training side
(dropout, noise drawn in the loop) sees exactly the stream it would see without loopkit's
seeding. Seeding is per batch, not per sample: it costs one reseed per batch (tens of
microseconds, a fraction of a percent of a batch of small images; see
``benchmarks/data_seeding.py``), where per-sample reseeding would cost as much as a
small sample's decoding.
"""

from __future__ import annotations

import contextlib
import numbers
import os
import random
from collections.abc import Callable, Iterator, Mapping, Sized
from typing import Any

import numpy as np
import torch
from torch.utils.data import (
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    Sampler,
    get_worker_info,
)
from torch.utils.data import default_collate as _default_collate

from ._checks import is_int_at_least

Key = tuple[int, int, int, int]  # (seed, epoch, rank, batch index)


def rng_seeds(key: Key) -> tuple[int, int, int]:
    """The (python, numpy, torch) seeds of the batch ``key``: well mixed, pure."""
    seed, epoch, rank, index = key
    state = np.random.SeedSequence([seed % 2**64, epoch, rank, index]).generate_state(
        3, np.uint64
    )
    py, npy, th = (int(v) for v in state)
    return py, npy % 2**32, th


@contextlib.contextmanager
def seeded_rngs(key: Key) -> Iterator[None]:
    """Set python, numpy and torch's CPU RNG from ``key`` inside; put them back in the main process.

    A worker process owns its RNGs (nothing else draws from them), so there they are left
    as the batch left them.
    """
    py, npy, th = rng_seeds(key)
    in_worker = get_worker_info() is not None
    saved = None
    if not in_worker:
        saved = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    random.seed(py)
    np.random.seed(npy)
    # The default CPU generator only: torch.manual_seed would also reseed every GPU.
    torch.default_generator.manual_seed(th)
    try:
        yield
    finally:
        if saved is not None:
            random.setstate(saved[0])
            np.random.set_state(saved[1])
            torch.set_rng_state(saved[2])


class _KeyedBatch(list[int]):
    """The indices of one batch, and the key its randomness is drawn from."""

    def __init__(self, indices: list[int], key: Key) -> None:
        super().__init__(indices)
        self.key = key

    def __reduce__(self) -> Any:  # sent to the workers through a queue
        return (_KeyedBatch, (list(self), self.key))


class _KeyedBatches(Sampler[list[int]]):
    """Batches of the sampler's indices, each carrying (seed, epoch, rank, batch index).

    Resuming mid-epoch skips the first ``skip`` batches by index (no sample is loaded to
    be thrown away) and numbers the next batch as it was numbered in the first run.
    """

    def __init__(
        self,
        base: Sampler[int] | None,
        dataset_length: int,
        batch_size: int,
        drop_last: bool,
        seed: int,
        rank: int,
    ) -> None:
        self.base = base
        self.dataset_length = dataset_length
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.seed, self.rank, self.epoch = seed, rank, 0
        self.skip = 0

    @property
    def samples(self) -> int:
        """Samples in one pass on this rank."""
        return len(self.base) if isinstance(self.base, Sized) else self.dataset_length

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        set_epoch = getattr(self.base, "set_epoch", None)
        if set_epoch is not None:
            set_epoch(epoch)

    def __iter__(self) -> Iterator[list[int]]:
        base = self.base
        indices: Iterator[int] = iter(base if base is not None else range(self.dataset_length))
        start, self.skip = self.skip, 0
        for _ in range(start * self.batch_size):  # indices only: nothing is loaded
            next(indices, None)
        number, batch = start, []
        for i in indices:
            batch.append(i)
            if len(batch) == self.batch_size:
                yield _KeyedBatch(batch, (self.seed, self.epoch, self.rank, number))
                number, batch = number + 1, []
        if batch and not self.drop_last:
            yield _KeyedBatch(batch, (self.seed, self.epoch, self.rank, number))

    def __len__(self) -> int:
        full, rest = divmod(self.samples, self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)


class _SeededBatches(Dataset[Any]):
    """The user's dataset, fetched and collated one whole batch at a time under its key."""

    def __init__(self, dataset: Dataset[Any], collate: Callable[[list[Any]], Any]) -> None:
        self.dataset = dataset
        self.collate = collate

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> Any:
        return self.dataset[index]

    def __getitems__(self, batch: list[int]) -> Any:
        # DataLoader hands a whole batch of indices here, then our pass-through collate
        # returns what this returns: the user's fetch and collate both run under the key.
        key = getattr(batch, "key", None)
        if key is None:
            return self.collate(self._fetch(batch))
        with seeded_rngs(key):
            return self.collate(self._fetch(batch))

    def _fetch(self, batch: list[int]) -> list[Any]:
        getitems = getattr(self.dataset, "__getitems__", None)
        if getitems is not None:
            return getitems(list(batch))  # type: ignore[no-any-return]
        return [self.dataset[i] for i in batch]


def _collated(batch: Any) -> Any:
    """The DataLoader's collate_fn: the batch was collated inside ``_SeededBatches``."""
    return batch


def _seed_worker(worker_id: int) -> None:
    # Code a worker runs outside a batch (a worker_init_fn of the dataset's own) still gets
    # reproducible numpy and random streams, from the worker's seeded torch seed.
    seed = torch.initial_seed() % 2**32
    np.random.seed(seed)
    random.seed(seed)


class _SeededRandomSampler(Sampler[int]):
    """Single-process shuffling with the order of DistributedSampler(num_replicas=1)."""

    def __init__(self, n: int, seed: int) -> None:
        self.n, self.seed, self.epoch = n, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        g = torch.Generator().manual_seed(_torch_seed(self.seed + self.epoch))
        return iter(torch.randperm(self.n, generator=g).tolist())

    def __len__(self) -> int:
        return self.n


class EpochLoader:
    """A DataLoader that advances its sampler's epoch on every pass, so no rank forgets.

    It also knows how far the current pass got (``position``, in batches), which is what
    a checkpoint needs to continue the same data order mid-epoch. Each batch is fetched
    (and collated) with the python, numpy and torch RNGs set from (seed, epoch, rank,
    batch index), so random augmentation is the same whatever the workers and resumes.
    """

    def __init__(self, loader: DataLoader[Any], batches: _KeyedBatches) -> None:
        self.loader = loader
        self.batches = batches
        self.epoch = 0
        """The epoch the next pass will run (0 before the first)."""
        self.position = 0
        """Batches handed out in the current pass."""
        self._resume_at = 0
        self._pass_epoch = 0
        self._pass_generator_state: torch.Tensor | None = None
        # Called (and dropped) when the next pass starts, before its first batch is drawn:
        # a Checkpointer defers an end-of-epoch save to here, after the epoch's own code.
        self._before_next_pass: list[Callable[[], object]] = []

    def __iter__(self) -> Iterator[Any]:
        while self._before_next_pass:
            # Each hook leaves the list before it runs: one that raises is not run again,
            # and the ones after it still run at the next pass.
            self._before_next_pass.pop(0)()
        epoch, self.epoch = self.epoch, self.epoch + 1
        self.batches.set_epoch(epoch)
        generator = self.loader.generator
        if generator is not None:
            # The pass draws its worker seeds from this generator: remember its state at the
            # start of the pass so a resumed pass draws the same ones.
            self._pass_generator_state = generator.get_state()
        start, self._resume_at = self._resume_at, 0
        self.batches.skip = start
        self._pass_epoch = epoch
        self.position = start
        return self._counted(iter(self.loader))

    def _counted(self, it: Iterator[Any]) -> Iterator[Any]:
        for batch in it:
            self.position += 1
            yield batch

    def set_epoch(self, epoch: int) -> None:
        """Make the next pass run ``epoch`` (for a resumed run)."""
        if not is_int_at_least(epoch, 0):
            raise ValueError(f"epoch must be an int >= 0, got {epoch!r}")
        self.epoch = epoch

    def state_dict(self, consumed: int | None = None) -> dict[str, Any]:
        """Where the current pass stands: its epoch and the batches ``consumed`` so far.

        Also records the data set's length, the batch size and the batches per pass, so a
        resume with other data is refused instead of repeating some samples and skipping
        others.
        """
        position = self.position if consumed is None else consumed
        state: dict[str, Any] = {
            "epoch": self._pass_epoch,
            "position": position,
            "next_epoch": self.epoch,
            "dataset_length": self.batches.dataset_length,
            "samples": self.batches.samples,
            "batch_size": self.batches.batch_size,
            "batches": len(self.loader),
        }
        generator = self.loader.generator
        if generator is not None:
            finished = position >= len(self.loader)
            if finished or self._pass_generator_state is None:
                # The next pass starts from the generator as it is now.
                state["generator"] = generator.get_state()
            else:
                # A resumed pass is rebuilt from its start: the state the pass began with.
                state["generator"] = self._pass_generator_state
        return state

    def _check_state(self, state: Any) -> None:
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
        if state["dataset_length"] != self.batches.dataset_length:
            raise ValueError(
                f"the data set has {self.batches.dataset_length} samples but the state was "
                f"saved with {state['dataset_length']}: resuming would repeat some samples and "
                "skip others; resume with the data set the run was saved with"
            )
        if state["batch_size"] != self.batches.batch_size:
            raise ValueError(
                f"the loader's batch size is {self.batches.batch_size} but the state was saved "
                f"with {state['batch_size']}: build the loader with the same batch size"
            )
        here = (self.batches.samples, len(self.loader))
        if (state["samples"], state["batches"]) != here:
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

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where ``state_dict`` left off: the same epoch, the next batch.

        The state is checked first (data set length, batch size, batches per pass, the
        generator state); a refused state changes nothing.
        """
        self._check_state(state)
        position = int(state["position"])
        if position >= len(self.loader):
            # The pass had finished: the next one is a new epoch, from its first batch.
            self.epoch, self._resume_at = int(state["next_epoch"]), 0
        else:
            self.epoch, self._resume_at = int(state["epoch"]), position
        # Described as "the pass to run next, with `_resume_at` batches done", so that a
        # state_dict() taken before the next pass starts round-trips.
        self._pass_epoch, self.position = self.epoch, self._resume_at
        generator = self.loader.generator
        saved = state.get("generator")
        if saved is not None and generator is not None:
            generator.set_state(saved)
            self._pass_generator_state = generator.get_state()

    def _snapshot(self) -> tuple[Any, ...]:
        """Everything ``load_state_dict`` changes, for ``_restore`` to put back."""
        generator = self.loader.generator
        return (
            self.epoch,
            self.position,
            self._resume_at,
            self._pass_epoch,
            self._pass_generator_state,
            generator.get_state() if generator is not None else None,
        )

    def _restore(self, snapshot: tuple[Any, ...]) -> None:
        (self.epoch, self.position, self._resume_at, self._pass_epoch,
         self._pass_generator_state, generator_state) = snapshot  # fmt: skip
        if generator_state is not None and self.loader.generator is not None:
            self.loader.generator.set_state(generator_state)

    def __len__(self) -> int:
        return len(self.loader)

    @property
    def batch_size(self) -> int:
        """Samples per batch on this rank."""
        return self.batches.batch_size


def default_num_workers(local_world_size: int | None = None) -> int:
    """Loader workers per process: this node's cores shared by its processes, one kept back."""
    from .distributed import info

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    per_process = (cores or 1) // max(local_world_size or info().local_world_size, 1)
    return max(0, min(8, per_process - 1))


# DataLoader arguments loader() sets itself: it shards, batches, keys and seeds the batches.
_OWN_ARGUMENTS = ("sampler", "batch_sampler", "worker_init_fn", "generator")


def loader(
    dataset: Dataset[Any],
    batch_size: int | None = None,
    *,
    global_batch_size: int | None = None,
    shuffle: bool = True,
    seed: int | np.integer[Any] = 0,
    drop_last: bool = False,
    num_workers: int | None = None,
    pin_memory: bool | None = None,
    persistent_workers: bool | None = None,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    **dataloader_kwargs: Any,
) -> EpochLoader:
    """A DataLoader set up as the guides advise, sharded across ranks under DDP.

    ``batch_size`` is per process; ``global_batch_size`` is split over the ranks (it must
    divide). Workers default to this node's cores per process minus one; ``pin_memory``
    only with CUDA; persistent workers; under DDP a ``DistributedSampler`` whose
    ``set_epoch`` is called on every pass. Each batch is fetched and collated with the
    python, numpy and torch RNGs set from (``seed``, epoch, rank, batch index), so random
    augmentation does not depend on the workers and resumes exactly. ``seed`` is any
    integer (numpy integers too) in [-2**63, 2**63 - 1]. Other DataLoader arguments
    (``prefetch_factor``, ``timeout``, ...) pass through.
    """
    from .distributed import info

    seed = _check_seed(seed)
    if isinstance(dataset, IterableDataset):
        raise TypeError(
            "loader() needs a map-style dataset (__getitem__ and __len__): it shards and "
            "resumes by index, which an IterableDataset has not; shard an IterableDataset "
            "yourself (e.g. by torch.utils.data.get_worker_info() and the rank) and pass it "
            "to a plain DataLoader"
        )
    taken = sorted(set(_OWN_ARGUMENTS) & set(dataloader_kwargs))
    if taken:
        raise TypeError(
            f"loader() sets {', '.join(taken)} itself (it shards, batches and seeds the data "
            "so that a resume continues exactly): drop them; pass shuffle= and seed= to "
            "loader() instead"
        )
    if collate_fn is not None and not callable(collate_fn):
        raise TypeError(f"collate_fn must be callable, got {type(collate_fn).__name__}")
    here = info()
    if (batch_size is None) == (global_batch_size is None):
        raise TypeError("pass exactly one of batch_size (per process) or global_batch_size")
    if global_batch_size is not None:
        _check_positive("global_batch_size", global_batch_size)
        if global_batch_size % here.world_size:
            raise ValueError(
                f"global_batch_size={global_batch_size} does not divide over "
                f"{here.world_size} processes: use a multiple of {here.world_size}"
            )
        batch_size = global_batch_size // here.world_size
    assert batch_size is not None
    _check_positive("batch_size", batch_size)
    if not isinstance(dataset, Sized):
        raise TypeError("loader() needs a map-style dataset with __len__ (it shards by index)")
    if num_workers is None:
        num_workers = default_num_workers(here.local_world_size)
    if pin_memory is None:
        pin_memory = here.device.type == "cuda"
    if persistent_workers is None:
        persistent_workers = num_workers > 0
    base: Any
    if here.is_distributed:
        base = DistributedSampler(
            dataset,
            num_replicas=here.world_size,
            rank=here.rank,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
        )
    elif shuffle:
        base = _SeededRandomSampler(len(dataset), seed)
    else:
        base = None
    batches = _KeyedBatches(base, len(dataset), batch_size, drop_last, seed, here.rank)
    # The generator only seeds the workers' own streams now (each batch is reseeded).
    generator = torch.Generator().manual_seed(_torch_seed(seed * 1000 + here.rank))
    dl = DataLoader(
        _SeededBatches(dataset, collate_fn or _default_collate),
        batch_sampler=batches,
        collate_fn=_collated,
        num_workers=num_workers,
        pin_memory=pin_memory,
        persistent_workers=persistent_workers,
        worker_init_fn=_seed_worker if num_workers > 0 else None,
        generator=generator,
        **dataloader_kwargs,
    )
    return EpochLoader(dl, batches)


_SEED_MIN, _SEED_MAX = -(2**63), 2**63 - 1


def _check_seed(seed: object) -> int:
    """``seed`` as an int, or a clear error naming it and the range a seed may take."""
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise TypeError(
            f"seed must be an integer (int or numpy integer) in [-2**63, 2**63 - 1], got "
            f"{seed!r} ({type(seed).__name__})"
        )
    value = int(seed)
    if not _SEED_MIN <= value <= _SEED_MAX:
        raise ValueError(f"seed must be in [-2**63, 2**63 - 1] (a 64-bit seed), got {value}")
    return value


def _torch_seed(value: int) -> int:
    """A seed ``torch.Generator.manual_seed`` takes: unchanged when in its range, else mod 2**64."""
    # Seeds derived from a valid seed (seed * 1000 + rank, seed + epoch) may leave the range
    # manual_seed accepts ([-2**63, 2**64 - 1]); those in it keep their value (and stream).
    return value if _SEED_MIN <= value <= 2**64 - 1 else value % 2**64


def _check_positive(name: str, value: object) -> None:
    if not is_int_at_least(value, 1):
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
