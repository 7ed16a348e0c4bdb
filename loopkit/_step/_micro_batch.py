"""Micro-batches that fit: each loader batch split into chunks, the update unchanged.

``loopkit.step(..., micro_batch=m)`` makes ``step.iterate`` hand out chunks of at most ``m``
samples of each batch, each its own micro-step. A chunk's backward is weighted by its
share of its batch (``weight=`` when the user gives none), and windows still end after
every ``accumulate``-th batch (and at the pass's end), so the update is the one the whole
batches would have made: the ragged split 128 -> 48, 48, 32 included.

``probe_micro_batch`` (``_probe``) finds the largest ``m`` that fits.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, TypeVar

import torch
from torch import nn

from .. import _ranks
from .._checks import is_int_at_least
from .._parallel._grad_sync import no_sync, sync_kind

T = TypeVar("T")


def leading_size(batch: object) -> int:
    """The batch's sample count: the leading size of its first tensor (0 if it has none)."""
    while True:
        if isinstance(batch, torch.Tensor):
            return int(batch.shape[0]) if batch.dim() else 1
        if isinstance(batch, Mapping):
            batch = next(iter(batch.values()), None)
        elif isinstance(batch, (list, tuple)) and batch:
            batch = batch[0]
        else:
            return 0


class Chunks:
    """A step's micro-batching: the chunk size, the current chunk's share, whether iterate is
    handing out chunks now, and whether the current window must be handed out again."""

    __slots__ = ("by_member", "others", "redo", "replaying", "share", "size", "splitting")

    def __init__(self, size: int | None) -> None:
        check_micro_batch(size)
        self.size = size
        self.share: float | None = None
        self.replaying = False
        self.redo = False
        self.by_member = False  # in a group that splits member by member (see ``split``)
        self.splitting = False  # ``split`` is handing out this step's chunks now
        self.others: list[nn.Module] = []  # the group's other DDP models (quiet while splitting)

    def check_entry(self) -> None:
        """Refuse a micro-step on a whole batch where the group wants ``step.split``."""
        if self.by_member and not self.splitting:
            raise RuntimeError(
                "micro_batch= in a loopkit.steps group with a frozen= member (a GAN): the "
                "group hands out whole batches and each member splits them itself, so the "
                "generator's chunks see the critic after its whole-batch update. Loop every "
                "member `for part in step.split(batch):` around its `with step:`"
            )

    def resume(self, saved: object) -> None:
        """A checkpoint's size: smaller than this run's after an out-of-memory redo, it is kept
        (the resumed run splits as the saved one did, so it stays bit-identical)."""
        if self.size is not None and isinstance(saved, int) and 1 <= saved < self.size:
            self.size = saved


def check_micro_batch(micro_batch: object) -> None:
    """Refuse a ``micro_batch=`` that is not a positive int (or None)."""
    if micro_batch is not None and not is_int_at_least(micro_batch, 1):
        raise ValueError(
            f"micro_batch= must be an int >= 1 (samples per micro-step; find it with "
            f"loopkit.probe_micro_batch) or None, got {micro_batch!r}"
        )


def take(batch: T, start: int, stop: int, size: int) -> T:
    """Rows ``start:stop`` of every tensor in ``batch`` whose leading size is ``size``."""
    if isinstance(batch, torch.Tensor):
        return batch[start:stop] if batch.dim() and batch.shape[0] == size else batch  # type: ignore[return-value]
    if isinstance(batch, Mapping):
        return type(batch)({k: take(v, start, stop, size) for k, v in batch.items()})  # type: ignore[call-arg]
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
        return type(batch)(*(take(v, start, stop, size) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(take(v, start, stop, size) for v in batch)
    return batch


def chunks(batch: T, micro_batch: int) -> list[tuple[T, float]]:
    """``(chunk, its share of the batch)`` for each chunk of at most ``micro_batch`` samples."""
    size = leading_size(batch)
    if size <= micro_batch:
        return [(batch, 1.0)]
    return [
        (take(batch, a, min(a + micro_batch, size), size), (min(a + micro_batch, size) - a) / size)
        for a in range(0, size, micro_batch)
    ]


def iterate(step: Any, batches: Iterable[T]) -> Iterator[T]:
    """``step.iterate`` with ``micro_batch``: each batch in chunks, windows ending at the last
    chunk of every ``accumulate``-th batch and of the pass (one batch looked ahead).

    An out-of-memory error inside a chunk's micro-step (a longer sequence than the probe's)
    is taken by ``step.__exit__`` (``recovered``): the window is dropped and its batches are
    handed out again in chunks half the size, so the update is still the whole batches'.
    """
    acc = step.accumulator
    if acc._window.micro:
        acc.flush()  # a window left open by an earlier pass is closed on its own
    seen, state = step.seen, step.chunks
    window: list[T] = []
    at_start = (seen.samples, seen.tokens)
    acc._by_marks = state.replaying = True  # windows end at the marks, not by counting chunks
    try:
        for batch, last in _looking_ahead(acc, iter(batches)):
            window.append(batch)
            ends = last or len(window) == acc.every
            todo = [batch]
            while todo:
                current = todo.pop(0)
                parts = chunks(current, state.size)
                for j, (chunk, share) in enumerate(parts, start=1):
                    if ends and current is window[-1] and j == len(parts):
                        acc._final_pending = True
                    state.share, state.redo = share, False
                    yield chunk
                    if state.redo:  # its micro-step ran out of memory: the window again
                        seen.samples, seen.tokens = at_start
                        todo = list(window)
                        break
            if ends:
                window, at_start = [], (seen.samples, seen.tokens)
    finally:
        acc._by_marks = state.replaying = False
        acc._final_pending = False
        acc.lookahead = 0
        state.share = None


def split(step: Any, batch: T) -> Iterator[T]:
    """A group member's chunks of ``batch``, each its own micro-step (``step.split``).

    In a group with a ``frozen=`` member (a GAN) the batch is split member by member: all
    of the critic's chunks, its update (on a window's last batch), then the generator's
    chunks through the updated critic, as on whole batches. The window ends at the last
    chunk of the batch the group says ends it; the other chunks skip DDP's all-reduce.
    """
    state, acc = step.chunks, step.accumulator
    if state.replaying or state.splitting:
        raise RuntimeError(
            "step.split(batch) inside step.iterate or another split: iterate already hands "
            "out chunks; split is for the members of a loopkit.steps group with frozen="
        )
    if not state.by_member:
        raise RuntimeError(
            "step.split(batch) is for the members of a loopkit.steps group with a frozen= "
            "member; a single step splits its batches itself in step.iterate (micro_batch=)"
        )
    if acc._inside:
        raise RuntimeError("step.split(batch) inside `with step:`: loop over it around `with`")
    ends = acc._final_pending
    parts = [(batch, 1.0)] if state.size is None else chunks(batch, state.size)
    ddp = sync_kind(step.model) == "ddp"
    state.splitting = True
    try:
        for j, (part, share) in enumerate(parts, start=1):
            last = j == len(parts)
            acc._final_pending = ends and last
            state.share = None if state.size is None else share
            with contextlib.ExitStack() as quiet:
                # A chunk that does not end the window skips DDP's all-reduce, its forward
                # too; the other members' models forward here without preparing one (a
                # prepared reducer would all-reduce their next backward, a no_sync one).
                if ddp and (not (ends and last) or acc._sync.reduce_by_hand):
                    quiet.enter_context(no_sync(step.model))
                for other in state.others:
                    quiet.enter_context(no_sync(other))
                yield part
    finally:
        state.splitting, state.share = False, None
        acc._final_pending = False  # a loop left early: the group closes the window


def _looking_ahead(acc: Any, it: Iterator[T]) -> Iterator[tuple[T, bool]]:
    """``(batch, whether it is the pass's last)``, one batch fetched ahead (``acc.lookahead``)."""
    try:
        nxt = next(it)
    except StopIteration:
        return
    while True:
        cur = nxt
        try:
            nxt = next(it)
        except StopIteration:
            acc.lookahead = 0
            yield cur, True
            return
        acc.lookahead = 1
        yield cur, False


def recovered(step: Any, exc: BaseException | None) -> bool:
    """Whether ``exc``, raised in a micro-step, was an out-of-memory error the chunks can
    shrink away from: then the window is dropped and redone in halves (one process)."""
    state = step.chunks
    if exc is None or not state.replaying or not isinstance(exc, Exception):
        return False
    memory: Any = importlib.import_module("accelerate.utils.memory")
    if not memory.should_reduce_batch_size(exc):
        return False
    if _ranks.is_multi_rank():
        raise RuntimeError(
            "out of memory in a micro-step under DDP: redoing the window on this rank alone "
            "would leave the other ranks waiting in an all-reduce. Probe with the largest "
            "(longest) batch the data holds, or lower micro_batch="
        ) from exc
    if state.size <= 1:
        return False  # nothing smaller to try: the error stands
    acc = step.accumulator
    acc.optimizer.zero_grad(set_to_none=True)  # the window's partial gradients go
    if acc.amp is not None:
        acc.amp.discard(acc.optimizer)
    acc._window = type(acc._window)()
    acc._guard.window_closed()
    acc._final_pending = False
    memory.clear_device_cache(garbage_collection=True)
    state.size, state.redo = max(1, state.size // 2), True
    return True
