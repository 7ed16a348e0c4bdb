"""detach_logging: record metrics on the device every step, read them once per interval.

The sinks are in ``_sinks``, the reductions in ``_reductions`` and the cross-rank
flush in ``_exchange``.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import Any, TypeVar, cast, overload

import torch

from .. import _ranks
from .._checks import is_int_at_least
from .._types import Reduction, Sink
from . import _log_state
from ._delivery import Delivery, as_sinks
from ._exchange import reduce_across_ranks
from ._recording import flush_call, keep, record_checked, record_one, take_back
from ._reductions import NUMBER, REDUCTIONS, Kind, Value, known_one_dtype, reduce_local
from ._sinks import print_sink

F = TypeVar("F", bound=Callable[..., Any])

_NO_KINDS: Mapping[str, Kind] = {}  # while restored values wait to move: every call checked


class detach_logging(_log_state.LogState):
    """Record metrics detached and on their device; reduce and read them once per ``every``.

    ``every``: flush interval, in log calls (None: only on ``flush()`` and leaving ``with``).
    ``sink``: a callable or a list of them (one that raises is reported once and the others
    still get the metrics). ``clock``: a loopkit step (or ``steps``/``accumulate``) whose
    update count is the sinks' ``step=``, the x-axis trackers plot against; a step's
    ``log=`` sets it to that step. Without one, ``step=`` counts the log calls.

    ``log(loss=loss, acc=acc)`` keeps each value as a detached tensor on its device: no
    host-device sync, no autograd graph kept alive, no copy (a tensor changed in place after
    it was logged is read as changed: log a clone of one you go on to change). Every
    ``every`` calls (and on ``flush()`` or leaving ``with log:``) each metric is reduced
    (``mean`` by default; ``reduce="max"`` or ``reduce={"acc": "max"}`` picks ``sum``/
    ``max``/``min``/``last``) and ``sink`` gets one dict of Python floats: the values are
    read from the device in a single transfer and reduced on the host, sums exactly rounded
    (``math.fsum``, so integer and float64 counters stay exact on any device while each value
    fits a float64), and a NaN among the values always comes out as NaN, for tensors and
    Python numbers alike.
    ``@log`` on a function returning a scalar tensor or a dict of them records its result
    and returns it unchanged.

    Under DDP, by default (``sync_ranks=None``) each rank reduces its own values with no
    collective, so logging on rank zero only is safe, and only rank zero calls the sink;
    ``sync_ranks=False`` calls the sink on every rank. ``sync_ranks=True`` reduces across
    ranks, in one all-gather per flush of each rank's statistics (summed in float64 on its
    device, merged exactly): means are over every value of every rank, ``sum``/
    ``max``/``min`` over all ranks, ``last`` the mean of the ranks' last values, and a
    metric logged on some ranks only is reduced over the ranks that logged it. Then the
    flush is a collective: every rank must flush together (the same number of ``log``
    calls between flushes, and ``flush()`` called on every rank), whatever it logged;
    leaving ``with log:`` on an exception then skips the flush rather than risk a hang.
    In a single process ``sync_ranks=True`` reduces locally, so the script runs unchanged.

    A checkpoint holds the log (a step's own log with ``Checkpointer(step=)``, any other
    under ``extra=``): its count, its place in the flush interval, the values recorded since
    the last flush and its trackers' runs, so a resumed run flushes as if never stopped.
    """

    def __init__(
        self,
        every: int | None = 1,
        sink: Sink | Callable[..., object] | Sequence[Callable[..., object]] | None = print_sink,
        *,
        reduce: Reduction | Mapping[str, Reduction] = "mean",
        sync_ranks: bool | None = None,
        clock: Any = None,
    ) -> None:
        _check_every(every)
        sinks = as_sinks(sink)
        if clock is not None and not isinstance(getattr(clock, "updates", None), int):
            raise TypeError(
                f"clock must be a loopkit.step, steps or accumulate (its updates are the "
                f"x-axis), got {type(clock).__name__}"
            )
        self._default: str
        self._per_metric: dict[str, str]
        if isinstance(reduce, str):
            self._default, self._per_metric = reduce, {}
        elif isinstance(reduce, Mapping):
            self._default, self._per_metric = "mean", dict(reduce)
        else:
            raise TypeError(
                f"reduce must be a reduction name or a dict metric -> name, got {reduce!r}"
            )
        for name in (self._default, *self._per_metric.values()):
            if name not in REDUCTIONS:
                raise ValueError(f"unknown reduction {name!r}: use one of {sorted(REDUCTIONS)}")
        if sync_ranks is not None and not isinstance(sync_ranks, bool):
            raise TypeError(f"sync_ranks must be None, True or False, got {sync_ranks!r}")
        self._every = every
        self._flush_at = math.inf if every is None else every  # what a record compares with
        self.sink = sink
        self.sync_ranks = sync_ranks
        self.clock = clock
        self._delivery = Delivery(sinks)
        self._values: dict[str, list[Value]] = {}
        self._calls_since_flush = 0
        self._restored: set[str] = set()  # metrics whose values a resume put on the CPU
        self._kinds: dict[str, Kind] = {}  # how each metric was last logged: what record appends
        # With the kinds of the metrics kept, the dtypes of every tensor kept since the last
        # flush (or more; None: unknown, after a resume): one dtype spares the flush a pass over
        # every value to find out. The checked path adds what the kinds do not say.
        self._dtypes: set[torch.dtype] | None = set()
        self.step = 0
        """Number of ``log(...)`` calls so far."""
        self.last: dict[str, float] = {}
        """The values of the most recent flush."""

    @property
    def every(self) -> int | None:
        """The flush interval, in log calls (None: only on ``flush()`` and leaving ``with``)."""
        return self._every

    @every.setter
    def every(self, every: int | None) -> None:
        _check_every(every)
        self._every, self._flush_at = every, math.inf if every is None else every

    # -- recording ----------------------------------------------------------------------

    @overload
    def __call__(self, fn: F, /) -> F: ...
    @overload
    def __call__(self, /, **metrics: torch.Tensor | float) -> None: ...
    def __call__(self, fn: F | None = None, /, **metrics: torch.Tensor | float) -> F | None:
        """``log(name=value, ...)`` records; ``@log`` decorates a function."""
        if fn is not None:
            if metrics or not callable(fn):
                raise TypeError(
                    "record metrics by keyword, log(loss=loss, acc=acc); a single positional "
                    "argument must be a function to decorate"
                )
            return _decorate(self, fn)
        self.record(metrics)
        return None

    def record(self, metrics: Mapping[str, torch.Tensor | float]) -> None:
        """Record one value per metric (a scalar tensor or a Python number)."""
        since = self._calls_since_flush + 1
        flushes = since >= self._flush_at
        # The common call, inline (it runs every micro-step): each metric logged the same way
        # as its last value (a 0-d tensor of the same dtype on the same device, or a Python
        # float) is appended as it is: no device op, no host read, no check repeated. Any
        # other value (a new metric, another kind, an int, a bad value, a value restored by a
        # resume still to move) takes back what was appended and goes to the full checks.
        kinds = _NO_KINDS if self._restored else self._kinds
        values = self._values
        taken = 0
        for name, v in metrics.items():
            kind = kinds.get(name)
            if kind is None:
                break
            if kind is NUMBER:
                if type(v) is not float:
                    break
            elif (
                not isinstance(v, torch.Tensor)
                or v.dtype is not kind[0]
                or v.dim() != 0
                or (not v.is_cpu if kind[2] else v.device != kind[1])
            ):
                break
            elif v.requires_grad:  # a value that holds no graph is kept as it is
                v = v.detach()
            kept = values.get(name)
            if kept is None:
                values[name] = [v]
            else:
                kept.append(v)
            taken += 1
        else:
            if taken:
                self.step += 1
                self._calls_since_flush = since
                if flushes:
                    flush_call(self, metrics, {}, set())
                return
        take_back(values, itertools.islice(metrics, taken))
        record_checked(self, metrics, flushes)

    _record_one = record_one  # a step's loss, each micro-step: the short path (_recording)
    _keep = staticmethod(keep)  # what _record_one is given of a step's loss (_recording)

    # -- reading ------------------------------------------------------------------------

    def flush(self) -> dict[str, float]:
        """Reduce what was recorded since the last flush, send it to the sink, return it.

        With ``sync_ranks=True`` this is a collective: call it on every rank, even one
        that recorded nothing since the last flush.
        """
        across = self._across_ranks()
        if not self._values and not across:
            self._calls_since_flush = 0
            return {}
        # Reduced before anything changes: if it raises, the values stay for the next flush.
        reduced = self._reduce(self._values, across)
        self._deliver(reduced)
        return reduced

    def _across_ranks(self) -> bool:
        """Whether flushes reduce across ranks (never with one process: nothing to meet)."""
        return self.sync_ranks is True and _ranks.is_multi_rank()

    def _deliver(self, reduced: dict[str, float]) -> None:
        """Commit a successful flush: clear the interval, remember it, call the sink."""
        self._values = {}
        self._calls_since_flush = 0
        self._restored = set()
        self._dtypes = set()  # the next values' dtypes: their metrics' kinds, unless checked
        if not reduced:  # a cross-rank flush where no rank had logged anything
            return
        self.last = reduced
        # The default keeps the sinks to rank zero (no collective needed to know the rank).
        if self._delivery.sinks and (self.sync_ranks is False or _ranks.world()[0] == 0):
            self._delivery.send(reduced, *self.axis())

    def axis(self) -> tuple[int, dict[str, float]]:
        """The sinks' ``step`` (the clock's updates, or the log calls) and the other axes."""
        clock = self.clock
        if clock is None:
            return self.step, {}
        updates = int(clock.updates)
        seen = getattr(clock, "seen", None)
        axes: dict[str, float] = {"updates": updates}
        if seen is not None:
            axes.update(seen.axes())
        return updates, axes

    # -- trackers: hyperparameters, closing (the checkpoint state: LogState) -------------------

    def config(self, **params: Any) -> None:
        """Log hyperparameters once, to every sink that takes them (``sink.config``)."""
        if _ranks.world()[0] == 0 or self.sync_ranks is False:
            self._delivery.config(params)

    def close(self) -> None:
        """Flush what is left, then close the sinks that can be closed (trackers' runs end)."""
        self.flush()
        self._delivery.close()

    def _how(self, name: str) -> str:
        return self._per_metric.get(name, self._default)

    def _reduce(self, values: dict[str, list[Value]], across: bool) -> dict[str, float]:
        if across:
            return reduce_across_ranks(values, self._how)
        one = known_one_dtype(self._dtypes, self._kinds, values)
        return reduce_local(values, self._how, one_dtype=one)

    def __enter__(self) -> detach_logging:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # Leaving on an exception that may be this rank's alone: a cross-rank flush would
        # wait for ranks that are not flushing (a hang), so the values stay unflushed.
        if exc_type is not None and self.sync_ranks is True:
            return
        self.flush()

    def __repr__(self) -> str:
        return f"detach_logging(every={self.every}, sink={self.sink!r})"


def _check_every(every: object) -> None:
    if every is not None and not is_int_at_least(every, 1):
        raise ValueError(
            f"every must be an int >= 1 (flush every that many calls) or None (flush only "
            f"on flush()), got {every!r}"
        )


def _decorate(self: detach_logging, fn: F) -> F:
    """``@log``: ``fn``'s return value (a scalar, or a dict of them) is recorded."""
    name = getattr(fn, "__name__", "value")

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        out = fn(*args, **kwargs)
        if isinstance(out, Mapping):
            self.record(out)
        elif isinstance(out, (torch.Tensor, int, float)):
            self.record({name: out})
        else:
            raise TypeError(
                f"@detach_logging: {name}() returned {type(out).__name__}; it must return "
                "a scalar tensor or a dict of scalar tensors to log"
            )
        return out

    return cast(F, wrapper)  # functools.wraps gives it fn's signature
