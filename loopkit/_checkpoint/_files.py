"""Checkpoint files in a directory: atomic writes, writers' locks, pruning, lineages, safe reads.

Writes are atomic: a hidden temporary file in the same directory, flushed and fsynced,
then renamed over the final name (and the directory fsynced). Only finished files carry
the ``ckpt-*.pt`` name, so a crash during a save leaves the previous checkpoints as they
were. Each writer's temporary has its own name (host, pid, random suffix) and is held
under an exclusive ``flock`` while it is written, so the clean-up of a crashed save's
leftovers never deletes a live writer's file (another process saving into the same
directory). A sharded model's checkpoint (a directory) replacing one of its number (a
re-save at the same update) takes its name by two renames (``replace_dir``); a writer
killed between them leaves the old one aside, which ``restore_replaced`` puts back. A write
the disk refuses raises an ``OSError`` naming the checkpoint and the cause (``No space left
on device``), its temporary removed. Reading uses ``torch.load(weights_only=True)``:
nothing in a file can run code.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import shutil
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any, TypeVar, cast

import torch

from .._errors import CheckpointError
from . import _unreadable

if sys.platform != "win32":
    import fcntl

FORMAT = "loopkit-checkpoint-1"
# A file, or a directory (a sharded model's checkpoint: ``_sharded``).
_NAME = re.compile(r"^ckpt-(\d{10})(\.pt)?$")
_TEMPORARIES = ".ckpt-*.tmp*"
# A replaced checkpoint directory renamed aside (``replace_dir``): its name, the writer's pid,
# a random suffix. No host in it: a host's name may hold ".tmp", which _TEMPORARIES matches.
_ASIDE = re.compile(r"^\.(ckpt-\d{10})\.old-\d+-[0-9a-f]+$")
HOST = re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname()) or "host"
"""This host's name, as temporaries are named (a writer's host, pid and a random suffix)."""

E = TypeVar("E", bound=BaseException)
Moves = list[tuple[Path, Path]]
"""Files moved aside, as (where it was, where it is now)."""


def path_for(directory: Path, number: int, sharded: bool = False) -> Path:
    """Where checkpoint ``number`` is written (a directory for a sharded model's)."""
    return directory / (f"ckpt-{number:010d}" if sharded else f"ckpt-{number:010d}.pt")


def number_of(path: Path) -> int:
    """The number in a checkpoint's file name."""
    match = _NAME.match(path.name)
    assert match is not None  # checkpoints() lists only such names
    return int(match.group(1))


def checkpoints(directory: Path) -> list[Path]:
    """Finished checkpoints of the current lineage in ``directory``, oldest first."""
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if _NAME.match(p.name))


def prune(directory: Path, keep: int, written: Path | None = None) -> None:
    """Delete all but the newest ``keep`` checkpoints, and the leftovers of dead saves.

    ``written``: the checkpoint just written, whose number may name a checkpoint of the
    other kind (a file where a directory is written, or the reverse: a run resumed on
    another number of processes): that one is older, and goes first."""
    if written is not None:
        twin = written.with_name(written.name[:-3] if written.suffix == ".pt" else
                                 f"{written.name}.pt")  # fmt: skip
        remove(twin)
    for old in checkpoints(directory)[:-keep]:
        remove(old)
    remove_stale_temporaries(directory)


def remove(path: Path) -> None:
    """Delete a checkpoint (a file, or a sharded model's directory)."""
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def remove_stale_temporaries(directory: Path) -> None:
    """Delete temporaries of saves that died, never one a live writer is writing; settle
    the checkpoints a dead writer was replacing (``restore_replaced``)."""
    if not directory.is_dir() or sys.platform == "win32":
        # Without flock a live writer's temporary cannot be told from a dead one's:
        # leave them (hidden files; they never carry a checkpoint's name).
        return
    restore_replaced(directory)
    for tmp in directory.glob(_TEMPORARIES):
        with _abandoned(tmp) as dead:
            if dead:
                remove(tmp)  # while locked: see atomic_save (a directory: _sharded.write)


def restore_replaced(*directories: Path) -> None:
    """Settle each checkpoint directory a dead writer renamed aside (``replace_dir``) in
    ``directories``: back under its name if the new one never took it, deleted if it did. A
    resume calls it first (rank zero, before any rank lists the checkpoints)."""
    for aside in (a for d in directories if d.is_dir() for a in d.glob(".ckpt-*.old-*")):
        directory = aside.parent
        match = _ASIDE.match(aside.name)
        if match is None:
            continue
        with _abandoned(aside, lockless=True) as dead:
            if not dead:
                continue
            name = directory / match.group(1)
            if name.exists():
                remove(aside)  # the new one is in place: the rest of the old one goes
            else:
                os.rename(aside, name)  # killed between the renames: the old one, whole
                fsync_dir(directory)


@contextlib.contextmanager
def _abandoned(path: Path, lockless: bool = False) -> Iterator[bool]:
    """Whether ``path``'s writer is gone (its lock free; the kernel drops a dead process's
    lock), held locked meanwhile. Without locks (Windows, a filesystem without flock) no
    writer can be told from a dead one: ``lockless`` is the answer then (a checkpoint set
    aside is put back: no save of this job is running when a resume asks)."""
    if sys.platform == "win32":
        yield lockless
        return
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        yield False  # renamed or removed meanwhile
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:  # a live writer holds it, or the filesystem has no locks
            yield lockless and err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN)
            return
        # The name must still be this inode: a finished save has renamed its file away.
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        yield same
    finally:
        os.close(fd)


def atomic_save(state: object, path: Path, checkpoint: Path | None = None) -> None:
    """Write ``state`` to ``path`` so that the name holds the old file or the whole new one.

    A write the disk refuses raises an ``OSError`` naming ``checkpoint`` (default ``path``)
    and the cause, the temporary removed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # The temporary is named for its writer (host, pid, random) and locked while it lives:
    # remove_stale_temporaries deletes only temporaries whose lock it can take.
    while True:
        tmp = path.with_name(f".{path.name}.tmp-{HOST}-{os.getpid()}-{secrets.token_hex(4)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        if sys.platform == "win32":
            break
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:
            break  # a filesystem without locks: clean-ups cannot lock it either, so they skip it
        if os.fstat(fd).st_nlink:
            break
        # A clean-up locked and deleted it between our open and our lock: start afresh.
        os.close(fd)
    f = os.fdopen(fd, "wb")
    sink = _Sink(f)
    try:
        torch.save(state, cast(IO[bytes], sink))  # it calls write and flush only
        f.flush()
        os.fsync(f.fileno())
        os.replace(tmp, path)  # atomic on POSIX: the name points at the old or the new file
    except BaseException as err:
        tmp.unlink(missing_ok=True)
        cause = err if isinstance(err, OSError) else sink.error
        if cause is not None and isinstance(err, Exception):
            raise write_failed(checkpoint or path, cause) from err
        raise
    finally:
        with contextlib.suppress(OSError):  # a flush the disk refuses: reported above
            f.close()  # releases the lock, after the rename
    fsync_dir(path.parent)


class _Sink:
    """The temporary as ``torch.save`` writes it, keeping the ``OSError`` a write raised:
    torch reports it as its own error (``unexpected pos``), naming neither file nor cause."""

    def __init__(self, f: Any) -> None:
        self.f = f
        self.error: OSError | None = None

    def write(self, data: bytes) -> int:
        try:
            return int(self.f.write(data))
        except OSError as err:
            self.error = err
            raise

    def flush(self) -> None:
        try:
            self.f.flush()
        except OSError as err:
            self.error = err
            raise


def write_failed(checkpoint: Path, cause: BaseException, part: str = "") -> OSError:
    """The error of a checkpoint the disk refused (``part`` of it: a rank's shards): its
    path, the cause (``No space left on device``, ``File too large``, a quota), ``cause``'s
    errno kept for callers to test."""
    number = cause.errno if isinstance(cause, OSError) else None
    said = (cause.strerror if isinstance(cause, OSError) else None) or repr(cause)
    return OSError(
        number if number is not None else errno.EIO,
        f"cannot write the checkpoint {checkpoint}{part}: {said} (nothing of it is left on "
        "disk; the checkpoints written before are as they were)",
    )


def replace_dir(tmp: Path, path: Path) -> None:
    """Rename the complete checkpoint directory ``tmp`` to ``path``, replacing the one there
    (a re-save at the same update), so that a resume finds the old or the new one, whole.

    A directory cannot be renamed over another: the old one is renamed aside (locked by
    this writer until deleted), the new one takes the name, then the old one goes. Killed
    between the renames, ``restore_replaced`` puts the old one back; killed while it is
    deleted, it deletes the rest."""
    if not path.exists():
        os.replace(tmp, path)
        fsync_dir(path.parent)
        return
    aside = path.with_name(f".{path.name}.old-{os.getpid()}-{secrets.token_hex(4)}")
    lock = hold(path)
    try:
        os.rename(path, aside)
        fsync_dir(path.parent)  # on disk before the name is taken: a crash finds one of them
        try:
            os.rename(tmp, path)
        except BaseException:
            os.rename(aside, path)
            raise
        fsync_dir(path.parent)
        remove(aside)
    finally:
        os.close(lock)


def hold(path: Path) -> int:
    """An exclusive lock on ``path`` (a directory being written), held until the returned
    descriptor is closed: ``remove_stale_temporaries`` does not remove a held one."""
    fd = os.open(path, os.O_RDONLY)
    if sys.platform != "win32":
        # A filesystem without locks: clean-ups cannot lock it either, so they skip it.
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def fsync_dir(directory: Path) -> None:
    """Make the renames in ``directory`` durable."""
    if sys.platform == "win32":
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def abandon_newer(directory: Path, target: Path, number: int) -> Moves:
    """Move the checkpoints newer than ``target`` (numbered ``number``) out of the lineage.

    They go to a new ``abandoned-<number>-<time>/`` subdirectory; returns the moves, for
    ``move_back``.
    """
    newer = [
        p
        for p in checkpoints(directory)
        if number_of(p) > number and not (target.exists() and p.samefile(target))
    ]
    if not newer:
        return []
    stamp = time.strftime("%Y%m%d-%H%M%S")
    aside = directory / f"abandoned-{number:010d}-{stamp}"
    n = 1
    while aside.exists():
        n += 1
        aside = directory / f"abandoned-{number:010d}-{stamp}-{n}"
    aside.mkdir()
    moved: Moves = []
    try:
        for p in newer:
            os.replace(p, aside / p.name)
            moved.append((p, aside / p.name))
        fsync_dir(directory)
    except BaseException:
        move_back(moved)
        raise
    return moved


def move_back(moved: Moves) -> None:
    """Undo ``abandon_newer``: the files go back, and the emptied subdirectory goes."""
    for original, aside in reversed(moved):
        os.replace(aside, original)
    if moved:
        aside_dir = moved[0][1].parent
        if not any(aside_dir.iterdir()):
            aside_dir.rmdir()


def load_checkpoint(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a checkpoint safely (no code runs); raise CheckpointError saying what is wrong
    with it (the machine's errors, ``OSError`` or out of memory, are raised as they are).

    A sharded model's checkpoint (a directory, whatever its name: one copied or renamed is
    one still) gives its ``loop.pt``: each DTensor there is a placeholder naming its shards'
    key, global shape and dtype."""
    p = Path(path)
    if p.is_dir():
        if not (p / "loop.pt").is_file():
            if _NAME.match(p.name) or (p / ".metadata").is_file():
                raise damaged(CheckpointError(f"{p}: unreadable (truncated or corrupt): no "
                                              "loop.pt"))  # fmt: skip
            raise CheckpointError(
                f"{p}: a directory without loop.pt, so not a checkpoint (a sharded model's "
                "checkpoint is a directory holding loop.pt beside its shards): pass a "
                "checkpoint file or such a directory, e.g. one of the ckpt-* in it"
            )
        p = p / "loop.pt"
    if not p.is_file():
        raise CheckpointError(f"{p}: no such checkpoint file")
    try:
        state = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as err:
        refused = _unreadable.refused_global(err)
        if refused is not None and "blocked" in str(err):  # made to run code: no damage
            raise CheckpointError(
                f"{p}: refused: loading it would call {refused} (the file holds objects other "
                "than tensors and plain containers, made to run code): never load it"
            ) from err
        if refused is not None:  # a whole file: the state saved in it is the user's to fix
            raise CheckpointError(
                f"{p}: refused: it holds a {refused}, which a safe load (torch.load with "
                "weights_only=True, so that no file can run code) does not read; the file "
                "is whole. Save plain Python numbers, lists and tensors in the state_dict "
                "of what you checkpoint (float(x), x.tolist(), torch.as_tensor(x)), or "
                f"allow it before resume(): torch.serialization.add_safe_globals([{refused}])"
            ) from err
        if not _unreadable.is_corruption(err):  # the machine's error (I/O, memory): as it is
            raise
        raise damaged(CheckpointError(f"{p}: unreadable (truncated or corrupt): {err}")) from err
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        found = state.get("format") if isinstance(state, dict) else type(state).__name__
        error = CheckpointError(f"{p}: not a loopkit checkpoint (found {found!r}, not {FORMAT!r})")
        # Another version's format is no damage: an older checkpoint would roll the run back.
        raise error if isinstance(found, str) else damaged(error)
    return state


def damaged(error: E, is_damaged: bool = True) -> E:
    """``error``, marked as saying the checkpoint is damaged (cannot be read: truncated,
    corrupt, a shard or ``loop.pt`` missing), not that it does not fit the run; returned."""
    setattr(error, "loopkit_damaged", is_damaged)  # noqa: B010 - an exception's own mark
    return error


def is_damaged(error: BaseException | None) -> bool:
    """Whether ``error`` says its checkpoint is damaged (``damaged``)."""
    return bool(getattr(error, "loopkit_damaged", False))
