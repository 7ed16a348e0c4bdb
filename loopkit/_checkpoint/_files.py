"""Checkpoint files in a directory: atomic writes, writers' locks, pruning, lineages, safe reads.

Writes are atomic: a hidden temporary file in the same directory, flushed and fsynced,
then renamed over the final name (and the directory fsynced). Only finished files carry
the ``ckpt-*.pt`` name, so a crash during a save leaves the previous checkpoints as they
were. Each writer's temporary has its own name (host, pid, random suffix) and is held
under an exclusive ``flock`` while it is written, so the clean-up of a crashed save's
leftovers never deletes a live writer's file (another process saving into the same
directory). Reading uses ``torch.load(weights_only=True)``: nothing in a file can run code.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import secrets
import shutil
import socket
import sys
import time
import zipfile
from pathlib import Path
from typing import Any

import torch

from .._errors import CheckpointError

if sys.platform != "win32":
    import fcntl

FORMAT = "loopkit-checkpoint-1"
# A file, or a directory (a sharded model's checkpoint: ``_sharded``).
_NAME = re.compile(r"^ckpt-(\d{10})(\.pt)?$")
_TEMPORARIES = ".ckpt-*.tmp*"
HOST = re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname()) or "host"
"""This host's name, as temporaries are named (a writer's host, pid and a random suffix)."""

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


def prune(directory: Path, keep: int) -> None:
    """Delete all but the newest ``keep`` checkpoints, and the temporaries of dead saves."""
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
    """Delete temporaries of saves that died; never one a live writer is writing."""
    if not directory.is_dir() or sys.platform == "win32":
        # Without flock a live writer's temporary cannot be told from a dead one's:
        # leave them (hidden files; they never carry a checkpoint's name).
        return
    for tmp in directory.glob(_TEMPORARIES):
        try:
            fd = os.open(tmp, os.O_RDONLY)
        except OSError:
            continue  # renamed or removed meanwhile
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # a live writer holds it
            # Its writer is gone (the kernel drops a dead process's lock). The name must
            # still be this inode: a finished save has renamed its file away.
            try:
                same = os.stat(tmp).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                continue
            if same:
                remove(tmp)  # while locked: see atomic_save (a directory: _sharded.write)
        finally:
            os.close(fd)


def atomic_save(state: object, path: Path) -> None:
    """Write ``state`` to ``path`` so that the name holds the old file or the whole new one."""
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
    try:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
        os.replace(tmp, path)  # atomic on POSIX: the name points at the old or the new file
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        f.close()  # releases the lock, after the rename
    fsync_dir(path.parent)


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
    """Read a checkpoint safely (no code runs); raise CheckpointError saying what is wrong.

    A sharded model's checkpoint (a directory, whatever its name: one copied or renamed is
    one still) gives its ``loop.pt``: each DTensor there is a placeholder naming its shards'
    key, global shape and dtype."""
    p = Path(path)
    if p.is_dir():
        if not (p / "loop.pt").is_file():
            if _NAME.match(p.name) or (p / ".metadata").is_file():
                raise CheckpointError(f"{p}: unreadable (truncated or corrupt): no loop.pt")
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
    except pickle.UnpicklingError as err:
        raise CheckpointError(
            f"{p}: refused: the file holds objects other than tensors and plain containers "
            f"(loading it could run code), or is not a checkpoint: {str(err).splitlines()[0]}"
        ) from err
    except (RuntimeError, EOFError, zipfile.BadZipFile, OSError, ValueError) as err:
        raise CheckpointError(f"{p}: unreadable (truncated or corrupt): {err}") from err
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        found = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise CheckpointError(f"{p}: not a loopkit checkpoint (found {found!r}, not {FORMAT!r})")
    return state
