"""How a detach_logging call's values are kept: the short path a step's loss takes each
micro-step, the checked path every other call takes, the flush a call makes, and taking a
call back (a failed flush leaves the log as if the call was never made)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, cast

import torch

from . import _log_state
from ._reductions import NUMBER, Kind, Value

# Each function takes the detach_logging as ``self`` (typed Any: _detach imports this module).
detach_logging = Any


def keep(loss: torch.Tensor, known: Kind | None) -> torch.Tensor:
    """What a record keeps of a step's ``loss`` (taken in backward, while the graph is
    alive): its value without the graph. A loss of a ``known`` kind is a plain tensor (the
    step's backward checked it), and ``.data`` gives what ``detach()`` does without a
    dispatched op: the cheapest capture of a micro-step's loss, a microsecond less in a loop."""
    return loss.data if known is not None else loss.detach()


def record_one(self: detach_logging, name: str, v: torch.Tensor, known: Kind | None = None) -> None:
    """``record({name: v})`` for one detached value (a step's loss, each micro-step): the
    call every micro-step makes, in a few lines; anything else goes through ``record``.

    ``known``: the kind the caller already found ``v`` to be (a 0-d floating tensor of that
    dtype and device; a step's backward reads its loss before autograd runs). Once a value of
    that kind passed the checks here, the metric's kind *is* that object, and a value vouched
    for by it is appended without reading the tensor again: touching a tensor the loop left
    cold costs more than the rest of the call."""
    kinds = self._kinds
    kind = kinds.get(name, NUMBER)  # NUMBER's dtype (None) is no tensor's either
    if kind is not known or self._restored:
        if (
            v.dtype is not kind[0]
            or self._restored
            or v.ndim
            or (not v.is_cpu if kind[2] else v.device != kind[1])
        ):
            self.record({name: v})
            if known is not None and kinds.get(name) == known:
                kinds[name] = known  # the same kind, as the object a caller vouches with
            return
        if known is not None:
            kinds[name] = known  # equal to the kind checked (the caller read v alike)
    kept = self._values.get(name)
    if kept is None:
        self._values[name] = [v]
    else:
        kept.append(v)
    self.step += 1
    since = self._calls_since_flush = self._calls_since_flush + 1
    if since >= self._flush_at:
        flush_call(self, (name,), {}, set())


def record_checked(
    self: detach_logging, metrics: Mapping[str, torch.Tensor | float], flushes: bool
) -> None:
    """``record`` with every value checked (and restored values moved to its device)."""
    if not metrics:
        raise TypeError("log() got no metrics: call it as log(loss=loss, ...)")
    # Values a resume restored on the CPU follow the metric to its device now.
    moved = _log_state.adopted(self._values, self._restored, metrics)
    checked = [
        (name, _checked(name, v, moved.get(name, self._values.get(name))))
        for name, v in metrics.items()
    ]
    # Stored only once every value is known good, so a bad call records nothing.
    before = {name: self._values[name] for name in moved}
    unmarked = self._restored.intersection(metrics)
    self._values.update(moved)
    self._restored -= unmarked
    for name, value in checked:
        self._values.setdefault(name, []).append(value)
    dtypes = {value.dtype for _, value in checked if isinstance(value, torch.Tensor)}
    if self._dtypes is not None:
        self._dtypes |= dtypes
    self.step += 1
    self._calls_since_flush += 1
    if flushes:
        flush_call(self, [name for name, _ in checked], before, unmarked)
    kinds, kept = self._kinds, self._dtypes
    for name, value in checked:
        old = kinds.get(name)
        if kept is not None and old is not None and old[0] is not None:
            kept.add(old[0])  # values of the kind replaced may still be kept
        if isinstance(value, torch.Tensor):
            kinds[name] = (value.dtype, value.device, value.device.type == "cpu")
        else:
            kinds[name] = NUMBER


def flush_call(
    self: detach_logging,
    names: Iterable[str],
    before: Mapping[str, list[Value]],
    unmarked: set[str],
) -> None:
    """The flush of the call that just recorded ``names``; if it fails, that call is taken
    back (``before``: the values it replaced, ``unmarked``: metrics it took off
    ``_restored``), as if never made."""
    try:
        reduced = self._reduce(self._values, self._across_ranks())
    except BaseException:
        # The flush failed before it changed anything (a collective that timed out, ranks
        # configured differently): take this call's values back out, as if never made.
        take_back(self._values, names)
        self._values.update(before)
        self._restored |= unmarked
        self.step -= 1
        self._calls_since_flush -= 1
        raise
    self._deliver(reduced)


def take_back(values: dict[str, list[Value]], names: Iterable[str]) -> None:
    """Remove the last value of each of ``names`` (a call taken back), and emptied lists."""
    for name in names:
        kept = values[name]
        kept.pop()
        if not kept:
            del values[name]


def check_value(name: object, v: object) -> None:
    """Refuse what no log takes, whatever it logged before: a name not a str, a tensor of
    more than one value or a complex one, an int too large for a float, anything but a tensor
    or a real number (each message says how to log it)."""
    if not isinstance(name, str):
        raise TypeError(
            f"metric names must be str, got {type(name).__name__}: {name!r}; log(loss=loss) or "
            "record({'loss': loss})"
        )
    if isinstance(v, torch.Tensor):
        if v.numel() != 1:
            raise ValueError(
                f"metric {name!r} has shape {tuple(v.shape)}: log scalars, e.g. "
                f"log({name}=value.mean())"
            )
        if v.is_complex():
            raise ValueError(f"metric {name!r} is complex: log its .abs() or .real")
        return
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        try:
            float(v)
        except OverflowError:
            raise ValueError(
                f"metric {name!r} is an int of {len(str(abs(int(v))))} digits, too large for a "
                "float: log it scaled down"
            ) from None
        return
    raise TypeError(f"metric {name!r} must be a scalar tensor or a number, got {type(v).__name__}")


def added(record: dict[str, Any] | None, metrics: Mapping[str, object]) -> dict[str, Any]:
    """``record`` (None: a new one) with ``metrics`` added, each checked by ``check_value``
    first: a step's ``log_metrics``, refused before its micro-step's update, not after."""
    for name, value in metrics.items():
        check_value(name, value)
    if record is None:
        return dict(metrics)
    record.update(metrics)
    return record


def check_alike(name: str, v: torch.Tensor | float, before: Value) -> None:
    """Refuse a metric's value logged another way than ``before`` (a tensor where it was a
    number, or the reverse; a tensor on another device)."""
    if isinstance(v, torch.Tensor):
        if not isinstance(before, torch.Tensor):
            raise TypeError(
                f"metric {name!r} was a Python number before and is a tensor now: log it "
                "the same way every call"
            )
        if before.device != v.device:
            raise ValueError(
                f"metric {name!r} was on {before.device} before and is on {v.device} "
                f"now: log it from the same device every call (or .to() it first)"
            )
    elif isinstance(before, torch.Tensor):
        raise TypeError(
            f"metric {name!r} was a tensor before and is a Python number now: log it "
            "the same way every call"
        )


def _checked(name: object, v: object, previous: list[Value] | None) -> Value:
    check_value(name, v)
    if previous:
        check_alike(cast(str, name), cast("torch.Tensor | float", v), previous[0])
    if isinstance(v, torch.Tensor):
        # Stored 0-d, so the flush stacks them without reshaping each one.
        return v.detach() if v.dim() == 0 else v.detach().reshape(())
    return float(cast(float, v))
