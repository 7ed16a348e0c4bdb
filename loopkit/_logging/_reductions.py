"""How detach_logging reduces a metric: on one rank, on the host; across ranks, each rank's
statistic and the merge of the ranks'.

One rank reads its values to the host (one transfer per device) and reduces them there: the
reduction is exact where a float64 sum on the device would round, and costs one stack and
one read however many metrics. Across ranks a mean travels as its count and float64 sum;
``sum``/``max``/``min`` as themselves; ``last`` as the rank's last value, merged as the
mean of the ranks' last values. A NaN among the values always gives NaN, and Python numbers
reduce as tensors do.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Iterable, Mapping, Sequence
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


def reduce_local(values: Values, how: HowOf, one_dtype: bool = False) -> dict[str, float]:
    """Every metric reduced on the host: its values read in one transfer per device, then
    reduced as Python numbers are (an exactly rounded sum, NaN-propagating ``max``/``min``),
    so tensors and numbers of any dtype reduce alike and integer counters stay exact.

    ``one_dtype``: the caller knows every tensor has one dtype (else each device's are
    looked at: a pass over every value, the flush's costliest part in a loop)."""
    read: dict[str, Sequence[float]] = {}
    on_device: dict[torch.device, list[str]] = {}
    for name, vals in values.items():
        # A metric's values are all tensors or all floats (checked as they are recorded).
        first = vals[0]
        if isinstance(first, torch.Tensor):
            on_device.setdefault(first.device, []).append(name)
        else:
            read[name] = cast("list[float]", vals)
    for names in on_device.values():
        tensors = cast("list[torch.Tensor]", values[names[0]])
        if len(names) > 1:
            tensors = [t for name in names for t in cast("list[torch.Tensor]", values[name])]
        one = one_dtype or _one_dtype(tensors)
        # Host-device sync: the one read per flush (per device holding metrics).
        flat = torch.stack(tensors).tolist() if one else _read_widened(tensors)
        start = 0
        for name in names:
            end = start + len(values[name])
            read[name] = flat[start:end]
            start = end
    return {name: reduced(how(name), read[name]) for name in values}


def known_one_dtype(
    dtypes: set[torch.dtype] | None, kinds: Mapping[str, Kind], names: Iterable[str]
) -> bool:
    """Whether every tensor kept for ``names`` has one dtype, known without reading one: a
    kept value of a metric has its metric's kind's dtype, or one in ``dtypes`` (what the
    checked path added; None: not known, after a resume)."""
    if dtypes is None:
        return False
    found = set(dtypes)
    for name in names:
        kind = kinds.get(name)
        if kind is None:  # kept by a call whose kinds are set after its flush: not known
            return False
        if kind[0] is not None:  # None: a Python number's kind
            found.add(kind[0])
    return len(found) < 2


def _read_widened(tensors: list[torch.Tensor]) -> list[float]:
    """0-d values of several dtypes read in one transfer: each dtype's stacked and widened
    alone (stacking them together would promote: int64 with bf16 -> bf16), then put back in
    order on the host. Two device ops per dtype, not one per value."""
    groups: dict[torch.dtype, list[int]] = {}
    for i, dtype in enumerate(map(_DTYPE, tensors)):
        groups.setdefault(dtype, []).append(i)
    wide = wide_dtype(tensors[0].device)
    parts = [torch.stack([tensors[i] for i in where]).to(wide) for where in groups.values()]
    read = torch.cat(parts).tolist()  # host-device sync: the flush's one read
    out = [0.0] * len(tensors)
    for i, value in zip((i for where in groups.values() for i in where), read, strict=True):
        out[i] = value
    return out


def reduced(how: str, vals: Sequence[float]) -> float:
    """One rank's reduction of a metric's values read to the host, as a float."""
    if how == "mean":
        return fsum(vals) / len(vals)
    return float(partial_floats(vals, how))


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


def partial_floats(vals: Sequence[float], how: str) -> float:
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


def fsum(vals: Sequence[float]) -> float:
    """An exactly rounded sum; with inf/nan (or overflow), IEEE semantics as in torch."""
    try:
        return math.fsum(vals)
    except (OverflowError, ValueError):  # inf + -inf, or finite values that overflow
        return float(sum(vals))


def _nan_or(pick: Callable[[Sequence[float]], float], vals: Sequence[float]) -> float:
    """``max``/``min`` that return NaN when any value is NaN (Python's depend on position)."""
    return math.nan if any(math.isnan(v) for v in vals) else pick(vals)
