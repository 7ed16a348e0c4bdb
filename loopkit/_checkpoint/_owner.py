"""Who owns a checkpoint directory: one job writes it; a second is refused while the first lives.

Rank zero of a job (the process that writes) claims the directory at its Checkpointer's
first save, or at its first ``resume()`` of a directory that exists, and checks at each one
that it still owns it; the other ranks learn its verdict through ``_ranks`` (one host-level
exchange per save and resume), so every rank of the job goes on or raises alike and none of
them is ever refused for its own job. Whatever goes wrong while rank zero judges becomes
that verdict, a refusal naming the record.

The owner record (``_claim_rules`` judges it) is written under a temporary name, locked
(``flock``), and linked to its name ``.loopkit-owner-<n>``, which fails if the name exists:
of two jobs that take ``n + 1`` over from a stale ``n`` at once, exactly one gets it, and the
other finds it live. A filesystem without hard links gets the record created in place
(``O_EXCL``: one winner too), and one without that either no guard, with a warning. The
owner keeps the lock while it owns the directory and touches the record every
``HEARTBEAT_S`` seconds (and at each save).

A claim is held for the Checkpointers of this process that use the directory: it is given
up when the last of them is closed or garbage-collected (after its background save is
written), at ``distributed.teardown`` (after every background save), or at exit.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import errno
import json
import os
import secrets
import sys
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from .. import _job, _ranks
from .._errors import CheckpointError
from ._claim_rules import (
    HEARTBEAT_S,
    RECORD,
    STALE_S,
    TEMPORARY,
    load,
    me,
    ours,
    records,
    refusal,
    stale,
    sweep,
    unreadable_stale,
)

if sys.platform != "win32":
    import fcntl

__all__ = ["HEARTBEAT_S", "STALE_S", "claimed", "release"]
_me = me  # what a record of this process says (tests and tools forge others from it)

# Filesystems that refuse a record (read-only, another user's, full): no job can write there,
# so there is nothing to guard; the save that tries says why.
_CANNOT_WRITE = (errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EDQUOT)
# link() on filesystems without hard links (gcsfuse, mountpoint-s3, blobfuse, some SMB and
# FUSE mounts): the record is created in place instead.
_NO_LINKS = (errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EXDEV, errno.EPERM,
             errno.EMLINK)  # fmt: skip


@dataclasses.dataclass
class _Held:
    path: Path
    token: str
    fd: int
    holders: dict[int, weakref.finalize[Any, Any]] = dataclasses.field(default_factory=dict)


_HELD: dict[str, _Held] = {}
_LOCK = threading.RLock()
_BEAT: list[threading.Event] = []
_UNGUARDED: set[str] = set()  # directories warned about (no guard there)


def _key(directory: Path) -> str:
    return str(directory.resolve())


def _claim(directory: Path, create: bool = True) -> tuple[str | None, bool]:
    """Rank zero's verdict: (a refusal or None, whether this call made the claim).
    ``create``: a save's (it makes the directory); a resume claims only one that exists."""
    key = _key(directory)
    with _LOCK:
        held = _HELD.get(key)
        lost = False
        if held is not None:
            record = load(held.path)
            if record is not None and record.get("token") == held.token and \
                    records(directory)[-1:] == [held.path]:  # fmt: skip
                with contextlib.suppress(OSError):  # a heartbeat at each save, too
                    os.utime(held.path)
                return None, False
            _drop(key)  # taken over, or its record removed: claimed anew below, or refused
            lost = True
        if not create and not directory.is_dir():
            return None, False  # nothing to guard yet: the first save claims it
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            if err.errno in _CANNOT_WRITE:
                return None, False
            raise
        mine = me()
        token = secrets.token_hex(8)
        mine.update(token=token, directory=key, dir_ino=os.stat(directory).st_ino)
        tmp = directory / f"{TEMPORARY}{os.getpid()}-{token}"
        try:
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        except OSError as err:
            if err.errno in _CANNOT_WRITE:
                return None, False
            raise
        try:
            _written(fd, mine)  # locked before it has its name: never found unlocked alive
            verdict = _take(directory, tmp, fd, mine, lost)  # fd: held or closed, unless it raises
        except BaseException:
            os.close(fd)
            raise
        finally:
            tmp.unlink(missing_ok=True)
        if verdict[1]:
            _heartbeat()
        return verdict


def _written(fd: int, mine: dict[str, Any]) -> None:
    """Lock ``fd``'s file and write the record into it."""
    if sys.platform != "win32":
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_EX)
    os.write(fd, json.dumps(mine).encode())
    os.fsync(fd)


def _take(
    directory: Path, tmp: Path, fd: int, mine: dict[str, Any], lost: bool
) -> tuple[str | None, bool]:
    """Link ``tmp`` as the next record unless a live job owns the directory (``lost``: this
    process owned it until that job took it over)."""
    now = os.fstat(fd).st_mtime  # the filesystem's clock
    while True:
        found = records(directory)
        number = 0
        if found:
            newest = found[-1]
            number = int(RECORD.match(newest.name).group(1))  # type: ignore[union-attr]
            record = load(newest)
            try:
                verdict = _verdict(directory, newest, record, mine, now, lost)
            except FileNotFoundError:
                continue  # released or taken over meanwhile: look again
            except Exception as err:  # a record no rule foresaw: refused, naming it
                verdict = (f"cannot tell whether the job named in {newest} is alive "
                           f"({err!r}): if no other job writes this directory, delete "
                           "that file"), False  # fmt: skip
            if verdict is not None:
                os.close(fd)
                return verdict
        name = directory / f".loopkit-owner-{number + 1:010d}"
        try:
            holder = _named(tmp, name, fd, mine)
        except FileExistsError:
            continue  # another claimant took it first: judge that one
        if holder is None:
            os.close(fd)
            return None, False
        _HELD[mine["directory"]] = _Held(name, mine["token"], holder)
        if holder != fd:
            os.close(fd)  # the record was created in place: its own descriptor holds it
        with contextlib.suppress(OSError):  # tidying: the claim is made
            for old in found:
                old.unlink(missing_ok=True)
            sweep(directory, mine, now, tmp)
        return None, True


def _verdict(
    directory: Path,
    newest: Path,
    record: dict[str, Any] | None,
    mine: dict[str, Any],
    now: float,
    lost: bool,
) -> tuple[str | None, bool] | None:
    """What the newest record says: None (stale: take it over), or the verdict to return."""
    if record is not None and record.get("dir_ino") == mine["dir_ino"] and ours(record, mine):
        return None, False
    why = unreadable_stale(newest, now) if record is None else stale(newest, record, mine, now)
    return None if why is not None else (refusal(directory, newest, record, now, lost), False)


def _named(tmp: Path, name: Path, fd: int, mine: dict[str, Any]) -> int | None:
    """Give the record ``name`` (FileExistsError if taken): the descriptor holding its lock
    (``fd``, or one of its own where it was created in place), or None where the filesystem
    can do neither a link nor an exclusive create (no guard)."""
    try:
        os.link(tmp, name)
        return fd
    except OSError as err:
        if err.errno not in _NO_LINKS:
            raise
    try:  # no hard links: created in place, exclusively (a reader waits for its contents)
        made = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    except OSError as err:
        if err.errno not in _NO_LINKS + _CANNOT_WRITE:
            raise
        if mine["directory"] not in _UNGUARDED:
            _UNGUARDED.add(mine["directory"])
            warnings.warn(f"{name.parent} is on a filesystem that can neither link nor "
                          f"create a file exclusively ({err}): loopkit cannot keep a second "
                          "job from writing it, so make sure no other job is given this "
                          "directory", RuntimeWarning, stacklevel=2)  # fmt: skip
        return None
    try:
        _written(made, mine)
    except BaseException:
        os.close(made)
        name.unlink(missing_ok=True)
        raise
    return made


def _drop(key: str) -> None:
    """Forget a claim (and delete its record if it is still this process's)."""
    held = _HELD.pop(key, None)
    if held is None:
        return
    for gone in held.holders.values():
        gone.detach()
    record = load(held.path)
    if record is not None and record.get("token") == held.token:
        held.path.unlink(missing_ok=True)
    os.close(held.fd)


def _hold(directory: Path, holder: object, settle: Callable[[], None] | None) -> None:
    """``holder`` (a Checkpointer) keeps the claim on ``directory`` while it lives; once it
    is collected, ``settle`` (its background save) is waited for before it lets go."""
    with _LOCK:
        key = _key(directory)
        held = _HELD.get(key)
        if held is not None and id(holder) not in held.holders:
            held.holders[id(holder)] = weakref.finalize(
                holder, _let_go, key, held.token, id(holder), settle
            )


def _let_go(key: str, token: str, holder: int, settle: Callable[[], None] | None) -> None:
    """A holder is gone: give the claim up if it was the last one."""
    if settle is not None:
        settle()  # its save in flight is written first
    with _LOCK:
        held = _HELD.get(key)
        if held is not None and held.token == token:
            held.holders.pop(holder, None)
            if not held.holders:
                _drop(key)


def release(directory: Path, holder: object | None = None) -> None:
    """Give up ``directory`` (a later save or resume claims it again); with ``holder``, only
    its hold (the claim goes with the last one)."""
    with _LOCK:
        key = _key(directory)
        held = _HELD.get(key)
        if held is not None and holder is not None:
            gone = held.holders.pop(id(holder), None)
            if gone is not None:
                gone.detach()
            if held.holders:
                return
        _drop(key)


class _Releaser:
    def release_all(self) -> None:
        """Give up every directory this process owns (teardown, exit)."""
        with _LOCK:
            for key in list(_HELD):
                _drop(key)


_RELEASER = _Releaser()
_OWNER_PID = os.getpid()


def _at_exit() -> None:
    if os.getpid() == _OWNER_PID:  # not in a forked child, which owns nothing
        _RELEASER.release_all()


atexit.register(_at_exit)


def _forked() -> None:
    """A forked child (a loader worker) owns nothing: its parent does."""
    global _LOCK
    _LOCK = threading.RLock()  # the parent's heartbeat may have held it at the fork
    for held in _HELD.values():
        for gone in held.holders.values():
            gone.detach()
        os.close(held.fd)  # the parent's lock stays: it holds its own descriptor
    _HELD.clear()
    _BEAT.clear()  # the heartbeat thread is not forked: a claim here starts its own


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked)


def _heartbeat() -> None:
    """Touch each record this process holds every HEARTBEAT_S seconds (one daemon thread)."""
    if _BEAT:
        return
    stop = threading.Event()
    _BEAT.append(stop)

    def beat() -> None:
        while not stop.wait(HEARTBEAT_S):
            with _LOCK:
                for held in _HELD.values():
                    with contextlib.suppress(OSError):  # taken over: the next save says so
                        os.utime(held.path)

    threading.Thread(target=beat, name="loopkit owner heartbeat", daemon=True).start()


@contextlib.contextmanager
def claimed(directory: Path, holder: object = None, create: bool = True) -> Iterator[None]:
    """A save (``create``) or a resume into ``directory`` by ``holder`` (a Checkpointer):
    refused on every rank (CheckpointError naming the other job) while another live job owns
    it; a claim this call made is given up if the call raises (as if it never ran)."""
    refusal, fresh = None, False
    if _ranks.world()[0] == 0:
        try:
            refusal, fresh = _claim(directory, create)
        except Exception as err:  # any failure is rank zero's verdict, for every rank
            refusal = f"cannot claim {directory} for this job: {err!r}"
    said = _ranks.gather_objects(refusal)[0]  # rank zero's verdict, for every rank
    if said is not None:
        raise CheckpointError(said)
    try:
        yield
    except BaseException:
        if fresh:
            release(directory)
        raise
    if _HELD and holder is not None:
        background = getattr(holder, "_background", None)
        _hold(directory, holder, None if background is None else background.join)
        # Given up at teardown, after every background save (whenever it was registered).
        _job.before_teardown(_RELEASER.release_all, last=True)
