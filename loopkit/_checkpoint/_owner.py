"""Who owns a checkpoint directory: one job writes it; a second is refused while the first lives.

Rank zero of a job (the process that writes) claims the directory at its Checkpointer's
first ``resume()`` or save, and checks at each one that it still owns it; the other ranks
learn its verdict through ``_ranks`` (one host-level exchange per save and resume), so every
rank of the job goes on or raises alike and none of them is ever refused for its own job.

An owner record is a small file ``.loopkit-owner-<n>`` in the directory: who owns it (host,
pid, process start time, the Slurm or torchrun job and its restart count, a random token).
It is written under a temporary name, locked (``flock``), and linked to its name, which
fails if the name exists: of two jobs that take ``n + 1`` over from a stale ``n`` at once,
exactly one gets it, and the other finds it live. The owner keeps the lock for as long as it
owns the directory and touches the record every ``HEARTBEAT_S`` seconds (and at each save).

A record is stale (taken over, without a person) when:
- on the same machine (the same kernel ``boot_id``), the lock on it is free (the kernel drops
  a dead process's lock); where the filesystem has no locks, its pid is gone, or now names a
  process started at another time (a pid reused), judged in the same pid namespace;
- it was written by an earlier attempt of this job (the same ``SLURM_JOB_ID`` and step, or
  the same ``TORCHELASTIC_RUN_ID`` other than torchrun's default ``none``, with a lower
  ``SLURM_RESTART_COUNT``/``TORCHELASTIC_RESTART_COUNT``): a launcher restarts a job once its
  processes are stopped; one that still runs (a zombie) finds at its next save that it lost
  the directory, and raises instead of writing;
- otherwise (another host): its record was not touched for ``STALE_S`` seconds, measured
  by the filesystem's clock (the mtime of the claimant's own record just written).
A record that names this process, or a process this one descends from (a script that
launches its own workers on its directory), is this job's. A record copied with its
directory (another directory inode) is no one's. The record goes at a clean end:
``distributed.teardown``, ``Checkpointer.close()``, the process's exit.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import errno
import json
import os
import re
import secrets
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .. import _job, _ranks
from .._errors import CheckpointError

if sys.platform != "win32":
    import fcntl

HEARTBEAT_S = 30.0
"""How often the owner touches its record."""
STALE_S = 300.0
"""A record on another host untouched this long (filesystem clock) belongs to a dead job."""
_RECORD = re.compile(r"^\.loopkit-owner-(\d{10})$")
_TEMPORARY = ".loopkit-owner.tmp-"
# Filesystems that refuse a record (read-only, another user's, full): no job can write there,
# so there is nothing to guard; the save that tries says why.
_CANNOT_WRITE = (errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EDQUOT)


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _proc_start(pid: int) -> int | None:
    """Process ``pid``'s start time (clock ticks since boot), None if it is gone or a zombie."""
    stat = _read(f"/proc/{pid}/stat")
    if stat is None:
        return None
    fields = stat[stat.rfind(")") + 2 :].split()  # after "(comm)", which may hold spaces
    return None if fields[0] in ("Z", "X") else int(fields[19])


def _ppid(pid: int) -> int | None:
    stat = _read(f"/proc/{pid}/stat")
    return None if stat is None else int(stat[stat.rfind(")") + 2 :].split()[1])


def _me() -> dict[str, Any]:
    """This process as a record names it."""
    pid, env = os.getpid(), os.environ
    start = _proc_start(pid)
    boot = _read("/proc/stat")
    btime = next((int(line.split()[1]) for line in (boot or "").splitlines()
                  if line.startswith("btime ")), None)  # fmt: skip
    began = time.time() if start is None or btime is None else (
        btime + start / os.sysconf("SC_CLK_TCK"))  # fmt: skip
    run = env.get("TORCHELASTIC_RUN_ID") if env.get("TORCHELASTIC_RUN_ID") != "none" else None
    slurm = env.get("SLURM_JOB_ID")
    job = f"slurm {slurm} step {env.get('SLURM_STEP_ID', '-')}" if slurm else (
        f"torchrun {run}" if run else None)  # fmt: skip
    restarts = [int(env.get(k, "0") or 0) if env.get(k, "0").isdigit() else 0
                for k in ("SLURM_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT")]  # fmt: skip
    try:
        pidns: str | None = os.readlink("/proc/self/ns/pid")
    except OSError:
        pidns = None
    return {
        "host": socket.gethostname(), "pid": pid, "start_ticks": start,
        "boot_id": _read("/proc/sys/kernel/random/boot_id"),
        "pidns": pidns,
        "started": time.strftime("%Y-%m-%d %H:%M:%S %z", time.localtime(began)),
        "job": job, "slurm_job_id": slurm, "torchelastic_run_id": run, "restarts": restarts,
    }  # fmt: skip


def describe(record: dict[str, Any]) -> str:
    """A job as a message names it: host, pid, start time, its Slurm job or torchrun run."""
    said = f"host {record.get('host')}, pid {record.get('pid')}, started {record.get('started')}"
    if record.get("slurm_job_id"):
        said += f", Slurm job {record['slurm_job_id']}"
    if record.get("torchelastic_run_id"):
        said += f", torchrun run {record['torchelastic_run_id']}"
    return said


@dataclasses.dataclass
class _Held:
    path: Path
    token: str
    fd: int


_HELD: dict[str, _Held] = {}
_LOCK = threading.RLock()
_BEAT: list[threading.Event] = []


def _key(directory: Path) -> str:
    return str(directory.resolve())


def _records(directory: Path) -> list[Path]:
    """The owner records in ``directory``, lowest number first."""
    return sorted(directory / n for n in os.listdir(directory) if _RECORD.match(n))


def _load(path: Path) -> dict[str, Any] | None:
    text = _read(str(path))
    try:
        record = json.loads(text) if text else None
    except ValueError:
        return None  # written half by a claimant killed mid-write: no one's
    return record if isinstance(record, dict) else None


def _same_process(record: dict[str, Any], pid: int, me: dict[str, Any]) -> bool:
    return (record.get("pid") == pid and record.get("host") == me["host"]
            and record.get("boot_id") == me["boot_id"]
            and record.get("start_ticks") == (_proc_start(pid) if pid != me["pid"]
                                              else me["start_ticks"]))  # fmt: skip


def _ours(record: dict[str, Any], me: dict[str, Any]) -> bool:
    """Whether ``record`` names this process or one it descends from (the same job)."""
    if _same_process(record, me["pid"], me):
        return True
    if me["pidns"] is None or record.get("pidns") != me["pidns"]:
        return False
    pid: int | None = os.getppid()
    for _ in range(64):
        if not pid or pid <= 1:
            return False
        if _same_process(record, pid, me):
            return True
        pid = _ppid(pid)
    return False


def _locked_by_someone(path: Path) -> bool | None:
    """Whether a process holds ``path``'s lock (the owner's); None where locks do not work."""
    if sys.platform == "win32":
        return None
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False  # gone meanwhile: released
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # shared: probes never block each other
    except OSError as err:
        return True if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN) else None
    finally:
        os.close(fd)
    return False


def _stale(path: Path, record: dict[str, Any], me: dict[str, Any], now: float) -> str | None:
    """Why ``record`` (at ``path``) belongs to no live job, or None if its job may be alive."""
    if record.get("dir_ino") != os.stat(path.parent).st_ino:
        return "a record copied with the directory"
    if record.get("host") == me["host"] and me["boot_id"] is not None:
        if record.get("boot_id") != me["boot_id"]:
            return "its host has restarted since"
        held = _locked_by_someone(path)
        if held is not None:
            return None if held else "its process is gone (its lock is free)"
        if record.get("pidns") == me["pidns"]:
            alive = _same_process(record, int(record.get("pid", 0)), me)
            return None if alive else "its process is gone"
    earlier = record.get("restarts")
    if me["job"] is not None and record.get("job") == me["job"] and isinstance(earlier, list) \
            and earlier < me["restarts"]:  # fmt: skip
        return "an earlier attempt of this job, restarted by its launcher"
    age = now - os.stat(path).st_mtime
    return f"no heartbeat for {age:.0f} s" if age > STALE_S else None


def _refusal(directory: Path, path: Path, record: dict[str, Any], now: float, lost: bool) -> str:
    age = now - os.stat(path).st_mtime
    head = (f"this job no longer owns {directory}: another job took it over"
            if lost else f"{directory} is written by another job that is alive")  # fmt: skip
    return (
        f"{head} ({describe(record)}; last heartbeat {max(age, 0):.0f} s ago). Two jobs "
        "writing one checkpoint directory would overwrite each other's checkpoints: give "
        "this job a directory of its own, or stop the other job first (a killed job's "
        "directory is taken over by the next run: on its host at once, from another host "
        f"{STALE_S:.0f} s after its last heartbeat, or at once by a later attempt of the same "
        f"Slurm job or torchrun run). If that job is surely gone, delete {path}"
    )


def _claim(directory: Path) -> tuple[str | None, bool]:
    """Rank zero's verdict: (a refusal or None, whether this call made the claim)."""
    key = _key(directory)
    with _LOCK:
        held = _HELD.get(key)
        lost = False
        if held is not None:
            record = _load(held.path)
            if record is not None and record.get("token") == held.token and \
                    _records(directory)[-1:] == [held.path]:  # fmt: skip
                with contextlib.suppress(OSError):  # a heartbeat at each save, too
                    os.utime(held.path)
                return None, False
            _drop(key)  # taken over, or its record removed: claimed anew below, or refused
            lost = True
        directory.mkdir(parents=True, exist_ok=True)
        me = _me()
        token = secrets.token_hex(8)
        me.update(token=token, directory=key, dir_ino=os.stat(directory).st_ino)
        tmp = directory / f"{_TEMPORARY}{os.getpid()}-{token}"
        try:
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        except OSError as err:
            if err.errno in _CANNOT_WRITE:
                return None, False
            raise
        try:
            if sys.platform != "win32":
                # Locked before it has its name: no probe ever finds it unlocked while alive.
                with contextlib.suppress(OSError):
                    fcntl.flock(fd, fcntl.LOCK_EX)
            os.write(fd, json.dumps(me).encode())
            os.fsync(fd)
            return _take(directory, tmp, fd, me, lost)
        except BaseException:
            os.close(fd)
            raise
        finally:
            tmp.unlink(missing_ok=True)


def _take(
    directory: Path, tmp: Path, fd: int, me: dict[str, Any], lost: bool
) -> tuple[str | None, bool]:
    """Link ``tmp`` as the next record unless a live job owns the directory (``lost``: this
    process owned it until that job took it over)."""
    now = os.fstat(fd).st_mtime  # the filesystem's clock
    while True:
        records = _records(directory)
        number = 0
        if records:
            newest = records[-1]
            number = int(_RECORD.match(newest.name).group(1))  # type: ignore[union-attr]
            record = _load(newest) or {}
            if record and record.get("dir_ino") == me["dir_ino"] and _ours(record, me):
                os.close(fd)
                return None, False
            try:
                why = _stale(newest, record, me, now) if record else "an unreadable record"
            except FileNotFoundError:
                continue  # released or taken over meanwhile: look again
            if why is None:
                os.close(fd)
                return _refusal(directory, newest, record, now, lost), False
        name = directory / f".loopkit-owner-{number + 1:010d}"
        try:
            os.link(tmp, name)
        except FileExistsError:
            continue  # another claimant took it first: judge that one
        for old in records:
            old.unlink(missing_ok=True)
        _HELD[me["directory"]] = _Held(name, me["token"], fd)
        _heartbeat()
        return None, True


def _drop(key: str) -> None:
    """Forget a claim (and delete its record if it is still this process's)."""
    held = _HELD.pop(key, None)
    if held is None:
        return
    record = _load(held.path)
    if record is not None and record.get("token") == held.token:
        held.path.unlink(missing_ok=True)
    os.close(held.fd)


def release(directory: Path) -> None:
    """Give up ``directory`` (a later save or resume claims it again)."""
    with _LOCK:
        _drop(_key(directory))


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
def claimed(directory: Path) -> Iterator[None]:
    """A save or a resume into ``directory``: refused on every rank (CheckpointError naming
    the other job) while another live job owns it; a claim this call made is given up if
    the call raises (as if it never ran)."""
    refusal, fresh = None, False
    if _ranks.world()[0] == 0:
        try:
            refusal, fresh = _claim(directory)
        except OSError as err:
            refusal = f"cannot claim {directory} for this job: {err}"
    said = _ranks.gather_objects(refusal)[0]  # rank zero's verdict, for every rank
    if said is not None:
        raise CheckpointError(said)
    try:
        yield
    except BaseException:
        if fresh:
            release(directory)
        raise
    if _HELD:
        # Given up at teardown, after the background save the call started is written
        # (registered after it: teardown runs its hooks in order).
        _job.before_teardown(_RELEASER.release_all)
