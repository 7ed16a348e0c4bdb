"""Data randomness as a pure function of (seed, epoch, rank, batch index).

Before a batch is fetched and collated, the python, numpy and torch RNGs it sees are set
from that key, in the main process and in a worker alike. So the batches, and their
random augmentation, are the same whatever ``num_workers`` is, with or without
``iterate``'s lookahead, before and after a resume, with or without persistent workers.
In the main process (``num_workers=0``) the RNG states are put back after each batch: the
training side (dropout, noise drawn in the loop) sees exactly the stream it would see
without loopkit's seeding. Seeding is per batch, not per sample: it costs one reseed per
batch (tens of microseconds, a fraction of a percent of a batch of small images; see
``benchmarks/data_seeding.py``), where per-sample reseeding would cost as much as a small
sample's decoding.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Iterator, Sized
from typing import Any, TypeVar, cast

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler, get_worker_info

T = TypeVar("T")

SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
"""The seeds ``loader(seed=)`` takes: any 64-bit integer."""

Key = tuple[int, int, int, int]  # (seed, epoch, rank, batch index)


def rng_seeds(key: Key) -> tuple[int, int, int]:
    """The (python, numpy, torch) seeds of the batch ``key``: well mixed, pure."""
    seed, epoch, rank, index = key
    state = np.random.SeedSequence([seed % 2**64, epoch, rank, index]).generate_state(3, np.uint64)
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


class KeyedBatch(list[int]):
    """The indices of one batch, and the key its randomness is drawn from."""

    def __init__(self, indices: list[int], key: Key) -> None:
        super().__init__(indices)
        self.key = key

    def __reduce__(self) -> tuple[type[KeyedBatch], tuple[list[int], Key]]:
        # Sent to the workers through a queue: the key must travel with the indices.
        return (KeyedBatch, (list(self), self.key))


class KeyedBatches(Sampler[list[int]]):
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
        *,
        shuffle: bool = True,
        world_size: int = 1,
    ) -> None:
        self.base = base
        self.dataset_length = dataset_length
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.shuffle = shuffle
        """Whether the base sampler shuffles (the order then depends on ``seed``)."""
        self.seed, self.rank, self.epoch = seed, rank, 0
        self.world_size = world_size
        """The processes the data set is sharded over (a pass's batch ``i`` on every rank
        together is the same ``batch_size * world_size`` samples whatever that number)."""
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
        # The pass's epoch as it starts: another pass begun meanwhile (a peek, an evaluation)
        # sets the epoch again, which must not change this pass's keys.
        start, self.skip, epoch = self.skip, 0, self.epoch
        for _ in range(start * self.batch_size):  # indices only: nothing is loaded
            next(indices, None)
        number, batch = start, []
        for i in indices:
            batch.append(i)
            if len(batch) == self.batch_size:
                yield KeyedBatch(batch, (self.seed, epoch, self.rank, number))
                number, batch = number + 1, []
        if batch and not self.drop_last:
            yield KeyedBatch(batch, (self.seed, epoch, self.rank, number))

    def __len__(self) -> int:
        full, rest = divmod(self.samples, self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def index_tensors(self) -> Iterator[tuple[torch.Tensor, Key]]:
        """The batches ``__iter__`` gives, as int64 tensors (slices of the pass's order)."""
        start, self.skip, epoch = self.skip, 0, self.epoch  # as __iter__: the pass's own
        base = self.base
        order: torch.Tensor
        if base is None:
            order = torch.arange(self.dataset_length)
        elif isinstance(base, SeededRandomSampler):
            order = base.order()
        else:  # DistributedSampler: its list of indices (numpy converts it ~10x faster)
            order = torch.from_numpy(np.fromiter(iter(base), dtype=np.int64))
        size = self.batch_size
        stop = len(order) - len(order) % size if self.drop_last else len(order)
        for number, at in enumerate(range(start * size, stop, size), start):
            yield order[at : at + size], (self.seed, epoch, self.rank, number)


class SeededBatches(Dataset[Any]):
    """The user's dataset, fetched and collated one whole batch at a time under its key.

    ``fetch`` makes a batch of indices (a preloaded cache's ``batch``); by default the
    dataset's ``__getitems__`` or one ``dataset[i]`` per index.
    """

    def __init__(
        self,
        dataset: Dataset[Any],
        collate: Callable[[Any], Any],
        fetch: Callable[[list[int]], Any] | None = None,
    ) -> None:
        self.dataset = dataset
        self.collate = collate
        self.fetch = fetch

    def __len__(self) -> int:
        return len(cast("Sized", self.dataset))  # loader() takes only datasets with __len__

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

    def _fetch(self, batch: list[int]) -> Any:
        if self.fetch is not None:
            return self.fetch(list(batch))
        getitems = getattr(self.dataset, "__getitems__", None)
        if getitems is not None:
            items: list[Any] = getitems(list(batch))  # the dataset's own batched fetch
            return items
        return [self.dataset[i] for i in batch]


def collated(batch: T) -> T:
    """The DataLoader's collate_fn: the batch was collated inside ``SeededBatches``."""
    return batch


def seed_worker(worker_id: int, then: Callable[[int], object] | None = None) -> None:
    """A worker's init: seed numpy and random from its torch seed, then run ``then``.

    Code a worker runs outside a batch (the user's ``worker_init_fn``, given as ``then``)
    gets reproducible streams; each batch is then fetched under its own key anyway.
    """
    seed = torch.initial_seed() % 2**32
    np.random.seed(seed)
    random.seed(seed)
    info = get_worker_info()
    if info is not None and isinstance(info.dataset, SeededBatches):
        # get_worker_info().dataset is where PyTorch's documented pattern opens a worker's
        # handles (``info.dataset.h5 = h5py.File(...)``): show the user's dataset, not our
        # wrapper. WorkerInfo refuses assignment once built; the workers' fetch loop keeps
        # its own reference to the wrapper, so only what user code sees changes.
        object.__setattr__(info, "dataset", info.dataset.dataset)
    if then is not None:
        then(worker_id)


class SeededRandomSampler(Sampler[int]):
    """Single-process shuffling with the order of DistributedSampler(num_replicas=1)."""

    def __init__(self, n: int, seed: int) -> None:
        self.n, self.seed, self.epoch = n, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        return iter(self.order().tolist())

    def order(self) -> torch.Tensor:
        """This epoch's order, as an int64 tensor."""
        g = torch.Generator().manual_seed(torch_seed(self.seed + self.epoch))
        return torch.randperm(self.n, generator=g)

    def __len__(self) -> int:
        return self.n


def torch_seed(value: int) -> int:
    """A seed ``torch.Generator.manual_seed`` takes: unchanged when in its range, else mod 2**64."""
    # Seeds derived from a valid seed (seed * 1000 + rank, seed + epoch) may leave the range
    # manual_seed accepts ([-2**63, 2**64 - 1]); those in it keep their value (and stream).
    return value if SEED_MIN <= value <= 2**64 - 1 else value % 2**64
