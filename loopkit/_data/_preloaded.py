"""``Preloaded``: a cache ``loopkit.preload`` built or opened, read as a data set.

Each field is mapped (``torch.from_file``, copy-on-write) from its file: fixed-shape
fields as ``[N, *shape]`` rows, fields whose sizes vary as their elements one after
another with each item's offset and shape (``_preload``'s docstring says how the cache is
built and shared). An item or a batch is a copy, never a view of the mapping; a batch
is one ``index_select`` per fixed-shape field, into a buffer the caller chooses (fresh,
shared with the main process, or one a loader hands out again: ``_gather_loader``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, get_worker_info

from . import _cache_admin, _cache_files
from ._cache_files import check_sizes, read_meta
from ._fields import Field


class Preloaded(Dataset[Any]):
    """A preloaded data set: items come from memory-mapped tensors, a batch in one index.

    ``cache[i]`` is item i (as the transform returned it, as tensors). ``cache.batch(
    indices)`` is a whole batch: each fixed-shape field indexed once (``tensors[j][indices]``),
    a field whose sizes vary as a list of tensors; ``loopkit.distributed.loader(cache,
    batch_size=...)`` batches it that way. ``__getitems__`` keeps torch's contract (a list
    of items), so a plain ``DataLoader`` gives the batches it gives over the data set.
    Items and batches are copies: changing one in place never changes the cache.
    """

    def __init__(self, path: Path, built: bool, *, verify: bool = False) -> None:
        meta = read_meta(path)
        self.path = path
        self.built = built
        """Whether this process built the cache (False: it opened one already there)."""
        self.fingerprint: str = meta["fingerprint"]
        self.single: bool = meta["single"]
        self._n: int = meta["length"]
        self.fields = [Field(f["dtype"], None if f["shape"] is None else tuple(f["shape"]),
                             f["ndim"]) for f in meta["fields"]]  # fmt: skip
        self.tensors: list[torch.Tensor] = []
        self.offsets: list[torch.Tensor | None] = []
        """Per field whose sizes vary: where each item starts in ``tensors[j]`` (N + 1)."""
        self.shapes: list[torch.Tensor | None] = []
        """Per field whose sizes vary: each item's shape, ``[N, ndim]``."""
        n = self._n
        sizes = {f"field{j}.{s}": n * f.ndim * 8 if s == "shapes" else (n + 1) * 8
                 for j, f in enumerate(self.fields) if f.shape is None
                 for s in ("offsets", "shapes")}  # fmt: skip
        check_sizes(path, sizes)
        for j, f in enumerate(self.fields):
            if f.shape is None:
                offsets = _mapped(path / f"field{j}.offsets", (n + 1) * 8).view(torch.int64)
                self.offsets.append(offsets)
                shapes = _mapped(path / f"field{j}.shapes", n * f.ndim * 8).view(torch.int64)
                self.shapes.append(shapes.view(n, f.ndim))
                sizes[f"field{j}.bin"] = int(offsets[-1]) * f.element_size
            else:
                self.offsets.append(None)
                self.shapes.append(None)
                sizes[f"field{j}.bin"] = n * int(np.prod(f.shape, dtype=np.int64)) * f.element_size
        check_sizes(path, sizes)
        if verify:
            _cache_files.verify(path, meta, sorted(sizes))
        # Each field's bytes (a row per item where the shape is fixed): batches are made by
        # indexing bytes, which works for every dtype (index_select lacks some, uint16...).
        self._bytes: list[torch.Tensor] = []
        for j, f in enumerate(self.fields):
            raw = _mapped(path / f"field{j}.bin", sizes[f"field{j}.bin"])
            if f.shape is None:
                self._bytes.append(raw)
                self.tensors.append(raw.view(f.torch_dtype))
            else:
                self._bytes.append(raw.view(n, sizes[f"field{j}.bin"] // max(n, 1)))
                self.tensors.append(raw.view(f.torch_dtype).view(n, *f.shape))

    @property
    def nbytes(self) -> int:
        """Bytes the cache holds (all fields, offsets and shapes included)."""
        index = [t for t in (*self.offsets, *self.shapes) if t is not None]
        return sum(t.numel() * t.element_size() for t in (*self.tensors, *index))

    def __len__(self) -> int:
        return self._n

    def remove(self) -> bool:
        """Delete this cache's directory (False if it was already gone): frees its RAM or disk.

        This process keeps reading what it mapped until it drops the object; a later
        ``preload`` builds the cache again. Under torchrun call it on one rank per node
        (``info().local_rank == 0``), after every rank is done with the cache.
        """
        return _cache_admin.remove(self.path)

    def _item_field(self, j: int, index: int) -> torch.Tensor:
        f, offsets, shapes = self.fields[j], self.offsets[j], self.shapes[j]
        if offsets is None or shapes is None:
            assert f.shape is not None
            return self._bytes[j][index].clone().view(f.torch_dtype).view(f.shape)
        size = f.element_size
        start, end = int(offsets[index]) * size, int(offsets[index + 1]) * size
        item = self._bytes[j][start:end].clone().view(f.torch_dtype)
        return item.view(shapes[index].tolist())

    def __getitem__(self, index: int) -> Any:
        if not -self._n <= index < self._n:
            raise IndexError(f"index {index} out of range for {self._n} items")
        index %= self._n
        parts = tuple(self._item_field(j, index) for j in range(len(self.fields)))
        return parts[0] if self.single else parts

    def batch(self, indices: Sequence[int]) -> Any:
        """A batch: one index operation per fixed-shape field, no per-sample Python."""
        # In a loader worker the batch is written straight into shared memory, as
        # default_collate does: sending it to the main process then copies nothing.
        return self._batch(indices, shared=get_worker_info() is not None)

    def _batch(self, indices: Sequence[int], shared: bool) -> Any:
        if isinstance(indices, torch.Tensor):
            idx = indices.to(torch.int64).reshape(-1)
        else:  # numpy converts a list of ints ~10x faster than torch.as_tensor does
            idx = torch.from_numpy(np.asarray(list(indices), dtype=np.int64).reshape(-1))
        low, high = (int(idx.min()), int(idx.max())) if len(idx) else (0, 0)
        if len(idx) and not -self._n <= low <= high < self._n:
            raise IndexError(f"an index of {list(indices)} is out of range for {self._n} items")
        if low < 0:
            idx = idx % self._n
        if shared:
            return self.gather(idx, _shared_buffer, shared=True)
        return self.gather(idx, _fresh_buffer)

    def gather(
        self, idx: torch.Tensor, buffer: Callable[[int, int], torch.Tensor], shared: bool = False
    ) -> Any:
        """The batch of ``idx`` (int64 indices in [0, len), unchecked), each fixed-shape field
        gathered by one ``index_select`` into ``buffer(rows, row_bytes)`` (a uint8 tensor);
        ``shared``: a field whose sizes vary goes into shared memory too."""
        parts: list[Any] = []
        for j, f in enumerate(self.fields):
            if f.shape is None:
                parts.append(self._ragged(j, idx, shared))
                continue
            rows = self._bytes[j]
            out = buffer(len(idx), rows.shape[1])
            torch.index_select(rows, 0, idx, out=out)
            if rows.shape[1] == 0:  # items without elements: no bytes to view as the dtype
                out = torch.empty(0, dtype=torch.uint8)
            parts.append(out.view(f.torch_dtype).view(len(idx), *f.shape))
        return parts[0] if self.single else tuple(parts)

    def _ragged(self, j: int, idx: torch.Tensor, shared: bool) -> list[torch.Tensor]:
        """The items of a field whose sizes vary: views of one fresh buffer, not of the cache."""
        f, offsets, shapes, flat = self.fields[j], self.offsets[j], self.shapes[j], self._bytes[j]
        assert offsets is not None and shapes is not None
        size = f.element_size
        starts = (offsets[idx] * size).tolist()
        numels = offsets[idx + 1] - offsets[idx]
        lengths = (numels * size).tolist()
        out = torch.empty(sum(lengths), dtype=torch.uint8)
        if shared:
            # One shared buffer (not the mapped file, which a worker cannot send).
            out.share_memory_()  # type: ignore[no-untyped-call]  # untyped in torch
        if lengths:
            torch.cat([flat[s : s + k] for s, k in zip(starts, lengths, strict=True)], out=out)
        pieces = torch.split_with_sizes(out.view(f.torch_dtype), numels.tolist())
        return [p.view(s) for p, s in zip(pieces, shapes[idx].tolist(), strict=True)]

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        """The items ``indices`` (torch's contract: a list of samples, collated after)."""
        batch = self._batch(indices, shared=False)
        columns = [f.unbind(0) if isinstance(f, torch.Tensor) else f
                   for f in ((batch,) if self.single else batch)]  # fmt: skip
        return [row[0] if self.single else row for row in zip(*columns, strict=True)]

    def __reduce__(self) -> tuple[Any, ...]:
        # A worker started by spawn maps the files again instead of receiving a copy.
        return (Preloaded, (self.path, False))

    def __repr__(self) -> str:
        return f"loopkit.Preloaded({self._n} items, {self.nbytes / 2**20:.1f} MiB at {self.path})"


def batch_as_is(batch: Any) -> Any:
    """The collate of a preloaded data set: its ``batch`` returns the batch itself."""
    return batch


def _mapped(path: Path, nbytes: int) -> torch.Tensor:
    """The file's bytes, mapped: viewed as any dtype (bfloat16, float8, ...) bit for bit."""
    # shared=False maps the file copy-on-write: no process can change the cache, and pages
    # nobody writes stay the page cache's single copy (shared by every process and worker).
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.from_file(str(path), shared=False, size=nbytes, dtype=torch.uint8)


def _fresh_buffer(rows: int, row_bytes: int) -> torch.Tensor:
    return torch.empty((rows, row_bytes), dtype=torch.uint8)


def _shared_buffer(rows: int, row_bytes: int) -> torch.Tensor:
    """A buffer in shared memory: a worker sends it to the main process without a copy."""
    out = torch.empty((rows, row_bytes), dtype=torch.uint8)
    return out.share_memory_()  # type: ignore[no-untyped-call,no-any-return]  # untyped
