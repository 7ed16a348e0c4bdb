"""Devices: parse what users write, check this machine has it, and compare devices."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ._types import DeviceLike


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


def local_device(local_rank: int = 0) -> torch.device:
    """This process's device in a job: its local rank's accelerator, else the CPU."""
    acc = torch.accelerator.current_accelerator(check_available=True)
    if acc is None:
        return torch.device("cpu")
    return torch.device(acc.type, local_rank % max(torch.accelerator.device_count(), 1))


def model_device(model: nn.Module) -> torch.device | None:
    """Where the (unwrapped) model's first parameter lives; None for a model without any."""
    for p in model.parameters():
        return p.device
    return None


def same_device(a: torch.device, b: torch.device) -> bool:
    """Whether two devices are one, an index-less accelerator meaning the current one."""
    if a.type != b.type:
        return False
    if a.type == "cpu":
        return True
    module: Any = getattr(torch, a.type, None)
    current = module.current_device() if hasattr(module, "current_device") else 0
    idx_a = a.index if a.index is not None else current
    idx_b = b.index if b.index is not None else current
    return bool(idx_a == idx_b)
