"""A disk that fills up during one drawn background save, through loopkit's own writer.

``FullDisk(at=k)``: the k-th background save (``async_save=True``) started while it is
active finds the disk full: its file's ``write`` gets ``ENOSPC`` part-way through (after some
bytes reached the temporary), on the writer's thread; loopkit's writer removes its
temporary and keeps the error for the loop, which learns it later. What it records (on the
loop's thread, as each save starts): the checkpoint that fails, the checkpoint directory
(names and bytes) when its save started, and any save started after it before the loop
raised the failure (none may be: the next save waits for the failed one, which raises).
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from loopkit._checkpoint import _background, _files
from loopkit._checkpoint._background import Background

# What a full disk writes before it refuses: some of the checkpoint, not all of it.
_ROOM = 4096


class _FullFile:
    """The temporary's file object on a disk with ``_ROOM`` bytes free."""

    def __init__(self, f: Any) -> None:
        self.f, self.left = f, _ROOM

    def write(self, data: bytes) -> int:
        if len(data) > self.left:
            self.f.write(bytes(data)[: self.left])
            self.left = 0
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.left -= len(data)
        return int(self.f.write(data))

    def flush(self) -> None:
        self.f.flush()


def on_disk(directory: Path) -> dict[str, bytes]:
    """Every entry of ``directory`` (checkpoints, temporaries) and its bytes."""
    if not directory.is_dir():
        return {}
    return {p.name: p.read_bytes() if p.is_file() else b"" for p in sorted(directory.iterdir())}


class FullDisk:
    """While active, the ``at``-th background save finds the disk full (None: none)."""

    def __init__(self, at: int | None) -> None:
        self.at = at
        self.started = 0  # background saves started
        self.failed: Path | None = None
        """The checkpoint whose write failed (None: none yet)."""
        self.before: dict[str, bytes] = {}
        """The checkpoint directory when that write started."""
        self.later: list[str] = []
        """Saves started after the failed one before the loop raised it (none may be)."""
        self.reported = False
        """The loop has raised the failure (set by the caller that caught it)."""
        self.found: list[str] = []
        """What the caller found wrong (``problems``)."""
        self._full = False  # the write in progress finds the disk full
        self._saved: tuple[Any, Any] | None = None

    def __enter__(self) -> FullDisk:
        start, sink = Background.start, _files._Sink
        self._saved = start, sink
        disk = self

        def counted(background: Background, name: str, write: Any) -> None:
            # On the loop's thread, after the save before it is finished (one at a time).
            disk.started += 1
            if disk.pending():
                disk.later.append(name)
            if disk.started == disk.at:
                disk.failed, disk.before = Path(name), on_disk(Path(name).parent)
                write = disk._failing(write)
            start(background, name, write)

        class Sink(sink):  # type: ignore[misc, valid-type]
            def __init__(self, f: Any) -> None:
                super().__init__(_FullFile(f) if disk._full else f)

        Background.start, _files._Sink = counted, Sink  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._saved is not None
        Background.start, _files._Sink = self._saved  # type: ignore[method-assign]

    def _failing(self, write: Callable[[], None]) -> Callable[[], None]:
        """``write``, on a full disk."""

        def full() -> None:  # on the writer's thread
            self._full = True
            try:
                write()
            finally:
                self._full = False

        return full

    def pending(self) -> bool:
        """Whether a save failed that the loop has not raised yet."""
        return self.failed is not None and not self.reported

    def problems(self, error: BaseException) -> list[str]:
        """What is wrong with ``error``, the loop's report of the failed write, and with the
        directory it left: it must name the checkpoint and the cause (ENOSPC, kept as the
        cause's errno), and the checkpoints on disk must be those before the write."""
        assert self.failed is not None
        wrong = []
        cause: BaseException | None = error
        while cause is not None and not isinstance(cause, OSError):
            cause = cause.__cause__
        if cause is None or cause.errno != errno.ENOSPC:
            wrong.append(f"the failed save raised {error!r}, not caused by ENOSPC")
        if str(self.failed) not in str(error):
            wrong.append(f"the failed save's error does not name {self.failed}: {error}")
        after = on_disk(self.failed.parent)
        if after != self.before:
            changed = sorted(set(after) ^ set(self.before)) or [
                k for k in after if after[k] != self.before[k]
            ]
            wrong.append(f"a failed save changed the checkpoints on disk: {changed}")
        if self.later:
            wrong.append(f"saved {self.later} after the failed save, which was not raised")
        return wrong


def exit_reports(world: Any) -> bool:
    """Whether ``world.ckpt``'s failed background save, which nothing waited for, is reported
    when the interpreter exits (loopkit's exit hook judges the saves not waited for: it
    prints the failure and exits with status 1, which a test process cannot do)."""
    return world.ckpt._background in getattr(_background, "_UNCHECKED", ())
