"""docs/clusters.md "Several nodes": two torchrun agents on this machine stand for two nodes.

Three launches of the recipe (2 nodes x 2 processes, c10d rendezvous): one run to the end,
each node with its own ``$TMPDIR``; one run sharing a ``$TMPDIR`` (a network filesystem)
whose second node's workers get a SIGTERM; the resume of that run, each node with its own
``$TMPDIR`` again. The same recipe run in this process is the one-process reference.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import runpy
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from clusters_recipes import recipe
from helpers import assert_bit_equal, assert_close, deep, launch_env

import loopkit

pytestmark = deep  # LOOPKIT_DEEP=1 runs this file (tests/helpers.py: deep)

SCRIPT = "train_nodes.py"
# Each print is one write, but another worker's may come between its text and its newline.
_START = re.compile(
    r"rank (\d+) on node (\d+): cache (built|mapped) at (\S+?); shards with (\[[\d, ]*\]), "
    r"replicas (\[[\d, ]*\]); from update (\d+)"
)
_AGENT = re.compile(rb"torchrun|torch\.distributed\.run")
_END = re.compile(r"rank (\d+): ([A-Za-z_]+) at update (\d+)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Node:
    """One torchrun agent running the recipe's command, its output read line by line."""

    def __init__(self, command: str, cwd: Path, tmpdir: Path, port: int, job: str) -> None:
        env = launch_env()
        env.update(HEAD="127.0.0.1", PORT=str(port), JOB_ID=job, TMPDIR=str(tmpdir))
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        self.tmpdir = tmpdir
        self.proc = subprocess.Popen(
            ["bash", "-c", command], cwd=cwd, env=env, text=True,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )  # fmt: skip
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def matching(self, pattern: re.Pattern[str]) -> list[tuple[str, ...]]:
        return [m.groups() for m in pattern.finditer("\n".join(self.lines))]

    def workers(self) -> list[int]:
        """The pids of the workers this agent started: the children of the torchrun process
        (bash may exec it in place, or start it as its child)."""
        parents: dict[int, int] = {}
        agents = set()
        for entry in Path("/proc").iterdir():
            with contextlib.suppress(OSError, IndexError, ValueError):
                pid = int(entry.name)
                parents[pid] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                if _AGENT.search((entry / "cmdline").read_bytes()):
                    agents.add(pid)
        mine = {pid for pid in agents if pid == self.proc.pid or parents[pid] == self.proc.pid}
        return sorted(pid for pid, parent in parents.items() if parent in mine)

    def finish(self, timeout: float = 300) -> int:
        try:
            code = self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                from helpers import kill_tree

                kill_tree(self.proc.pid)
                self.proc.wait()
        self.reader.join(10)
        return code


def _launch(command: str, cwd: Path, tmpdirs: tuple[Path, Path]) -> tuple[_Node, _Node]:
    port, job = _free_port(), f"nodes-{os.getpid()}-{time.monotonic_ns()}"
    return tuple(_Node(command, cwd, t, port, job) for t in tmpdirs)  # type: ignore[return-value]


def _finished(nodes: tuple[_Node, _Node]) -> dict[str, Any]:
    """Both agents' exit statuses and what each rank said, with which agent said it."""
    codes = [n.finish() for n in nodes]
    out = "\n".join(line for n in nodes for line in n.lines)
    assert codes == [0, 0], out[-4000:]
    starts, ends = {}, {}
    for a, n in enumerate(nodes):
        for rank, group, built, path, shard, replicas, first in n.matching(_START):
            starts[int(rank)] = {
                "agent": a, "node": int(group), "built": built == "built", "path": path,
                "shard": json.loads(shard), "replicas": json.loads(replicas), "from": int(first),
            }  # fmt: skip
        for rank, reason, updates in n.matching(_END):
            ends[int(rank)] = (a, reason, int(updates))
    assert sorted(starts) == sorted(ends) == [0, 1, 2, 3], out[-4000:]
    return {"starts": starts, "ends": ends, "out": out}


def _check_layout(starts: dict[int, dict[str, Any]], tmpdirs: tuple[Path, Path]) -> None:
    """Each agent is one node of consecutive ranks, its shard group; replicas across nodes."""
    for a in (0, 1):
        ranks = sorted(r for r, s in starts.items() if s["agent"] == a)
        assert len(ranks) == 2 and ranks[1] == ranks[0] + 1, starts
        assert {starts[r]["node"] for r in ranks} == {ranks[0] // 2}
        for r in ranks:
            assert starts[r]["shard"] == ranks, starts
            assert starts[r]["replicas"] == [r % 2, r % 2 + 2], starts
            assert starts[r]["path"].startswith(f"{tmpdirs[a]}/preload/"), starts


def _weights(checkpoint: Path) -> list[torch.Tensor]:
    return list(loopkit.export_weights(checkpoint).values())


def _one_process(where: Path, monkeypatch: pytest.MonkeyPatch) -> list[torch.Tensor]:
    """The recipe run in this process (no launcher): the one-process weights."""
    (where / "tmp").mkdir(parents=True)
    recipe("Several nodes").write(where)
    monkeypatch.chdir(where)
    monkeypatch.setattr(tempfile, "tempdir", str(where / "tmp"))
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    runpy.run_path(str(where / SCRIPT), run_name="__main__")
    (final,) = sorted((where / "runs" / "nodes").glob("ckpt-*"))
    return _weights(final)


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the workers' pids in /proc")
def test_two_nodes_cache_once_per_node_hsdp_across_and_a_stop_on_one_node(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two agents of 2 processes: each node's local rank 0 builds its own cache (one build in
    the job on a shared $TMPDIR), HSDP shards within a node and replicates across, matching
    one process; a SIGTERM to one node's workers stops all 4 ranks at one update, one
    checkpoint, exit 0; the resume ends bit-identical to the run never stopped."""
    rec = recipe("Several nodes")
    (command,) = rec.commands
    own = (tmp_path / "node0-tmp", tmp_path / "node1-tmp")
    shared = tmp_path / "shared-tmp"
    for d in (*own, shared, tmp_path / "whole", tmp_path / "stopped"):
        d.mkdir()
    rec.write(tmp_path / "whole")
    rec.write(tmp_path / "stopped")

    # 1. To the end, each node its own $TMPDIR: one build per node, both at once.
    whole = _finished(_launch(command, tmp_path / "whole", own))
    _check_layout(whole["starts"], own)
    starts = whole["starts"]
    assert sorted(r for r, s in starts.items() if s["built"]) == [0, 2], starts
    assert len({s["path"] for s in starts.values()}) == 2
    assert {e[1:] for e in whole["ends"].values()} == {("max_epochs", 16)}
    (final,) = sorted((tmp_path / "whole" / "runs" / "nodes").glob("ckpt-*"))
    assert final.name == "ckpt-0000000016"
    weights = _weights(final)
    assert_close(weights, _one_process(tmp_path / "one", monkeypatch), atol=1e-6)

    # 2. A shared $TMPDIR (one build in the job); node "1" (the second agent) gets a SIGTERM
    # on its workers once every rank is in the loop (the stop's handlers are in place).
    nodes = _launch(command, tmp_path / "stopped", (shared, shared))
    deadline = time.monotonic() + 240
    while sum(len(n.matching(_START)) for n in nodes) < 4:
        assert time.monotonic() < deadline and all(n.proc.poll() is None for n in nodes), "\n".join(
            line for n in nodes for line in n.lines
        )[-4000:]
        time.sleep(0.05)
    workers = nodes[1].workers()
    assert len(workers) == 2, workers
    for pid in workers:
        os.kill(pid, signal.SIGTERM)
    stopped = _finished(nodes)
    starts = stopped["starts"]
    assert len([r for r, s in starts.items() if s["built"]]) == 1, starts
    assert {s["path"] for s in starts.values()} == {starts[0]["path"]}
    assert starts[0]["path"].startswith(f"{shared}/preload/")
    (at,) = {e[1:] for e in stopped["ends"].values()}
    assert at[0] == "SIGTERM" and 0 < at[1] < 16, stopped["ends"]
    saved = sorted((tmp_path / "stopped" / "runs" / "nodes").glob("ckpt-*"))
    assert [p.name for p in saved] == [f"ckpt-{at[1]:010d}"]

    # 3. Both nodes relaunched (their own $TMPDIRs, whose caches run 1 built): it resumes.
    resumed = _finished(_launch(command, tmp_path / "stopped", own))
    _check_layout(resumed["starts"], own)
    assert not any(s["built"] for s in resumed["starts"].values())
    assert {s["from"] for s in resumed["starts"].values()} == {at[1]}
    assert {e[1:] for e in resumed["ends"].values()} == {("max_epochs", 16)}
    final = sorted((tmp_path / "stopped" / "runs" / "nodes").glob("ckpt-*"))[-1]
    assert final.name == "ckpt-0000000016"
    assert_bit_equal(weights, _weights(final))
