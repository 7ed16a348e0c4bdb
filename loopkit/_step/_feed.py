"""What ``step.iterate`` does with each batch: move it, count what was seen, show progress.

``Seen`` is the x-axes a step's log and progress display read besides the update count:
the epoch, and the samples and tokens handed to the loop (counted from host-side shapes,
times the number of ranks: no host sync). It is saved with the step, so a resumed run
continues the same axes.
"""

from __future__ import annotations

import functools
import math
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, TypeVar

from .. import _ranks
from .._data import _consumed
from .._data._epoch_loader import training_iter
from .._observe._progress import ProgressDisplay
from . import _micro_batch
from ._batch_layout import quick_size
from ._micro_batch import leading_size

T = TypeVar("T")

# clock -> (max_updates, max_epochs) of the `until` built on it: the totals an ETA needs.
LIMITS: weakref.WeakKeyDictionary[Any, tuple[int | None, int | None]] = weakref.WeakKeyDictionary()


class Seen:
    """Samples, tokens and passes handed to the loop by ``iterate`` (all ranks together)."""

    __slots__ = ("_length", "_live", "_resumed", "batches", "epoch", "passes", "samples", "tokens")

    def __init__(self) -> None:
        self.samples = 0
        self.tokens = 0
        self.passes = 0
        self.epoch: int | None = None  # of the pass being iterated, where the loader says
        self.batches = 0  # handed out in the pass being iterated (0 once it ended)
        self._length: int | None = None  # that pass's len(), where it has one
        self._resumed = 0  # a restored pass left open: the batches it had handed out
        self._live = False  # a pass is being iterated (its generator not closed)

    def axes(self) -> dict[str, float]:
        """The x-axes known so far (tokens only once counted)."""
        out: dict[str, float] = {}
        epoch = self.epoch if self.epoch is not None else self.passes - 1
        if epoch >= 0:
            out["epoch"] = epoch
        out["samples"] = self.samples
        if self.tokens:
            out["tokens"] = self.tokens
        return out

    def begin_pass(self, source: object) -> None:
        """``source`` has handed out its pass's first batch: its epoch is known now."""
        epoch = getattr(getattr(source, "_progress", None), "pass_epoch", None)
        self.epoch = epoch if isinstance(epoch, int) else None
        # A loader that knows its epoch says which pass this is; another iterable counts its
        # passes, and the first after a restore continues a pass saved part-way (a stateful
        # loader resumes it; one restarted from its start is still that epoch's pass).
        if isinstance(epoch, int):
            self.passes = epoch + 1
        elif not self._resumed:
            self.passes += 1
        # A stateful loader goes on from where it was saved; another starts the pass again.
        self.batches = self._resumed if stateful(source) else 0
        self._resumed, self._length, self._live = 0, _length(source), True

    def end_pass(self) -> None:
        """The pass ran out (not left by a ``break``): none is open now."""
        self.batches = self._resumed = 0

    def leave(self) -> None:
        """The pass's generator closed: it ran out, or the loop left it (``break``), and the
        loop's next ``iterate`` is a new pass."""
        self._live = False

    def open_batches(self) -> int:
        """Where a pass that the next ``iterate`` goes on with stands: one being iterated (not
        all of its ``len()`` handed out), or a restored one not yet begun; else 0."""
        if self._resumed:
            return self._resumed
        done, length = self.batches, self._length
        return done if self._live and (length is None or done < length) else 0

    def resumed_batches(self) -> int:
        """Where a restored pass left open was saved (until its next pass begins), or 0."""
        return self._resumed

    def state_dict(self) -> dict[str, int]:
        """The counters a resumed run continues from."""
        return {"samples": self.samples, "tokens": self.tokens, "passes": self.passes,
                "pass_batches": self.open_batches()}  # fmt: skip

    def load_state_dict(self, state: Mapping[str, Any] | None) -> None:
        """Restore ``state_dict``'s counters (a checkpoint from before they existed: zeros)."""
        state = state or {}
        self.epoch = None
        self.samples = int(state.get("samples", 0))
        self.tokens = int(state.get("tokens", 0))
        self.passes = int(state.get("passes", 0))
        done = int(state.get("pass_batches", 0))
        if self._live:  # loaded under a pass being iterated: that pass goes on
            self.batches = done
        else:  # a resume: the next pass goes on with the one saved part-way
            self.batches, self._length, self._resumed = done, None, done

    def snapshot(self) -> tuple[int, int | None, int]:
        """What ``load_state_dict`` changes beyond ``state_dict``: a failed resume puts it back
        (a pass left by a ``break`` stays one whose next pass is new)."""
        return self.batches, self._length, self._resumed

    def restore(self, snapshot: tuple[int, int | None, int]) -> None:
        """Put back what ``snapshot`` read."""
        self.batches, self._length, self._resumed = snapshot


def stateful(source: object) -> bool:
    """A loader that a resume puts back part-way: a ``distributed.loader``, or one a
    Checkpointer saves (``loader=``, ``extra=``: torchdata's StatefulDataLoader)."""
    return hasattr(source, "_progress") or _consumed.saved(source)


def resumed(step: Any, source: object) -> int:
    """The batches of ``source``'s pass handed out before the resume it goes on from."""
    return step.seen.resumed_batches() if stateful(source) else 0


def _length(source: object) -> int | None:
    """``len(source)``, or None where it has none (or one that raises)."""
    try:
        n = len(source)  # type: ignore[arg-type]
    except Exception:
        return None
    return n if isinstance(n, int) and n >= 0 else None


def counted(
    batches: Iterable[T],
    source: object,
    seen: Seen,
    tokens: Callable[[T], int] | None,
    display: ProgressDisplay | None,
    doctor: Any = None,
    whole: bool = True,
) -> Iterator[T]:
    """Hand out ``batches`` (after the lookahead), counting each, ticking the display after
    each micro-step. ``source`` is what the loop iterates (its epoch, if it has one);
    ``whole``: each item is a batch (not a chunk of one)."""
    world = _ranks.world()[1]
    first = True
    try:
        for batch in batches:
            if first:  # the source's pass has begun: its epoch is known now
                first = False
                seen.begin_pass(source)
            size = quick_size(batch)  # the usual layouts, in one call (per batch)
            if size is None:
                size = leading_size(batch)
            seen.samples += size * world
            if doctor is not None:  # this micro-step's samples: the FLOPs scale by them
                doctor.step_samples(size)
            if tokens is not None:
                count = int(tokens(batch))
                seen.tokens += count * world
                if doctor is not None:  # its tokens/s and FLOP figures per this rank
                    doctor.count(tokens=count)
            if whole:  # (micro_batch= counts its batches itself, not their chunks)
                seen.batches += 1  # before the yield: a save in this micro-step counts it
            yield batch
            if display is not None:
                display.tick()
        seen.end_pass()
    finally:
        seen.leave()
        if display is not None:
            display.close()


def restore(step: Any, state: Mapping[str, Any]) -> None:
    """A step's checkpoint: what ``iterate`` had seen and the chunk size it had come to."""
    step.seen.load_state_dict(state.get("seen"))
    step.chunks.resume(state.get("micro_batch"))


def chunk_weight(step: Any, weight: Any) -> Any:
    """The weight of a micro-step: the user's, or a chunk's share of its batch (first
    backward of the micro-step only: the later ones take the same weight)."""
    share = step.chunks.share
    if weight is not None or share is None or step.accumulator._did_backward:
        return weight
    return share


def total_updates(clock: Any, iterable: object, every: int, seen: Seen) -> int | None:
    """The updates at the end of training (``until``'s limits, the first reached) or of this
    pass, if known. Called before the pass starts (a resumed pass's place is `resume_at`, or
    where ``seen`` was saved for a stateful loader the checkpoint put back)."""
    max_updates, max_epochs = LIMITS.get(clock, (None, None))
    batches = _length(iterable)  # (a len() that raises: none, as the look-ahead takes it)
    if batches is None:
        return max_updates
    per_pass = math.ceil(batches / every)
    if max_epochs is not None:
        by_epochs = max_epochs * per_pass
        return by_epochs if max_updates is None else min(max_updates, by_epochs)
    if max_updates is not None:
        return max_updates
    # A resumed pass of a distributed.loader starts part-way: iter() clears `resume_at`.
    done_in_pass = getattr(getattr(iterable, "_progress", None), "resume_at", None)
    if done_in_pass is None:  # another loader: resumed part-way if its state was restored
        done_in_pass = seen.resumed_batches() if stateful(iterable) else 0
    return int(clock.updates) + math.ceil(max(batches - done_in_pass, 0) / every)


def iterate(
    step: Any, iterable: Iterable[T], progress: bool | str, tokens: Callable[[T], int] | None
) -> Iterator[T]:
    """``step.iterate`` (``step``: a ``loopkit.step``): move, look ahead (accumulate), count
    and display; the arguments checked first."""
    if progress not in (True, False, "tqdm", "plain"):
        raise ValueError(
            f"progress must be True, False, 'tqdm' or 'plain' (a printed line), got {progress!r}"
        )
    if tokens is not None and not callable(tokens):
        raise TypeError(
            f"tokens must be a function batch -> int (e.g. lambda b: b['input_ids'].numel()), "
            f"got {tokens!r}"
        )
    doc, mover = step.doctor, step._mover
    # Before anything below starts the pass (a generator's iter()): its place is still known.
    acc = step.accumulator
    total = total_updates(acc, iterable, acc.every, step.seen) if progress else None
    # A distributed.loader's pass started here is training's from its start (``_passes``).
    started = training_iter(iterable)
    if doc is None:
        taken, move = started, mover
    else:
        if doc.loader is None:
            doc.loader = iterable  # what the doctor's tips read: the loader, not its pass
        taken, move = doc.iterate(started), functools.partial(_timed_move, doc, mover)
    batches: Iterable[T]
    if step.chunks.size is not None:  # each batch in chunks; windows end at the marks
        batches = _micro_batch.iterate(step, iterable, map(move, taken), resumed(step, iterable))
    else:  # each batch moved as the look-ahead takes it
        batches = step.accumulator._iterate_from(iterable, taken, move, resumed(step, iterable))
    display = None
    if progress and _ranks.world()[0] == 0:
        log = step.log
        display = ProgressDisplay(
            step,
            step.seen.axes,
            (lambda: log.last) if log is not None else dict,
            total,
            use_tqdm={True: None, "tqdm": True, "plain": False}[progress],
        )
    whole = step.chunks.size is None
    return counted(batches, iterable, step.seen, tokens, display, step.doctor, whole)


def _timed_move(doc: Any, mover: Callable[[T], T], batch: T) -> T:
    with doc.phase("h2d"):
        return mover(batch)
