"""Where detach_logging's reduced metrics go: standard output, a stdlib logger, TensorBoard."""

from __future__ import annotations

import inspect
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any, Protocol


def print_sink(metrics: dict[str, float], *, step: int) -> None:
    """Print ``step 100 | loss 0.1234 | acc 0.5`` to standard output."""
    print(format_metrics(metrics, step))


def format_metrics(metrics: Mapping[str, float], step: int) -> str:
    """``step 100 | loss 0.1234 | acc 0.5``: four significant digits per value."""
    return " | ".join([f"step {step}"] + [f"{k} {v:.4g}" for k, v in metrics.items()])


def takes_step(sink: Callable[..., object]) -> bool:
    """Whether ``sink`` declares a ``step`` keyword (then it is given the log call count)."""
    try:
        params = inspect.signature(sink).parameters
    except (TypeError, ValueError):  # builtins such as print have no signature
        return False
    p = params.get("step")
    return p is not None and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)


class LoggingSink:
    """Send reduced metrics to a stdlib ``logging`` logger, one record per flush."""

    def __init__(
        self,
        # LoggerAdapter is generic in the logger it wraps: any of them will do.
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
        self.logger.log(self.level, "%s", format_metrics(metrics, step))


class ScalarWriter(Protocol):
    """What TensorBoardSink writes to: a ``SummaryWriter``, or anything shaped like one."""

    def add_scalar(self, tag: str, scalar_value: float, /, global_step: int) -> object: ...
    def flush(self) -> object: ...


class TensorBoardSink:
    """Write reduced metrics as TensorBoard scalars (needs the ``tensorboard`` extra).

    ``log_dir`` is required (unless ``writer=`` is given): a default would write into
    ``./runs/`` of whatever directory the script was started from.
    """

    def __init__(
        self, log_dir: str | os.PathLike[str] | None = None, *, writer: ScalarWriter | None = None
    ) -> None:
        if writer is None and log_dir is None:
            raise TypeError(
                "TensorBoardSink needs the directory to write to: TensorBoardSink('runs/exp1') "
                "(or writer= a SummaryWriter you made)"
            )
        if writer is not None and log_dir is not None:
            raise TypeError("TensorBoardSink takes log_dir or writer=, not both")
        if writer is None:
            assert log_dir is not None  # checked above
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as err:  # pragma: no cover - depends on the environment
                raise ImportError(
                    "TensorBoardSink needs tensorboard: pip install 'torch-loopkit[tensorboard]'"
                ) from err
            writer = SummaryWriter(log_dir=os.fspath(log_dir))
        self.writer = writer

    def __call__(self, metrics: dict[str, float], *, step: int) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, global_step=step)
        self.writer.flush()
