"""Who owns a checkpoint directory: a live job's is refused to a second job, naming it; a
killed job's is taken over (at once on its host, by a later attempt of the same job, or
after its heartbeat stops elsewhere), by exactly one of the jobs that race for it."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import mlp

import loopkit
from loopkit._checkpoint import _owner

_FORK = multiprocessing.get_context("fork")


def _ckpt(directory: Path) -> loopkit.Checkpointer:
    model = mlp()
    return loopkit.Checkpointer(directory, model=model,
                                optimizer=torch.optim.SGD(model.parameters(), lr=0.1))  # fmt: skip


@pytest.fixture(autouse=True)
def _released() -> Iterator[None]:
    """Each test starts and ends with no directory owned by this process."""
    _owner._RELEASER.release_all()
    yield
    _owner._RELEASER.release_all()


def _own_then_wait(directory: str, ready: Any, done: Any) -> None:
    """Another job (a forked process, no descendant of the test): saves into ``directory``,
    then lives until told to end (or is killed)."""
    try:
        _ckpt(Path(directory)).save()
        ready.send(os.getpid())
        done.recv()
    finally:
        os._exit(0)


def _other_job(directory: Path) -> tuple[Any, Any, int]:
    """Start another live job owning ``directory``; its process, its pipe and pid."""
    _ckpt(directory)  # the imports a Checkpointer needs, once, before the fork (no claim)
    ours, theirs = _FORK.Pipe()
    proc = _FORK.Process(target=_own_then_wait, args=(str(directory), theirs, theirs))
    proc.start()
    assert ours.poll(60), "the other job did not start"
    return proc, ours, ours.recv()


def _records(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.glob(".loopkit-owner-*"))


def test_a_second_job_is_refused_naming_the_live_owner(tmp_path: Path) -> None:
    """A live job owns the directory: resume() and save() of another job raise at once,
    naming its host, pid and start time, and change nothing (no file, no state)."""
    proc, pipe, pid = _other_job(tmp_path)
    try:
        before = sorted(p.name for p in tmp_path.iterdir())
        ckpt = _ckpt(tmp_path)
        for call in (ckpt.resume, ckpt.save):
            with pytest.raises(loopkit.CheckpointError) as info:
                call()
            said = str(info.value)
            assert "is written by another job that is alive" in said
            assert f"pid {pid}" in said and f"host {os.uname().nodename}" in said
            assert "started 20" in said and "a directory of its own" in said
        assert sorted(p.name for p in tmp_path.iterdir()) == before
        assert ckpt.last_saved_update is None and not ckpt._used
    finally:
        pipe.send(None)
        proc.join(30)


def test_a_killed_jobs_directory_is_taken_over_at_once(tmp_path: Path) -> None:
    """SIGKILL leaves the record behind; the next job on the same host takes it over at
    once (the dead process's lock is free) and resumes its checkpoint."""
    proc, _, pid = _other_job(tmp_path)
    os.kill(pid, signal.SIGKILL)
    proc.join(30)
    assert _records(tmp_path) == [".loopkit-owner-0000000001"]
    ckpt = _ckpt(tmp_path)
    assert ckpt.resume() == tmp_path / "ckpt-0000000001.pt"
    assert _records(tmp_path) == [".loopkit-owner-0000000002"]
    record = json.loads((tmp_path / ".loopkit-owner-0000000002").read_text())
    assert record["pid"] == os.getpid()
    ckpt.close()  # a clean end gives it up
    assert _records(tmp_path) == []


def _forged(directory: Path, number: int = 1, age: float = 0.0, **fields: Any) -> Path:
    """An owner record as another job would have left it, last touched ``age`` s ago."""
    record = {"host": "node-b", "pid": 4242, "started": "2030-01-01 00:00:00 +0000",
              "start_ticks": 1, "boot_id": "other", "pidns": "pid:[1]", "job": None,
              "restarts": [0, 0], "token": "feed", "dir_ino": os.stat(directory).st_ino,
              "slurm_job_id": None, "torchelastic_run_id": None}  # fmt: skip
    record.update(fields)
    path = directory / f".loopkit-owner-{number:010d}"
    path.write_text(json.dumps(record))
    stamp = time.time() - age
    os.utime(path, (stamp, stamp))
    return path


def test_another_hosts_owner_is_live_until_its_heartbeat_stops(tmp_path: Path) -> None:
    """A record of another host, touched within STALE_S: refused, naming the host, pid,
    start and the Slurm job; untouched for longer: taken over."""
    _forged(tmp_path, slurm_job_id="77", job="slurm 77 step 0", age=10)
    with pytest.raises(loopkit.CheckpointError) as info:
        _ckpt(tmp_path).resume()
    said = str(info.value)
    assert "host node-b, pid 4242, started 2030-01-01 00:00:00 +0000, Slurm job 77" in said
    assert "last heartbeat 10 s ago" in said and ".loopkit-owner-0000000001" in said
    _forged(tmp_path, age=_owner.STALE_S + 60)
    assert _ckpt(tmp_path).resume() is None
    assert _records(tmp_path) == [".loopkit-owner-0000000002"]


def test_a_later_attempt_of_the_same_job_takes_over_and_fences_the_earlier(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Slurm requeue (same SLURM_JOB_ID, a higher SLURM_RESTART_COUNT) or a torchrun
    restart takes its own earlier attempt's directory over at once, from another host;
    the same attempt's live record is not; an earlier attempt still alive is refused at
    its next save (it lost the directory) instead of writing."""
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    _forged(tmp_path, job="slurm 77 step 0", restarts=[1, 0], slurm_job_id="77")
    with pytest.raises(loopkit.CheckpointError, match="alive"):
        _ckpt(tmp_path).resume()  # the same attempt, alive elsewhere: not ours to take
    _forged(tmp_path, job="slurm 77 step 0", restarts=[0, 0], slurm_job_id="77")
    ckpt = _ckpt(tmp_path)
    assert ckpt.resume() is None
    (mine,) = tmp_path.glob(".loopkit-owner-*")
    # A later attempt on another host takes it from this one (this one is the zombie now).
    mine.unlink()
    _forged(tmp_path, number=int(mine.name[-10:]) + 1, job="slurm 77 step 0",
            restarts=[2, 0], slurm_job_id="77")  # fmt: skip
    with pytest.raises(loopkit.CheckpointError) as info:
        ckpt.save()
    assert "this job no longer owns" in str(info.value) and "Slurm job 77" in str(info.value)
    assert ckpt.checkpoints() == []
    monkeypatch.delenv("SLURM_JOB_ID")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun's default id: no job
    _forged(tmp_path, number=9, job=None)
    with pytest.raises(loopkit.CheckpointError, match="alive"):
        _ckpt(tmp_path).resume()


def test_a_reused_pid_or_a_zombie_is_no_live_owner(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a filesystem without locks, the owner's pid is checked with its start time: a
    record whose pid now names another process (a pid reused, here this very process
    started at another time) is stale; one naming a live process as it started is not."""
    me = _owner._me()
    monkeypatch.setattr(_owner, "_locked_by_someone", lambda path: None)
    _forged(tmp_path, host=me["host"], boot_id=me["boot_id"], pidns=me["pidns"],
            pid=os.getppid(), start_ticks=_owner._proc_start(os.getppid()))  # fmt: skip
    # The parent is alive, as it started: but this process descends from it, so it is this
    # job's own (a script that launches its workers on its directory); a sibling would be
    # refused. The same record with another start time is a reused pid: stale.
    assert _ckpt(tmp_path).resume() is None and _records(tmp_path) == [
        ".loopkit-owner-0000000001"]  # fmt: skip
    _forged(tmp_path, number=2, host=me["host"], boot_id=me["boot_id"], pidns=me["pidns"],
            pid=os.getppid(), start_ticks=-5)  # fmt: skip
    assert _ckpt(tmp_path).resume() is None
    assert _records(tmp_path) == [".loopkit-owner-0000000003"]


def test_a_copied_directory_is_no_ones(tmp_path: Path) -> None:
    """A record copied with its directory (another inode) names no owner of the copy."""
    (tmp_path / "x").mkdir()
    _forged(tmp_path / "x")
    record = json.loads((tmp_path / "x" / ".loopkit-owner-0000000001").read_text())
    record["dir_ino"] += 1
    (tmp_path / "x" / ".loopkit-owner-0000000001").write_text(json.dumps(record))
    assert _ckpt(tmp_path / "x").resume() is None


def _race(directory: str, go: Any, out: Any, end: Any) -> None:
    try:
        go.wait(30)
        refusal, fresh = _owner._claim(Path(directory))
        out.put((os.getpid(), refusal, fresh))
        end.wait(60)  # alive while the others judge
    finally:
        os._exit(0)


def test_jobs_racing_for_a_stale_directory_exactly_one_wins(tmp_path: Path) -> None:
    """Four jobs take a dead job's directory over at the same moment: exactly one gets it,
    each other one is refused naming the winner."""
    proc, _, pid = _other_job(tmp_path)
    os.kill(pid, signal.SIGKILL)
    proc.join(30)
    go, out, end = _FORK.Event(), _FORK.Queue(), _FORK.Event()
    racers = [_FORK.Process(target=_race, args=(str(tmp_path), go, out, end)) for _ in range(4)]
    for r in racers:
        r.start()
    go.set()
    results = [out.get(timeout=60) for _ in racers]
    end.set()
    for r in racers:
        r.join(30)
    winners = [(p, fresh) for p, refusal, fresh in results if refusal is None]
    assert len(winners) == 1 and winners[0][1], results
    for _, refusal, _ in results:
        assert refusal is None or f"pid {winners[0][0]}," in refusal
    assert _records(tmp_path) == [".loopkit-owner-0000000002"]


def test_a_failed_first_save_leaves_no_record_and_teardown_releases(tmp_path: Path) -> None:
    """A claim made by a save that then fails is given up (nothing of it left); one that
    succeeds is held until distributed.teardown (or exit, or close())."""
    ckpt = _ckpt(tmp_path / "x")
    (tmp_path / "z").mkdir()
    (tmp_path / "z" / "ckpt-0000000001.pt").mkdir()  # a name a save cannot take
    with pytest.raises(OSError):
        _ckpt(tmp_path / "z").save()
    assert _records(tmp_path / "z") == []
    ckpt.save()
    assert _records(tmp_path / "x") == [".loopkit-owner-0000000001"]
    loopkit.distributed.teardown()
    assert _records(tmp_path / "x") == []
