"""loopkit.preload: the deterministic part of a data pipeline, run once into a shared cache.

The items (after ``transform``: decode, resize, tokenize) are stored as one file per field
of a directory (``_cache_files``), fixed-shape fields as ``[N, *shape]`` in their own dtype
(uint8 stays uint8, bfloat16 stays bfloat16, a Python float is a float64), fields whose
sizes vary as the items' elements one after another with each item's offset and shape.
Every process and every loader worker maps the same files (``torch.from_file``), so the
page cache holds one copy per node, whatever the number of ranks and workers; what a
``Preloaded`` hands out (an item, a batch) is a copy, never a view of the mapping.

The directory's name carries the data set's fingerprint (``_fields``: length, the fields'
shapes and dtypes, a hash of a spread sample of items, the transform's name or ``key=``),
so a changed data set never reuses an old cache: it gets a new one. A build writes into a
temporary directory and renames it into place when complete, under a lock that makes a
second builder of the same cache wait and then open it. The default root is private to
the user, and a cache someone else could have written is refused (``_cache_trust``).
Under ``torchrun`` one process per node (local rank 0) builds or opens it; the others
wait without a collective's timeout (``_cache_handoff``), then map it. The ranks then
compare what their caches hold (every file's sha256), so a job whose nodes built from
different copies of the data is refused on every rank before it trains.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Sequence, Sized
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, get_worker_info

from .._job import info
from . import _cache_admin, _cache_files
from ._cache_files import check_sizes, complete, read_meta
from ._cache_handoff import Announcer, agree, builder_error, job_token, wait_for
from ._cache_trust import check_cache, check_root, default_roots, make_root
from ._fields import Field, Survey, as_tensors, fingerprint


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
        idx = torch.as_tensor(list(indices), dtype=torch.int64).reshape(-1)
        low, high = (int(idx.min()), int(idx.max())) if len(idx) else (0, 0)
        if len(idx) and not -self._n <= low <= high < self._n:
            raise IndexError(f"an index of {list(indices)} is out of range for {self._n} items")
        if low < 0:
            idx = idx % self._n
        parts: list[Any] = []
        for j, f in enumerate(self.fields):
            if f.shape is None:
                parts.append(self._ragged(j, idx, shared))
                continue
            rows = self._bytes[j]
            out = torch.empty((len(idx), rows.shape[1]), dtype=torch.uint8)
            if shared:
                out.share_memory_()  # type: ignore[no-untyped-call]  # untyped in torch
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


def preload(
    dataset: Dataset[Any],
    cache: str | os.PathLike[str] | None = None,
    *,
    transform: Callable[[Any], Any] | None = None,
    key: str | None = None,
    trust_shared_cache: bool = False,
    verify: bool | None = None,
) -> Preloaded:
    """Run ``transform`` over every item once and map the result; see the module docstring.

    ``cache`` is a directory (default ``/dev/shm/loopkit-preload-<uid>``, RAM-backed, when
    it has room, else ``loopkit-preload-<uid>`` in the temporary directory, both mode 0700);
    the cache goes in a subdirectory named by ``key`` (default: the data set's and
    transform's names) and the fingerprint. A root or cache that another user owns or
    that group or others can write is refused (PermissionError) unless
    ``trust_shared_cache=True``. ``verify`` checks a cache this call did not build against
    the sha256 of each file written at its build (default: only with
    ``trust_shared_cache``). Under torchrun every rank calls it: local rank 0 builds or
    opens, the others wait (however long) and map the same files; if it fails, every rank
    raises (local rank 0 its own exception, the others a RuntimeError naming it), and so
    does every rank if the nodes' caches hold different data (each node's copy of the data
    set differs). Raises OSError before writing anything if the directory has no room for it,
    saying how many bytes are needed where; ValueError for an empty data set.
    """
    if not isinstance(dataset, Sized) or not hasattr(dataset, "__getitem__"):
        raise TypeError("preload needs a map-style data set (__len__ and __getitem__)")
    if transform is not None and not callable(transform):
        raise TypeError(f"transform must be callable, got {type(transform).__name__}")
    if key is not None and (not isinstance(key, str) or not key or "/" in key):
        raise ValueError(f"key must be a non-empty name without '/', got {key!r}")
    if not isinstance(trust_shared_cache, bool):
        raise TypeError(f"trust_shared_cache must be a bool, got {trust_shared_cache!r}")
    if verify is not None and not isinstance(verify, bool):
        raise TypeError(f"verify must be a bool or None, got {verify!r}")
    n = len(dataset)
    if n == 0:
        raise ValueError(
            "preload got an empty data set (len 0): there is nothing to store; preload the "
            "data set once it has items"
        )
    default = cache is None
    roots = [Path(cache)] if cache is not None else default_roots()
    job = info()
    builder = job.local_rank == 0
    token = job_token()  # the one collective, as every rank starts: nothing slow before it
    name = key or _default_key(dataset, transform)

    def get(i: int) -> tuple[torch.Tensor, ...]:
        item = dataset[i]
        return as_tensors(transform(item) if transform is not None else item)[0]

    opening = _Opening(n, get, name, roots, default, trust_shared_cache,
                       trust_shared_cache if verify is None else verify)  # fmt: skip
    announcer = Announcer(roots[0], name, token) if builder and token else None
    failure: Exception | None = None
    cache_: Preloaded | None = None
    held: tuple[Path, str] | None = None
    try:  # from here on, a failure on any rank reaches every rank (agree)
        for root in roots:
            check_root(root, default=default, trust=trust_shared_cache)
        if builder:  # where this call's handoff file goes (the others wait for it)
            make_root(roots[0], default=default, trust=trust_shared_cache)
        if announcer is not None:
            announcer.say("working")
        if builder:
            first = dataset[0]
            single = as_tensors(transform(first) if transform is not None else first)[1]
            cache_ = opening.open_or_build(fingerprint(n, get, name), single)
        else:
            # The node's builder posts its outcome when it is done: a failure it could not
            # write into the handoff file (no root, a full disk) still reaches this rank.
            builder_rank = job.rank - job.local_rank  # torchrun numbers a node's ranks in a row
            cache_ = _waited(n, get, name, roots[0], token, builder_rank)
        held = (cache_.path, _cache_files.contents(cache_.path))  # compared across nodes
        if announcer is not None:
            announcer.say("ready", path=str(cache_.path))
    except Exception as err:  # every rank must learn of it (below), then it is raised
        failure = err
        if announcer is not None:
            with contextlib.suppress(OSError):
                announcer.say("failed", error=f"{type(err).__name__}: {err}")
    if token:
        agree(failure, held, announcer, token, job.rank, job.world_size)
    if failure is not None:
        raise failure  # this rank's own exception, as it was raised
    assert cache_ is not None
    return cache_


def _waited(
    n: int,
    get: Callable[[int], tuple[torch.Tensor, ...]],
    name: str,
    where: Path,
    token: str,
    builder_rank: int,
) -> Preloaded:
    """A waiting rank's part: its own fingerprint, then local rank 0's cache, mapped."""
    own: Exception | None = None
    try:
        survey = fingerprint(n, get, name)
    except Exception as err:  # raised once local rank 0 is done: all meet in the exchange
        own = err
    path = wait_for(where, name, token, lambda: builder_error(token, builder_rank))
    if own is not None:
        raise own
    if path.name != f"{name}-{survey.fingerprint}":
        raise RuntimeError(
            f"preload: local rank 0 made the cache {path}, but this rank's data set has the "
            f"fingerprint {survey.fingerprint}: every rank must preload the same data set"
        )
    return Preloaded(path, built=False)


class _Opening:
    """Local rank 0's part: find the cache (and check it), or build it under the lock."""

    def __init__(
        self,
        n: int,
        get: Callable[[int], tuple[torch.Tensor, ...]],
        name: str,
        roots: list[Path],
        default: bool,
        trust: bool,
        verify: bool,
    ) -> None:
        self.n, self.get, self.name, self.roots = n, get, name, roots
        self.default, self.trust, self.verify = default, trust, verify

    def _found(self, places: list[Path], survey: Survey) -> Preloaded | None:
        """The complete cache at one of ``places``, checked, or None."""
        path = next((p for p in places if complete(p)), None)
        if path is None:
            return None
        if not self.trust:
            check_cache(path)
        opened = Preloaded(path, built=False, verify=self.verify)
        if (opened.fingerprint, len(opened)) != (survey.fingerprint, self.n):
            raise RuntimeError(
                f"preload: the cache {path} holds {len(opened)} items of fingerprint "
                f"{opened.fingerprint}, not {self.n} of {survey.fingerprint} as its name "
                f"says: delete it to rebuild it"
            )
        return opened

    def open_or_build(self, survey: Survey, single: bool) -> Preloaded:
        places = [root / f"{self.name}-{survey.fingerprint}" for root in self.roots]
        found = self._found(places, survey)
        if found is not None:
            return found
        # RAM (/dev/shm) when it has room, else the temporary directory (disk).
        needed = _cache_files.needed_bytes(self.n, survey) if len(places) > 1 else 0
        final = next((p for p in places[:-1] if _cache_files.free_bytes(p.parent) >= needed),
                     places[-1])  # fmt: skip
        make_root(final.parent, default=self.default, trust=self.trust)
        with _cache_files.build_lock(final.parent, final.name) as locked:
            found = self._found(places, survey)  # another process built it while we waited
            if found is not None:
                return found
            if locked:  # no live builder holds them: a killed build's leftovers
                _cache_files.remove_leftovers(final.parent, final.name)
            _cache_files.write(self.n, self.get, survey, single, final)
        return Preloaded(final, built=True)


def _default_key(dataset: object, transform: object) -> str:
    parts = [type(dataset).__qualname__]
    if transform is not None:
        parts.append(getattr(transform, "__qualname__", type(transform).__qualname__))
    return "-".join(p.replace("<", "").replace(">", "").replace(".", "_") for p in parts)
