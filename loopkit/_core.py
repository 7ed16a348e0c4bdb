"""Private core shared by every middleware: device resolution and the decorator engine."""

from __future__ import annotations

import contextlib
from typing import TypeAlias

import torch

DeviceLike: TypeAlias = "str | int | torch.device"


class ContextDecorator(contextlib.ContextDecorator):
    """Base of every middleware: a reusable context manager that also decorates functions.

    ``@mw`` and ``with mw:`` enter the same object, so a middleware keeps one set of
    semantics whichever way it is used.
    """


def resolve_device(device: DeviceLike) -> torch.device:
    """Parse ``device`` and check this machine can use it; raise ValueError saying why not."""
    if isinstance(device, bool) or not isinstance(device, (str, int, torch.device)):
        raise TypeError(
            f"device must be a str, int or torch.device, got {type(device).__name__}: "
            "pass e.g. 'cpu', 'cuda', 'cuda:1' or torch.device('cuda', 0)"
        )
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(
            f"{device!r} is not a device: pass e.g. 'cpu', 'cuda', 'cuda:1' ({err})"
        ) from None
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
