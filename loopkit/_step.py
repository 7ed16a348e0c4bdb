"""loopkit.step: the middlewares composed in one documented order.

Per micro-batch, from the outside in:

1. ``to_device`` moves the batch (``s.to_device(batch)`` or ``step.iterate(loader)``,
   which also moves the next batch while this one computes).
2. ``accumulate`` opens the micro-step (the first of a window clears the optimizer's
   gradients); on a non-final micro-step it enters ``no_sync`` *before* the forward, since
   DDP decides at the forward whether to all-reduce.
3. ``autocast_step`` covers the forward only.
4. ``s.backward(loss)`` leaves autocast, normalizes the loss for the window, scales it
   (fp16) and back-propagates.
5. Leaving ``with`` on the last micro-step of a window: unscale (fp16), normalize, clip,
   optimizer step (skipped on inf/nan), scaler update, scheduler step (only if the
   optimizer stepped), ``zero_grad(set_to_none=True)``.
6. ``detach_logging`` records the detached loss (and ``s.log_metrics(...)``) once per
   micro-step (a micro-step that raises records nothing); it reads the device only when it
   flushes.

Each piece keeps the semantics it has alone; a disabled piece is not entered at all.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from types import TracebackType
from typing import Any, TypeVar

import torch
from torch import nn

from ._accumulate import accumulate as accumulate_
from ._checks import is_int_at_least
from ._devices import model_device, resolve_device, same_device
from ._doctor import doctor as doctor_
from ._grad_sync import unwrap
from ._logging import detach_logging, print_sink
from ._precision import autocast_step
from ._to_device import _Mover
from ._types import DeviceLike, PrecisionLike, Weight

T = TypeVar("T")


class step:
    """One reusable context manager per training loop: ``with step as s: ...; s.backward(loss)``.

    Build it once, before the loop, and enter it once per micro-batch. ``precision``
    (``"bf16"``, ``"fp16"``, ``"fp32"``), ``accumulate=N`` micro-batches per update (with
    ``no_sync`` under DDP and exact normalization), ``clip_grad_norm``, ``scheduler``
    (stepped once per real update), ``device`` for ``s.to_device``/``step.iterate`` and
    ``log`` (a ``detach_logging`` or an int: print every that many micro-steps);
    ``skip_nonfinite``/``max_consecutive_skips`` guard bf16/fp32 updates (see accumulate);
    ``doctor=loopkit.doctor()`` times every phase of every step.
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
        log: detach_logging | int | None = None,
        non_blocking: bool | None = None,
        uint8_to: torch.dtype | None = None,
        normalize: tuple[Sequence[float], Sequence[float]] | None = None,
        channels_last: bool = False,
        skip_nonfinite: bool = False,
        max_consecutive_skips: int | None = None,
        doctor: doctor_ | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        here = model_device(unwrap(model))
        target = here if device is None else resolve_device(device)
        if (
            here is not None
            and target is not None
            and not same_device(here, target)
        ):
            raise ValueError(
                f"the model is on {here} but device={str(target)!r}: move the model "
                f"first (model.to({str(target)!r})), then build the step"
            )
        self.device: torch.device = target if target is not None else torch.device("cpu")
        self.amp = autocast_step(precision, device_type=self.device.type)
        self._autocast_on = self.amp.precision != "fp32"
        self.log: detach_logging | None = _make_log(log)
        self.accumulate = accumulate_(
            model,
            optimizer,
            accumulate,
            scheduler=scheduler,
            clip_grad_norm=clip_grad_norm,
            amp=self.amp if self.amp.precision != "fp32" else None,
            skip_nonfinite=skip_nonfinite,
            max_consecutive_skips=max_consecutive_skips,
        )
        self._mover = _Mover(self.device, non_blocking, uint8_to, normalize, channels_last)
        if doctor is not None and not isinstance(doctor, doctor_):
            raise TypeError(f"doctor must be a loopkit.doctor(), got {type(doctor).__name__}")
        self.doctor = doctor
        if doctor is not None:
            doctor.precision = self.amp.precision
            doctor.device = self.device
            doctor.optimizer = optimizer
            doctor.watch(model)
        self.model = model
        self.optimizer = optimizer
        self._in_autocast = False
        self._loss: torch.Tensor | None = None
        self._extra: dict[str, Any] = {}

    # -- the micro-step -----------------------------------------------------------------------

    def __enter__(self) -> step:
        doc = self.doctor
        if doc is not None:
            doc.__enter__()
        try:
            self.accumulate.__enter__()
        except BaseException as err:
            if doc is not None:  # nothing of this micro-step stays entered
                doc.__exit__(type(err), err, err.__traceback__)
            raise
        if self._autocast_on:
            self.amp.__enter__()
            self._in_autocast = True
        return self

    def backward(self, loss: torch.Tensor, weight: Weight | None = None) -> None:
        """Leave autocast and back-propagate ``loss`` for this micro-step (see accumulate)."""
        if self._in_autocast:
            # Backward runs outside autocast, as torch recommends: its ops take the dtypes
            # the forward chose.
            self._in_autocast = False
            self.amp.__exit__(None, None, None)
        self.accumulate.backward(loss, weight)
        if self.log is not None:
            self._loss = loss.detach()

    def log_metrics(self, **metrics: torch.Tensor | float) -> None:
        """Add metrics to this micro-step's log record (needs ``log=``)."""
        if self.log is None:
            raise RuntimeError("this step has no log: build it with log=N or log=detach_logging()")
        self._extra.update(metrics)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        doc = self.doctor
        # This micro-step's record is taken out first: whatever fails below, nothing of it
        # is left to be logged under the next micro-step.
        loss, extra = self._loss, self._extra
        self._loss, self._extra = None, {}
        try:
            try:
                if self._in_autocast:
                    self._in_autocast = False
                    self.amp.__exit__(exc_type, exc, tb)
            finally:
                if doc is not None and self.accumulate.ends_window:
                    with doc.phase("optimizer"):
                        self.accumulate.__exit__(exc_type, exc, tb)
                else:
                    self.accumulate.__exit__(exc_type, exc, tb)
            log = self.log
            if log is not None and exc_type is None:
                if loss is not None:
                    extra["loss"] = loss
                if extra:
                    if doc is not None:
                        with doc.phase("logging"):
                            log.record(extra)
                    else:
                        log.record(extra)
        finally:
            if doc is not None:
                doc.__exit__(exc_type, exc, tb)

    # -- data ---------------------------------------------------------------------------------

    def to_device(self, batch: T) -> T:
        """Move a batch to the step's device with its transfer options."""
        return self._mover(batch)  # type: ignore[no-any-return]

    def iterate(self, iterable: Iterable[T]) -> Iterator[T]:
        """Yield the batches moved to the device; the last closes its window on exit.

        Looking one batch ahead also starts the next batch's (non-blocking) copy while the
        current one computes.
        """
        doc = self.doctor
        if doc is None:
            return self.accumulate.iterate(self._mover(b) for b in iterable)
        return self.accumulate.iterate(self._timed_moves(doc, doc.iterate(iterable)))

    def _timed_moves(self, doc: doctor_, batches: Iterable[T]) -> Iterator[T]:
        for b in batches:
            with doc.phase("h2d"):
                moved = self._mover(b)
            yield moved

    def flush(self) -> bool:
        """Close a partial window (after a loop that did not use ``iterate``) and the log."""
        stepped = self.accumulate.flush()
        if self.log is not None:
            self.log.flush()
        return stepped

    # -- what a user reads ----------------------------------------------------------------

    @property
    def updates(self) -> int:
        """Optimizer updates done."""
        return self.accumulate.updates

    @property
    def skipped(self) -> int:
        """Updates skipped on inf/nan (fp16)."""
        return self.accumulate.skipped

    @property
    def grad_norm(self) -> torch.Tensor | None:
        """Gradient norm before clipping at the last update (device tensor; needs clipping)."""
        return self.accumulate.grad_norm

    @property
    def ends_window(self) -> bool:
        """Whether this micro-step ends an accumulation window (an update follows)."""
        return self.accumulate.ends_window

    def state_dict(self) -> dict[str, Any]:
        """Counters and the GradScaler state, for a checkpoint taken between windows."""
        return {"accumulate": self.accumulate.state_dict(), "amp": self.amp.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""
        self.accumulate.load_state_dict(state["accumulate"])
        self.amp.load_state_dict(state["amp"])

    def __repr__(self) -> str:
        return (
            f"loopkit.step(precision={self.amp.precision!r}, "
            f"accumulate={self.accumulate.every}, device={str(self.device)!r})"
        )


def _make_log(log: detach_logging | int | None) -> detach_logging | None:
    if log is None or isinstance(log, detach_logging):
        return log
    if not is_int_at_least(log, 1):
        raise ValueError(
            f"log must be a loopkit.detach_logging, an int >= 1 (print every that many "
            f"micro-steps) or None, got {log!r}"
        )
    return detach_logging(every=log, sink=print_sink)
