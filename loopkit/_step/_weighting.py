"""How a window's micro-steps are weighted: the checks on ``weight=`` and the loss each scales.

The reference weight is fixed at the first weighted backward (averaged over the ranks, so
every rank scales its losses alike) and kept across windows and in checkpoints; the open
micro-step's weight is reused by its later backward calls. Nothing changes until
``commit`` is called after the backward succeeded.
"""

from __future__ import annotations

from typing import Any

import torch

from .._types import Weight
from ._cross_rank import agreed_reference
from ._normalize import checked_weight, scaled_loss
from ._window import Window


class Weighting:
    """The weighted reference of one accumulate and the weight of its open micro-step."""

    __slots__ = ("every", "group", "micro_weight", "reference", "sharded")

    def __init__(self, every: int, sharded: bool, group: Any) -> None:
        self.every, self.sharded, self.group = every, sharded, group
        self.reference: Any = None  # fixed at the first weighted backward
        self.micro_weight: Any = None  # the weight of the micro-step now open

    def scaled(
        self, loss: torch.Tensor, weight: Weight | None, window: Window, first: bool
    ) -> tuple[Any, Any, Any]:
        """``(loss to back-propagate, this micro-step's weight, reference)``; changes nothing.

        Raises ValueError for ``weight=`` given on some micro-steps of a window and not on
        others, or on a micro-step's later backward.
        """
        weighted = weight is not None
        if first and window.weighted is not None and weighted != window.weighted:
            raise ValueError(
                "pass weight= on every micro-step of a window or on none: this window "
                f"started {'with' if window.weighted else 'without'} weights"
            )
        if not first and weighted:
            raise ValueError(
                "weight= belongs to the micro-step: pass it on the micro-step's first "
                "backward only (the later ones take the same weight)"
            )
        w: Any = 1
        reference = self.reference
        if weight is not None:
            w = checked_weight(weight)
            if reference is None:
                reference = agreed_reference(w, self.every, self.sharded, self.group)
        elif not first and window.weighted:
            w = self.micro_weight
        applies = window.weighted or weighted
        return scaled_loss(loss, self.every, w if applies else None, reference), w, reference

    def commit(self, weight: Any, reference: Any) -> None:
        """A weighted micro-step's first backward succeeded: keep its weight and the reference."""
        self.reference, self.micro_weight = reference, weight

    def state(self) -> Any:
        """The reference, for a checkpoint (a host value)."""
        ref = self.reference
        return ref.detach().cpu() if isinstance(ref, torch.Tensor) else ref
