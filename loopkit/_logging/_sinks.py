"""Where detach_logging's reduced metrics go: standard output, a stdlib logger, TensorBoard."""

from __future__ import annotations

import importlib
import inspect
import json
import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

from ._tracker import Tracker, held_in, read_record, write_record


def print_sink(metrics: dict[str, float], *, step: int) -> None:
    """Print ``metrics`` at ``step`` as ``step 100 | loss 0.1234 | acc 0.5`` to standard output."""
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
    """Send reduced metrics to a stdlib ``logging`` logger (``logger``: one, an adapter or
    its name), one record per flush at ``level`` (default ``logging.INFO``)."""

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


class TensorBoardSink(Tracker):
    """Write reduced metrics as TensorBoard scalars (needs the ``tensorboard`` extra).

    ``log_dir`` is required (unless ``writer=`` is given): a default would write into
    ``./runs/`` of whatever directory the script was started from. The writer is made at
    the first write (a resumed run appends to the same directory); hyperparameters go in as
    a text summary; the last step written and the points written at it are kept in
    ``<log_dir>/.loopkit-last-step.json`` (a resume after a kill -9 writes no point twice).
    """

    def __init__(
        self, log_dir: str | os.PathLike[str] | None = None, *, writer: ScalarWriter | None = None
    ) -> None:
        super().__init__()
        if writer is None and log_dir is None:
            raise TypeError(
                "TensorBoardSink needs the directory to write to: TensorBoardSink('runs/exp1') "
                "(or writer= a SummaryWriter you made)"
            )
        if writer is not None and log_dir is not None:
            raise TypeError("TensorBoardSink takes log_dir or writer=, not both")
        if writer is None:
            try:
                importlib.import_module("torch.utils.tensorboard")
            except ImportError as err:  # pragma: no cover - depends on the environment
                raise ImportError(
                    "TensorBoardSink needs tensorboard: pip install 'torch-loopkit[tensorboard]'"
                ) from err
        self.log_dir = None if log_dir is None else os.fspath(log_dir)
        self.writer: Any = writer

    def _start(self, run_id: str | None) -> str:
        if self.writer is None:
            summary = importlib.import_module("torch.utils.tensorboard")
            self.writer = summary.SummaryWriter(log_dir=self.log_dir)
        return self.log_dir or "writer"

    def _write(self, values: dict[str, float], step: int) -> None:
        for name, value in values.items():
            self.writer.add_scalar(name, value, global_step=step)
        self.writer.flush()

    def _sidecar(self) -> Path | None:
        return None if self.log_dir is None else Path(self.log_dir, ".loopkit-last-step.json")

    def _wrote(self, step: int, count: int) -> None:
        side = self._sidecar()
        if side is not None:  # flushed to the event file first: the record never runs ahead
            write_record(side, {"last_step": step, "count": count})

    def _write_config(self, params: dict[str, Any]) -> None:
        add_text = getattr(self.writer, "add_text", None)
        if add_text is not None:
            add_text("hparams", json.dumps(params, default=str, sort_keys=True))

    def _held_through(self) -> tuple[int, int] | int | None:
        side = self._sidecar()
        return None if side is None else held_in(read_record(side))

    def _finish(self) -> None:
        close = getattr(self.writer, "close", None)
        if close is not None:
            close()
