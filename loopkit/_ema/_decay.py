"""The EMA's decay at each of its updates: pure functions, tested without a model."""

from __future__ import annotations

import math

from .._checks import is_int_at_least


def check_settings(
    decay: object, every: object, warmup: object, gamma: object, power: object
) -> None:
    """Refuse settings that cannot make an average, saying which and why."""
    if not _real(decay) or not 0.0 <= float(decay) < 1.0:  # type: ignore[arg-type]
        raise ValueError(
            f"decay must be a number in [0, 1) (the weight kept per update: 0.999, 0.9999), "
            f"got {decay!r}"
        )
    if not is_int_at_least(every, 1):
        raise ValueError(
            f"every must be an int >= 1 (optimizer updates per EMA update), got {every!r}"
        )
    if not isinstance(warmup, bool):
        raise TypeError(f"warmup must be True or False, got {warmup!r}")
    for name, value in (("warmup_gamma", gamma), ("warmup_power", power)):
        if not _real(value) or float(value) <= 0:  # type: ignore[arg-type]
            raise ValueError(f"{name} must be a positive number, got {value!r}")


def _real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def decay_at(update: int, decay: float, warmup: bool, gamma: float, power: float) -> float:
    """The decay of the EMA's ``update``-th update (1-based), as timm's ModelEmaV3.

    Without warm-up it is ``decay``; with it, the first update copies the weights (decay 0)
    and the k-th (k >= 2) decays by ``min(decay, 1 - (1 + (k - 1) / gamma) ** -power)``, so an
    early average is not dominated by the random initialization.
    """
    if not warmup:
        return decay
    k = update - 1
    if k <= 0:
        return 0.0
    return min(decay, 1.0 - float((1.0 + k / gamma) ** -power))
