"""Who owns a checkpoint directory: a live job's is refused to a second job, naming it; a
killed job's is taken over (at once on its host, by a later attempt of the same job, or
after its heartbeat stops elsewhere), by exactly one of the jobs that race for it."""

from __future__ import annotations

import errno
import gc
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
from helpers import deep, mlp

import loopkit
from loopkit._checkpoint import _background, _claim_rules, _owner

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
              "start_ticks": 1, "boot_id": "other", "pidns": "pid:[1]", "slurm": None,
              "slurm_restart": 0, "launch": None, "launch_restart": 0, "token": "feed",
              "dir_ino": os.stat(directory).st_ino, "slurm_job_id": None,
              "torchelastic_run_id": None}  # fmt: skip
    record.update(fields)
    path = directory / f".loopkit-owner-{number:010d}"
    path.write_text(json.dumps(record))
    stamp = time.time() - age
    os.utime(path, (stamp, stamp))
    return path


def test_another_hosts_owner_is_live_until_its_heartbeat_stops(tmp_path: Path) -> None:
    """A record of another host, touched within STALE_S: refused, naming the host, pid,
    start and the Slurm job; untouched for longer: taken over."""
    _forged(tmp_path, slurm_job_id="77", slurm=["", "77", "0"], age=10)
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
    _forged(tmp_path, slurm=["", "77", "0"], slurm_restart=1, slurm_job_id="77")
    with pytest.raises(loopkit.CheckpointError, match="alive"):
        _ckpt(tmp_path).resume()  # the same attempt, alive elsewhere: not ours to take
    _forged(tmp_path, slurm=["", "77", "0"], slurm_restart=0, slurm_job_id="77")
    ckpt = _ckpt(tmp_path)
    assert ckpt.resume() is None
    (mine,) = tmp_path.glob(".loopkit-owner-*")
    # A later attempt on another host takes it from this one (this one is the zombie now).
    mine.unlink()
    _forged(tmp_path, number=int(mine.name[-10:]) + 1, slurm=["", "77", "0"],
            slurm_restart=2, slurm_job_id="77")  # fmt: skip
    with pytest.raises(loopkit.CheckpointError) as info:
        ckpt.save()
    assert "this job no longer owns" in str(info.value) and "Slurm job 77" in str(info.value)
    assert ckpt.checkpoints() == []
    monkeypatch.delenv("SLURM_JOB_ID")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun's default id: no job
    _forged(tmp_path, number=9, launch=None)
    with pytest.raises(loopkit.CheckpointError, match="alive"):
        _ckpt(tmp_path).resume()


def test_a_reused_pid_or_a_zombie_is_no_live_owner(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a filesystem without locks, the owner's pid is checked with its start time: a
    record whose pid now names another process (a pid reused, here this very process
    started at another time) is stale; one naming a live process as it started is not."""
    me = _owner._me()
    monkeypatch.setattr(_claim_rules, "locked_by_someone", lambda path: None)
    _forged(tmp_path, host=me["host"], boot_id=me["boot_id"], pidns=me["pidns"],
            pid=os.getppid(), start_ticks=_claim_rules.proc_start(os.getppid()))  # fmt: skip
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


def _race_four(tmp_path: Path) -> list[Any]:
    """Four forked jobs claim ``tmp_path`` at the same moment: each one's (pid, refusal, fresh)."""
    go, out, end = _FORK.Event(), _FORK.Queue(), _FORK.Event()
    racers = [_FORK.Process(target=_race, args=(str(tmp_path), go, out, end)) for _ in range(4)]
    for r in racers:
        r.start()
    go.set()
    results = [out.get(timeout=60) for _ in racers]
    end.set()
    for r in racers:
        r.join(30)
    return results


def test_jobs_racing_for_a_stale_directory_exactly_one_wins(tmp_path: Path) -> None:
    """Four jobs take a dead job's directory over at the same moment: exactly one gets it,
    each other one is refused naming the winner."""
    proc, _, pid = _other_job(tmp_path)
    os.kill(pid, signal.SIGKILL)
    proc.join(30)
    results = _race_four(tmp_path)
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


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@deep
def test_a_claim_lives_as_long_as_the_checkpointers_that_hold_it(tmp_path: Path) -> None:
    """Trials in one process, each a Checkpointer of its own directory, never closed: each
    directory is given up when its Checkpointer is garbage-collected (no descriptor or record
    left); of two Checkpointers of one directory, the record goes with the last one."""
    start = _fds()
    for trial in range(40):
        ckpt = _ckpt(tmp_path / f"trial{trial}")
        ckpt.save()
        assert _records(tmp_path / f"trial{trial}") == [".loopkit-owner-0000000001"]
        del ckpt
        gc.collect()
        assert _records(tmp_path / f"trial{trial}") == []
    assert _fds() <= start and not _owner._HELD
    first, second = _ckpt(tmp_path / "shared"), _ckpt(tmp_path / "shared")
    first.save()
    second.save()
    first.close()
    assert _records(tmp_path / "shared") == [".loopkit-owner-0000000001"]
    del second
    gc.collect()
    assert _records(tmp_path / "shared") == []


def test_the_same_host_name_with_another_boot_id_is_another_machine(tmp_path: Path) -> None:
    """Containers given one host name: a record of that name but another kernel boot_id is
    another machine's, live until its heartbeat stops (not "restarted", taken at once)."""
    me = _owner._me()
    _forged(tmp_path, host=me["host"], boot_id="another-kernel", pidns=me["pidns"], age=10)
    with pytest.raises(loopkit.CheckpointError, match="is written by another job that is alive"):
        _ckpt(tmp_path).resume()
    _forged(tmp_path, host=me["host"], boot_id="another-kernel", age=_owner.STALE_S + 60)
    assert _ckpt(tmp_path).resume() is None
    assert _records(tmp_path) == [".loopkit-owner-0000000002"]


def _torchrun(monkeypatch: pytest.MonkeyPatch, endpoint: str, restart: int, **env: str) -> None:
    """This process as a torchrun worker: run id 100, its workers' store at ``endpoint``."""
    for name in ("SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_RESTART_COUNT", "SLURM_CLUSTER_NAME"):
        monkeypatch.delenv(name, raising=False)
    addr, port = endpoint.rsplit(":", 1)
    for name, value in {"TORCHELASTIC_RUN_ID": "100", "MASTER_ADDR": addr, "MASTER_PORT": port,
                        "TORCHELASTIC_RESTART_COUNT": str(restart), **env}.items():  # fmt: skip
        monkeypatch.setenv(name, value)


def test_a_torchrun_restart_takes_over_only_its_own_launch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A restart (--max-restarts) takes its own launch's earlier attempt over at once; another
    launch given the same --rdzv-id (another store endpoint, or the same loopback endpoint on
    another machine) stays live, so a refused launch's restart is refused again; a Slurm
    requeue takes over although its torchrun launch is new."""
    _torchrun(monkeypatch, "node-a:29400", restart=1)
    _forged(tmp_path, launch=["100", "node-b:29400"], launch_restart=0, age=5)
    with pytest.raises(loopkit.CheckpointError, match="alive"):
        _ckpt(tmp_path).resume()  # launch B (refused at attempt 0) at its restart: refused
    _forged(tmp_path, launch=["100", "localhost:29400"], launch_restart=0, age=5)
    _torchrun(monkeypatch, "localhost:29400", restart=1)
    with pytest.raises(loopkit.CheckpointError, match="alive"):
        _ckpt(tmp_path).resume()  # a loopback store: another machine's launch is another
    _forged(tmp_path, launch=["100", "node-a:29400"], launch_restart=0, age=5)
    _torchrun(monkeypatch, "node-a:29400", restart=1)
    ckpt = _ckpt(tmp_path)
    assert ckpt.resume() is None and _records(tmp_path) == [".loopkit-owner-0000000002"]
    ckpt.close()
    slurm = {"SLURM_JOB_ID": "9", "SLURM_STEP_ID": "0", "SLURM_RESTART_COUNT": "1"}
    _torchrun(monkeypatch, "node-c:29400", restart=0, **slurm)
    _forged(tmp_path, slurm=["", "9", "0"], slurm_restart=1, launch=["100", "node-d:1"],
            launch_restart=0, age=5)  # fmt: skip
    with pytest.raises(loopkit.CheckpointError, match="alive"):
        _ckpt(tmp_path).resume()  # two torchruns in one Slurm step: two launches
    _forged(tmp_path, slurm=["", "9", "0"], slurm_restart=0, launch=["100", "node-d:1"],
            launch_restart=3, age=5)  # fmt: skip
    assert _ckpt(tmp_path).resume() is None  # a requeue: every earlier process is stopped


def _no_links(monkeypatch: pytest.MonkeyPatch, create: bool = True) -> None:
    """This filesystem as gcsfuse or an S3 mount: no hard links (nor, with ``create=False``,
    an exclusive create of a record)."""

    def refused(*args: Any, **kwargs: Any) -> None:
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")

    monkeypatch.setattr(os, "link", refused)
    if not create:
        opened = os.open

        def no_exclusive(path: Any, flags: int, *args: Any) -> int:
            if str(path).rsplit("/", 1)[-1].startswith(".loopkit-owner-") and flags & os.O_EXCL:
                raise OSError(errno.ENOSYS, "Function not implemented")
            return opened(path, flags, *args)

        monkeypatch.setattr(os, "open", no_exclusive)


def test_a_filesystem_without_hard_links_still_has_one_owner(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without link(), the record is created in place: saves work, the owner is recorded
    (its lock held), another job is refused, a record being written counts as live; where
    even that fails, saves work unguarded, with a warning."""
    _no_links(monkeypatch)
    ckpt = _ckpt(tmp_path / "a")
    ckpt.save()
    assert _records(tmp_path / "a") == [".loopkit-owner-0000000001"]
    record = tmp_path / "a" / ".loopkit-owner-0000000001"
    assert json.loads(record.read_text())["pid"] == os.getpid()
    assert _claim_rules.locked_by_someone(record) in (True, None)
    ckpt.save()  # still its own
    assert [p.name for p in ckpt.checkpoints()] == ["ckpt-0000000001.pt", "ckpt-0000000002.pt"]
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / ".loopkit-owner-0000000001").write_text("")  # a claimant mid-write
    with pytest.raises(loopkit.CheckpointError, match="its owner record is being written"):
        _ckpt(tmp_path / "b").resume()
    _forged(tmp_path / "b", number=1, age=0).write_text("")
    stamp = time.time() - _owner.HEARTBEAT_S - 30
    os.utime(tmp_path / "b" / ".loopkit-owner-0000000001", (stamp, stamp))
    assert _ckpt(tmp_path / "b").resume() is None  # one killed mid-write: no one's
    assert _records(tmp_path / "b") == [".loopkit-owner-0000000002"]
    _no_links(monkeypatch, create=False)
    with pytest.warns(RuntimeWarning, match="cannot keep a second job from writing it"):
        assert _ckpt(tmp_path / "c").save() == tmp_path / "c" / "ckpt-0000000001.pt"
    assert _records(tmp_path / "c") == []


def test_racing_jobs_without_hard_links_one_wins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four jobs claim one directory at once on a filesystem without link(): one wins."""
    _no_links(monkeypatch)
    results = _race_four(tmp_path)
    assert [fresh for _, refusal, fresh in results if refusal is None] == [True], results
    assert _records(tmp_path) == [".loopkit-owner-0000000001"]


def test_teardown_gives_the_directory_up_after_the_background_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """resume() (the claim), then an async save: teardown waits for the write while the
    directory is still owned, then gives it up, whatever order the hooks came in."""
    model = mlp()
    ckpt = loopkit.Checkpointer(tmp_path, model=model, async_save=True,
                                optimizer=torch.optim.SGD(model.parameters(), lr=0.1))  # fmt: skip
    seen: list[list[str]] = []
    finish = _background.Background.finish

    def watched(self: _background.Background) -> None:
        if self.in_flight:  # the write is waited for: whose directory is it meanwhile
            seen.append(_records(tmp_path))
        finish(self)

    monkeypatch.setattr(_background.Background, "finish", watched)
    ckpt.resume()
    ckpt.save()
    loopkit.distributed.teardown()
    assert seen == [[".loopkit-owner-0000000001"]]
    assert _records(tmp_path) == [] and ckpt.checkpoints() == [tmp_path / "ckpt-0000000001.pt"]


def test_temporaries_of_claimants_killed_mid_claim_are_deleted(tmp_path: Path) -> None:
    """A claim deletes the temporary records of dead claimants (their process gone on this
    machine, or untouched for STALE_S), not a live claimant's."""
    me = _owner._me()
    child = _FORK.Process(target=os._exit, args=(0,))
    child.start()
    child.join(30)
    dead = dict(me, pid=child.pid, start_ticks=1, dir_ino=os.stat(tmp_path).st_ino)
    (tmp_path / ".loopkit-owner.tmp-1-dead").write_text(json.dumps(dead))
    (tmp_path / ".loopkit-owner.tmp-2-old").write_text("")
    stamp = time.time() - _owner.STALE_S - 60
    os.utime(tmp_path / ".loopkit-owner.tmp-2-old", (stamp, stamp))
    (tmp_path / ".loopkit-owner.tmp-3-live").write_text(json.dumps(dict(me, dir_ino=1)))
    (tmp_path / ".loopkit-owner.tmp-4-fresh").write_text("")
    _ckpt(tmp_path).save()
    assert sorted(p.name for p in tmp_path.glob(".loopkit-owner*")) == [
        ".loopkit-owner-0000000001",
        ".loopkit-owner.tmp-3-live",
        ".loopkit-owner.tmp-4-fresh",
    ]


def test_an_unexpected_error_while_judging_is_a_refusal_naming_the_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A record no rule foresaw (judging it raises), or any failure of rank zero's claim, is
    the verdict every rank gets: a CheckpointError (naming the record), nothing changed."""
    me = _owner._me()
    _forged(tmp_path, host=me["host"], boot_id=me["boot_id"], pidns=me["pidns"], pid="x")
    monkeypatch.setattr(_claim_rules, "locked_by_someone", lambda path: None)
    assert _ckpt(tmp_path).resume() is None  # a pid that names no process: gone
    _owner._RELEASER.release_all()
    _forged(tmp_path, number=5)

    def odd(*args: Any) -> None:
        raise KeyError("host")

    monkeypatch.setattr(_owner, "stale", odd)
    with pytest.raises(loopkit.CheckpointError) as info:
        _ckpt(tmp_path).save()
    assert ".loopkit-owner-0000000005" in str(info.value) and "KeyError" in str(info.value)
    assert _records(tmp_path) == [".loopkit-owner-0000000005"]
    assert not list(tmp_path.glob(".loopkit-owner.tmp-*"))
    monkeypatch.setattr(_owner, "_claim", lambda *args: {}["x"])
    with pytest.raises(loopkit.CheckpointError, match=r"cannot claim .* KeyError"):
        _ckpt(tmp_path).resume()


def test_resume_of_a_missing_directory_creates_nothing(tmp_path: Path) -> None:
    """resume() of a directory that does not exist (or under a read-only parent) returns
    None and creates nothing; the first save makes and claims it."""
    ckpt = _ckpt(tmp_path / "new" / "run")
    assert ckpt.resume() is None and not (tmp_path / "new").exists()
    ckpt.save()
    assert _records(tmp_path / "new" / "run") == [".loopkit-owner-0000000001"]
    if os.geteuid() != 0:  # root writes anywhere
        (tmp_path / "ro").mkdir()
        (tmp_path / "ro").chmod(0o555)
        assert _ckpt(tmp_path / "ro" / "run").resume() is None
        assert not (tmp_path / "ro" / "run").exists()
