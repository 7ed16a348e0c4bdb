"""How detach_logging reduces a metric: each rank's statistic, and the merge of the ranks'.

A mean travels between ranks as its count and sum; ``sum``/``max``/``min`` as themselves;
``last`` as the rank's last value, merged as the mean of the ranks' last values. A NaN
among the values always gives NaN, and Python numbers reduce as float64 tensors do.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import TypeAlias, cast

import torch

REDUCTIONS: frozenset[str] = frozenset({"mean", "sum", "max", "min", "last"})

Value: TypeAlias = "torch.Tensor | float"
"""One recorded value (a 0-d tensor or a Python float), or one rank's statistic."""
Values: TypeAlias = "Mapping[str, Sequence[Value]]"
"""The values recorded since the last flush, by metric: all tensors or all floats."""
HowOf: TypeAlias = "Callable[[str], str]"
"""The reduction of a metric, by name."""
Kind: TypeAlias = "tuple[torch.dtype, torch.device, bool] | tuple[None, None, None]"
"""How a metric was last recorded: a 0-d tensor's dtype, device and whether that is the
CPU (the cheapest check), or ``NUMBER``."""
NUMBER: Kind = (None, None, None)
"""The kind of a metric recorded as a Python float (compared by identity)."""


def reduce_local(values: Values, how: HowOf) -> dict[str, float]:
    """Every metric reduced as one rank's ``(count, statistic)`` merged alone (the same
    arithmetic as a cross-rank flush), the statistics read in one transfer per device."""
    stats = partials(values, how)
    read: dict[str, float] = {}
    on_device: dict[torch.device, list[str]] = {}
    for name, (_, stat) in stats.items():
        if isinstance(stat, torch.Tensor):
            on_device.setdefault(stat.device, []).append(name)
        else:
            read[name] = stat
    for names in on_device.values():
        tensors = [cast(torch.Tensor, stats[name][1]) for name in names]
        # Host-device sync: the one read per flush (per device holding metrics).
        floats = [tensors[0].item()] if len(tensors) == 1 else torch.stack(tensors).tolist()
        read.update(zip(names, floats, strict=True))
    # One rank's merge: a mean is its sum over its count; the others are their statistic.
    return {
        name: read[name] / stats[name][0] if how(name) == "mean" else read[name] for name in values
    }


def partials(values: Values, how: HowOf) -> dict[str, tuple[int, Value]]:
    """Per metric, its count and this rank's statistic (a 0-d tensor or a float)."""
    out: dict[str, tuple[int, Value]] = {}
    for name, vals in values.items():
        # A metric's values are all tensors or all floats (checked as they are recorded).
        if isinstance(vals[0], torch.Tensor):
            out[name] = (len(vals), partial_tensor(cast("list[torch.Tensor]", vals), how(name)))
        else:
            out[name] = (len(vals), partial_floats(cast("list[float]", vals), how(name)))
    return out


def wide_dtype(device: torch.device) -> torch.dtype:
    """The dtype reductions run in: float64, except on MPS, which has none."""
    return torch.float32 if device.type == "mps" else torch.float64


def stacked(vals: list[torch.Tensor]) -> torch.Tensor:
    """The 0-d values as one wide 1-D tensor (each converted first if their dtypes differ)."""
    wide = wide_dtype(vals[0].device)
    if _one_dtype(vals):
        return torch.stack(vals).to(wide)
    # torch.stack would promote to a common dtype first (int64 with float32 -> float32).
    return torch.stack([v.to(wide) for v in vals])


def partial_tensor(vals: list[torch.Tensor], how: str) -> torch.Tensor:
    """One rank's statistic of a metric's 0-d values, wide, on their device: a mean travels
    as its sum; ``max``/``min`` propagate NaN. Two device ops for a mean or a sum."""
    if how == "last":
        return vals[-1].to(wide_dtype(vals[0].device))
    if how in ("mean", "sum"):
        if _one_dtype(vals):
            # Widened as it sums (each value converted, then added: the same as widening
            # the stack first, without the widened copy).
            return torch.stack(vals).sum(dtype=wide_dtype(vals[0].device))
        return stacked(vals).sum()
    t = stacked(vals)
    return t.max() if how == "max" else t.min()  # torch.max/min propagate NaN


def _one_dtype(vals: list[torch.Tensor]) -> bool:
    # The dtypes read in C (a map, not a generator: each value's read costs ~5x less).
    return len(set(map(_DTYPE, vals))) == 1


_DTYPE = operator.attrgetter("dtype")


def partial_floats(vals: list[float], how: str) -> float:
    """The same statistic as ``partial_tensor``, with the same NaN behaviour."""
    if how in ("mean", "sum"):
        return fsum(vals)
    if how == "max":
        return _nan_or(max, vals)
    if how == "min":
        return _nan_or(min, vals)
    return vals[-1]


def merge(how: str, logged: list[tuple[float, float]]) -> float:
    """Combine (count, statistic) pairs from the ranks that logged a metric."""
    stats = [s for _, s in logged]
    if how == "mean":
        return fsum(stats) / math.fsum(c for c, _ in logged)
    if how == "sum":
        return fsum(stats)
    if how == "max":
        return _nan_or(max, stats)
    if how == "min":
        return _nan_or(min, stats)
    return fsum(stats) / len(stats)  # last: the mean of each rank's last value


def fsum(vals: list[float]) -> float:
    """An exactly rounded sum; with inf/nan (or overflow), IEEE semantics as in torch."""
    try:
        return math.fsum(vals)
    except (OverflowError, ValueError):  # inf + -inf, or finite values that overflow
        return float(sum(vals))


def _nan_or(pick: Callable[[list[float]], float], vals: list[float]) -> float:
    """``max``/``min`` that return NaN when any value is NaN (Python's depend on position)."""
    return math.nan if any(math.isnan(v) for v in vals) else pick(vals)
