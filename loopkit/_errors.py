"""loopkit's exceptions: one base, so ``except loopkit.LoopkitError`` catches what loopkit raises
for its own reasons. Bad arguments keep raising the built-in ``TypeError``/``ValueError``."""

from __future__ import annotations


class LoopkitError(Exception):
    """Base of the errors loopkit raises for its own reasons (not for a bad argument)."""


class CheckpointError(LoopkitError, RuntimeError):
    """A checkpoint file that cannot be used: unreadable, unsafe, or for another setup."""


class OpenWindowWarning(UserWarning):
    """Micro-steps of a loopkit window that did not (or not yet) become their own update."""


class UnwrappedModelWarning(UserWarning):
    """A step built on a model that its process group does not keep in sync."""


class SinkFailedWarning(UserWarning):
    """A logging sink raised: reported once; training and the other sinks go on."""
