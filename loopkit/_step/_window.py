"""One accumulation window's state: what its micro-steps have done so far, and what
becomes of a window its loop left open (a pass's end, an overdue window, FSDP's unreduced).

A window that closes (or is dropped) is replaced by a new instance: a reset is one
assignment, so no field can be forgotten.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from .._errors import OpenWindowWarning


class Window:
    """What one accumulation window has seen."""

    __slots__ = (
        "cleared_foreign",
        "failed",
        "last_synced",
        "loss_finite",
        "micro",
        "n_backward",
        "overdue",
        "weight_min",
        "weight_sum",
        "weighted",
    )

    def __init__(self) -> None:
        self.micro = 0  # micro-steps entered
        self.n_backward = 0  # of which called backward
        self.weighted: bool | None = None  # whether its micro-steps pass weight=
        self.weight_sum: Any = 0  # float or device tensor
        self.weight_min: torch.Tensor | None = None  # for weights that live on a device
        self.loss_finite: torch.Tensor | None = None  # device flag, when losses are watched
        self.last_synced = True  # whether the last backward ran with gradient sync
        self.cleared_foreign = False  # gradients from elsewhere were cleared when it opened
        self.failed = 0  # micro-steps that ended in an exception (a skipped bad batch)
        self.overdue = False
        """Its last micro-step was to end it and raised: loop control asked before the next
        micro-step (``settle``), or ``flush``, closes it at its place, so the windows after a
        skipped bad batch stay where they were; the next micro-step opening first clears it
        (the window goes on under its own rules, as a hand loop's with ``continue``)."""

    def add_backward(
        self, weight: Any, weighted: bool, finite: torch.Tensor | None, synced: bool
    ) -> None:
        """Record a micro-step's backward (after it succeeded)."""
        if finite is not None:
            prior = self.loss_finite
            self.loss_finite = finite if prior is None else prior & finite
        self.weighted = weighted
        self.weight_sum = weight if self.n_backward == 0 else self.weight_sum + weight
        if isinstance(weight, torch.Tensor):
            low = self.weight_min
            self.weight_min = weight if low is None else torch.minimum(low, weight)
        self.n_backward += 1
        self.last_synced = synced

    def add_more(self, finite: torch.Tensor | None, synced: bool) -> None:
        """Record a further backward of the micro-step already counted."""
        if finite is not None:
            prior = self.loss_finite
            self.loss_finite = finite if prior is None else prior & finite
        self.last_synced = synced

    def foreign(self, has_grads: bool) -> bool:
        """Whether a window with no backward of its own had its parameters trained by another
        backward: gradients there now, or cleared as it opened (unless every micro-step of it
        failed: then nothing of it ran, and those gradients were the code before's)."""
        cleared = self.cleared_foreign and self.failed < self.micro
        return self.n_backward == 0 and (cleared or has_grads)

    def bad_device_weight(self) -> Any:
        """A 0-d bool tensor: whether a device weight was not positive and finite; False if none."""
        low = self.weight_min
        return False if low is None else ~(torch.isfinite(low) & (low > 0))


def unreducible(acc: Any) -> bool:
    """Whether ``acc``'s open window waits for an FSDP backward with sync (its last backward
    ran without one: FSDP cannot reduce its gradients by hand)."""
    window = acc._window
    return acc._kind in ("fsdp1", "fsdp2") and bool(window.n_backward) and not window.last_synced


def close_left_open(acc: Any) -> None:
    """Close the window a pass of ``iterate`` left open as its items end (a length not kept,
    or the pass's last micro-step raised). Not one FSDP cannot reduce: the next pass's first
    micro-step syncs and closes it (``_last_batch.marking``), the one window spanning two,
    which is said (after the last pass it would not be applied)."""
    if not acc._window.micro or acc._inside:
        return
    if not unreducible(acc):
        acc.flush()
        return
    warnings.warn(
        f"the pass ended with its window's last micro-step run without gradient sync (it "
        f"raised before its backward, or the data ended before its length) under "
        f"{acc._kind.upper()}, which cannot reduce that window's gradients by hand: the window "
        "goes on to the next pass's first micro-step, which syncs and closes it; after the "
        "last pass it is not applied (step.flush() refuses it)",
        OpenWindowWarning,
        stacklevel=2,
    )


def going_on(acc: Any, window: Window) -> Window:
    """The window the micro-step entering after overdue ``window`` takes: ``window`` going on
    under its own rules, as a hand loop's does (it ends in this micro-step, counted, or at its
    next batch's mark, chunks), or a new one if the loop dropped its gradients."""
    if _discard_dropped(acc, window):
        new: Window = acc._window
        return new
    window.overdue = False
    return window


def discard_overdue(acc: Any) -> bool:
    """Drop ``acc``'s window if it is overdue and the loop dropped its gradients; whether it did."""
    window = acc._window
    return bool(window.overdue) and _discard_dropped(acc, window)


def _discard_dropped(acc: Any, window: Window) -> bool:
    """End ``window`` (its last micro-step raised) with no update if the loop dropped all its
    gradients since (``optimizer.zero_grad()`` in its handler, or at the top of the next
    iteration: how a hand loop skips a bad batch), counted as a skipped window; whether it
    did. Gradients dropped in part are still refused where the window ends."""
    guard = acc._guard
    if not window.n_backward or unreducible(acc) or not _dropped_all(guard._marks):
        return False
    if acc._params.have_grads():
        return False
    guard.refuse_scheduler_step()  # (a scheduler.step() in the handler is still refused)
    if acc.amp is not None:
        acc.amp.discard(acc.optimizer)
    # A window that ended without an update, as a non-finite one does: loop control sees its
    # end (cadence points stay at their batches) and step.updated says no update.
    progress = acc._progress
    progress.skipped += 1
    progress.last_updated = False
    acc._window = Window()
    guard.window_closed()
    return True


def _dropped_all(marks: tuple[tuple[torch.Tensor, Any, int], ...]) -> bool:
    """Whether the gradients loopkit's last backward left (the guard's ``marks``) were all
    dropped since, set to None by code outside: a skipped batch's, not ones never there."""
    return any(g is not None for _, g, _ in marks) and all(p.grad is None for p, _, _ in marks)
