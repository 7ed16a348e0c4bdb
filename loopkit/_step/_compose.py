"""loopkit.step: the middlewares composed in one order, stated where it is implemented.

The order is the numbered lines of ``step.__enter__``, ``step.backward`` and
``step.__exit__`` (one line per middleware); docs/index.md says the same order in words.
Each piece keeps the semantics it has alone; a disabled piece is not entered at all.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from types import TracebackType
from typing import Any, TypeVar

import torch
from torch import nn

from .._checks import is_int_at_least
from .._compile._options import CompileLike
from .._data._to_device import Mover
from .._devices import model_device, resolve_device, same_device
from .._ema import _average
from .._logging import _detach, _recording
from .._observe import _doctor
from .._parallel._grad_sync import unwrap
from .._precision import autocast_step
from .._tracing import EagerUnderCompile, eagerly
from .._types import DeviceLike, PrecisionLike, Weight
from . import _accumulate, _feed, _micro_batch
from ._frozen import Frozen

T = TypeVar("T")


_DEPRECATED_ACCUMULATE = (
    "step.accumulate is deprecated: use step.accumulator (the attribute no longer shares its "
    "name with the accumulate= count)"
)


def _deprecated_accumulate(self: step) -> _accumulate.accumulate:
    warnings.warn(_DEPRECATED_ACCUMULATE, DeprecationWarning, stacklevel=2)
    return self.accumulator


def _check_arguments(
    model: object, accumulate: object, micro_batch: int | None, doctor: object
) -> _micro_batch.Chunks:
    """Refuse a bad model, ``accumulate=`` (named as the user wrote it: accumulate says
    ``every``), ``micro_batch=`` or ``doctor=``, in that order; the chunks of ``micro_batch``."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if not is_int_at_least(accumulate, 1):
        raise ValueError(
            f"accumulate= must be an int >= 1 (micro-batches per optimizer update), got "
            f"{accumulate!r}"
        )
    chunks = _micro_batch.Chunks(micro_batch)  # checks micro_batch=
    if doctor is not None and not isinstance(doctor, _doctor.doctor):
        raise TypeError(f"doctor must be a loopkit.doctor(), got {type(doctor).__name__}")
    return chunks


def _refuse_outside() -> None:
    """``s.backward`` outside ``with step as s:``, said in the step's terms."""
    raise RuntimeError(
        "s.backward(loss) must be called inside `with step as s:` (it belongs to that "
        "micro-step's window): indent it under the with block"
    )


class step(EagerUnderCompile, contextlib.ContextDecorator):
    """One reusable context manager per training loop: ``with step as s: ...; s.backward(loss)``.

    Build it once, before the loop, and enter it once per micro-batch (or decorate the micro-
    step function with ``@step``). ``precision`` (``"bf16"``, ``"fp16"``, ``"fp32"``),
    ``accumulate=N`` micro-batches per update (with ``no_sync`` under DDP and exact
    normalization), ``clip_grad_norm`` (``measure_grad_norm``: the norm, unclipped),
    ``scheduler`` (stepped once per real update), ``device`` for
    ``s.to_device``/``step.iterate`` and ``log`` (a ``detach_logging`` or an int: print every
    that many micro-steps); ``skip_nonfinite``/``max_consecutive_skips`` guard the updates (see
    accumulate); ``doctor=loopkit.doctor()`` times every phase. ``micro_batch=m``: ``iterate``
    hands out batches in chunks of at most ``m`` samples; ``ema=loopkit.ema(model)`` (or a list:
    several decays) is averaged after each real update. ``frozen=[D]``: modules trained through
    but not (a GAN's discriminator in the generator's step): no gradient and no DDP all-reduce
    inside its micro-steps, ``requires_grad`` restored on exit. ``compile_optimizer=True`` (or
    torch.compile's keywords): the optimizer's step compiled once, with tensor lrs (a scheduler
    causes no recompile). ``non_blocking``, ``uint8_to``, ``normalize`` and ``channels_last``
    are ``loopkit.to_device``'s, applied to each batch ``iterate``/``s.to_device`` moves.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        precision: PrecisionLike = "fp32",
        accumulate: int = 1,
        clip_grad_norm: float | None = None,
        scheduler: Any = None,
        device: DeviceLike | None = None,
        log: _detach.detach_logging | int | None = None,
        non_blocking: bool | None = None,
        uint8_to: torch.dtype | None = None,
        normalize: tuple[Sequence[float], Sequence[float]] | None = None,
        channels_last: bool = False,
        skip_nonfinite: bool = False,
        max_consecutive_skips: int | None = None,
        doctor: _doctor.doctor | None = None,
        frozen: Sequence[nn.Module] = (),
        micro_batch: int | None = None,
        ema: _average.ema | Sequence[_average.ema] | None = None,
        compile_optimizer: CompileLike = False,
        measure_grad_norm: bool = False,
    ) -> None:
        # Everything is checked before anything is built or bound.
        chunks = _check_arguments(model, accumulate, micro_batch, doctor)
        self._frozen = Frozen(frozen, optimizer)
        self.device: torch.device = _target_device(model, device)
        self.amp = autocast_step(precision, device_type=self.device.type)
        self.log: _detach.detach_logging | None = _make_log(log)
        self.chunks = chunks  # micro_batch=: the chunk size now
        chunks.watch(unwrap(model), frozen)
        self.seen = _feed.Seen()
        """Samples, tokens and epochs ``iterate`` handed out: the log's other x-axes."""
        self._mover = Mover(self.device, non_blocking, uint8_to, normalize, channels_last)
        self.accumulator = _accumulate.accumulate(
            model, optimizer, accumulate, scheduler=scheduler, clip_grad_norm=clip_grad_norm,
            amp=self.amp if self.amp.precision != "fp32" else None,
            skip_nonfinite=skip_nonfinite, max_consecutive_skips=max_consecutive_skips,
            ema=ema, compile_optimizer=compile_optimizer, measure_grad_norm=measure_grad_norm,
        )  # fmt: skip
        """The ``loopkit.accumulate`` this step drives (windows, update, counters)."""
        self.doctor = doctor
        if doctor is not None:
            doctor.attach(model, optimizer, precision=self.amp.precision, device=self.device)
        self.model, self.optimizer = model, optimizer
        if self.log is not None and self.log.clock is None:
            self.log.clock = self  # its sinks plot against this step's updates
        self._autocast_on = self.amp.precision != "fp32"
        self._in_autocast = False
        self._loss: torch.Tensor | None = None
        self._loss_kind: Any = None  # accumulate's loss_kind of the micro-step's losses
        self._extra: dict[str, Any] | None = None  # log_metrics's, made on its first call
        self._weight: Weight | None = None  # the micro-step's weight= (its log record's)

    # -- the micro-step: the composition order, one line per middleware ----------------------

    def _enter(self) -> step:
        doc = self.doctor
        # 1. doctor: the step's clock starts (the batch was moved by `iterate`/`to_device`).
        if doc is not None:
            doc.__enter__()
        # 2. accumulate: the micro-step opens (a window's first clears the gradients); a
        #    non-final one enters no_sync before the forward, where DDP decides to all-reduce.
        try:
            if self.chunks.share is not None or self.chunks.by_member:  # else nothing to check
                self.chunks.check_entry()  # a GAN member with micro_batch= needs step.split
            # Its own _enter/_backward/_exit: this step's entry points already ran eagerly
            # (_tracing), so the accumulator's (and autocast_step's) need not ask again.
            self.accumulator._enter()
        except BaseException as err:
            if doc is not None:  # nothing of this micro-step stays entered
                doc.__exit__(type(err), err, err.__traceback__)
            raise
        # 3. frozen modules: no gradient, no all-reduce, until the micro-step ends.
        if self._frozen.params:
            self._frozen.freeze()
        # 4. autocast_step: the forward runs under autocast (not entered for fp32).
        if self._autocast_on:
            self.amp._enter()
            self._in_autocast = True
        return self

    def backward(self, loss: torch.Tensor, weight: Weight | None = None, **autograd: Any) -> None:
        """Leave autocast and back-propagate ``loss`` for this micro-step (see accumulate);
        several calls add up, ``inputs=``/``retain_graph=`` go to autograd."""
        if torch.compiler.is_dynamo_compiling():  # run eagerly: _tracing
            return eagerly(self._backward, loss, weight, **autograd)
        return self._backward(loss, weight, **autograd)

    def _backward(self, loss: torch.Tensor, weight: Weight | None, **autograd: Any) -> None:
        acc = self.accumulator
        if not acc._inside:
            _refuse_outside()
        # 5. autocast ends before backward, as torch recommends (backward ops take the
        #    dtypes the forward chose); accumulate scales the loss for the window and fp16.
        if self._in_autocast:
            self._in_autocast = False
            self.amp._exit(None, None, None)
        self._weight = self._weight if acc._did_backward else weight  # its record's
        if self.chunks.share is not None:  # a chunk's share of its batch
            weight = _feed.chunk_weight(self, weight)
        acc._backward(loss, weight, **autograd)
        if self.log is not None:  # the record's loss, its kind told if every backward's was
            detached = self.log._keep(loss, kind := acc._weighting.loss_kind)  # (None: checked)
            if self._loss is None:
                self._loss, self._loss_kind = detached, kind
            else:
                self._loss = self._loss + detached
                self._loss_kind = kind if kind is self._loss_kind else None

    def log_metrics(self, **metrics: torch.Tensor | float) -> None:
        """Add metrics to this micro-step's log record (needs ``log=``); ``loss=`` takes the
        place of the loss the step records from its backward (a data loss beside a total)."""
        if self.log is None:
            raise RuntimeError("this step has no log: build it with log=N or log=detach_logging()")
        self._extra = _recording.added(self._extra, metrics)  # (refused here, not at exit)

    def _exit(self, exc_type: type[BaseException] | None, exc: BaseException | None,
              tb: TracebackType | None) -> bool:  # fmt: skip
        doc = self.doctor
        # The record is taken out first: whatever fails, none of it is logged by the next.
        loss, extra, weight, kind = self._loss, self._extra, self._weight, self._loss_kind
        self._loss, self._extra, self._weight = None, None, None
        try:
            try:
                # 6. autocast_step exits if backward did not already leave it.
                if self._in_autocast:
                    self._in_autocast = False
                    self.amp._exit(exc_type, exc, tb)
            finally:
                # 7. frozen modules get their requires_grad and gradient sync back.
                try:
                    if self._frozen.params:
                        self._frozen.thaw()
                finally:
                    # 8. accumulate closes the micro-step; on a window's last, the update.
                    if doc is None:
                        self.accumulator._exit(exc_type, exc, tb)
                    else:
                        with _phase(doc, "optimizer" if self.accumulator.ends_window else None):
                            self.accumulator._exit(exc_type, exc, tb)
            # 9. detach_logging records the detached loss and metrics (never of a failure).
            if self.log is not None and exc_type is None:
                _record(self, self.log, loss, extra, weight, kind)
        finally:
            # 10. doctor: the step's clock stops.
            if doc is not None:
                doc.__exit__(exc_type, exc, tb)
        # 11. out of memory in a chunk: redo, halved.
        return exc is not None and _micro_batch.recovered(self, exc)

    # -- data ---------------------------------------------------------------------------------

    def to_device(self, batch: T) -> T:
        """Move a batch to the step's device with its transfer options."""
        return self._mover.move(batch)

    def iterate(
        self, iterable: Iterable[T], *, progress: bool | str = False,
        tokens: Callable[[T], int] | None = None,
    ) -> Iterator[T]:  # fmt: skip
        """Yield the batches moved to the device; the last closes its window on exit. It
        looks one batch ahead (the next copy starts while this one computes) and counts
        each batch handed out (``step.seen``; ``tokens=`` a host-side count per batch).
        ``progress=True`` (or ``"plain"``) shows updates of the total, the epoch, samples/s
        or tokens/s, an ETA and the last flushed metrics on rank zero, with no host sync."""
        return _feed.iterate(self, iterable, progress, tokens)

    def split(self, batch: T) -> Iterator[T]:
        """A ``loopkit.steps`` member's chunks of ``batch`` (micro_batch= beside frozen=)."""
        return _micro_batch.split(self, batch)

    def flush(self) -> bool:
        """Close a partial window (after a loop that did not use ``iterate``) and the log."""
        stepped = self.accumulator.flush()
        if self.log is not None:
            self.log.flush()
        return stepped

    # -- what a user reads ----------------------------------------------------------------

    @property
    def updates(self) -> int:
        """Optimizer updates done."""
        return self.accumulator.updates

    @property
    def updated(self) -> bool:
        """Whether the last micro-step, ``flush()`` or loop control (closing a window whose
        last micro-step raised) made an update (Accelerate's ``sync_gradients``: False inside
        ``with``, mid-window, on an inf/nan skip; no sync)."""
        return self.accumulator.updated

    @property
    def skipped(self) -> int:
        """Windows ended with no update: inf/nan, or dropped by the loop (see accumulate's)."""
        return self.accumulator.skipped

    @property
    def grad_norm(self) -> torch.Tensor | None:
        """The last update's total gradient norm before clipping (see accumulate.grad_norm)."""
        return self.accumulator.grad_norm

    @property
    def ends_window(self) -> bool:
        """Whether this micro-step ends an accumulation window (an update follows)."""
        return self.accumulator.ends_window

    @property
    def micro_step(self) -> int:
        """Micro-steps entered in the current window (0 between windows)."""
        return self.accumulator.micro_step

    accumulate = property(_deprecated_accumulate, doc="Deprecated name of step.accumulator.")

    def state_dict(self) -> dict[str, Any]:
        """Counters, what was seen, the chunk size and the GradScaler, between windows."""
        return {"accumulate": self.accumulator.state_dict(), "amp": self.amp.state_dict(),
                "seen": self.seen.state_dict(), "micro_batch": self.chunks.size}  # fmt: skip

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what ``state_dict`` returned (a chunk size halved by then is kept)."""
        self.accumulator.load_state_dict(state["accumulate"])
        self.amp.load_state_dict(state["amp"])
        _feed.restore(self, state)  # what was seen, the chunk size

    def __repr__(self) -> str:
        said = f"accumulate={self.accumulator.every}, device={str(self.device)!r}"
        return f"loopkit.step(precision={self.amp.precision!r}, {said})"


def _record(
    step: step, log: _detach.detach_logging, loss: torch.Tensor | None,
    extra: dict[str, Any] | None, weight: Weight | None, kind: Any,
) -> None:  # fmt: skip
    """A micro-step's log record: its loss (detached in backward) and ``log_metrics``."""
    doc = step.doctor
    if extra is None and loss is not None and doc is None and step.chunks.share is None:
        log._record_one("loss", loss, kind)  # the usual micro-step: its loss alone, the short path
        return
    if extra is None:
        extra = {} if loss is None else {"loss": loss}
    elif loss is not None:
        extra.setdefault("loss", loss)  # the user's own log_metrics(loss=) is what they log
    if step.chunks.share is None and doc is None:
        if extra:  # the usual micro-step, every one: nothing else to do
            log.record(extra)
        return
    # A chunk of a batch (micro_batch=) adds to its batch's record, logged once the batch
    # is done: the log counts and averages whole batches.
    record = step.chunks.batch_record(extra, log._how, weight)
    if record:
        with _phase(doc, "logging"):
            log.record(record)


_NOTHING = contextlib.nullcontext()  # reusable: no allocation per micro-step


def _phase(doc: _doctor.doctor | None, name: str | None) -> contextlib.AbstractContextManager[Any]:
    """The doctor's phase ``name``, or nothing (no doctor, or no phase to name)."""
    if doc is None or name is None:
        return _NOTHING
    return doc.phase(name)


def _target_device(model: nn.Module, device: DeviceLike | None) -> torch.device:
    """The device a step moves batches to: ``device=``, which must be the model's, or the
    model's own (the CPU for a model with no tensors)."""
    here = model_device(unwrap(model))
    target = here if device is None else resolve_device(device)
    if here is not None and target is not None and not same_device(here, target):
        raise ValueError(
            f"the model is on {here} but device={str(target)!r}: move the model "
            f"first (model.to({str(target)!r})), then build the step"
        )
    return target if target is not None else torch.device("cpu")


def _make_log(log: _detach.detach_logging | int | None) -> _detach.detach_logging | None:
    if log is None or isinstance(log, _detach.detach_logging):
        return log
    if not is_int_at_least(log, 1):
        raise ValueError(
            f"log must be a loopkit.detach_logging, an int >= 1 (print every that many "
            f"micro-steps) or None, got {log!r}"
        )
    return _detach.detach_logging(every=log)  # prints: print_sink is the default
