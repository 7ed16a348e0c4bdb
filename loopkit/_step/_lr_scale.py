"""scale_lr: change the learning rate for a new batch size, live and in the scheduler's base.

A scheduler recomputes the lr from its base lrs (``base_lrs``, the param groups'
``initial_lr``): scaling only ``param_group["lr"]`` is undone at its next step (a LambdaLR
resets it to base x factor). Scaling the base too keeps the new rate for the whole schedule.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch

Rule = Literal["linear", "sqrt"]

# Where schedulers keep rates besides ``base_lrs``: the param groups' keys (OneCycleLR's
# bounds) and the schedulers' own lists (CyclicLR's peaks, ReduceLROnPlateau's floors).
_GROUP_RATES = ("initial_lr", "max_lr", "min_lr")
_SCHEDULER_RATES = ("base_lrs", "max_lrs", "min_lrs")


def lr_factor(from_batch: int, to_batch: int, rule: Rule) -> float:
    """The factor a batch change multiplies the lr by (linear or square-root scaling)."""
    for name, value in (("from_batch", from_batch), ("to_batch", to_batch)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1 (a batch size), got {value!r}")
    if rule not in ("linear", "sqrt"):
        raise ValueError(f"rule must be 'linear' or 'sqrt', got {rule!r}")
    ratio = to_batch / from_batch
    return ratio if rule == "linear" else math.sqrt(ratio)


def _schedulers(scheduler: Any) -> list[Any]:
    """The scheduler and, for SequentialLR/ChainedScheduler, every one inside it."""
    inner = getattr(scheduler, "_schedulers", None)
    if inner is not None:
        return [s for sub in inner for s in _schedulers(sub)]
    return [scheduler]


def scale_lr(
    optimizer: torch.optim.Optimizer,
    scheduler: Any = None,
    *,
    from_batch: int,
    to_batch: int,
    rule: Rule = "linear",
) -> float:
    """Scale the live lr and the scheduler's base lrs by the batch change; return the factor.

    ``rule="linear"`` multiplies by ``to_batch / from_batch`` (SGD's rule), ``"sqrt"`` by
    its square root (often used with Adam). Every rate a scheduler keeps is scaled: its
    ``base_lrs``, OneCycleLR's ``max_lr``/``min_lr``, CyclicLR's ``max_lrs``,
    ReduceLROnPlateau's ``min_lrs``, so the schedule is the one built with the scaled rates.
    Refused, before anything changes: a scheduler bound to another optimizer, or one that
    keeps no rates loopkit knows (no ``base_lrs`` list).
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    factor = lr_factor(from_batch, to_batch, rule)
    subs = [] if scheduler is None else _schedulers(scheduler)
    for sub in subs:
        kinds = [k for k in _SCHEDULER_RATES if isinstance(getattr(sub, k, None), list)]
        if not kinds:
            raise TypeError(
                f"scale_lr cannot scale a {type(sub).__name__}: it keeps no base_lrs, so its "
                "rates are its own. Build it with the scaled rates instead (factor "
                f"{factor!r})"
            )
        if getattr(sub, "optimizer", optimizer) is not optimizer:
            raise ValueError("the scheduler is bound to a different optimizer than the one given")
    # Everything is checked: now change the rates.
    for group in optimizer.param_groups:
        group["lr"] *= factor
        for key in _GROUP_RATES:
            if key in group:
                group[key] *= factor
    for sub in subs:
        for key in _SCHEDULER_RATES:
            rates = getattr(sub, key, None)
            if isinstance(rates, list):
                setattr(sub, key, [lr * factor for lr in rates])
        if hasattr(sub, "_last_lr"):
            sub._last_lr = [g["lr"] for g in optimizer.param_groups]
    return factor
