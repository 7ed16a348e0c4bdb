"""loopkit.preload: the deterministic part of a data pipeline, run once into a shared cache.

The items (after ``transform``: decode, resize, tokenize) are stored as one file per field
of a directory, fixed-shape fields as ``[N, *shape]`` in their own dtype (uint8 stays
uint8), variable-length ones as one flat buffer plus offsets. Every process and every
loader worker maps the same files (``torch.from_file``), so the page cache holds one copy
per node, whatever the number of ranks and workers.

The directory's name carries the data set's fingerprint (length, the fields' shapes and
dtypes, a hash of a spread sample of items, the transform's name or ``key=``), so a
changed data set never reuses an old cache: it gets a new one. A build writes into a
temporary directory and renames it into place when complete; a build killed half-way
leaves only a temporary directory that is never opened (and is removed by the next build).
Under ``torchrun`` one process per node (local rank 0) builds; the others wait, then map it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence, Sized
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, get_worker_info

from .. import _ranks
from .._job import info

FORMAT = 1
_SAMPLED = 16  # items hashed for the fingerprint, spread over the data set
_SHM = Path("/dev/shm")


@dataclasses.dataclass(frozen=True)
class Field:
    """One field of every item: its dtype, and its shape (None where the length varies)."""

    dtype: str
    shape: tuple[int, ...] | None


def as_tensors(item: object) -> tuple[tuple[torch.Tensor, ...], bool]:
    """An item's fields as tensors, and whether the item was a single tensor (not a tuple).

    Tensors, numpy arrays, array-likes (a PIL image), ints, floats and bools are taken.
    """
    single = not isinstance(item, (tuple, list))
    parts = (item,) if single else tuple(item)  # type: ignore[arg-type]  # checked: a sequence
    out = []
    for i, part in enumerate(parts):
        if isinstance(part, torch.Tensor):
            out.append(part.detach().cpu().contiguous())
        elif isinstance(part, (bool, int, float, np.generic)):
            out.append(torch.as_tensor(part))
        elif isinstance(part, np.ndarray) or hasattr(part, "__array_interface__"):
            out.append(torch.from_numpy(np.ascontiguousarray(np.asarray(part))))
        else:
            raise TypeError(
                f"preload stores tensors, arrays and numbers; field {i} of an item is a "
                f"{type(part).__name__}: make transform return tensors (e.g. decoded images)"
            )
    return tuple(out), single


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def fingerprint(
    dataset: Sized, get: Callable[[int], tuple[torch.Tensor, ...]], key: str
) -> tuple[str, list[Field]]:
    """The cache's name-giving hash, and the fields as a spread sample of items shows them."""
    n = len(dataset)
    if n == 0:
        raise ValueError("preload got an empty data set: there is nothing to store")
    picks = sorted({round(i * (n - 1) / max(_SAMPLED - 1, 1)) for i in range(min(n, _SAMPLED))})
    h = hashlib.sha256(f"loopkit-preload/{FORMAT}/{key}/{n}".encode())
    fields: list[Field] | None = None
    for i in picks:
        parts = get(i)
        if fields is None:
            fields = [Field(_dtype_name(p), tuple(p.shape)) for p in parts]
        elif len(parts) != len(fields):
            raise ValueError(f"item {i} has {len(parts)} fields, item 0 has {len(fields)}")
        for j, p in enumerate(parts):
            f = fields[j]
            if _dtype_name(p) != f.dtype:
                raise ValueError(f"field {j}: item {i} is {p.dtype}, item 0 is torch.{f.dtype}")
            if f.shape is not None and tuple(p.shape) != f.shape:
                fields[j] = Field(f.dtype, None)  # its length varies: stored flat
            h.update(f"{i}:{j}:{p.dtype}:{tuple(p.shape)}".encode())
            h.update(p.numpy().tobytes())
    assert fields is not None
    for j, f in enumerate(fields):
        h.update(f"{j}:{f}".encode())
    return h.hexdigest()[:20], fields


class Preloaded(Dataset[Any]):
    """A preloaded data set: items come from memory-mapped tensors, a batch in one index.

    ``cache[i]`` is item i (as the transform returned it, as tensors);
    ``cache.__getitems__(indices)`` is a whole batch: each fixed-shape field indexed once
    (``tensors[j][indices]``), a variable-length one as a list of tensors.
    ``loopkit.distributed.loader(cache, batch_size=...)`` batches it that way.
    """

    def __init__(self, path: Path, built: bool) -> None:
        meta = json.loads((path / "meta.json").read_text())
        self.path = path
        self.built = built
        """Whether this process built the cache (False: it opened one already there)."""
        self.fingerprint: str = meta["fingerprint"]
        self.single: bool = meta["single"]
        self._n: int = meta["length"]
        self.fields = [Field(f["dtype"], None if f["shape"] is None else tuple(f["shape"]))
                       for f in meta["fields"]]  # fmt: skip
        self.tensors: list[torch.Tensor] = []
        self.offsets: list[torch.Tensor | None] = []
        for j, f in enumerate(self.fields):
            dtype = getattr(torch, f.dtype)
            if f.shape is not None:
                numel = self._n * int(np.prod(f.shape, dtype=np.int64))
                data = _mapped(path / f"field{j}.bin", numel, dtype)
                self.tensors.append(data.view(self._n, *f.shape))
                self.offsets.append(None)
            else:
                offsets = _mapped(path / f"field{j}.offsets", self._n + 1, torch.int64)
                self.tensors.append(_mapped(path / f"field{j}.bin", int(offsets[-1]), dtype))
                self.offsets.append(offsets)

    @property
    def nbytes(self) -> int:
        """Bytes the cache holds (all fields, offsets included)."""
        total = sum(t.numel() * t.element_size() for t in self.tensors)
        return total + sum(o.numel() * 8 for o in self.offsets if o is not None)

    def __len__(self) -> int:
        return self._n

    def _field(self, j: int, index: int) -> torch.Tensor:
        offsets = self.offsets[j]
        if offsets is None:
            return self.tensors[j][index]
        return self.tensors[j][int(offsets[index]) : int(offsets[index + 1])]

    def __getitem__(self, index: int) -> Any:
        if not -self._n <= index < self._n:
            raise IndexError(f"index {index} out of range for {self._n} items")
        index %= self._n
        parts = tuple(self._field(j, index) for j in range(len(self.fields)))
        return parts[0] if self.single else parts

    def __getitems__(self, indices: Sequence[int]) -> Any:
        """A batch: one index operation per fixed-shape field, no per-sample Python."""
        idx = torch.as_tensor(list(indices), dtype=torch.int64)
        # In a loader worker the batch is written straight into shared memory, as
        # default_collate does: sending it to the main process then copies nothing.
        in_worker = get_worker_info() is not None
        parts: list[Any] = []
        for j, t in enumerate(self.tensors):
            if self.offsets[j] is None:
                out = torch.empty((len(idx), *t.shape[1:]), dtype=t.dtype)
                if in_worker:
                    out.share_memory_()  # type: ignore[no-untyped-call]  # untyped in torch
                parts.append(torch.index_select(t, 0, idx, out=out))
            else:
                parts.append([self._field(j, int(i)) for i in idx])
        return parts[0] if self.single else tuple(parts)

    def __reduce__(self) -> tuple[Any, ...]:
        # A worker started by spawn maps the files again instead of receiving a copy.
        return (Preloaded, (self.path, False))

    def __repr__(self) -> str:
        return f"loopkit.Preloaded({self._n} items, {self.nbytes / 2**20:.1f} MiB at {self.path})"


def batch_as_is(batch: Any) -> Any:
    """The collate of a preloaded data set: its ``__getitems__`` returns the batch itself."""
    return batch


def _mapped(path: Path, numel: int, dtype: torch.dtype) -> torch.Tensor:
    # shared=False maps the file copy-on-write: no process can change the cache, and pages
    # nobody writes stay the page cache's single copy (shared by every process and worker).
    if numel == 0:
        return torch.empty(0, dtype=dtype)
    return torch.from_file(str(path), shared=False, size=numel, dtype=dtype)


def preload(
    dataset: Dataset[Any],
    cache: str | os.PathLike[str] | None = None,
    *,
    transform: Callable[[Any], Any] | None = None,
    key: str | None = None,
) -> Preloaded:
    """Run ``transform`` over every item once and map the result; see the module docstring.

    ``cache`` is a directory (default ``/dev/shm/loopkit-preload``, RAM-backed, when it has
    room, else ``loopkit-preload`` in the temporary directory); the cache goes in a
    subdirectory named by ``key`` (default: the data set's and transform's names) and the
    fingerprint. Under torchrun every rank calls it: local rank
    0 builds, the others wait and map the same files. Raises OSError before writing
    anything if the directory has no room for it, saying how many bytes are needed where.
    """
    if not isinstance(dataset, Sized) or not hasattr(dataset, "__getitem__"):
        raise TypeError("preload needs a map-style data set (__len__ and __getitem__)")
    if transform is not None and not callable(transform):
        raise TypeError(f"transform must be callable, got {type(transform).__name__}")
    if key is not None and (not isinstance(key, str) or not key or "/" in key):
        raise ValueError(f"key must be a non-empty name without '/', got {key!r}")
    name = key or _default_key(dataset, transform)

    def get(i: int) -> tuple[torch.Tensor, ...]:
        item = dataset[i]
        return as_tensors(transform(item) if transform is not None else item)[0]

    first = dataset[0]
    single = as_tensors(transform(first) if transform is not None else first)[1]
    fp, fields = fingerprint(dataset, get, name)
    places = [root / f"{name}-{fp}" for root in _roots(cache)]
    final = next((p for p in places if _complete(p)), None)
    if final is None:
        # RAM (/dev/shm) when it has room, else the temporary directory (disk).
        needed = _needed_bytes(dataset, get, fields) if len(places) > 1 else 0
        final = next((p for p in places[:-1] if _free(p.parent) >= needed), places[-1])
    failure: Exception | None = None
    built = False
    if _local_rank() == 0 and not _complete(final):
        try:
            _build(dataset, get, fields, single, fp, final)
            built = True
        except Exception as err:  # every rank must learn of it (below), then it is raised
            failure = err
    # One exchange: nobody maps before the builders are done, and all raise if one failed.
    said = None if failure is None else f"{type(failure).__name__}: {failure}"
    reports = _ranks.gather_objects(said)
    if failure is not None:
        raise failure
    failed = [(r, e) for r, e in enumerate(reports) if e is not None]
    if failed:
        rank, what = failed[0]
        raise RuntimeError(f"preload: rank {rank} could not build the cache: {what}")
    final = next((p for p in places if _complete(p)), final)  # where the builder put it
    if not _complete(final):
        raise RuntimeError(
            f"preload: {final} is not there after the build: every process of a node must "
            "see the same cache directory (pass cache= a node-local or shared path)"
        )
    return Preloaded(final, built)


def _default_key(dataset: object, transform: object) -> str:
    parts = [type(dataset).__qualname__]
    if transform is not None:
        parts.append(getattr(transform, "__qualname__", type(transform).__qualname__))
    return "-".join(p.replace("<", "").replace(">", "").replace(".", "_") for p in parts)


def _roots(cache: str | os.PathLike[str] | None) -> list[Path]:
    """Where the cache may be: ``cache``, or /dev/shm's (if writable) then the temp dir's."""
    if cache is not None:
        return [Path(cache)]
    places = [Path(tempfile.gettempdir()) / "loopkit-preload"]
    if _SHM.is_dir() and os.access(_SHM, os.W_OK):
        places.insert(0, _SHM / "loopkit-preload")
    return places


def _free(directory: Path) -> int:
    """Free bytes where ``directory`` is (or would be created)."""
    while not directory.exists() and directory != directory.parent:
        directory = directory.parent
    return shutil.disk_usage(directory).free


def _local_rank() -> int:

    return info().local_rank


def _complete(path: Path) -> bool:
    return (path / "meta.json").is_file()


def _needed_bytes(dataset: Sized, get: Callable[[int], tuple[torch.Tensor, ...]],
                  fields: list[Field]) -> int:  # fmt: skip
    """Bytes the cache will take: exact for fixed shapes, estimated from a sample otherwise."""
    n = len(dataset)
    total = 0
    sample: list[tuple[torch.Tensor, ...]] | None = None
    for j, f in enumerate(fields):
        size = torch.empty((), dtype=getattr(torch, f.dtype)).element_size()
        if f.shape is not None:
            total += n * int(np.prod(f.shape, dtype=np.int64)) * size
            continue
        if sample is None:
            sample = [get(round(i * (n - 1) / 15)) for i in range(min(n, 16))]
        mean = sum(p[j].numel() for p in sample) / len(sample)
        total += int(mean * n * 1.25) * size + (n + 1) * 8  # a margin for the estimate
    return total


def _build(
    dataset: Sized,
    get: Callable[[int], tuple[torch.Tensor, ...]],
    fields: list[Field],
    single: bool,
    fp: str,
    final: Path,
) -> None:
    """Write the cache into a temporary directory and rename it into place when complete."""
    root = final.parent
    root.mkdir(parents=True, exist_ok=True)
    needed = _needed_bytes(dataset, get, fields)
    free = shutil.disk_usage(root).free
    if needed > free:
        raise OSError(
            f"preload needs {needed:,} bytes ({needed / 2**30:.2f} GiB) in {root} but only "
            f"{free:,} are free: pass cache= a directory with room, or free space there"
        )
    for stale in root.glob(f".{final.name}.tmp-*"):  # a killed build's leftovers
        shutil.rmtree(stale, ignore_errors=True)
    tmp = root / f".{final.name}.tmp-{os.getpid()}"
    tmp.mkdir()
    try:
        n = len(dataset)
        files = [open(tmp / f"field{j}.bin", "wb") for j in range(len(fields))]  # noqa: SIM115
        offsets = [[0] if f.shape is None else None for f in fields]
        try:
            for i in range(n):
                parts = get(i)
                if len(parts) != len(fields):
                    raise ValueError(f"item {i} has {len(parts)} fields, not {len(fields)}")
                for j, (p, f) in enumerate(zip(parts, fields, strict=True)):
                    if _dtype_name(p) != f.dtype:
                        raise ValueError(
                            f"field {j} of item {i} is {p.dtype}, not torch.{f.dtype}"
                        )
                    if f.shape is not None and tuple(p.shape) != f.shape:
                        raise ValueError(
                            f"field {j} of item {i} has shape {tuple(p.shape)}, the sampled "
                            f"items {f.shape}: a field whose shape varies must vary in the "
                            "sample too (or give it one shape in transform)"
                        )
                    files[j].write(p.numpy().tobytes())
                    off = offsets[j]
                    if off is not None:
                        off.append(off[-1] + p.numel())
        finally:
            for fh in files:
                fh.flush()
                os.fsync(fh.fileno())
                fh.close()
        for j, off in enumerate(offsets):
            if off is not None:
                (tmp / f"field{j}.offsets").write_bytes(np.asarray(off, dtype=np.int64).tobytes())
        meta = {
            "format": FORMAT,
            "fingerprint": fp,
            "length": n,
            "single": single,
            "fields": [dataclasses.asdict(f) for f in fields],
        }
        # meta.json is what makes a cache complete, and only the final name is ever opened.
        (tmp / "meta.json").write_text(json.dumps(meta))
        try:
            os.rename(tmp, final)
        except OSError:
            if not _complete(final):  # not a builder on another node that got there first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
