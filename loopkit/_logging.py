"""detach_logging: record metrics on the device every step, read them once per interval."""

from __future__ import annotations

import functools
import hashlib
import inspect
import logging
import math
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Any, TypeVar, overload

import torch

from . import _ranks
from ._checks import is_int_at_least
from ._types import Reduction, Sink

_REDUCTIONS: frozenset[str] = frozenset({"mean", "sum", "max", "min", "last"})

F = TypeVar("F", bound=Callable[..., Any])


def print_sink(metrics: dict[str, float], *, step: int) -> None:
    """Print ``step 100 | loss 0.1234 | acc 0.5`` to standard output."""
    print(_format(metrics, step))


def _format(metrics: Mapping[str, float], step: int) -> str:
    return " | ".join([f"step {step}"] + [f"{k} {v:.4g}" for k, v in metrics.items()])


class LoggingSink:
    """Send reduced metrics to a stdlib ``logging`` logger, one record per flush."""

    def __init__(
        self,
        logger: logging.Logger | logging.LoggerAdapter[Any] | str = "loopkit",
        level: int = logging.INFO,
    ) -> None:
        # Checked here, not at the first flush, so a wrong argument fails where it is written.
        if not isinstance(logger, (logging.Logger, logging.LoggerAdapter, str)):
            raise TypeError(
                f"LoggingSink(logger=...) takes a logging.Logger (or LoggerAdapter) or a logger "
                f"name, e.g. LoggingSink(logging.getLogger(__name__)) or LoggingSink('train'); "
                f"got {type(logger).__name__}: {logger!r}"
            )
        if isinstance(level, bool) or not isinstance(level, int):
            raise TypeError(
                f"LoggingSink(level=...) takes an int logging level such as logging.INFO, "
                f"got {type(level).__name__}: {level!r}"
            )
        self.logger = logging.getLogger(logger) if isinstance(logger, str) else logger
        self.level = level

    def __call__(self, metrics: dict[str, float], *, step: int) -> None:
        self.logger.log(self.level, "%s", _format(metrics, step))


class TensorBoardSink:
    """Write reduced metrics as TensorBoard scalars (needs the ``tensorboard`` extra)."""

    def __init__(self, log_dir: str | None = None, *, writer: Any = None) -> None:
        if writer is None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as err:  # pragma: no cover - depends on the environment
                raise ImportError(
                    "TensorBoardSink needs tensorboard: pip install 'loopkit[tensorboard]'"
                ) from err
            writer = SummaryWriter(log_dir=log_dir)
        self.writer = writer

    def __call__(self, metrics: dict[str, float], *, step: int) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, global_step=step)
        self.writer.flush()


def _takes_step(sink: Callable[..., object]) -> bool:
    try:
        params = inspect.signature(sink).parameters
    except (TypeError, ValueError):  # builtins such as print have no signature
        return False
    p = params.get("step")
    return p is not None and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)


class detach_logging:
    """Record metrics detached and on their device; reduce and read them once per ``every``.

    ``log(loss=loss, acc=acc)`` keeps each value as a detached tensor on its device: no
    host-device sync, no autograd graph kept alive. Every ``every`` calls (and on
    ``flush()`` or leaving ``with log:``) each metric is reduced (``mean`` by default;
    ``reduce="max"`` or ``reduce={"acc": "max"}`` picks ``sum``/``max``/``min``/``last``)
    and ``sink`` gets one dict of Python floats, read from the device in a single
    transfer. Reductions run in float64 (float32 on MPS, which has no float64), so integer
    and float64 counters stay exact, and a NaN among the values always comes out as NaN,
    for tensors and Python numbers alike. ``@log`` on a function returning a scalar
    tensor or a dict of them records its result and returns it unchanged.

    Under DDP, by default (``sync_ranks=None``) each rank reduces its own values with no
    collective, so logging on rank zero only is safe, and only rank zero calls the sink;
    ``sync_ranks=False`` calls the sink on every rank. ``sync_ranks=True`` reduces across
    ranks, in one all-gather per flush: means are over every value of every rank, ``sum``/
    ``max``/``min`` over all ranks, ``last`` the mean of the ranks' last values, and a
    metric logged on some ranks only is reduced over the ranks that logged it. Then the
    flush is a collective: every rank must flush together (the same number of ``log``
    calls between flushes, and ``flush()`` called on every rank), whatever it logged;
    leaving ``with log:`` on an exception then skips the flush rather than risk a hang.
    In a single process ``sync_ranks=True`` reduces locally, so the script runs unchanged.
    """

    def __init__(
        self,
        every: int | None = 1,
        sink: Sink | Callable[..., object] | None = print_sink,
        *,
        reduce: Reduction | Mapping[str, Reduction] = "mean",
        sync_ranks: bool | None = None,
    ) -> None:
        if every is not None and not is_int_at_least(every, 1):
            raise ValueError(
                f"every must be an int >= 1 (flush every that many calls) or None (flush only "
                f"on flush()), got {every!r}"
            )
        if sink is not None and not callable(sink):
            raise TypeError(
                f"sink must be callable with a dict of floats (e.g. print), got {sink!r}"
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
            if name not in _REDUCTIONS:
                raise ValueError(f"unknown reduction {name!r}: use one of {sorted(_REDUCTIONS)}")
        if sync_ranks is not None and not isinstance(sync_ranks, bool):
            raise TypeError(f"sync_ranks must be None, True or False, got {sync_ranks!r}")
        self.every = every
        self.sink = sink
        self.sync_ranks = sync_ranks
        self._sink_takes_step = sink is not None and _takes_step(sink)
        self._values: dict[str, list[Any]] = {}
        self._calls_since_flush = 0
        self.step = 0
        """Number of ``log(...)`` calls so far."""
        self.last: dict[str, float] = {}
        """The values of the most recent flush."""

    # -- recording ----------------------------------------------------------------------

    @overload
    def __call__(self, fn: F, /) -> F: ...
    @overload
    def __call__(self, /, **metrics: torch.Tensor | float) -> None: ...
    def __call__(self, fn: Any = None, /, **metrics: torch.Tensor | float) -> Any:
        """``log(name=value, ...)`` records; ``@log`` decorates a function."""
        if fn is not None:
            if metrics or not callable(fn):
                raise TypeError(
                    "record metrics by keyword, log(loss=loss, acc=acc); a single positional "
                    "argument must be a function to decorate"
                )
            return self._decorate(fn)
        self.record(metrics)
        return None

    def record(self, metrics: Mapping[str, torch.Tensor | float]) -> None:
        """Record one value per metric (a scalar tensor or a Python number)."""
        if not metrics:
            raise TypeError("log() got no metrics: call it as log(loss=loss, ...)")
        checked = [(name, _checked(name, v, self._values.get(name))) for name, v in metrics.items()]
        flushes = self.every is not None and self._calls_since_flush + 1 >= self.every
        across = self._across_ranks() if flushes else False
        # Stored only once every value is known good, so a bad call records nothing.
        for name, value in checked:
            self._values.setdefault(name, []).append(value)
        self.step += 1
        self._calls_since_flush += 1
        if not flushes:
            return
        try:
            reduced = self._reduce(self._values, across)
        except BaseException:
            # The flush failed before it changed anything (a collective that timed out, ranks
            # configured differently): take this call's values back out, as if never made.
            for name, _ in checked:
                kept = self._values[name]
                kept.pop()
                if not kept:
                    del self._values[name]
            self.step -= 1
            self._calls_since_flush -= 1
            raise
        self._deliver(reduced)

    def _decorate(self, fn: F) -> F:
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

        return wrapper  # type: ignore[return-value]

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
        if not reduced:  # a cross-rank flush where no rank had logged anything
            return
        self.last = reduced
        # The default keeps the sink to rank zero (no collective needed to know the rank).
        if self.sink is not None and (self.sync_ranks is False or _ranks.world()[0] == 0):
            if self._sink_takes_step:
                self.sink(reduced, step=self.step)  # type: ignore[call-arg]
            else:
                self.sink(reduced)

    def _how(self, name: str) -> str:
        return self._per_metric.get(name, self._default)

    def _reduce(self, values: dict[str, list[Any]], across: bool) -> dict[str, float]:
        if across:
            return self._reduce_across_ranks(values)
        return self._reduce_local(values)

    def _reduce_local(self, values: dict[str, list[Any]]) -> dict[str, float]:
        out: dict[str, float] = {}
        on_device: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
        for name, vals in values.items():
            how = self._how(name)
            if isinstance(vals[0], torch.Tensor):
                t = _stacked(vals)
                on_device.setdefault(t.device, []).append((name, _reduce_tensor(t, how)))
            else:
                out[name] = _merge(how, [(len(vals), _partial_floats(vals, how))])
        for pairs in on_device.values():
            # Host-device sync: the one read per flush (per device holding metrics).
            floats = torch.stack([t for _, t in pairs]).tolist()
            out.update(zip([n for n, _ in pairs], floats, strict=True))
        return {name: out[name] for name in values}

    def _reduce_across_ranks(self, values: dict[str, list[Any]]) -> dict[str, float]:
        """Every rank's partial statistics in one all-gather, then one read to the host.

        Each rank sends a fixed-size row: a fingerprint of its sorted (name, reduction)
        pairs, its number of metrics, then a count and a partial statistic per metric in
        sorted-name order. When every row has the same fingerprint and the metrics fit,
        that one gather is the whole exchange. Otherwise (metrics logged on some ranks
        only, or more than fit) the ranks swap their name lists and gather again over the
        union. Every rank decides from the same gathered rows, so all take the same branch.
        """
        device = _ranks.comm_device()
        partials = self._partials(values)
        mine = sorted((name, self._how(name)) for name in values)
        n = len(mine)
        fits = n <= _CAPACITY
        prefix = [_fingerprint(mine), float(n)]
        order = [name for name, _ in mine] if fits else []
        local = _row(prefix, partials, order, _CAPACITY, device)
        # Host-device sync: the one read per flush.
        rows = _ranks.gather_rows(local).tolist()
        head = rows[0][:2]
        if head[1] <= _CAPACITY and all(row[:2] == head for row in rows):
            start = len(prefix)
            counts = [row[start : start + n] for row in rows]
            stats = [row[start + _CAPACITY : start + _CAPACITY + n] for row in rows]
            return self._combine(values, mine, counts, stats)
        # Different metrics on different ranks: agree on the union, then gather over it.
        everyone: list[list[tuple[str, str]]] = _ranks.gather_objects(mine)
        union: dict[str, str] = {}
        for rank, pairs in enumerate(everyone):
            for name, how in pairs:
                if union.setdefault(name, how) != how:
                    raise RuntimeError(
                        f"metric {name!r} is reduced with {union[name]!r} on one rank and "
                        f"{how!r} on rank {rank}: build detach_logging with the same reduce= "
                        "on every rank"
                    )
        both = sorted(union.items())
        order = [name for name, _ in both]
        local = _row([], partials, order, len(order), device)
        # Host-device sync: the second read of a flush whose ranks logged different metrics.
        rows = _ranks.gather_rows(local).tolist()
        counts = [row[: len(order)] for row in rows]
        stats = [row[len(order) :] for row in rows]
        return self._combine(values, both, counts, stats)

    def _partials(self, values: dict[str, list[Any]]) -> dict[str, tuple[int, Any]]:
        """Per metric, its count and its partial statistic (a 0-d tensor or a float)."""
        out: dict[str, tuple[int, Any]] = {}
        for name, vals in values.items():
            how = self._how(name)
            if isinstance(vals[0], torch.Tensor):
                out[name] = (len(vals), _partial_tensor(_stacked(vals), how))
            else:
                out[name] = (len(vals), _partial_floats(vals, how))
        return out

    @staticmethod
    def _combine(
        values: dict[str, list[Any]],
        layout: list[tuple[str, str]],
        counts: list[list[float]],
        stats: list[list[float]],
    ) -> dict[str, float]:
        """Merge the ranks' rows; this rank's first-seen order first, then the others' names."""
        out: dict[str, float] = {}
        for i, (name, how) in enumerate(layout):
            logged = [(c[i], s[i]) for c, s in zip(counts, stats, strict=True) if c[i] > 0]
            out[name] = _merge(how, logged)
        return {**{name: out[name] for name in values}, **out}

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


# Metrics that fit the one fixed-size gather of a cross-rank flush; more take the slower,
# name-exchanging path (still correct).
_CAPACITY = 32


def _fingerprint(pairs: list[tuple[str, str]]) -> float:
    """48 bits of a hash of the sorted (name, reduction) pairs: exact in a float64."""
    digest = hashlib.blake2b(repr(pairs).encode(), digest_size=6).digest()
    return float(int.from_bytes(digest, "big"))


def _row(
    prefix: list[float],
    partials: dict[str, tuple[int, Any]],
    order: list[str],
    slots: int,
    device: torch.device,
) -> torch.Tensor:
    """``prefix``, then ``slots`` counts, then ``slots`` statistics, as float64 on ``device``.

    Slot ``i`` holds metric ``order[i]`` (count 0 where this rank did not log it). Counts
    and Python-number statistics are known on the host; tensor statistics are placed with
    one ``index_copy_``, so the row costs one host-to-device copy and no host read.
    """
    row = [*prefix, *([0.0] * (2 * slots))]
    start = len(prefix)
    on_device: dict[torch.device, tuple[list[int], list[torch.Tensor]]] = {}
    for i, name in enumerate(order):
        got = partials.get(name)
        if got is None:
            continue
        count, stat = got
        row[start + i] = float(count)
        if isinstance(stat, torch.Tensor):
            where, stats = on_device.setdefault(stat.device, ([], []))
            where.append(start + slots + i)
            stats.append(stat)
        else:
            row[start + slots + i] = stat
    if not on_device:
        return _host_to(row, device)
    positions = [p for where, _ in on_device.values() for p in where]
    # The positions ride along in the same host-to-device copy as the counts.
    both = _host_to(row + [float(p) for p in positions], device)
    source = torch.cat(
        [_moved(torch.stack(stats), device).to(torch.float64) for _, stats in on_device.values()]
    )
    out = both[: len(row)]
    out.index_copy_(0, both[len(row) :].long(), source)
    return out


def _host_to(values: list[float], device: torch.device) -> torch.Tensor:
    """A float64 tensor of host numbers on ``device``, without making the host wait."""
    return _moved(torch.tensor(values, dtype=torch.float64), device)


def _moved(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    if t.device == device:
        return t
    if t.device.type == "cpu" and device.type == "cuda":
        # Pinned, so the copy is asynchronous: a pageable copy would wait for the stream.
        return t.pin_memory().to(device, non_blocking=True)
    # Host-device sync: only for metrics on an accelerator with a gloo group (one per device).
    return t.to(device)


def _wide(device: torch.device) -> torch.dtype:
    """The dtype reductions run in: float64, except on MPS, which has none."""
    return torch.float32 if device.type == "mps" else torch.float64


def _stacked(vals: list[torch.Tensor]) -> torch.Tensor:
    """The 0-d values as one wide 1-D tensor (each converted first if their dtypes differ)."""
    wide = _wide(vals[0].device)
    first = vals[0].dtype
    if all(v.dtype == first for v in vals):
        return torch.stack(vals).to(wide)
    # torch.stack would promote to a common dtype first (int64 with float32 -> float32).
    return torch.stack([v.to(wide) for v in vals])


def _checked(name: object, v: object, previous: list[Any] | None) -> Any:
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
        if previous:
            if not isinstance(previous[0], torch.Tensor):
                raise TypeError(
                    f"metric {name!r} was a Python number before and is a tensor now: log it "
                    "the same way every call"
                )
            if previous[0].device != v.device:
                raise ValueError(
                    f"metric {name!r} was on {previous[0].device} before and is on {v.device} "
                    f"now: log it from the same device every call (or .to() it first)"
                )
        # Stored 0-d, so the flush stacks them without reshaping each one.
        return v.detach() if v.dim() == 0 else v.detach().reshape(())
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        if previous and isinstance(previous[0], torch.Tensor):
            raise TypeError(
                f"metric {name!r} was a tensor before and is a Python number now: log it "
                "the same way every call"
            )
        try:
            return float(v)
        except OverflowError:
            raise ValueError(
                f"metric {name!r} is an int of {len(str(abs(int(v))))} digits, too large for a "
                "float: log it scaled down"
            ) from None
    raise TypeError(f"metric {name!r} must be a scalar tensor or a number, got {type(v).__name__}")


def _reduce_tensor(t: torch.Tensor, how: str) -> torch.Tensor:
    """The final value of one metric on its device (``t`` is already wide)."""
    if how == "mean":
        return t.mean()
    return _partial_tensor(t, how)


def _partial_tensor(t: torch.Tensor, how: str) -> torch.Tensor:
    """One rank's statistic for a cross-rank merge: a mean travels as its sum."""
    if how in ("mean", "sum"):
        return t.sum()
    if how == "max":
        return t.max()  # torch.max propagates NaN
    if how == "min":
        return t.min()
    return t[-1]


def _partial_floats(vals: list[float], how: str) -> float:
    """The same statistic as ``_partial_tensor``, with the same NaN behaviour."""
    if how in ("mean", "sum"):
        return _fsum(vals)
    if how == "max":
        return _nan_or(max, vals)
    if how == "min":
        return _nan_or(min, vals)
    return vals[-1]


def _merge(how: str, logged: list[tuple[float, float]]) -> float:
    """Combine (count, statistic) pairs from the ranks that logged a metric."""
    stats = [s for _, s in logged]
    if how == "mean":
        return _fsum(stats) / math.fsum(c for c, _ in logged)
    if how == "sum":
        return _fsum(stats)
    if how == "max":
        return _nan_or(max, stats)
    if how == "min":
        return _nan_or(min, stats)
    return _fsum(stats) / len(stats)  # last: the mean of each rank's last value


def _fsum(vals: list[float]) -> float:
    """An exactly rounded sum; with inf/nan (or overflow), IEEE semantics as in torch."""
    try:
        return math.fsum(vals)
    except (OverflowError, ValueError):  # inf + -inf, or finite values that overflow
        return float(sum(vals))


def _nan_or(pick: Callable[[list[float]], float], vals: list[float]) -> float:
    """``max``/``min`` that return NaN when any value is NaN (Python's depend on position)."""
    return math.nan if any(math.isnan(v) for v in vals) else pick(vals)
