"""Private core shared by every middleware: device resolution and the decorator engine."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, TypeAlias

import torch
from torch.utils._python_dispatch import TorchDispatchMode

DeviceLike: TypeAlias = "str | int | torch.device"


class ContextDecorator(contextlib.ContextDecorator):
    """Base of every middleware: a reusable context manager that also decorates functions.

    ``@mw`` and ``with mw:`` enter the same object, so a middleware keeps one set of
    semantics whichever way it is used.
    """


def is_int_at_least(value: object, low: int) -> bool:
    """Whether ``value`` is a real int (not a bool, not a float such as nan) and >= ``low``."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def parse_device(device: object) -> torch.device:
    """Parse ``device`` (no check that this machine has it); raise saying what to pass."""
    if isinstance(device, bool) or not isinstance(device, (str, int, torch.device)):
        raise TypeError(
            f"device must be a str, int or torch.device, got {type(device).__name__}: "
            "pass e.g. 'cpu', 'cuda', 'cuda:1' or torch.device('cuda', 0)"
        )
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(
            f"{device!r} is not a device: pass e.g. 'cpu', 'cuda', 'cuda:1' ({err})"
        ) from None


def resolve_device(device: DeviceLike) -> torch.device:
    """Parse ``device`` and check this machine can use it; raise ValueError saying why not."""
    dev = parse_device(device)
    if dev.type == "cpu" or dev.type == "meta":
        return dev
    module = getattr(torch, dev.type, None)
    is_available = getattr(module, "is_available", None)
    if is_available is not None and not is_available():
        raise ValueError(
            f"device {str(dev)!r} is not available on this machine: "
            f"torch.{dev.type}.is_available() is False; use 'cpu' or install a build with "
            f"{dev.type} support"
        )
    device_count = getattr(module, "device_count", None)
    if dev.index is not None and device_count is not None and dev.index >= device_count():
        raise ValueError(
            f"device {str(dev)!r} does not exist: this machine has {device_count()} "
            f"{dev.type} device(s), indices 0..{device_count() - 1}"
        )
    return dev


def default_device() -> torch.device:
    """The device training runs on when none is named: the current accelerator, else the CPU."""
    acc = torch.accelerator.current_accelerator(check_available=True)
    return acc if acc is not None else torch.device("cpu")


# (op, args, kwargs, result) for every aten op; the result is None before the op has run.
OpCallback: TypeAlias = Callable[[Any, tuple[Any, ...], dict[str, Any], Any], None]


class OpObserver(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Runs every aten op unchanged and shows it to ``before`` and/or ``after``.

    The one dispatch-level hook behind ``count_host_syncs`` and ``track_memory``.
    """

    def __init__(self, before: OpCallback | None = None, after: OpCallback | None = None) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.before, self.after = before, after

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if self.before is not None:
            self.before(func, args, kwargs, None)
        out = func(*args, **kwargs)
        if self.after is not None:
            self.after(func, args, kwargs, out)
        return out
