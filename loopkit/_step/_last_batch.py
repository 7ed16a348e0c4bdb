"""How ``iterate`` knows a pass's last batch (whose window closes in its micro-step): by
looking one batch ahead, or by counting to the iterable's length.

Looking ahead takes batch i+1 from the iterable before batch i's micro-step runs. Where
taking a batch can run code that draws random numbers in this process (a ``DataLoader``
with ``num_workers=0`` running its data set, an ``IterableDataset``, a generator of the
user's), that would move those draws before the micro-step's (dropout, noise), and the
run would no longer see the random stream of the loop written by hand. There the batches
are taken when the loop asks, as a plain ``for`` loop takes them, and the last is known by
counting to ``len()``; an iterable that ends before its length, or that has none, closes
its open window when it ends, before the loop goes on (``step.updated`` is then not yet
true inside the last micro-step).

Ahead is kept only where taking a batch cannot draw from this process's random streams: a
``distributed.loader`` (each batch's draws come from its own key, the streams put back), a
``DataLoader`` with workers, an in-memory sequence or tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Protocol, TypeVar

import torch
from torch.utils.data import DataLoader

from .._data._epoch_loader import EpochLoader

T = TypeVar("T")


class Holder(Protocol):
    """What is told how many batches are held back (a step's clock: ``lookahead``)."""

    lookahead: int


def _taken_here(source: object) -> bool:
    """Whether taking a batch of ``source`` may run its data set in this process."""
    if isinstance(source, EpochLoader):
        return False  # reseeded per batch, the streams put back: order does not matter
    if isinstance(source, DataLoader):
        return source.num_workers == 0
    # An in-memory sequence is already made; anything else may make its items as it goes.
    return not isinstance(source, (Sequence, torch.Tensor))


def counted_length(source: object) -> int | None:
    """The batches to count to instead of looking ahead: None to look ahead, -1 to count
    with no known end (closed when the batches end)."""
    if not _taken_here(source):
        return None
    try:
        n = len(source)  # type: ignore[arg-type]
    except TypeError:
        return -1
    return n if isinstance(n, int) and n >= 0 else -1


def marked(
    holder: Holder,
    source: object,
    items: Iterable[T],
    move: Callable[[T], T] | None = None,
) -> Iterator[tuple[T, bool]]:
    """``(batch, whether it is the pass's last)`` for each batch of ``items`` (taken from
    ``source``, moved by ``move`` as it is taken). ``holder.lookahead`` is 1 while a batch
    is held back. When the batches end before a last one was marked (a length that was
    not kept), the caller closes the window left open."""
    n = counted_length(source)
    if n is None:
        yield from _ahead(holder, iter(items), move)
        return
    holder.lookahead = 0
    for i, item in enumerate(items, start=1):  # taken when the loop asks, as a plain loop does
        yield (item if move is None else move(item)), i == n


def _ahead(
    holder: Holder, it: Iterator[T], move: Callable[[T], T] | None
) -> Iterator[tuple[T, bool]]:
    try:
        # Moved as soon as it is taken: the next batch's copy overlaps this one's compute.
        nxt = next(it) if move is None else move(next(it))
    except StopIteration:
        return
    while True:
        cur = nxt
        try:
            nxt = next(it) if move is None else move(next(it))
        except StopIteration:
            holder.lookahead = 0
            yield cur, True
            return
        holder.lookahead = 1
        yield cur, False
