"""A preloaded cache's DataLoader: without workers, each batch gathered straight into a buffer.

With ``num_workers=0`` a batch of a ``Preloaded`` is one ``index_select`` per fixed-shape
field (``Preloaded.gather``) over a slice of the pass's order held as a tensor
(``KeyedBatches.index_tensors``: the batches the sampler gives, without a Python list per
batch), and none of the per-batch work that buys nothing there:

- no reseed without a ``collate_fn``: the cache's transform ran when it was built, and a
  gather draws no random number, so the batch is the one its key would give; a
  ``collate_fn`` still runs under the batch's key (``seeded_rngs``);
- no per-sample items and collate: the batch is the gathered tensors;
- buffers handed out again (``BufferPool``), once nothing outside the loader holds a tensor
  on them, so a batch the loop keeps never changes.

With workers, the DataLoader's own iterator fetches through ``SeededBatches``, as for any
data set; the batches are the same bytes either way.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader
from torch.utils.data._utils.pin_memory import pin_memory
from torch.utils.data.dataloader import _BaseDataLoaderIter

from ._preloaded import Preloaded, batch_as_is
from ._seeding import KeyedBatches, SeededBatches, seeded_rngs

_use_count = getattr(torch._C, "_storage_Use_Count", None)
"""How many tensors (and storage objects) share a storage; without it no buffer is reused."""


def _holders(buffer: torch.Tensor) -> int:
    assert _use_count is not None
    return int(_use_count(buffer.untyped_storage()._cdata))


class BufferPool:
    """Batch buffers, each handed out again once nothing outside the pool holds a tensor on it.

    A buffer is free when its storage's use count is what it was with the pool alone
    holding it: any tensor on it the loop keeps (the batch, a view of it, a numpy array
    of it, an autograd graph saving it) counts. The buffers are never pinned: with
    ``pin_memory`` the batch handed out is the DataLoader's pinned copy (a pinned buffer
    reused could still be read by a ``non_blocking`` copy to the device).
    """

    KEEP = 4
    """Buffers the pool tracks: a loop holds one or two batches (its own, the lookahead)."""

    def __init__(self) -> None:
        self._held: list[tuple[torch.Tensor, int]] = []  # (buffer, its use count alone)

    def __call__(self, rows: int, row_bytes: int) -> torch.Tensor:
        # Always a new view, never the pooled tensor itself: a reference to the pooled
        # object would not show in its storage's use count, a view's does.
        for buffer, alone in self._held:
            if buffer.shape == (rows, row_bytes) and _holders(buffer) == alone:
                return buffer.view(rows, row_bytes)
        buffer = torch.empty((rows, row_bytes), dtype=torch.uint8)
        if _use_count is not None and len(self._held) < self.KEEP:
            self._held.append((buffer, _holders(buffer)))
        return buffer.view(rows, row_bytes)


class GatherLoader(DataLoader[Any]):
    """``distributed.loader``'s DataLoader over a ``Preloaded``: ``_Gathering`` without workers."""

    def _get_iterator(self) -> _BaseDataLoaderIter:
        if self.num_workers == 0:
            return _Gathering(self)
        return super()._get_iterator()


class _Gathering(_BaseDataLoaderIter):
    """One pass without workers: a gather per field, the collate_fn (if any) under the key."""

    def __init__(self, loader: GatherLoader) -> None:
        # The base draws the pass's seed from the loader's generator, as every pass does: the
        # generator's state (saved in the loader's state) is the same with or without workers.
        super().__init__(loader)
        fetched, batches = loader.dataset, loader.batch_sampler
        assert isinstance(fetched, SeededBatches) and isinstance(batches, KeyedBatches)
        assert isinstance(fetched.dataset, Preloaded)
        self._cache = fetched.dataset
        self._collate = None if fetched.collate is batch_as_is else fetched.collate
        self._batches = batches.index_tensors()
        self._buffers = BufferPool()

    def __next__(self) -> Any:
        idx, key = next(self._batches)
        batch = self._cache.gather(idx, self._buffers)
        if self._collate is not None:
            with seeded_rngs(key):
                batch = self._collate(batch)
        if self._pin_memory:  # a copy, as the DataLoader pins: the buffers are free again
            batch = pin_memory(batch, self._pin_memory_device)  # type: ignore[no-untyped-call]
        self._num_yielded += 1
        return batch
