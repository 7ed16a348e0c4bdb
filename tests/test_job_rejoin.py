"""A group restarted under a torchrun agent that keeps its store: the ranks join afresh.

torchrun's c10d and static rendezvous host the store the workers join through in the agent
(``TORCHELASTIC_USE_AGENT_STORE=True``), and it outlives them: each restarted group finds the
keys the group before it wrote (every rank's gloo address, NCCL's unique id). A rank that
joins before a peer reads the dead peer's address: init fails ("Connection refused") or
hangs. ``distributed.setup()`` joins under a namespace the ranks of the group agree on.
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import threading
import time

import pytest
import torch.distributed as dist
from helpers import ROOT, deep, launch_env

from loopkit import _job

pytestmark = deep  # LOOPKIT_DEEP=1 runs this file (tests/helpers.py: deep)

ROUNDS = 6

# Each process joins, all-reduces and leaves ROUNDS times; in each round one rank comes
# 0.5 s late, so the other reads the late rank's keys before it writes them: the keys of the
# round before, left in the store as a killed group leaves them.
_WORKER = f"""
import datetime, os, time
import torch, torch.distributed as dist
from loopkit import distributed

rank = int(os.environ["RANK"])
for r in range({ROUNDS}):
    if r % 2 == rank:
        time.sleep(0.5)
    distributed.setup(timeout=datetime.timedelta(seconds=10))
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == 2, t
    dist.destroy_process_group()
    print("round", r, "joined", flush=True)
"""


def test_groups_restarted_on_an_agent_store_join_every_time() -> None:
    """Six groups in a row on one store, a rank late in each: every one joins and all-reduces."""
    agent = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # type: ignore[attr-defined]
    procs = []
    for rank in range(2):
        env = launch_env()
        env.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(agent.port),
                   TORCHELASTIC_USE_AGENT_STORE="True")  # fmt: skip
        procs.append(subprocess.Popen([sys.executable, "-c", _WORKER], cwd=ROOT, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))  # fmt: skip
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=120)[0])
    finally:
        for proc in procs:
            proc.kill()
    for rank, (proc, out) in enumerate(zip(procs, outputs, strict=True)):
        assert proc.returncode == 0, f"rank {rank}:\n{out[-3000:]}"
        assert out.count("joined") == ROUNDS, out[-3000:]


def test_ranks_agree_on_a_new_name_whichever_comes_first() -> None:
    """A rank that reads the earlier group's name first still ends on rank 0's new one."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # type: ignore[attr-defined]
    store.set(_job._ROUND, "an-earlier-group")
    store.set(f"{_job._ROUND}/an-earlier-group/ok/x", "1")  # that group's answers are there
    wait = datetime.timedelta(seconds=20)
    names: dict[int, str] = {}

    def join(rank: int) -> None:
        client = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=wait)  # type: ignore[attr-defined]
        names[rank] = _job._agree(client, rank, 3, wait)

    others = [threading.Thread(target=join, args=(r,)) for r in (1, 2)]
    for t in others:
        t.start()
    time.sleep(0.6)  # both have read the earlier group's name and wait for its rank 0
    join(0)
    for t in others:
        t.join(timeout=20)
    assert len(set(names.values())) == 1 and len(names) == 3, names
    assert names[0] != "an-earlier-group"


def test_a_missing_rank_zero_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """No rank 0 ever joins: the other rank stops at the timeout, saying rank 0 is missing."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # type: ignore[attr-defined]
    store.set(_job._ROUND, "an-earlier-group")
    wait = datetime.timedelta(seconds=1)
    client = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=wait)  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="rank 1: rank 0 did not join the group within"):
        _job._agree(client, 1, 2, wait)


def test_no_agent_store_joins_by_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without torchrun's agent store (a plain launch, srun) init reads env:// as before."""
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    env = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "x", "MASTER_PORT": "1"}
    assert _job._rendezvous(env, None) == {"init_method": "env://"}
    assert os.environ.get("TORCHELASTIC_USE_AGENT_STORE") is None
