"""Gradient sync for one accumulate's micro-steps: which run under ``no_sync``, and why.

A window's non-final micro-steps run under ``no_sync``, entered before the forward (DDP
decides at the forward whether the backward all-reduces). Once a DDP micro-step has made
a second backward, DDP would reduce at each synced forward's backward and leave a second
backward from one forward local: from then on the window-ending micro-steps run under
``no_sync`` too and the window is reduced by hand, once, at its end (the window in which
it was first seen is reduced by hand as well, whatever DDP reduced of it).
"""

from __future__ import annotations

from types import TracebackType

from torch import nn

from .._parallel._grad_sync import no_sync, unwrap
from .._types import SyncKind
from ._window import Window


class MicroStepSync:
    """Whether the open micro-step runs under ``no_sync``, for one model and its sync kind."""

    __slots__ = ("_no_sync", "entered", "kind", "model", "reduce_by_hand")

    def __init__(self, model: nn.Module, kind: SyncKind) -> None:
        self.model, self.kind = model, kind
        self._no_sync: no_sync | None = None if kind == "none" else no_sync(model)
        self.entered = False  # the open micro-step runs under no_sync
        self.reduce_by_hand = False  # DDP micro-steps make several backward passes

    def enter(self, ending: bool) -> None:
        """Before the micro-step's forward: turn sync off unless it ends the window."""
        if (not ending or self.reduce_by_hand) and self._no_sync is not None:
            self._no_sync.__enter__()
            self.entered = True

    def exit(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """After the micro-step: put the model's sync setting back."""
        if self.entered and self._no_sync is not None:
            self.entered = False
            self._no_sync.__exit__(exc_type, exc, tb)

    def refuse_synced_forward(self) -> None:
        """Raise if a DDP model's forward ran with sync on although this micro-step has it off.

        DDP would then all-reduce the backward: the forward ran outside the micro-step.
        """
        if not (self.entered and self.kind == "ddp"):
            return
        if getattr(unwrap(self.model), "require_forward_param_sync", False):
            raise RuntimeError(
                "this DDP model's forward ran with gradient sync on, outside this micro-step "
                "(which runs under no_sync), so DDP would all-reduce this backward: run the "
                "forward inside `with step:`, or loop over loopkit.steps(...).iterate(loader), "
                "which turns sync off for the whole iteration"
            )

    def refuse_unreduced_end(self, window: Window) -> None:
        """Raise if an FSDP window ends on a micro-step without sync (it cannot reduce later).

        Nothing has changed then: the window stays open and its next micro-step with
        backward (which syncs, since the window is due) closes it.
        """
        if window.n_backward and not window.last_synced and self.kind not in ("none", "ddp"):
            raise RuntimeError(
                f"the window ended on a micro-step that ran without gradient sync under "
                f"{self.kind.upper()}, which cannot reduce its gradients afterwards; the "
                "window is kept open (nothing was changed) and its next micro-step with "
                "backward closes it. Use `for batch in acc.iterate(loader)` so the last "
                "micro-batch of the data syncs"
            )

    def another_backward(self, synced: bool) -> bool:
        """A micro-step made a further backward; whether the window is still reduced by DDP.

        DDP prepares one reduction at each forward with sync on, and reduces the next
        backward only: a further backward from the same forward (``retain_graph=True``, two
        losses on one output) stays local, one after a new forward is reduced. Which it was
        cannot be seen from here, so a synced DDP micro-step's further backward sends the
        window to the by-hand reduction at its end (the part DDP averaged already is equal on
        every rank: averaging it again changes it by rounding at most). Every rank must make
        the same backward calls, as DDP requires anyway, so every rank takes that path. From
        then on every DDP micro-step runs under no_sync and its window is reduced once, by
        hand.
        """
        if self.kind != "ddp":
            return synced
        self.reduce_by_hand = True
        return False
