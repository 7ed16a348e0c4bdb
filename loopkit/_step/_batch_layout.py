"""Where a batch keeps its samples: how many there are, and which parts to cut for a chunk.

A loader's ``collate_fn`` lays a batch out in containers (tuples, lists, dicts,
namedtuples, dataclasses). Tensors hold the samples along their first dimension;
lists may be *fields* (``default_collate`` turns a sample's tuple into a list of batched
tensors) or *samples* (names, token lists, variable-length tensors, one dict per sample:
what a custom collate keeps per sample). The two readings can look alike, so each list is
read the way that explains the batch best, for each size ``B`` the batch could have:

- a tensor whose first dimension is ``B`` counts +1 (it is cut), any other tensor -2 (it
  would be handed whole to every chunk: a batch-level tensor, or a misreading);
- a list read as samples counts +1 if its length is ``B``, -1 otherwise (kept whole); +2
  for a list of plain values (names, ids); as many as its length when nothing but samples
  could look like it (dicts holding plain values or different shapes, tensors or lists of
  different lengths);
- a list read as fields counts what its items count (tensors of one shape, as one).

The size with the best count wins (a list read as fields where both readings count the
same, as ``default_collate`` lays it out). Where sizes tie, the loader's ``batch_size``
decides, else the parts cut in the batch before, else the size that cuts more parts; else
the batch is refused, saying which parts disagree. Per size this is one pass over the batch
(the best reading of each list does not depend on the others'), so a batch of any depth is
read in linear time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, MutableMapping
from typing import Any, TypeVar

import torch

from .._data._to_device import unshared_copy

T = TypeVar("T")
Path = tuple[object, ...]

_LEAF = (str, bytes, int, float, complex, bool, type(None))
"""Values a batch holds per sample in a list (names, ids, labels), or once (a scalar)."""


@dataclasses.dataclass(frozen=True)
class Layout:
    """A batch's sample count and the lists cut as one entry per sample (by identity)."""

    size: int
    samples: frozenset[int]
    cut: frozenset[Path]
    """The paths of the parts cut (tensors and per-sample lists), to read the next batch alike."""


def _named(node: object) -> bool:
    return isinstance(node, tuple) and hasattr(node, "_fields")


def _is_dataclass(node: object) -> bool:
    return dataclasses.is_dataclass(node) and not isinstance(node, type)


def _scalar(e: object) -> bool:
    return isinstance(e, _LEAF) or (isinstance(e, torch.Tensor) and e.dim() == 0)


def _leaf_list(seq: list[Any] | tuple[Any, ...]) -> bool:
    """A list of plain values (names, ids, labels): per sample, or kept whole."""
    return all(_scalar(e) for e in seq)


def _only_samples(seq: list[Any] | tuple[Any, ...]) -> bool:
    """Whether nothing but one entry per sample looks like this list (default_collate makes
    none of these): dicts holding plain values, or tensors of other shapes under one key;
    tensors or lists of plain values of different lengths."""
    if all(isinstance(e, Mapping) for e in seq):
        if any(_scalar(v) and not isinstance(v, torch.Tensor) for e in seq for v in e.values()):
            return True
        shapes: dict[object, set[tuple[int, ...]]] = {}
        for e in seq:
            for k, v in e.items():
                if isinstance(v, torch.Tensor):
                    shapes.setdefault(k, set()).add(tuple(v.shape))
        return any(len(s) > 1 for s in shapes.values())
    if all(isinstance(e, torch.Tensor) and e.dim() >= 1 for e in seq):
        return len({int(e.shape[0]) for e in seq}) > 1
    if all(isinstance(e, (list, tuple)) and not _named(e) and _leaf_list(e) for e in seq):
        return len({len(e) for e in seq}) > 1
    return False


def _same_tensors(seq: list[Any] | tuple[Any, ...]) -> bool:
    """Whether a list holds tensors of one shape only (images of one size, say)."""
    first = seq[0]
    return (
        isinstance(first, torch.Tensor)
        and first.dim() >= 1
        and all(isinstance(e, torch.Tensor) and e.shape == first.shape for e in seq)
    )


def _children(node: object) -> list[tuple[object, object]] | None:
    """``(key, child)`` of a container read as fields, None for anything else."""
    if isinstance(node, Mapping):
        return list(node.items())
    if _is_dataclass(node):
        return [(f.name, getattr(node, f.name)) for f in dataclasses.fields(node)]  # type: ignore[arg-type]
    if isinstance(node, (list, tuple)):
        return list(enumerate(node))
    return None


class _Reading:
    """The best reading of a batch for one size: its count, the per-sample lists, the cuts."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.samples: set[int] = set()
        self.cut: set[Path] = set()

    def score(self, node: object, path: Path) -> int:
        size = self.size
        if isinstance(node, torch.Tensor):
            if not node.dim():
                return 0
            if int(node.shape[0]) == size:
                self.cut.add(path)
                return 1
            return -2
        children = _children(node)
        if children is None:
            return 0
        if not isinstance(node, (list, tuple)) or _named(node):
            return sum(self.score(child, (*path, key)) for key, child in children)
        if not node:
            return 0
        if _leaf_list(node):
            if len(node) == size:  # names, ids: more telling than one tensor's size
                self.samples.add(id(node))
                self.cut.add(path)
                return 2
            return -1
        only = _only_samples(node)
        as_samples = (len(node) if only else 1) if len(node) == size else -1
        # Read as fields, recorded apart: kept only if that reading wins (a tie goes to
        # default_collate's fields, unless only samples could look like this list).
        fields = _Reading(size)
        as_fields = sum(fields.score(child, (*path, key)) for key, child in children)
        if _same_tensors(node):  # one kind of thing repeated: one part's say, not len's
            as_fields = 1 if int(node[0].shape[0]) == size else -2
        if as_samples > as_fields or (only and as_samples == as_fields):
            self.samples.add(id(node))
            self.cut.add(path)
            return as_samples
        self.samples |= fields.samples
        self.cut |= fields.cut
        return as_fields


def _sizes(node: object, out: set[int]) -> None:
    """Every size the batch could have: tensors' first dimensions and lists' lengths."""
    if isinstance(node, torch.Tensor):
        if node.dim():
            out.add(int(node.shape[0]))
        return
    children = _children(node)
    if children is None:
        return
    if isinstance(node, (list, tuple)) and not _named(node) and node:
        out.add(len(node))
    for _, child in children:
        _sizes(child, out)


def quick_size(batch: object) -> int | None:
    """The sample count of the batches most loaders make, without a full read: a tensor, or a
    tuple, list or dict of tensors sharing their first dimension (``read`` reads them so);
    None for anything else."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else None
    if type(batch) in (tuple, list):
        parts: Any = batch
    elif type(batch) is dict:
        parts = batch.values()
    else:
        return None
    size = None
    for part in parts:
        if not isinstance(part, torch.Tensor) or not part.dim():
            return None
        if size is None:
            size = int(part.shape[0])
        elif part.shape[0] != size:
            return None
    return size


def read(batch: object, hint: int | None = None, before: Layout | None = None) -> Layout | None:
    """The batch's layout (None where nothing in it has a size). ``hint``: the loader's batch
    size; ``before``: the layout of the batch before. A tie they cannot break is refused."""
    sizes: set[int] = set()
    _sizes(batch, sizes)
    if not sizes:
        return None
    readings = []
    for size in sorted(sizes):
        reading = _Reading(size)
        readings.append((reading.score(batch, ()), reading))
    top = max(score for score, _ in readings)
    best = [r for score, r in readings if score == top]
    if len(best) > 1:
        by_hint = [r for r in best if r.size == hint]
        by_before = [r for r in best if before is not None and r.cut == before.cut]
        # default_collate lays a batch out as fields: a one-tensor sample (TensorDataset(x))
        # comes as ``[x]``, which reads as one sample as well as ``len(x)``; the reading with
        # the fewest lists taken as samples is the collated one.
        fewest = min(len(r.samples) for r in best)
        as_fields = [r for r in best if len(r.samples) == fewest]
        most = max(len(r.cut) for r in as_fields)
        best = by_hint or by_before or [r for r in as_fields if len(r.cut) == most]
    if len(best) > 1:
        said = "; ".join(f"{r.size} ({', '.join(_said(p) for p in sorted(r.cut, key=str)[:3])})"
                         for r in best)  # fmt: skip
        raise ValueError(
            f"micro_batch= cannot tell how many samples this batch holds: its parts agree "
            f"equally on {said}. Hand out batch-level tensors (a mask, position ids shared by "
            "every sample) outside the batch, or give the per-sample parts their samples "
            "along the first dimension, so that most of the batch says its size"
        )
    chosen = best[0]
    return Layout(chosen.size, frozenset(chosen.samples), frozenset(chosen.cut))


def _said(path: Path) -> str:
    return "batch" + "".join(f"[{k!r}]" for k in path)


def take(batch: T, start: int, stop: int, layout: Layout) -> T:
    """Samples ``start:stop`` of ``batch`` as ``layout`` reads it: rows of tensors of the
    batch's size, entries of per-sample lists; everything else whole, containers kept."""
    size = layout.size
    if isinstance(batch, torch.Tensor):
        return batch[start:stop] if batch.dim() and batch.shape[0] == size else batch  # type: ignore[return-value]
    if isinstance(batch, Mapping):
        items = {k: take(v, start, stop, layout) for k, v in batch.items()}
        if isinstance(batch, MutableMapping):
            new = unshared_copy(batch)  # keeps a defaultdict's factory, a subclass's attributes
            new.update(items)
            return new
        return type(batch)(items)  # type: ignore[call-arg]
    if _is_dataclass(batch):
        new_obj = unshared_copy(batch)
        for f in dataclasses.fields(batch):  # type: ignore[arg-type]
            object.__setattr__(new_obj, f.name, take(getattr(batch, f.name), start, stop, layout))
        return new_obj
    if isinstance(batch, tuple) and _named(batch):
        return type(batch)(*(take(v, start, stop, layout) for v in batch))
    if isinstance(batch, (list, tuple)):
        if id(batch) in layout.samples:
            return batch[start:stop]  # type: ignore[return-value]
        parts = [take(v, start, stop, layout) for v in batch]
        return parts if type(batch) is list else type(batch)(parts)  # type: ignore[return-value]
    return batch
