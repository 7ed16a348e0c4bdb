"""An owner record of a checkpoint directory: what it says, and when its job is gone.

A record is a small JSON file ``.loopkit-owner-<n>``: who owns the directory (host, kernel
``boot_id``, pid, process start time, the Slurm job and the torchrun launch with their
restart counts, a random token). ``_owner`` claims and holds it; this module judges it.

A record is stale (taken over, without a person) when:
- on the same machine (the same host name and kernel ``boot_id``: a host name alone is not
  a machine, containers share them), the lock on it is free (the kernel drops a dead
  process's lock); where the filesystem has no locks, its pid is gone, or now names a
  process started at another time (a pid reused), judged in the same pid namespace;
- it was written by an earlier attempt of this job: the same Slurm job and step (and
  cluster) with a lower ``SLURM_RESTART_COUNT`` (a requeue), or, in the same Slurm attempt
  or outside Slurm, the same torchrun launch with a lower ``TORCHELASTIC_RESTART_COUNT``. A
  torchrun launch is its run id and the rendezvous store its workers meet at
  (``MASTER_ADDR:MASTER_PORT``, on this machine where that address is a loopback one): two
  launches given one ``--rdzv-id`` are two jobs, so a refused one's restart is refused too;
- otherwise (another machine): its record was not touched for ``STALE_S`` seconds, measured
  by the filesystem's clock (the mtime of the claimant's own record just written).
A record that names this process, or a process this one descends from (a script that
launches its own workers on its directory), is this job's. A record copied with its
directory (another directory inode) is no one's.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import socket
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

if sys.platform != "win32":
    import fcntl

HEARTBEAT_S = 30.0
"""How often the owner touches its record."""
STALE_S = 300.0
"""A record of another machine untouched this long (filesystem clock) belongs to a dead job."""
RECORD = re.compile(r"^\.loopkit-owner-(\d{10})$")
TEMPORARY = ".loopkit-owner.tmp-"


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def proc_start(pid: int) -> int | None:
    """Process ``pid``'s start time (clock ticks since boot), None if it is gone or a zombie."""
    stat = _read(f"/proc/{pid}/stat")
    if stat is None:
        return None
    fields = stat[stat.rfind(")") + 2 :].split()  # after "(comm)", which may hold spaces
    return None if fields[0] in ("Z", "X") else int(fields[19])


def _ppid(pid: int) -> int | None:
    stat = _read(f"/proc/{pid}/stat")
    return None if stat is None else int(stat[stat.rfind(")") + 2 :].split()[1])


def _count(value: str | None) -> int:
    return int(value) if value is not None and value.isdigit() else 0


def _launches(env: Mapping[str, str]) -> dict[str, Any]:
    """The Slurm job and the torchrun launch this process belongs to, with their restarts."""
    slurm = env.get("SLURM_JOB_ID") or None
    run = env.get("TORCHELASTIC_RUN_ID") or None
    addr, port = env.get("MASTER_ADDR"), env.get("MASTER_PORT")
    return {
        "slurm_job_id": slurm,
        "torchelastic_run_id": None if run == "none" else run,  # torchrun's default: no id
        "slurm": None if slurm is None else [
            env.get("SLURM_CLUSTER_NAME", ""), slurm, env.get("SLURM_STEP_ID", "-")],
        "slurm_restart": _count(env.get("SLURM_RESTART_COUNT")),
        "launch": None if run in (None, "none") else [
            run, f"{addr}:{port}" if addr and port else None],
        "launch_restart": _count(env.get("TORCHELASTIC_RESTART_COUNT")),
    }  # fmt: skip


def me() -> dict[str, Any]:
    """This process as a record names it."""
    pid = os.getpid()
    start = proc_start(pid)
    boot = _read("/proc/stat")
    btime = next((int(line.split()[1]) for line in (boot or "").splitlines()
                  if line.startswith("btime ")), None)  # fmt: skip
    began = time.time() if start is None or btime is None else (
        btime + start / os.sysconf("SC_CLK_TCK"))  # fmt: skip
    try:
        pidns: str | None = os.readlink("/proc/self/ns/pid")
    except OSError:
        pidns = None
    return {
        "host": socket.gethostname(), "pid": pid, "start_ticks": start,
        "boot_id": _read("/proc/sys/kernel/random/boot_id"), "pidns": pidns,
        "started": time.strftime("%Y-%m-%d %H:%M:%S %z", time.localtime(began)),
        **_launches(os.environ),
    }  # fmt: skip


def describe(record: dict[str, Any]) -> str:
    """A job as a message names it: host, pid, start time, its Slurm job or torchrun run."""
    said = f"host {record.get('host')}, pid {record.get('pid')}, started {record.get('started')}"
    if record.get("slurm_job_id"):
        said += f", Slurm job {record['slurm_job_id']}"
    if record.get("torchelastic_run_id"):
        said += f", torchrun run {record['torchelastic_run_id']}"
    return said


def records(directory: Path) -> list[Path]:
    """The owner records in ``directory``, lowest number first."""
    return sorted(directory / n for n in os.listdir(directory) if RECORD.match(n))


def load(path: Path) -> dict[str, Any] | None:
    """The record at ``path``; None if it is empty, half written or not a record."""
    text = _read(str(path))
    try:
        record = json.loads(text) if text else None
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def _same_machine(record: dict[str, Any], me: dict[str, Any]) -> bool:
    return me["boot_id"] is not None and record.get("boot_id") == me["boot_id"] and \
        record.get("host") == me["host"]  # fmt: skip


def _same_process(record: dict[str, Any], pid: object, me: dict[str, Any]) -> bool:
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return False
    return (record.get("pid") == pid and _same_machine(record, me)
            and record.get("start_ticks") == (proc_start(pid) if pid != me["pid"]
                                              else me["start_ticks"]))  # fmt: skip


def ours(record: dict[str, Any], me: dict[str, Any]) -> bool:
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


def locked_by_someone(path: Path) -> bool | None:
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


def _lower(then: object, now: int) -> bool:
    return isinstance(then, int) and not isinstance(then, bool) and then < now


def _loopback(endpoint: str | None) -> bool:
    host = "" if endpoint is None else endpoint.rsplit(":", 1)[0].strip("[]").lower()
    return host in ("", "localhost", "::1", "0.0.0.0", "ip6-localhost") or host.startswith("127.")


def _earlier_attempt(record: dict[str, Any], me: dict[str, Any]) -> bool:
    """Whether ``record`` was written by an earlier attempt of this process's job."""
    slurm = me["slurm"]
    if slurm is not None and record.get("slurm") == slurm and \
            _lower(record.get("slurm_restart"), me["slurm_restart"]):  # fmt: skip
        return True  # a requeue: Slurm stopped every process of the earlier attempt
    launch = me["launch"]
    if launch is None or record.get("launch") != launch or record.get("slurm") != slurm \
            or record.get("slurm_restart") != me["slurm_restart"]:  # fmt: skip
        return False
    if _loopback(launch[1]) and not _same_machine(record, me):
        return False  # a store only this machine reaches: another machine's is another launch
    return _lower(record.get("launch_restart"), me["launch_restart"])


def stale(path: Path, record: dict[str, Any], me: dict[str, Any], now: float) -> str | None:
    """Why ``record`` (at ``path``) belongs to no live job, or None if its job may be alive."""
    if record.get("dir_ino") != os.stat(path.parent).st_ino:
        return "a record copied with the directory"
    if _same_machine(record, me):
        held = locked_by_someone(path)
        if held is not None:
            return None if held else "its process is gone (its lock is free)"
        if record.get("pidns") == me["pidns"]:
            alive = _same_process(record, record.get("pid"), me)
            return None if alive else "its process is gone"
    if _earlier_attempt(record, me):
        return "an earlier attempt of this job, restarted by its launcher"
    age = now - os.stat(path).st_mtime
    return f"no heartbeat for {age:.0f} s" if age > STALE_S else None


def unreadable_stale(path: Path, now: float) -> str | None:
    """Why an unreadable record (empty, half written, not JSON) is no one's, or None while a
    claimant may still be writing it (where links fail, a record is written in place)."""
    if locked_by_someone(path):
        return None
    age = now - os.stat(path).st_mtime
    return f"an unreadable record, untouched for {age:.0f} s" if age > HEARTBEAT_S else None


def refusal(
    directory: Path, path: Path, record: dict[str, Any] | None, now: float, lost: bool
) -> str:
    """What a job refused because ``record`` (None: one being written) is live says."""
    age = now - os.stat(path).st_mtime
    head = (f"this job no longer owns {directory}: another job took it over"
            if lost else f"{directory} is written by another job that is alive")  # fmt: skip
    who = "its owner record is being written" if record is None else describe(record)
    return (
        f"{head} ({who}; last heartbeat {max(age, 0):.0f} s ago). Two jobs "
        "writing one checkpoint directory would overwrite each other's checkpoints: give "
        "this job a directory of its own, or stop the other job first (a killed job's "
        "directory is taken over by the next run: on its machine at once, from another one "
        f"{STALE_S:.0f} s after its last heartbeat, or at once by a later attempt of the same "
        f"Slurm job or torchrun launch). If that job is surely gone, delete {path}"
    )


def sweep(directory: Path, me: dict[str, Any], now: float, own: Path) -> None:
    """Delete the temporary records of claimants killed mid-claim: one whose process (on this
    machine) is gone, or untouched for ``STALE_S`` (a live claimant's lives milliseconds)."""
    for name in os.listdir(directory):
        path = directory / name
        if not name.startswith(TEMPORARY) or path == own:
            continue
        with contextlib.suppress(OSError):  # gone meanwhile, or not ours to delete
            record = load(path)
            gone = record is not None and _same_machine(record, me) and \
                record.get("pidns") == me["pidns"] and \
                not _same_process(record, record.get("pid"), me)  # fmt: skip
            if gone or now - os.stat(path).st_mtime > STALE_S:
                path.unlink()
