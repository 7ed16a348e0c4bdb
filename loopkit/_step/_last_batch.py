"""How ``iterate`` knows a pass's last batch (whose window closes in its micro-step): by
looking one batch ahead, or by counting to the iterable's length.

Looking ahead takes batch i+1 from the iterable before batch i's micro-step runs. Where
taking a batch can run code that draws random numbers in this process (a ``DataLoader``
with ``num_workers=0`` running its data set, a sampler of the user's, a ``Sized`` iterable
of the user's), that would move those draws before the micro-step's (dropout, noise), and
the run would no longer see the random stream of the loop written by hand. There the
batches are taken when the loop asks, as a plain ``for`` loop takes them, and the last is
known by counting to ``len()``; at the counted last one the next is asked for (past the
end that draws nothing) to confirm it: a length that was not kept goes on looking ahead
from there, and an iterable that ends before its length closes its open window as it ends.
(An ``IterableDataset``'s loader is taken at its word: past its end its code would run.)

Ahead is kept where taking a batch cannot draw from this process's random streams (a
``distributed.loader``: each batch's draws come from its own key, the streams put back; a
``DataLoader`` with workers and torch's own samplers; an in-memory sequence or tensor),
and where nothing else tells the last batch (an iterable without a length: a generator,
an ``IterableDataset`` without ``__len__``), so that loop control sees every window end
inside the loop body. Such an iterable that draws random numbers as it yields does not
keep the hand loop's random stream: give it a ``__len__``.

A batch taken ahead moves a stateful loader's own place past the loop's: for a loader a
Checkpointer saves, its state is recorded before each batch taken ahead
(``_data._consumed``), so a save holds the place after the batches the loop consumed.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol, TypeVar

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    SubsetRandomSampler,
)

from .._data import _consumed
from .._data._epoch_loader import EpochLoader, hand_back, training_iter, training_pass
from .._stream._replay import replayed
from ._window import close_left_open, unreducible

T = TypeVar("T")


class Holder(Protocol):
    """What is told how many batches are held back (a step's clock: ``lookahead``)."""

    lookahead: int


# Samplers that draw nothing per index: a DataLoader's workers run the data set, its main
# process only takes indices from these (a RandomSampler draws its order as a pass starts).
_QUIET_SAMPLERS = (SequentialSampler, RandomSampler, SubsetRandomSampler, DistributedSampler)


def _taken_here(source: object) -> bool:
    """Whether taking a batch of ``source`` may run code drawing random numbers here."""
    if isinstance(source, EpochLoader):
        return False  # reseeded per batch, the streams put back: order does not matter
    if isinstance(source, DataLoader):
        if source.num_workers == 0:
            return True
        if isinstance(source.dataset, IterableDataset):
            return False  # no sampler: the workers take the items
        quiet = (
            type(source.batch_sampler) is BatchSampler and type(source.sampler) in _QUIET_SAMPLERS
        )
        return not quiet
    # An in-memory sequence is already made; anything else may make its items as it goes.
    return not isinstance(source, (Sequence, torch.Tensor))


def counted_length(source: object) -> int | None:
    """The batches to count to instead of looking ahead (None: look ahead)."""
    if not _taken_here(source):
        return None
    try:
        n = len(source)  # type: ignore[arg-type]
    except Exception:  # no length (TypeError), or a __len__ that raises: look ahead
        return None
    return n if isinstance(n, int) and n >= 0 else None


# Samplers whose ``len()`` is the whole pass's after a resume too (torch's, torchdata's
# resumable ones), by qualified name: torchdata is optional, and a subclass may count otherwise.
_WHOLE_PASS_SAMPLERS = frozenset(
    f"{prefix}.{name}"
    for prefix, names in {
        "torch.utils.data.sampler": ("SequentialSampler", "RandomSampler",
                                     "SubsetRandomSampler", "WeightedRandomSampler",
                                     "BatchSampler"),
        "torch.utils.data.distributed": ("DistributedSampler",),
        "torchdata.stateful_dataloader.sampler": ("RandomSampler", "BatchSampler",
                                                  "StatefulDistributedSampler"),
    }.items()
    for name in names
)  # fmt: skip


def _whole_pass_length(source: object) -> bool:
    """Whether ``len(source)`` is the whole pass's even when a resume put it back part-way:
    a ``DataLoader`` over a map-style data set whose samplers are torch's or torchdata's own
    (torchdata's StatefulDataLoader as built), and ``loopkit.replayed`` (its loader's pass
    read again from the start). Another stateful iterable's ``len()`` may count
    what it has left (a user's resumable sampler, say), and counting its resumed pass from
    what was done would take its batches early (a batch asked for past a count that was
    short confirms there are more: the windows stay right, but the draws move), so its
    resumed pass counts from its start and a ragged last window closes when the loop asks
    past it."""
    if isinstance(source, replayed):  # its pass read again from the start: the whole pass's
        return True
    if not isinstance(source, DataLoader) or isinstance(source.dataset, IterableDataset):
        return False
    samplers = (source.sampler, source.batch_sampler)
    return all(
        s is None or f"{type(s).__module__}.{type(s).__qualname__}" in _WHOLE_PASS_SAMPLERS
        for s in samplers
    )


def marked(
    holder: Holder,
    source: object,
    items: Iterable[T],
    move: Callable[[T], T] | None = None,
    done: int = 0,
) -> Iterator[tuple[T, bool]]:
    """``(batch, whether it is the pass's last)`` for each batch of ``items`` (taken from
    ``source``, moved by ``move`` as it is taken). ``holder.lookahead`` is 1 while a batch
    is held back. When the batches end before a last one was marked (a length that was
    not kept), the caller closes the window left open. Called as the pass starts (by
    iterate's generators, at their first batch): ``iter(items)`` starts it. ``done``: the
    batches of this pass handed out before a resume (a stateful loader goes on after them,
    its ``len()`` the whole pass's)."""
    n = counted_length(source)
    if n is not None and done and _whole_pass_length(source):
        n = n - done if n > done else None  # (none left by the count: look ahead)
    it = training_iter(items)  # a distributed.loader's pass is training's from its start
    track = _consumed.tracker(source)  # None (no cost per batch) unless a Checkpointer saves it
    if track is None:
        marks = _marked(holder, source, it, n, move, None)
    else:
        marks = _tracked(track, _marked(holder, source, it, n, move, track))
    if isinstance(source, EpochLoader):  # (its pass started: by training_iter, or iterate's)
        return _handed(source, training_pass(source), marks)
    return marks


def _handed(
    loader: EpochLoader, opened: Any, marks: Iterator[tuple[T, bool]]
) -> Iterator[tuple[T, bool]]:
    """``marks`` over a training pass of ``loader``, counting the batches handed to the loop:
    a loop left mid-pass gives back what the loader counted beyond them (a batch taken ahead,
    or one taken as the error came: ``_consumed`` keeps the state before it for a stateful
    loader)."""
    back = hand_back  # (bound now: at interpreter exit a module's globals may go first)
    handed, done = 0, False
    try:
        for pair in marks:
            handed += 1
            yield pair
        done = True
    finally:
        if not done:
            back(loader, opened, handed)


def _tracked(track: _consumed.Tracker, marks: Iterator[tuple[T, bool]]) -> Iterator[tuple[T, bool]]:
    """``marks``, telling ``track`` whether the pass ran out or was left mid-way."""
    done = False
    try:
        yield from marks
        done = True
        track.ended()
    finally:
        if not done:
            track.left()


def _marked(
    holder: Holder,
    source: object,
    it: Iterator[T],
    n: int | None,
    move: Callable[[T], T] | None,
    track: _consumed.Tracker | None,
) -> Iterator[tuple[T, bool]]:
    if n is None:
        yield from (
            _ahead(holder, it, move) if track is None else _ahead_tracked(holder, it, move, track)
        )
        return
    holder.lookahead = 0
    # Past the end of an iterable data set its code runs (the samples a dropped last batch
    # would hold): its length is taken as it is (torch warns when it is not kept).
    trusted = isinstance(source, DataLoader) and isinstance(source.dataset, IterableDataset)
    for i, item in enumerate(it, start=1):  # taken when the loop asks, as a plain loop does
        # Moved as soon as it is taken, before anything is taken after it: a loader that
        # refills one batch object in place changes it at the next take.
        if move is not None:
            item = move(item)
        if i < n or (trusted and i == n):
            yield item, i == n
            continue
        # The loader's place after the counted last, before the check takes it further.
        state = track.take() if track is not None else None
        try:  # the counted last: past the end nothing is drawn
            following = next(it)
        except StopIteration:
            if track is not None:
                track.hold(state)
            yield item, True
            return
        if move is not None:  # (moved on taking it, as every batch is)
            following = move(following)
            it = map(move, it)
        # The length was not kept: more batches come, looked ahead from here.
        holder.lookahead = 1
        if track is not None:
            track.hold(state)
        yield item, False
        rest = itertools.chain([following], it)
        yield from (
            _ahead(holder, rest, None)
            if track is None
            else _ahead_tracked(holder, rest, None, track)
        )
        return


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


def _ahead_tracked(
    holder: Holder, it: Iterator[T], move: Callable[[T], T] | None, track: _consumed.Tracker
) -> Iterator[tuple[T, bool]]:
    """``_ahead`` for a loader a Checkpointer saves: its state recorded before each batch is
    taken ahead (what a save holds while the loop has the batch before it)."""
    try:
        nxt = next(it) if move is None else move(next(it))
    except StopIteration:
        return
    while True:
        cur = nxt
        state = track.take()
        try:
            nxt = next(it) if move is None else move(next(it))
        except StopIteration:
            holder.lookahead = 0
            track.hold(state)
            yield cur, True
            return
        holder.lookahead = 1
        track.hold(state)
        yield cur, False


def marking(
    acc: Any,
    source: object,
    items: Iterable[T],
    move: Callable[[Any], Any] | None,
    done: int,
) -> Iterator[T]:
    """``acc.iterate``'s generator (``acc``: the accumulate): close a left-over window, mark
    the pass's last item (``marked``: looked ahead or counted), close a window the items
    left open."""
    if acc._window.micro:
        if unreducible(acc):
            # FSDP cannot reduce the left-over gradients by hand: the first micro-step of
            # this pass syncs and closes that window (the one case a window spans two).
            acc._final_pending = True
        else:
            acc.flush()
    acc.iterating += 1
    try:
        for item, last in marked(acc, source, items, move, done):
            if last:  # (an FSDP left-over mark above stays for the first micro-step)
                acc._final_pending = True
            yield item
        # The items ended before the one counted last (a length not kept), or the last
        # micro-step raised: their window closes now, before the loop goes on.
        close_left_open(acc)
    finally:
        acc.iterating -= 1
        acc._final_pending = False
        acc.lookahead = 0
