"""docs/clusters.md "torchrun elastic": a worker killed under ``--max-restarts``, a node lost
under ``--nnodes 1:2``.

The recipes' loop records, per rank, a ``start <update> <world> <time>`` line for each
process and the sample indices of each micro-step under the update it goes to. Each group of
processes (a torchrun attempt) resumes where the newest checkpoint stopped, so the history the
run kept is each group's record, cut where the next group resumed. One reference launch (never
killed) is shared by both tests.
"""

from __future__ import annotations

import contextlib
import functools
import os
import random
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from clusters_recipes import recipe
from helpers import DEEP, assert_close, deep, kill_tree, launch_env

import loopkit

SCRIPT = "train_elastic.py"
SAMPLES, WINDOWS_PER_EPOCH, EPOCHS = 512, 8, 4  # global batch 32, accumulate=2
# CI: one launch, one kill; LOOPKIT_DEEP=1: three launches of three kills (--max-restarts 3).
LAUNCHES, KILLS = (3, 3) if DEEP else (1, 1)

pytestmark = [
    pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds workers in /proc"),
    deep,  # LOOPKIT_DEEP=1 runs this file (tests/helpers.py: deep)
]


@dataclass
class Attempt:
    """One process's record: where it resumed, its group's size, its micro-steps."""

    rank: int
    update: int
    world: int
    started: float
    steps: list[tuple[int, list[int]]] = field(default_factory=list)


def _attempts(where: Path) -> list[Attempt]:
    """Every process's record, in the order they started."""
    found: list[Attempt] = []
    for path in sorted(where.glob("runs/seen/rank*.txt")):
        rank = int(path.stem.removeprefix("rank"))
        mine: list[Attempt] = []
        for line in path.read_text().split("\n")[:-1]:  # whole lines: a worker may be writing
            if line.startswith("start "):
                _, update, world, started = line.split()
                mine.append(Attempt(rank, int(update), int(world), float(started)))
            else:
                update, indices = line.split(" ", 1)
                samples = [int(i) for i in indices.strip("[]").split(", ")]
                mine[-1].steps.append((int(update), samples))
        found += mine
    return sorted(found, key=lambda a: a.started)


def _groups(where: Path) -> list[list[Attempt]]:
    """The records grouped by torchrun attempt: a group's processes all start (after the
    resume, a collective) before any process of the next group does."""
    attempts, groups = _attempts(where), []
    while attempts:
        first = attempts[0]
        group, attempts = attempts[: first.world], attempts[first.world :]
        assert sorted(a.rank for a in group) == list(range(first.world)), group
        assert {(a.update, a.world) for a in group} == {(first.update, first.world)}, group
        groups.append(group)
    return groups


def _kept(groups: list[list[Attempt]]) -> dict[int, dict[int, list[int]]]:
    """Per update, per rank, the samples the run kept: each group's, cut where the next
    group resumed (the work after the newest checkpoint is done again)."""
    kept: dict[int, dict[int, list[int]]] = {}
    for group in groups:
        kept = {u: ranks for u, ranks in kept.items() if u < group[0].update}
        for attempt in group:
            for update, indices in attempt.steps:
                kept.setdefault(update, {}).setdefault(attempt.rank, []).extend(indices)
    return kept


def _every_sample_once(kept: dict[int, dict[int, list[int]]]) -> None:
    assert sorted(kept) == list(range(EPOCHS * WINDOWS_PER_EPOCH)), sorted(kept)
    for epoch in range(EPOCHS):
        windows = range(epoch * WINDOWS_PER_EPOCH, (epoch + 1) * WINDOWS_PER_EPOCH)
        seen = sorted(i for u in windows for part in kept[u].values() for i in part)
        assert seen == list(range(SAMPLES)), f"epoch {epoch}: samples missed or repeated"


def _final_weights(where: Path) -> list[torch.Tensor]:
    final = sorted((where / "runs" / "elastic").glob("ckpt-*"))[-1]
    assert final.name == f"ckpt-{EPOCHS * WINDOWS_PER_EPOCH:010d}.pt", final
    return list(loopkit.export_weights(final).values())


def _launch(command: str, where: Path, log: str, **env_vars: str) -> subprocess.Popen[bytes]:
    env = launch_env()
    env.update(env_vars)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    with open(where / log, "wb") as out:
        return subprocess.Popen(["bash", "-c", command], cwd=where, env=env, stdout=out,
                                stderr=subprocess.STDOUT)  # fmt: skip


def _finish(proc: subprocess.Popen[bytes], where: Path, log: str) -> None:
    try:
        proc.wait(timeout=600)
    finally:
        kill_tree(proc.pid)
    assert proc.returncode == 0, (where / log).read_text()[-4000:]


def _tree(pid: int) -> list[int]:
    """``pid`` and every process below it."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError, IndexError, ValueError):
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        found.append(todo.pop())
        todo += children.get(found[-1], [])
    return found


def _workers(agent: int) -> dict[int, int]:
    """The running workers of the torchrun below ``agent``: pid by RANK."""
    found = {}
    for pid in _tree(agent):
        with contextlib.suppress(OSError):
            if SCRIPT in (Path("/proc") / str(pid) / "cmdline").read_text():
                env = (Path("/proc") / str(pid) / "environ").read_bytes().split(b"\0")
                rank = [v for v in env if v.startswith(b"RANK=")]
                if rank:
                    found[int(rank[0][5:])] = pid
    return found


def _trained(where: Path, processes: int, steps: int) -> bool:
    """Whether ``processes`` records have started and the newest has ``steps`` micro-steps."""
    attempts = _attempts(where)
    return len(attempts) >= processes and len(attempts[-1].steps) >= steps


def _wait_for(
    what: str, condition: Callable[[], bool], procs: list[subprocess.Popen[bytes]]
) -> None:
    deadline = time.monotonic() + 600
    while not condition():
        assert all(p.poll() is None for p in procs), f"a launch ended while waiting for {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[torch.Tensor], dict]:  # type: ignore[type-arg]
    """The recipe's run never killed (2 processes): its final weights and kept history."""
    where = tmp_path_factory.mktemp("elastic-reference")
    rec = recipe("torchrun elastic: a worker dies")
    rec.write(where)
    (command,) = rec.commands
    _finish(_launch(command, where, "torchrun.log"), where, "torchrun.log")
    groups = _groups(where)
    assert [len(g) for g in groups] == [2], groups
    return _final_weights(where), _kept(groups)


@pytest.mark.parametrize("launch", range(LAUNCHES))
def test_a_killed_worker_restarts_the_group_which_ends_bit_identical(
    reference: tuple[list[torch.Tensor], dict],  # type: ignore[type-arg]
    tmp_path: Path,
    launch: int,
) -> None:
    """A worker SIGKILLed mid-run: the group resumes by itself; same samples, same weights."""
    rec = recipe("torchrun elastic: a worker dies")
    rec.write(tmp_path)
    (command,) = rec.commands
    assert "--max-restarts 3" in command
    rng = random.Random(f"dies {launch}")
    proc = _launch(command, tmp_path, "torchrun.log")
    kills = 0
    try:
        for k in range(KILLS):
            target = rng.randint(10, 50)  # micro-steps into this group: mid-window, mid-save
            with contextlib.suppress(AssertionError):  # the run may end before the kill
                far_enough = functools.partial(_trained, tmp_path, 2 * (k + 1), target)
                _wait_for("the next group to train", far_enough, [proc])
            workers = _workers(proc.pid)
            if proc.poll() is not None or len(workers) != 2:
                break
            os.kill(workers[rng.randrange(2)], 9)
            kills += 1
    finally:
        _finish(proc, tmp_path, "torchrun.log")
    assert kills >= 1, "the run ended before any kill landed"
    groups = _groups(tmp_path)
    assert [len(g) for g in groups] == [2] * (kills + 1), groups
    weights, kept = reference
    assert _kept(groups) == kept  # each update, each rank: the same samples
    for got, want in zip(_final_weights(tmp_path), weights, strict=True):
        assert torch.equal(got, want), (got - want).abs().max()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _host(agents: list[subprocess.Popen[bytes]], port: int) -> int | None:
    """Which of ``agents`` (or a process below it) listens on ``port``: the rendezvous host."""
    listening = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for row in Path(table).read_text().splitlines()[1:]:
                cols = row.split()
                if cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:
                    listening.add(f"socket:[{cols[9]}]")
    for n, agent in enumerate(agents):
        for pid in _tree(agent.pid):
            for fd in Path(f"/proc/{pid}/fd").glob("*"):
                with contextlib.suppress(OSError):
                    if os.readlink(fd) in listening:
                        return n
    return None


def test_a_lost_node_leaves_a_smaller_group_that_sees_every_sample_once(
    reference: tuple[list[torch.Tensor], dict],  # type: ignore[type-arg]
    tmp_path: Path,
) -> None:
    """Two agents of 1 process; one killed with its worker: the other resumes alone with
    reseed=True, every sample of every epoch once, weights within float rounding."""
    (command,) = recipe("torchrun elastic: a node leaves").commands
    assert recipe("torchrun elastic: a node leaves").files == {}  # the loop is the section before's
    recipe("torchrun elastic: a worker dies").write(tmp_path)
    port = _free_port()
    env = {"HEAD": "127.0.0.1", "PORT": str(port), "JOB_ID": f"leaves-{os.getpid()}"}
    # Started together, as srun starts nodes: they join the first rendezvous together.
    agents = [_launch(command, tmp_path, f"node{n}.log", **env) for n in range(2)]
    try:
        _wait_for("the rendezvous store", lambda: _host(agents, port) is not None, agents)
        host = _host(agents, port)  # the agent that binds the endpoint hosts it: it stays
        stays, leaves = (agents[0], agents[1]) if host == 0 else (agents[1], agents[0])

        def both_training() -> bool:
            try:
                last = _groups(tmp_path)[-1]
            except (AssertionError, IndexError):  # no record yet, or a group still starting
                return False
            saved = list(tmp_path.glob("runs/elastic/ckpt-*.pt"))  # complete ones only
            return len(last) == 2 and min(len(a.steps) for a in last) >= 12 and bool(saved)

        _wait_for("both nodes to train", both_training, agents)
        kill_tree(leaves.pid)  # the node and its worker at once
        leaves.wait()
    finally:
        kill_tree(leaves.pid)
        _finish(stays, tmp_path, f"node{agents.index(stays)}.log")
    groups = _groups(tmp_path)
    assert [len(g) for g in groups][-2:] == [2, 1], groups
    assert groups[-1][0].update > 0  # it resumed a checkpoint the two processes wrote
    _every_sample_once(_kept(groups))
    assert_close(_final_weights(tmp_path), reference[0], atol=1e-5)
