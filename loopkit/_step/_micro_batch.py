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
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

import torch
from torch import nn

from .. import _ranks
from .._checks import is_int_at_least
from .._logging._recording import check_alike, check_value
from .._logging._reductions import fsum, partial_floats, wide_dtype
from .._parallel._grad_sync import no_sync, sync_kind
from . import _batch_layout, _last_batch
from ._window import close_left_open, unreducible

T = TypeVar("T")


def leading_size(batch: object) -> int:
    """The batch's sample count (0 if nothing in it has a size), as ``_batch_layout`` reads
    it; a tie between sizes is read as the first (counting only: cutting refuses it)."""
    quick = _batch_layout.quick_size(batch)  # per batch: the usual layouts without a full read
    if quick is not None:
        return quick
    try:
        layout = _batch_layout.read(batch)
    except ValueError:
        sizes: set[int] = set()
        _batch_layout._sizes(batch, sizes)
        return min(sizes)
    return 0 if layout is None else layout.size


class Chunks:
    """A step's micro-batching: the chunk size, the current chunk's share, whether iterate is
    handing out chunks now, and whether the current window must be handed out again; the
    log record of the batch being handed out, and the model's batch-statistics layers."""

    __slots__ = (
        "batch_last", "by_member", "layout", "norms", "others", "quiet", "record", "redo",
        "replaying", "share", "size", "splitting",
    )  # fmt: skip

    def __init__(self, size: int | None) -> None:
        check_micro_batch(size)
        self.size = size
        self.share: float | None = None
        self.replaying = False
        self.redo = False
        self.by_member = False  # in a group that splits member by member (see ``split``)
        self.splitting = False  # ``split`` is handing out this step's chunks now
        self.others: list[nn.Module] = []  # the group's other DDP models (quiet while splitting)
        self.norms: list[tuple[str, nn.Module]] = []  # BatchNorm layers (``watch``)
        self.batch_last = True  # the chunk handed out now is its batch's last
        self.quiet = False  # its batch's record was logged before a redo: not again
        self.record: list[tuple[Any, dict[str, Any]]] = []  # the batch's chunks' (weight, record)
        self.layout: _batch_layout.Layout | None = None  # the last batch's, read alike next

    def watch(self, model: nn.Module, frozen: Sequence[nn.Module] = ()) -> None:
        """Remember the layers that normalize by the batch's statistics: ``model``'s, and those
        of the modules its micro-steps run through (``frozen=``, a GAN's critic)."""
        if self.size is None:
            return
        found = {id(m): (n, m) for n, m in model.named_modules()
                 if isinstance(m, nn.modules.batchnorm._BatchNorm)}  # fmt: skip
        for k, module in enumerate(frozen):
            for n, m in module.named_modules():
                if isinstance(m, nn.modules.batchnorm._BatchNorm):
                    found.setdefault(id(m), (f"frozen[{k}]{'.' + n if n else ''}", m))
        self.norms = list(found.values())

    def refuse_batch_statistics(self) -> None:
        """Refuse to cut a batch that BatchNorm layers normalize by its statistics: each chunk
        would be normalized by its own, and the update would not be the whole batch's."""
        busy = [n or "the model" for n, m in self.norms if m.training or m.running_mean is None]
        if busy:
            raise RuntimeError(
                f"micro_batch={self.size} would cut batches that BatchNorm layers ({busy[0]!r}"
                f"{f' and {len(busy) - 1} more' if len(busy) > 1 else ''}) normalize by their "
                "statistics in training mode: each chunk would be normalized by its own, so "
                "the update would not be the whole batch's (nor the running statistics). Use "
                "smaller loader batches with accumulate= (each micro-batch normalized alone, as "
                "you tuned it), replace BatchNorm with GroupNorm or LayerNorm, or put those "
                "layers in eval mode (frozen statistics)"
            )

    def batch_record(
        self, metrics: dict[str, Any], how: Callable[[str], str], weight: Any = None
    ) -> dict[str, Any] | None:
        """The record to log for a micro-step: its own, or, when it is a chunk of a batch, the
        batch's once its last chunk is done (``combined``: as the whole batch would have
        logged it, by each metric's reduction ``how(name)``; ``weight``: the chunk's
        ``weight=``, else its share). None: nothing to log now."""
        if self.share is None:
            return metrics or None
        self.record.append((self.share if weight is None else weight, metrics))
        if not self.batch_last:
            return None
        parts, self.record = self.record, []
        return None if self.quiet or not parts else combined(parts, how) or None

    def check_entry(self) -> None:
        """Refuse a micro-step on a whole batch where the group wants ``step.split``, and a
        chunk of a cut batch that BatchNorm in training mode would normalize alone (checked
        as each chunk's micro-step opens: the mode the forward will run in)."""
        share = self.share
        if share is not None and share < 1.0 and self.norms:
            self.refuse_batch_statistics()
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


def combined(parts: list[tuple[Any, dict[str, Any]]], how: Callable[[str], str]) -> dict[str, Any]:
    """A batch's record from its chunks' ``(weight, record)``: per metric, by its reduction,
    what the whole batch would have logged. A mean is weighted by the chunks' weights (their
    shares of the samples, or the ``weight=`` given: tokens); ``sum`` adds, ``max``/``min``
    pick (a NaN among them shows) and ``last`` picks the last. Tensors combine in the log's
    wide dtype (float64: a counter stays exact) and stay on their device (no host sync);
    Python numbers combine as the log reduces them. Refused, as the log would refuse them,
    before anything is combined: values no log takes, a metric logged as a tensor by one
    chunk and a number (or a tensor elsewhere) by another."""
    by_name: dict[str, list[tuple[Any, Any]]] = {}
    for w, record in parts:
        for name, v in record.items():
            check_value(name, v)
            pairs = by_name.setdefault(name, [])
            if pairs:
                check_alike(name, v, pairs[0][1])
            pairs.append((w, v))
    out: dict[str, Any] = {}
    for name, pairs in by_name.items():
        values = [v for _, v in pairs]
        reduction = how(name)
        if reduction == "last":
            out[name] = values[-1]
        elif not isinstance(values[0], torch.Tensor):
            out[name] = _combined_numbers(pairs, reduction)
        else:
            wide = wide_dtype(values[0].device)
            t = torch.stack([v.detach().reshape(()).to(wide) for v in values])
            if reduction == "sum":
                out[name] = t.sum()
            elif reduction in ("max", "min"):
                out[name] = t.max() if reduction == "max" else t.min()  # (NaN propagates)
            else:
                weights = torch.stack([torch.as_tensor(w, device=t.device).to(wide).reshape(())
                                       for w, _ in pairs])  # fmt: skip
                out[name] = (t * weights).sum() / weights.sum()
    return out


def _combined_numbers(pairs: list[tuple[Any, Any]], reduction: str) -> float:
    values = [float(v) for _, v in pairs]
    if reduction in ("sum", "max", "min"):
        return partial_floats(values, reduction)  # the log's own: IEEE sums, NaN shows
    if len(set(values)) == 1:
        return values[0]  # a constant (the lr): exactly itself
    weights = [float(w) for w, _ in pairs]
    return fsum([w * v for w, v in zip(weights, values, strict=True)]) / fsum(weights)


def check_micro_batch(micro_batch: object) -> None:
    """Refuse a ``micro_batch=`` that is not a positive int (or None)."""
    if micro_batch is not None and not is_int_at_least(micro_batch, 1):
        raise ValueError(
            f"micro_batch= must be an int >= 1 (samples per micro-step; find it with "
            f"loopkit.probe_micro_batch) or None, got {micro_batch!r}"
        )


def chunks(
    batch: T, micro_batch: int, state: Chunks | None = None, hint: object = None
) -> list[tuple[T, float]]:
    """``(chunk, its share of the batch)`` for each chunk of at most ``micro_batch`` samples.

    ``state``: the step's micro-batching, whose last layout breaks a tie between sizes;
    ``hint``: the loader's ``batch_size``, which does too."""
    layout = _batch_layout.read(
        batch,
        hint=hint if isinstance(hint, int) else None,
        before=None if state is None else state.layout,
    )
    if layout is None:
        raise ValueError(
            f"micro_batch= cannot tell how many samples a batch of {type(batch).__name__} "
            "holds, so it cannot cut it: hand out tensors with the samples along their first "
            "dimension (in a tuple, list, dict, namedtuple or dataclass; per-sample lists of "
            "names or of variable-length tensors are cut with them)"
        )
    if state is not None:
        state.layout = layout
    size = layout.size
    if size <= micro_batch:
        return [(batch, 1.0)]
    return [
        (_batch_layout.take(batch, a, min(a + micro_batch, size), layout),
         (min(a + micro_batch, size) - a) / size)
        for a in range(0, size, micro_batch)
    ]  # fmt: skip


def iterate(step: Any, source: object, batches: Iterable[T], done: int = 0) -> Iterator[T]:
    """``step.iterate`` with ``micro_batch``: each batch in chunks, windows ending at the last
    chunk of every ``accumulate``-th batch and of the pass (one batch looked ahead; ``done``:
    as ``_last_batch.marked``'s).

    An out-of-memory error inside a chunk's micro-step (a longer sequence than the probe's)
    is taken by ``step.__exit__`` (``recovered``): the window is dropped and its batches are
    handed out again in chunks half the size, so the update is still the whole batches'.
    """
    acc = step.accumulator
    # A window left open by an earlier pass is closed on its own; one FSDP cannot reduce by
    # hand goes on to this pass's first mark (its synced micro-step closes it).
    if acc._window.micro and not unreducible(acc):
        acc.flush()
    seen, state = step.seen, step.chunks
    window: list[T] = []
    delivered = 0  # batches of the window whose log record is delivered (kept over a redo)
    at_start = (seen.samples, seen.tokens, seen.batches)
    acc._by_marks = state.replaying = True  # windows end at the marks, not by counting chunks
    acc.iterating += 1
    try:
        for batch, last in _last_batch.marked(acc, source, batches, None, done):
            window.append(batch)
            ends = last or len(window) == acc.every
            todo = [batch]
            while todo:
                current = todo.pop(0)
                index = len(window) - len(todo) - 1  # its place in the window
                parts = chunks(current, state.size, state, getattr(source, "batch_size", None))
                state.quiet = index < delivered
                for j, (chunk, share) in enumerate(parts, start=1):
                    if ends and current is window[-1] and j == len(parts):
                        acc._final_pending = True
                    state.share, state.redo = share, False
                    state.batch_last = j == len(parts)
                    if j == 1:  # a batch's record holds its own chunks' (one sat out: gone)
                        state.record = []
                    if state.batch_last:  # a whole batch handed out (a save in it counts it)
                        seen.batches += 1
                    yield chunk
                    if state.redo:  # its micro-step ran out of memory: the window again
                        seen.samples, seen.tokens, seen.batches = at_start
                        todo = list(window)
                        break
                else:
                    delivered = max(delivered, index + 1)
            if ends:
                window, at_start, delivered = [], (seen.samples, seen.tokens, seen.batches), 0
        close_left_open(acc)  # ended before the batch counted last, or its last chunk raised
    finally:
        acc.iterating -= 1
        acc._by_marks = state.replaying = False
        acc._final_pending = False
        acc.lookahead = 0
        state.share, state.batch_last, state.quiet, state.record = None, True, False, []


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
    parts = [(batch, 1.0)] if state.size is None else chunks(batch, state.size, state)
    ddp = sync_kind(step.model) == "ddp"
    state.splitting = True
    try:
        for j, (part, share) in enumerate(parts, start=1):
            last = j == len(parts)
            acc._final_pending = ends and last
            state.share = None if state.size is None else share
            state.batch_last = last
            with contextlib.ExitStack() as quiet:
                # A chunk that does not end the window skips DDP's all-reduce, its forward
                # too; the other members' models forward here without preparing one (a
                # prepared reducer would all-reduce their next backward, a no_sync one).
                if ddp and (not (ends and last) or acc._sync.reduce_by_hand):
                    quiet.enter_context(no_sync(step.model))
                for other in state.others:
                    quiet.enter_context(no_sync(other))
                if step.doctor is not None:  # this chunk's samples: the FLOPs scale by them
                    step.doctor.step_samples(leading_size(part))
                yield part
    finally:
        state.splitting, state.share, state.batch_last, state.record = False, None, True, []
        acc._final_pending = False  # a loop left early: the group closes the window


def recovered(step: Any, exc: BaseException | None) -> bool:
    """Whether ``exc``, raised in a micro-step, was an out-of-memory error the chunks can
    shrink away from: then the window is dropped and redone in halves (one process)."""
    state = step.chunks
    # An out-of-memory error is a RuntimeError (torch.OutOfMemoryError is one): anything
    # else is the user's and comes out unchanged, with nothing imported on its way.
    if exc is None or not state.replaying or not isinstance(exc, RuntimeError):
        return False
    try:
        memory: Any = importlib.import_module("accelerate.utils.memory")
    except ImportError:  # a broken install must not replace the user's error
        return False
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
    state.record = []  # the failed batch's chunks so far: its redo logs it whole
    memory.clear_device_cache(garbage_collection=True)
    state.size, state.redo = max(1, state.size // 2), True
    return True
