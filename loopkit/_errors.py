"""loopkit's exceptions: one base, so ``except loopkit.LoopkitError`` catches what loopkit raises
for its own reasons. Bad arguments keep raising the built-in ``TypeError``/``ValueError``.

Each class says it lives in ``loopkit`` (``__module__``), where users import it from: a
traceback prints ``loopkit.CheckpointError``, the name to catch, not this private module's.
"""

from __future__ import annotations


class LoopkitError(Exception):
    """Base of the errors loopkit raises for its own reasons (not for a bad argument)."""

    __module__ = "loopkit"


class CheckpointError(LoopkitError, RuntimeError):
    """A checkpoint file that cannot be used: unreadable, unsafe, or for another setup."""

    __module__ = "loopkit"


class OpenWindowWarning(UserWarning):
    """Micro-steps of a loopkit window that did not (or not yet) become their own update."""

    __module__ = "loopkit"


class UnwrappedModelWarning(UserWarning):
    """A step built on a model that its process group does not keep in sync."""

    __module__ = "loopkit"


class SinkFailedWarning(UserWarning):
    """A logging sink raised: reported once; training and the other sinks go on."""

    __module__ = "loopkit"


class ResumeWarning(UserWarning):
    """A resumed (or relaunched) run whose loop would train the wrong epochs, or nothing."""

    __module__ = "loopkit"
