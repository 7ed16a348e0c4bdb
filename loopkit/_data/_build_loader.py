"""``loopkit.distributed.loader``: a DataLoader set up as the guides advise, resumable.

It shards over the ranks, batches with keys (``_seeding``) and returns an
``EpochLoader`` (``_epoch_loader``), which counts its epochs and its place in them.
"""

from __future__ import annotations

import functools
import numbers
import os
from collections.abc import Callable, Sized
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset, Sampler
from torch.utils.data import default_collate as _default_collate

from .._checks import is_int_at_least
from .._job import info
from ._epoch_loader import EpochLoader
from ._gather_loader import GatherLoader
from ._preloaded import Preloaded, batch_as_is
from ._seeding import (
    SEED_MAX,
    SEED_MIN,
    KeyedBatches,
    SeededBatches,
    SeededRandomSampler,
    collated,
    seed_worker,
    torch_seed,
)


def default_num_workers(local_world_size: int | None = None) -> int:
    """Loader workers per process: the cores over ``local_world_size`` (the node's), less one."""

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    per_process = (cores or 1) // max(local_world_size or info().local_world_size, 1)
    return max(0, min(8, per_process - 1))


# DataLoader arguments loader() sets itself: it shards, batches, keys and seeds the batches.
_OWN_ARGUMENTS = ("sampler", "batch_sampler", "generator")


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
    worker_init_fn: Callable[[int], object] | None = None,
    **dataloader_kwargs: Any,
) -> EpochLoader:
    """A DataLoader set up as the guides advise, sharded across ranks under DDP.

    ``batch_size`` is per process; ``global_batch_size`` is split over the ranks (it must
    divide). ``dataset``, ``shuffle`` and ``drop_last`` are DataLoader's. ``num_workers``
    defaults to this node's cores per process minus one; ``pin_memory`` only with CUDA;
    ``persistent_workers`` (default: when there are workers); under DDP a
    ``DistributedSampler`` whose ``set_epoch`` is called on every training pass. Each batch is
    fetched and collated with the python, numpy and torch RNGs set from (``seed``, epoch,
    rank, batch index), so random augmentation does not depend on the workers and resumes
    exactly. ``seed`` is any integer (numpy integers too) in [-2**63, 2**63 - 1].
    ``worker_init_fn`` (to open a per-worker file handle, say) runs in each worker after
    loopkit has seeded python's, numpy's and torch's RNGs there (from the loader's
    generator); each batch is then fetched with the RNGs set from its own key. Other
    DataLoader arguments (``prefetch_factor``, ``timeout``, ...) pass through.

    A pass counts as an epoch when training consumes it: a pass of ``step.iterate(loader)``
    from its start, any other pass (``for x, y in loader:``) once a micro-step of a loopkit
    step (or an optimizer's ``step()``) consumes a batch it handed out. A peek
    (``next(iter(loader))``) or an evaluation pass over it changes nothing of the training
    run. ``set_epoch(epoch)`` sets the next pass's epoch; ``training_pass()`` counts from
    its start (see the multi-GPU guide, "Which passes are epochs").

    A ``loopkit.preload`` cache is batched by one index operation per field
    (``Preloaded.batch``), with no workers by default; without workers straight into
    buffers handed out again once nothing can read them, and without a reseed
    unless a ``collate_fn`` is given: it receives the whole batch (batch-level
    augmentation, under the batch's RNG key).
    """

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
    if worker_init_fn is not None and not callable(worker_init_fn):
        raise TypeError(f"worker_init_fn must be callable, got {type(worker_init_fn).__name__}")
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
    preloaded = isinstance(dataset, Preloaded)
    if num_workers is None:
        # A preloaded batch is one index operation: workers would only add the trip back.
        num_workers = 0 if preloaded else default_num_workers(here.local_world_size)
    if pin_memory is None:
        pin_memory = here.device.type == "cuda"
    if persistent_workers is None:
        persistent_workers = num_workers > 0
    base: Sampler[int] | None
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
        base = SeededRandomSampler(len(dataset), seed)
    else:
        base = None
    batches = KeyedBatches(
        base, len(dataset), batch_size, drop_last, seed, here.rank, shuffle=bool(shuffle),
        world_size=here.world_size,
    )  # fmt: skip
    # The generator only seeds the workers' own streams now (each batch is reseeded).
    generator = torch.Generator().manual_seed(torch_seed(seed * 1000 + here.rank))
    fetched = (
        SeededBatches(dataset, collate_fn or batch_as_is, fetch=dataset.batch)
        if isinstance(dataset, Preloaded)
        else SeededBatches(dataset, collate_fn or _default_collate)
    )
    dl = (GatherLoader if isinstance(dataset, Preloaded) else DataLoader)(
        fetched,
        batch_sampler=batches,
        collate_fn=collated,
        num_workers=num_workers,
        pin_memory=pin_memory,
        persistent_workers=persistent_workers,
        # A partial of module-level functions: picklable for workers started by spawn.
        worker_init_fn=functools.partial(seed_worker, then=worker_init_fn)
        if num_workers > 0
        else None,
        generator=generator,
        **dataloader_kwargs,
    )
    return EpochLoader(dl, batches)


def _check_seed(seed: object) -> int:
    """``seed`` as an int, or a clear error naming it and the range a seed may take."""
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise TypeError(
            f"seed must be an integer (int or numpy integer) in [-2**63, 2**63 - 1], got "
            f"{seed!r} ({type(seed).__name__})"
        )
    value = int(seed)
    if not SEED_MIN <= value <= SEED_MAX:
        raise ValueError(f"seed must be in [-2**63, 2**63 - 1] (a 64-bit seed), got {value}")
    return value


def _check_positive(name: str, value: object) -> None:
    if not is_int_at_least(value, 1):
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
