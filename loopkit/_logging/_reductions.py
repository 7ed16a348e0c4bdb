"""How detach_logging reduces a metric: each rank's statistic, and the merge of the ranks'.

A mean travels between ranks as its count and sum; ``sum``/``max``/``min`` as themselves;
``last`` as the rank's last value, merged as the mean of the ranks' last values. A NaN
among the values always gives NaN, and Python numbers reduce as float64 tensors do.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import TypeAlias

import torch

REDUCTIONS: frozenset[str] = frozenset({"mean", "sum", "max", "min", "last"})

Value: TypeAlias = "torch.Tensor | float"
"""One recorded value (a 0-d tensor or a Python float), or one rank's statistic."""
Values: TypeAlias = "Mapping[str, Sequence[Value]]"
"""The values recorded since the last flush, by metric: all tensors or all floats."""
HowOf: TypeAlias = "Callable[[str], str]"
"""The reduction of a metric, by name."""


def tensors(vals: Sequence[Value]) -> list[torch.Tensor]:
    """A metric's values as tensors (a metric is logged the same way every call)."""
    return [v for v in vals if isinstance(v, torch.Tensor)]


def numbers(vals: Sequence[Value]) -> list[float]:
    """A metric's values as Python floats (a metric is logged the same way every call)."""
    return [v for v in vals if not isinstance(v, torch.Tensor)]


def reduce_local(values: Values, how: HowOf) -> dict[str, float]:
    """Every metric reduced on its device, then read in one transfer per device."""
    out: dict[str, float] = {}
    on_device: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
    for name, vals in values.items():
        h = how(name)
        if isinstance(vals[0], torch.Tensor):
            t = stacked(tensors(vals))
            on_device.setdefault(t.device, []).append((name, reduce_tensor(t, h)))
        else:
            out[name] = merge(h, [(len(vals), partial_floats(numbers(vals), h))])
    for pairs in on_device.values():
        # Host-device sync: the one read per flush (per device holding metrics).
        floats = torch.stack([t for _, t in pairs]).tolist()
        out.update(zip([n for n, _ in pairs], floats, strict=True))
    return {name: out[name] for name in values}


def partials(values: Values, how: HowOf) -> dict[str, tuple[int, Value]]:
    """Per metric, its count and this rank's statistic (a 0-d tensor or a float)."""
    out: dict[str, tuple[int, Value]] = {}
    for name, vals in values.items():
        if isinstance(vals[0], torch.Tensor):
            out[name] = (len(vals), partial_tensor(stacked(tensors(vals)), how(name)))
        else:
            out[name] = (len(vals), partial_floats(numbers(vals), how(name)))
    return out


def wide_dtype(device: torch.device) -> torch.dtype:
    """The dtype reductions run in: float64, except on MPS, which has none."""
    return torch.float32 if device.type == "mps" else torch.float64


def stacked(vals: list[torch.Tensor]) -> torch.Tensor:
    """The 0-d values as one wide 1-D tensor (each converted first if their dtypes differ)."""
    wide = wide_dtype(vals[0].device)
    first = vals[0].dtype
    if all(v.dtype == first for v in vals):
        return torch.stack(vals).to(wide)
    # torch.stack would promote to a common dtype first (int64 with float32 -> float32).
    return torch.stack([v.to(wide) for v in vals])


def reduce_tensor(t: torch.Tensor, how: str) -> torch.Tensor:
    """The final value of one metric on its device (``t`` is already wide)."""
    if how == "mean":
        return t.mean()
    return partial_tensor(t, how)


def partial_tensor(t: torch.Tensor, how: str) -> torch.Tensor:
    """One rank's statistic for a cross-rank merge: a mean travels as its sum."""
    if how in ("mean", "sum"):
        return t.sum()
    if how == "max":
        return t.max()  # torch.max propagates NaN
    if how == "min":
        return t.min()
    return t[-1]


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
