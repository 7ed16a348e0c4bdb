"""The extension contracts, written once: what a user's object must be to plug into loopkit.

Re-exported from ``loopkit``. Each is a structural type (a ``Protocol``) or an alias, so an
object fits by what it has, not by what it inherits.
"""

from __future__ import annotations

from typing import Any, Literal, Protocol, TypeAlias, runtime_checkable

import torch

DeviceLike: TypeAlias = "str | int | torch.device"
"""A device as users write it: ``"cuda"``, ``"cuda:1"``, ``0`` or a ``torch.device``."""

Weight: TypeAlias = "float | int | torch.Tensor"
"""A micro-batch's weight in its window: its sample or token count (a number or 0-d tensor)."""

Precision: TypeAlias = Literal["bf16", "fp16", "fp32"]
"""A precision by name; ``precision=`` also takes ``torch.bfloat16``/``float16``/``float32``."""
PrecisionLike: TypeAlias = "Precision | str | torch.dtype"

Reduction: TypeAlias = Literal["mean", "sum", "max", "min", "last"]
"""How ``detach_logging`` reduces a metric over a flush interval (and over ranks)."""

SyncKind: TypeAlias = Literal["none", "ddp", "fsdp1", "fsdp2"]
"""What synchronizes a model's gradients across ranks."""


@runtime_checkable
class Stateful(Protocol):
    """Anything a checkpoint can carry: it gives and takes a state dict."""

    def state_dict(self) -> Any: ...
    def load_state_dict(self, state: Any, /) -> Any: ...


class Sink(Protocol):
    """Where reduced metrics go: any callable taking the dict of floats.

    A sink that also declares a ``step`` keyword receives the x-axis: the optimizer-update
    count of the step the log belongs to (the number of ``log(...)`` calls for a log with
    no step); one that declares ``axes`` also gets the epoch, samples and tokens seen.
    """

    def __call__(self, metrics: dict[str, float], /) -> object: ...


@runtime_checkable
class Scheduler(Protocol):
    """A learning-rate scheduler stepped once per optimizer update, with no argument."""

    def step(self) -> object: ...


class Clock(Protocol):
    """What is read of a step's windows: updates, the open window, the held-back batch.

    ``loopkit.accumulate`` and ``loopkit.steps`` are clocks; a ``loopkit.step``'s is its
    ``accumulator``.
    """

    @property
    def updates(self) -> int: ...
    @property
    def micro_step(self) -> int: ...
    def settle(self) -> int: ...
    @property
    def every(self) -> int: ...
    @property
    def lookahead(self) -> int: ...
