"""Normalization as pure functions: how a micro-step's loss is scaled, and the one factor
the window's boundary multiplies the summed gradients by.

Each micro-step back-propagates ``loss / every`` (or ``loss * weight / w_ref`` with
weights), exactly what a hand-written loop does (unweighted: ``loss`` back-propagated from
the gradient ``1 / every``, which is what ``loss / every`` hands it, with no division to
run); at the boundary, where the window's true size is known, one factor turns the sum into
the large-batch gradient: nothing for a full unweighted window (bit-identical to the hand-
written loop), ``every / k`` for a ragged one of ``k`` micro-steps, ``w_ref /
sum(weights)`` with weights. Under DDP gradients are averaged over ``world`` ranks, so the
weighted factor is ``world * w_ref / sum over ranks``.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .._types import Weight


def scaled_loss(loss: torch.Tensor, every: int, weight: Any = None, w_ref: Any = None) -> Any:
    """The loss a micro-step back-propagates: ``loss / every``, or ``loss * weight / w_ref``."""
    return loss / every if weight is None else loss * (weight / w_ref)


def seed_gradient(dtype: torch.dtype, device: torch.device, every: int) -> torch.Tensor:
    """The gradient a micro-step's unweighted backward starts from: the one ``(loss /
    every).backward()`` reaches ``loss`` with (``DivBackward`` computes ``1 / every`` with
    this same op, in the loss's dtype): the same bits, without the division's graph node."""
    return torch.ones((), dtype=dtype, device=device) / every


def reference_weight(first_weight: Any, every: int) -> Any:
    """The weighted reference: the first weight as if every micro-step had it."""
    return first_weight * every


def boundary_factor(
    n_backward: int, every: int, weighted: bool, weight_total: Any = None, w_ref: Any = None,
    world: int = 1,
) -> Any:  # fmt: skip
    """The factor for the window's summed gradients; None when they need none (a full window)."""
    if not weighted:
        return None if n_backward == every else every / n_backward
    return world * w_ref / weight_total


def by_hand_factor(
    n_plain: float, n_weighted: float, weight_total: float, ref_sum: float, refs: float,
    every: int, world: int,
) -> float | None:  # fmt: skip
    """The factor after a by-hand all-reduce, from the sums over ranks; None: no rank backed.

    ``n_plain``/``n_weighted``: backward calls without/with weights on all ranks;
    ``ref_sum``/``refs``: the weight references of the ``refs`` ranks that have one.
    """
    if n_plain and n_weighted:
        raise ValueError(
            "some ranks passed weight= in this window and others did not: pass weight= on "
            "every micro-step of every rank, or on none"
        )
    if n_weighted:
        return world * (ref_sum / refs) / weight_total
    if n_plain:
        return every * world / n_plain
    return None


def checked_weight(weight: Weight) -> Any:
    """A host weight as a checked float; an accelerator tensor as is (checked at the boundary)."""
    if isinstance(weight, bool) or not isinstance(weight, (int, float, torch.Tensor)):
        raise TypeError(
            f"weight must be a positive number or a scalar tensor (samples or tokens in the "
            f"micro-batch), got {type(weight).__name__}"
        )
    if isinstance(weight, torch.Tensor):
        if weight.numel() != 1:
            raise ValueError(f"weight must be a scalar, got shape {tuple(weight.shape)}")
        if weight.device.type != "cpu":
            # Reading it here would stall the host every micro-step; it is checked once per
            # window instead.
            return weight.detach().reshape(()).float()
        weight = weight.item()  # host memory: no device sync
    value = float(weight)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(
            f"weight must be positive and finite, got {value}: pass the number of samples "
            "or tokens in this micro-batch"
        )
    return value


BAD_WEIGHT = (
    "a weight of this window was not positive and finite: weights must be positive and "
    "finite (the update was not made and the window's gradients were dropped)"
)
