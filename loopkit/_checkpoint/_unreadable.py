"""Which errors reading a checkpoint say the checkpoint is damaged, and which do not.

``resume(skip_damaged=True)`` moves a damaged checkpoint aside and rolls the run back, so
only what a damaged file shows counts: a file or shard missing, a zip or pickle cut short
or corrupt, DCP metadata that cannot be read. An error of the machine (``EIO``/``ESTALE``
on a network filesystem, ``EMFILE``, the host or the GPU out of memory, a collective that
failed) and content that reads but that a safe load refuses (a numpy number in a user's
state) say nothing about the file: they are raised as they are.
"""

from __future__ import annotations

import errno
import pickle
import re
import sys
import zipfile
from collections.abc import Iterable
from pathlib import Path

from .._errors import CheckpointError

# What torch's zip reader says of a file cut short or overwritten (inline_container.cc).
_CORRUPT = ("PytorchStreamReader", "inline_container", "archive is corrupted", "setStorage",
            "out of bounds for storage")  # fmt: skip
# What a machine without memory or a failed device or collective says: never damage.
_MACHINE = ("out of memory", "can't allocate memory", "CUDA error", "CUDA driver", "NCCL",
            "Gloo", "Connection", "timed out", "Timeout")  # fmt: skip
# torch's words for a global it refuses (the second: one of a module it blocks, os.system).
_GLOBAL = re.compile(r"(?:Unsupported global: GLOBAL|unsupported GLOBAL) ([\w.]+)")


def refused_global(err: BaseException) -> str | None:
    """The class or function a safe load refused (``weights_only``) in a whole file, if
    ``err`` is that refusal: the name is one this process has (a numpy scalar, a user's
    class). A name it does not have is a pickle garbled by damage; None then too."""
    found = _GLOBAL.search(str(err)) if isinstance(err, pickle.UnpicklingError) else None
    if found is None:
        return None
    parts = found.group(1).split(".")
    for cut in range(len(parts) - 1, 0, -1):
        # Looked up among the modules already imported: a damaged file imports nothing.
        obj: object = sys.modules.get(".".join(parts[:cut]))
        if obj is None:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name, None)
        return found.group(1) if obj is not None else None
    return None


def _seek_before_start(err: BaseException) -> bool:
    """Whether ``err`` is torch's zip reader seeking before the start of a file cut short
    (``EINVAL`` from a file, a ValueError from a buffer): never the machine's."""
    return isinstance(err, OSError) and err.errno == errno.EINVAL


def of_the_machine(err: BaseException) -> bool:
    """Whether ``err`` is the machine's (I/O, memory, device, collective), not the file's."""
    if isinstance(err, FileNotFoundError) or _seek_before_start(err):  # the checkpoint's
        return False
    if isinstance(err, (OSError, MemoryError)):  # EIO, ESTALE, EMFILE, ENOMEM...
        return True
    return any(m in str(err) for m in _MACHINE)


def is_corruption(err: BaseException) -> bool:
    """Whether ``err``, raised reading a checkpoint, shows the file damaged (see above)."""
    if of_the_machine(err):
        return False
    if isinstance(err, FileNotFoundError) or _seek_before_start(err):  # a file missing or
        return True  # cut short
    if isinstance(err, pickle.UnpicklingError):
        return refused_global(err) is None
    if isinstance(err, (EOFError, zipfile.BadZipFile, ValueError)):  # ValueError: a seek
        return True  # before the start of a file cut short, bytes that decode to no text
    if isinstance(err, RuntimeError):
        return any(m in str(err) for m in _CORRUPT)
    return False


def in_metadata(frames: Iterable[object]) -> bool:
    """Whether a DCP failure's frames (a ``traceback.StackSummary``) passed through the
    reading of its ``.metadata``: a pickle that can fail with any error when overwritten."""
    return any(getattr(f, "name", None) in ("read_metadata", "set_up_storage_reader")
               for f in frames)  # fmt: skip


def dcp_damage(failures: dict[int, object]) -> bool:
    """Whether every rank's failure in a DCP ``CheckpointException`` shows the checkpoint
    damaged (decided alike on every rank: each holds every rank's failure)."""
    hurt = []
    for failure in failures.values():
        exc, frames = failure if isinstance(failure, tuple) and len(failure) == 2 else (failure, ())
        if not isinstance(exc, BaseException):
            return False
        hurt.append(is_corruption(exc) or (in_metadata(frames) and not of_the_machine(exc)))
    return bool(hurt) and all(hurt)


def metadata_damage(directory: Path) -> CheckpointError | None:
    """The damage DCP's ``.metadata`` of ``directory`` shows, read as DCP will read it: each
    rank, before the collective read, so that the ranks agree first. The machine's error is
    raised as it is; any other (missing, overwritten: a pickle fails with any error) is
    returned, for the caller to mark damaged; None if it reads. (DCP's own read wraps it in
    an error that keeps only its text.)"""
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    try:
        FileSystemReader(str(directory)).read_metadata()
    except Exception as err:
        if of_the_machine(err):
            raise
        error = CheckpointError(
            f"{directory}: unreadable (DCP's .metadata is missing or corrupt): {err!r}"
        )
        error.__cause__ = err
        return error
    return None
