"""detach_logging: record metrics on the device every step, read them once per interval."""

from __future__ import annotations

import functools
import inspect
import logging
import math
import zlib
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Any, Literal, Protocol, TypeAlias, TypeVar, overload

import torch

from ._core import is_int_at_least

Reduction: TypeAlias = Literal["mean", "sum", "max", "min", "last"]
_REDUCTIONS: frozenset[str] = frozenset({"mean", "sum", "max", "min", "last"})

F = TypeVar("F", bound=Callable[..., Any])


class Sink(Protocol):
    """Where reduced metrics go: any callable taking the dict of floats.

    A sink that also declares a ``step`` keyword receives the number of ``log(...)``
    calls made so far.
    """

    def __call__(self, metrics: dict[str, float], /) -> object: ...


def print_sink(metrics: dict[str, float], *, step: int) -> None:
    """Print ``step 100 | loss 0.1234 | acc 0.5`` to standard output."""
    print(_format(metrics, step))


def _format(metrics: Mapping[str, float], step: int) -> str:
    return " | ".join([f"step {step}"] + [f"{k} {v:.4g}" for k, v in metrics.items()])


class LoggingSink:
    """Send reduced metrics to a stdlib ``logging`` logger, one record per flush."""

    def __init__(self, logger: logging.Logger | str = "loopkit", level: int = logging.INFO):
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
    transfer. ``@log`` on a function returning a scalar tensor or a dict of them records
    its result and returns it unchanged.

    Under DDP (``sync_ranks=None`` and a process group of more than one rank, or
    ``sync_ranks=True``) a flush is one all-gather of every rank's partial statistics:
    means are over all ranks' values, ``sum``/``max``/``min`` over all ranks, ``last`` the
    mean of the ranks' last values; only rank zero calls the sink. Every rank must then
    log the same metrics and flush together.
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
        # Stored only once every value is known good, so a bad call records nothing.
        for name, value in checked:
            self._values.setdefault(name, []).append(value)
        self.step += 1
        self._calls_since_flush += 1
        if self.every is not None and self._calls_since_flush >= self.every:
            self.flush()

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
        """Reduce what was recorded since the last flush, send it to the sink, return it."""
        if not self._values:
            self._calls_since_flush = 0
            return {}
        values, self._values = self._values, {}
        step, self._calls_since_flush = self.step, 0
        group = _process_group(self.sync_ranks)
        if group is not None:
            ordered = self._reduce_across_ranks(values, group)
        else:
            ordered = self._reduce_local(values)
        self.last = ordered
        if self.sink is not None and (group is None or _rank(group) == 0):
            if self._sink_takes_step:
                self.sink(ordered, step=step)  # type: ignore[call-arg]
            else:
                self.sink(ordered)
        return ordered

    def _reduce_local(self, values: dict[str, list[Any]]) -> dict[str, float]:
        out: dict[str, float] = {}
        on_device: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
        for name, vals in values.items():
            how = self._per_metric.get(name, self._default)
            if isinstance(vals[0], torch.Tensor):
                t = torch.stack(vals).float()  # values are 0-d already (see _checked)
                on_device.setdefault(t.device, []).append((name, _reduce_tensor(t, how)))
            else:
                out[name] = _reduce_floats(vals, how)
        for pairs in on_device.values():
            # Host-device sync: the one read per flush (per device holding metrics).
            floats = torch.stack([t for _, t in pairs]).tolist()
            out.update(zip([n for n, _ in pairs], floats, strict=True))
        return {name: out[name] for name in values}

    def _reduce_across_ranks(self, values: dict[str, list[Any]], group: Any) -> dict[str, float]:
        """Every rank's partial statistics in one all-gather, then one read to the host."""
        import torch.distributed as dist

        device = _comm_device(group)
        parts: list[torch.Tensor] = []
        layout: list[tuple[str, str]] = []
        for name, vals in values.items():
            how = self._per_metric.get(name, self._default)
            if isinstance(vals[0], torch.Tensor):
                t = torch.stack(vals).to(device, torch.float64)
            else:
                t = torch.tensor(vals, dtype=torch.float64, device=device)
            if how == "mean":
                parts += [
                    t.sum().reshape(1),
                    torch.full((1,), len(vals), dtype=torch.float64, device=device),
                ]
            else:
                parts.append(_reduce_tensor(t, how).reshape(1))
            layout.append((name, how))
        # A fingerprint of the metric names travels with the values: ranks that logged
        # different metrics get a clear error instead of silently mixed numbers.
        fingerprint = float(zlib.crc32("\0".join(values).encode()))
        parts.append(torch.full((1,), fingerprint, dtype=torch.float64, device=device))
        local = torch.cat(parts)
        world = dist.get_world_size(group)
        gathered = torch.empty(world * local.numel(), dtype=local.dtype, device=device)
        # all_gather_single is the newer name of all_gather_into_tensor (deprecated in 2.13).
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(gathered, local, group=group)
        # Host-device sync: the one read per flush.
        rows = gathered.view(world, -1).tolist()
        if any(row[-1] != fingerprint for row in rows):
            raise RuntimeError(
                "ranks flushed different metrics: log the same names on every rank, the same "
                "number of times (the flush is a collective)"
            )
        out: dict[str, float] = {}
        col = 0
        for name, how in layout:
            if how == "mean":
                out[name] = math.fsum(r[col] for r in rows) / math.fsum(r[col + 1] for r in rows)
                col += 2
                continue
            column = [r[col] for r in rows]
            col += 1
            if how == "sum":
                out[name] = math.fsum(column)
            elif how == "max":
                out[name] = max(column)
            elif how == "min":
                out[name] = min(column)
            else:  # last: the mean of each rank's last value
                out[name] = math.fsum(column) / world
        return out

    def __enter__(self) -> detach_logging:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.flush()

    def __repr__(self) -> str:
        return f"detach_logging(every={self.every}, sink={self.sink!r})"


def _process_group(sync_ranks: bool | None) -> Any:
    """The default group when metrics are reduced across ranks, else None."""
    if sync_ranks is False:
        return None
    import torch.distributed as dist

    on = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    if sync_ranks and not on:
        raise RuntimeError(
            "sync_ranks=True but no process group with more than one rank is initialized: "
            "call loopkit.distributed.setup() under torchrun first, or leave sync_ranks=None"
        )
    return dist.group.WORLD if on else None


def _rank(group: Any) -> int:
    import torch.distributed as dist

    return dist.get_rank(group)


def _comm_device(group: Any) -> torch.device:
    import torch.distributed as dist

    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _checked(name: str, v: object, previous: list[Any] | None) -> Any:
    if isinstance(v, torch.Tensor):
        if v.numel() != 1:
            raise ValueError(
                f"metric {name!r} has shape {tuple(v.shape)}: log scalars, e.g. "
                f"log({name}=value.mean())"
            )
        if v.is_complex():
            raise ValueError(f"metric {name!r} is complex: log its .abs() or .real")
        if previous and not isinstance(previous[0], torch.Tensor):
            raise TypeError(
                f"metric {name!r} was a Python number before and is a tensor now: log it "
                "the same way every call"
            )
        # Stored 0-d, so the flush stacks them without reshaping each one.
        return v.detach() if v.dim() == 0 else v.detach().reshape(())
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        if previous and isinstance(previous[0], torch.Tensor):
            raise TypeError(
                f"metric {name!r} was a tensor before and is a Python number now: log it "
                "the same way every call"
            )
        return float(v)
    raise TypeError(f"metric {name!r} must be a scalar tensor or a number, got {type(v).__name__}")


def _reduce_tensor(t: torch.Tensor, how: str) -> torch.Tensor:
    if how == "mean":
        return t.mean()
    if how == "sum":
        return t.sum()
    if how == "max":
        return t.max()
    if how == "min":
        return t.min()
    return t[-1]


def _reduce_floats(vals: list[float], how: str) -> float:
    if how == "mean":
        return math.fsum(vals) / len(vals)
    if how == "sum":
        return math.fsum(vals)
    if how == "max":
        return max(vals)
    if how == "min":
        return min(vals)
    return vals[-1]
