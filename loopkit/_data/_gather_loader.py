"""A preloaded cache's DataLoader: without workers, each batch gathered straight into a buffer.

With ``num_workers=0`` a batch of a ``Preloaded`` is one ``index_select`` per fixed-shape
field (``Preloaded.gather``) over a slice of the pass's order held as a tensor
(``KeyedBatches.index_tensors``: the batches the sampler gives, without a Python list per
batch), and none of the per-batch work that buys nothing there:

- no reseed without a ``collate_fn``: the cache's transform ran when it was built, and a
  gather draws no random number, so the batch is the one its key would give; a
  ``collate_fn`` still runs under the batch's key (``seeded_rngs``);
- no per-sample items and collate: the batch is the gathered tensors;
- buffers handed out again (``BufferPool``), once nothing outside the loader can read them
  (no tensor or storage object on them, never shared with another process), so a batch
  the loop keeps, or sends away, never changes.

With workers, the DataLoader's own iterator fetches through ``SeededBatches``, as for any
data set; the batches are the same bytes either way.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch.utils.data import DataLoader
from torch.utils.data._utils.pin_memory import pin_memory
from torch.utils.data.dataloader import _BaseDataLoaderIter

from ._preloaded import Preloaded, batch_as_is
from ._seeding import KeyedBatches, SeededBatches, seeded_rngs

_use_count = getattr(torch._C, "_storage_Use_Count", None)
"""How many tensors (and storage objects) share a storage; without it no buffer is reused."""


class _Buffer:
    """A pooled buffer and how its storage looks with the pool alone holding it."""

    __slots__ = ("alone", "refs", "storage", "tensor")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        # The storage's Python object, held for the buffer's life: torch keeps one per
        # storage once made, so one kept by the user (``x.untyped_storage()``, a
        # ``TypedStorage``) is this object, seen in its reference count; every tensor on
        # the storage (any view, a numpy array's or a DLPack capsule's tensor) is seen in
        # the storage's use count.
        self.storage = tensor.untyped_storage()
        self.alone = self.holders()
        self.refs = sys.getrefcount(self.storage)

    def holders(self) -> int:
        assert _use_count is not None
        return int(_use_count(self.storage._cdata))

    def free(self) -> bool:
        """Whether nothing but the pool can read the buffer (False once it was shared)."""
        return (
            self.holders() == self.alone
            and sys.getrefcount(self.storage) == self.refs
            and not self.storage.is_shared()
        )


class BufferPool:
    """Batch buffers, each handed out again once nothing outside the pool can read it.

    Liveness is decided from the storage, not from the tensors handed out: a buffer is
    free when its storage's use count and its storage object's reference count are what
    they were with the pool alone holding it: any tensor on it the loop keeps (the batch,
    a view of it however made, a numpy array or DLPack capsule of it, an autograd graph
    saving it) and any storage object kept counts. A storage that was moved to shared
    memory (pickled for a ``torch.multiprocessing`` queue or process: another process
    maps it, which no count here shows) is never handed out again: the pool drops it. The
    buffers are never pinned: with ``pin_memory`` the batch handed out is the DataLoader's
    pinned copy (a pinned buffer reused could still be read by a ``non_blocking`` copy).
    """

    KEEP = 4
    """Buffers the pool tracks: a loop holds one or two batches (its own, the lookahead)."""

    def __init__(self) -> None:
        self._held: list[_Buffer] = []

    def __call__(self, rows: int, row_bytes: int) -> torch.Tensor:
        # Always a new view, never the pooled tensor itself: a reference to the pooled
        # object would not show in its storage's use count, a view's does.
        for held in self._held:
            if held.tensor.shape == (rows, row_bytes) and held.free():
                return held.tensor.view(rows, row_bytes)
        # Another process may read a shared one for as long as it likes: the pool lets it go.
        self._held = [held for held in self._held if not held.storage.is_shared()]
        buffer = torch.empty((rows, row_bytes), dtype=torch.uint8)
        if _use_count is not None and len(self._held) < self.KEEP:
            self._held.append(_Buffer(buffer))
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
