"""Slurm without torchrun: srun's variables read by setup(), and the rules for which process
is a task of a step (pure, no processes); the recipe of docs/clusters.md under a fake srun."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import deep

from loopkit import distributed
from loopkit._slurm import hosts, is_step_task, srun_env, tasks_per_node

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT")  # fmt: skip

# A task of `srun -N2 --ntasks-per-node=2 python train.py` (step 3 of job 4242), on node 1.
TASK = {
    "SLURM_JOB_ID": "4242",
    "SLURM_STEP_ID": "3",
    "SLURM_PROCID": "3",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
    "SLURM_NTASKS": "4",
    "SLURM_STEP_NUM_TASKS": "4",
    "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
    "SLURM_JOB_NODELIST": "gpu[07-08]",
    "SLURM_STEP_NODELIST": "gpu[07-08]",
}


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """No launcher variable of torchrun's or Slurm's in this process's environment."""
    for k in list(os.environ):
        if k in TORCHRUN_VARS or k.startswith("SLURM_"):
            monkeypatch.delenv(k)
    yield monkeypatch


@pytest.mark.parametrize(
    ("nodelist", "expected"),
    [
        ("node1", ["node1"]),
        ("node[01-04,07],gpu5", ["node01", "node02", "node03", "node04", "node07", "gpu5"]),
        ("a[8-10]", ["a8", "a9", "a10"]),
        ("a[098-100]", ["a098", "a099", "a100"]),
        ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
        ("x-[3],y[1]-ib", ["x-3", "y1-ib"]),
    ],
)
def test_node_lists_expand_as_slurm_writes_them(nodelist: str, expected: list[str]) -> None:
    """Ranges keep their zeros, lists and several bracket groups expand in order."""
    assert list(hosts(nodelist)) == expected


@pytest.mark.parametrize("bad", ["node[1-2", "node1-2]", "n[[1]]", "n[a-b]", "n[3-1]", "a,,b"])
def test_malformed_node_lists_are_refused(bad: str) -> None:
    """An unbalanced bracket, a range that is not one, an empty name: ValueError."""
    with pytest.raises(ValueError, match="node list"):
        list(hosts(bad))


@pytest.mark.parametrize(
    ("spec", "expected"),
    [("4", [4]), ("2(x3),1", [2, 2, 2, 1]), ("1,3(x2)", [1, 3, 3])],
)
def test_tasks_per_node_expand(spec: str, expected: list[int]) -> None:
    """Slurm's compressed counts, one entry per node."""
    assert tasks_per_node(spec) == expected


@pytest.mark.parametrize("bad", ["", "2(3)", "x", "2(x)"])
def test_malformed_tasks_per_node_are_refused(bad: str) -> None:
    """Anything but N or N(xM), comma-separated: ValueError saying the form."""
    with pytest.raises(ValueError, match=r"2\(x3\),1"):
        tasks_per_node(bad)


def test_a_task_of_an_srun_step_gets_torchrun_s_variables() -> None:
    """Rank, world, local rank and world from srun; the step's first node; the job's port."""
    assert srun_env(TASK) == {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "gpu07",
        "MASTER_PORT": str(15000 + (4242 * 16 + 3) % 17000),
    }


def test_uneven_nodes_the_step_s_nodes_and_what_the_user_set() -> None:
    """An uneven layout is read at this node's place; the step's node list beats the job's
    (a step may run on some of its nodes); MASTER_ADDR/PORT and reserved ports are kept."""
    env = TASK | {"SLURM_STEP_TASKS_PER_NODE": "3,1", "SLURM_PROCID": "3", "SLURM_LOCALID": "0",
                  "SLURM_JOB_NODELIST": "cpu[1-9]", "SLURM_STEP_NODELIST": "cpu[4,6]"}  # fmt: skip
    got = srun_env(env)
    assert got is not None
    assert (got["LOCAL_WORLD_SIZE"], got["MASTER_ADDR"]) == ("1", "cpu4")
    assert srun_env(env | {"SLURM_STEP_RESV_PORTS": "12001-12004"})["MASTER_PORT"] == "12001"  # type: ignore[index]
    mine = srun_env(env | {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29511"})
    assert mine is not None and (mine["MASTER_ADDR"], mine["MASTER_PORT"]) == ("10.0.0.1", "29511")
    del env["SLURM_STEP_TASKS_PER_NODE"], env["SLURM_STEP_NODELIST"]
    only_job = srun_env(env | {"SLURM_TASKS_PER_NODE": "2(x2)"})
    assert only_job is not None and only_job["LOCAL_WORLD_SIZE"] == "2"
    assert only_job["MASTER_ADDR"] == "cpu1"


def test_the_steps_of_one_job_get_different_ports() -> None:
    """Two steps of one job running at once on one first node must not share a port."""
    ports = {srun_env(TASK | {"SLURM_STEP_ID": str(s)})["MASTER_PORT"] for s in range(16)}  # type: ignore[index]
    assert len(ports) == 16 and all(15000 <= int(p) < 32000 for p in ports)


@pytest.mark.parametrize(
    ("what", "env"),
    [
        ("a salloc shell: SLURM_NTASKS=4, no task of a step",
         {k: v for k, v in TASK.items() if k not in ("SLURM_PROCID", "SLURM_STEP_ID")}),
        ("the batch script (step 0xfffffffb, printed unsigned)",
         TASK | {"SLURM_STEP_ID": "4294967291", "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}),
        ("the batch script (printed signed)", TASK | {"SLURM_STEP_ID": "-5", "SLURM_PROCID": "0"}),
        ("salloc's interactive step", TASK | {"SLURM_STEP_ID": "4294967290"}),
        ("the extern step", TASK | {"SLURM_STEP_ID": "4294967292"}),
        ("a one-task step (srun --pty bash)",
         TASK | {"SLURM_STEP_NUM_TASKS": "1", "SLURM_NTASKS": "1", "SLURM_PROCID": "0"}),
        ("a batch script without step variables", {"SLURM_JOB_ID": "1", "SLURM_NTASKS": "8",
                                                   "SLURM_PROCID": "0"}),
    ],
)  # fmt: skip
def test_processes_that_are_not_tasks_of_a_step_run_alone(what: str, env: dict[str, str]) -> None:
    """Slurm's variables outside an srun step of several tasks say nothing about this process."""
    assert srun_env(env) is None, what


def test_step_task_rule() -> None:
    """A task: SLURM_PROCID and a normal SLURM_STEP_ID (or the old SLURM_STEPID)."""
    assert is_step_task({"SLURM_PROCID": "0", "SLURM_STEPID": "0"})
    assert not is_step_task({"SLURM_STEP_ID": "0"})
    with pytest.raises(RuntimeError, match="not a step number"):
        is_step_task({"SLURM_PROCID": "0", "SLURM_STEP_ID": "batch"})


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"SLURM_STEP_NUM_TASKS": None, "SLURM_NTASKS": None}, "SLURM_NTASKS (the step's number"),
        ({"SLURM_PROCID": "4"}, "SLURM_PROCID=4 is not below SLURM_STEP_NUM_TASKS=4"),
        ({"SLURM_LOCALID": None}, "SLURM_LOCALID (this task's rank on its node) is missing"),
        ({"SLURM_LOCALID": "2"}, "SLURM_LOCALID=2 is not below the 2 tasks of this node"),
        ({"SLURM_STEP_TASKS_PER_NODE": "3,1", "SLURM_NODEID": None}, "SLURM_NODEID"),
        ({"SLURM_STEP_TASKS_PER_NODE": "3,1", "SLURM_NODEID": "5"}, "lists 2 nodes"),
        ({"SLURM_STEP_TASKS_PER_NODE": "two"}, "SLURM_STEP_TASKS_PER_NODE: 'two' is not"),
        ({"SLURM_STEP_NODELIST": "gpu[07-08"}, "set MASTER_ADDR"),
        ({"SLURM_STEP_NODELIST": None, "SLURM_JOB_NODELIST": None}, "set MASTER_ADDR"),
        ({"SLURM_JOB_ID": None}, "set MASTER_PORT"),
    ],
)  # fmt: skip
def test_half_set_or_inconsistent_srun_variables_are_refused(
    change: dict[str, str | None], says: str
) -> None:
    """A task of a step whose variables are missing or disagree: RuntimeError saying which."""
    env = {**TASK, **{k: v for k, v in change.items() if v is not None}}
    for k in [k for k, v in change.items() if v is None]:
        env.pop(k, None)
    with pytest.raises(RuntimeError) as info:
        srun_env(env)
    assert says in str(info.value), str(info.value)


def test_setup_in_a_salloc_shell_or_batch_script_runs_single_process(
    clean_env: pytest.MonkeyPatch,
) -> None:
    """SLURM_NTASKS=4 in an allocation's shell, python run without srun: no group to wait for."""
    for k, v in TASK.items():
        if k not in ("SLURM_PROCID", "SLURM_STEP_ID"):
            clean_env.setenv(k, v)
    with distributed.setup() as info:
        assert (info.rank, info.world_size, info.local_rank) == (0, 1, 0)
        assert not dist.is_initialized()
    clean_env.setenv("SLURM_PROCID", "0")
    clean_env.setenv("SLURM_STEP_ID", "4294967291")  # the batch script itself
    with distributed.setup() as info:
        assert info.world_size == 1 and not dist.is_initialized()
    assert not any(k in os.environ for k in TORCHRUN_VARS)


def test_torchrun_s_variables_win_over_srun_s(clean_env: pytest.MonkeyPatch) -> None:
    """`srun torchrun ...`: a worker has both; torchrun's say where it is (here: half-set)."""
    for k, v in TASK.items():
        clean_env.setenv(k, v)
    clean_env.setenv("RANK", "0")
    with pytest.raises(RuntimeError, match="the launcher environment is half-set"):
        distributed.setup()


def test_a_refused_or_failed_join_changes_nothing(clean_env: pytest.MonkeyPatch) -> None:
    """Bad srun variables are refused before any state changes; a join that fails puts the
    exported variables back (the environment is as before the call)."""
    for k, v in (TASK | {"SLURM_LOCALID": "7"}).items():
        clean_env.setenv(k, v)
    before = dict(os.environ)
    with pytest.raises(RuntimeError, match="SLURM_LOCALID=7"):
        distributed.setup()
    assert dict(os.environ) == before and not dist.is_initialized()
    clean_env.setenv("SLURM_LOCALID", "1")
    clean_env.setenv("MASTER_ADDR", "gpu07")  # one the user set stays as it was

    def refuse(**kwargs: object) -> None:
        assert os.environ["RANK"] == "3" and os.environ["LOCAL_WORLD_SIZE"] == "2"
        raise ConnectionError("no route to gpu07")

    clean_env.setattr(dist, "init_process_group", refuse)
    before = dict(os.environ)
    with pytest.raises(ConnectionError):
        distributed.setup()
    assert dict(os.environ) == before and not dist.is_initialized()


# -- the recipe of docs/clusters.md, under a fake srun and scontrol ----------------------------

FAKE_SRUN = '''#!{python}
"""Slurm's srun on one node, simulated: SLURM_NTASKS tasks of step 0 with srun's variables,
the signals srun forwards forwarded, the highest status returned (128 + n for a signal)."""
import os, signal, subprocess, sys
args = sys.argv[1:]
while args and args[0].startswith("-"):
    args.pop(0)
n = int(os.environ["SLURM_NTASKS"])
procs = []
def forward(sig, frame):
    for p in procs:
        if p.poll() is None:
            p.send_signal(sig)
for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2):
    signal.signal(sig, forward)
for i in range(n):
    env = dict(os.environ, SLURM_STEP_ID="0", SLURM_PROCID=str(i), SLURM_LOCALID=str(i),
               SLURM_NODEID="0", SLURM_NTASKS=str(n), SLURM_STEP_NUM_TASKS=str(n),
               SLURM_STEP_TASKS_PER_NODE=str(n),
               SLURM_STEP_NODELIST=os.environ["SLURM_JOB_NODELIST"])
    procs.append(subprocess.Popen(args, env=env))
codes = [p.wait() for p in procs]
sys.exit(max(128 - c if c < 0 else c for c in codes))
'''
FAKE_SCONTROL = '#!/bin/bash\necho "$*" >> "$FAKE_SLURM_LOG"\n'


def fake_slurm(where: Path, job_id: int, tasks: int = 2) -> dict[str, str]:
    """A bin folder holding srun and scontrol first on PATH; a batch script's environment
    (the batch step: SLURM_PROCID=0 of step 0xfffffffb, which is no task of a step)."""
    import stat
    import sys

    from helpers import launch_env

    bin_dir = where / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN.format(python=sys.executable)),
                       ("scontrol", FAKE_SCONTROL)):  # fmt: skip
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(stat.S_IRWXU)
    env = {k: v for k, v in launch_env().items() if not k.startswith("SLURM_")}
    env.pop("LOCAL_WORLD_SIZE", None)
    return env | {
        "PATH": f"{bin_dir}:{Path(sys.executable).parent}:{env['PATH']}",
        "SLURM_JOB_ID": str(job_id),
        "SLURM_JOB_NAME": "train",
        "SLURM_NTASKS": str(tasks),
        "SLURM_JOB_NODELIST": "localhost",
        "SLURM_PROCID": "0",
        "SLURM_STEP_ID": "4294967291",
        "SLURM_GPUS_ON_NODE": str(tasks),
        "FAKE_SLURM_LOG": str(where / "scontrol.log"),
    }


def free_job_id() -> int:
    """A job id whose derived port (step 0) is free here now."""
    import random
    import socket

    while True:
        job = random.randrange(10_000, 10_000_000)
        with socket.socket() as s:
            try:
                s.bind(("", 15000 + (job * 16) % 17000))
            except OSError:
                continue
        return job


def run_batch(script: Path, env: dict[str, str], signal_after: Path | None = None,
              sig: int = 0) -> tuple[int, str]:  # fmt: skip
    """``bash script`` as sbatch would run it; with ``signal_after`` (a checkpoint directory),
    ``sig`` is sent to the script once a first checkpoint is written there."""
    import subprocess
    import threading
    import time

    proc = subprocess.Popen(
        ["bash", script.name], cwd=script.parent, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout or []), daemon=True)
    reader.start()
    if signal_after is not None:
        deadline = time.monotonic() + 120
        while not list(signal_after.glob("ckpt-*.pt")):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)
            time.sleep(0.01)
        proc.send_signal(sig)
    status = proc.wait(timeout=300)
    reader.join(timeout=10)
    return status, "".join(lines)


def newest_weights(directory: Path) -> dict[str, torch.Tensor]:
    """The model's weights in the newest checkpoint of ``directory``."""
    newest = sorted(directory.glob("ckpt-*.pt"))[-1]
    state = torch.load(newest, weights_only=False)
    return {k: v for k, v in state["model"].items()}


@deep
def test_the_slurm_recipe_stops_saves_exits_75_requeues_and_resumes_exactly(
    tmp_path: Path,
) -> None:
    """docs/clusters.md "Slurm without torchrun": sbatch's script under a fake srun (2 tasks):
    USR1 to the script, forwarded to both tasks, stops them at one update with a checkpoint;
    srun's status and the script's is 75, the job is requeued; the requeued run resumes and
    ends at the uninterrupted run's weights, bit for bit."""
    import re
    import signal

    from clusters_recipes import recipe

    r = recipe("Slurm without torchrun")
    r.write(tmp_path)
    (tmp_path / "train.sbatch").write_text(r.commands[0])
    env = fake_slurm(tmp_path, free_job_id())
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    status, out = run_batch(tmp_path / "train.sbatch", env | {"CKPT_DIR": str(whole)})
    assert status == 0 and "stopped at update 600: max_updates" in out, out
    assert not (tmp_path / "scontrol.log").exists()
    status, out = run_batch(tmp_path / "train.sbatch", env | {"CKPT_DIR": str(parts)},
                            signal_after=parts, sig=signal.SIGUSR1)  # fmt: skip
    assert status == 75 and "srun exited 75" in out, out
    stopped = re.findall(r"stopped at update (\d+): SIGUSR1", out)
    assert len(stopped) == 1 and 50 <= int(stopped[0]) < 600, out
    assert sorted(parts.glob("ckpt-*.pt"))[-1].name == f"ckpt-{int(stopped[0]):010d}.pt"
    assert (tmp_path / "scontrol.log").read_text() == f"requeue {env['SLURM_JOB_ID']}\n"
    status, out = run_batch(tmp_path / "train.sbatch", env | {"CKPT_DIR": str(parts)})
    assert status == 0 and "stopped at update 600: max_updates" in out, out
    a, b = newest_weights(whole), newest_weights(parts)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@deep
def test_the_torchrun_recipe_signals_the_workers_torchrun_exits_0_and_requeues(
    tmp_path: Path,
) -> None:
    """docs/clusters.md "Signals, exit statuses and requeue": USR1 to the batch script, which
    sends it to torchrun's workers only: both ranks stop at one update and save there,
    torchrun exits 0 (not 1), the script requeues the job."""
    import re
    import signal

    from clusters_recipes import recipe

    r = recipe("Signals, exit statuses and requeue")
    r.write(tmp_path)
    (tmp_path / "train.sbatch").write_text(r.commands[0])
    env = fake_slurm(tmp_path, free_job_id())
    ckpts = tmp_path / "ckpts"
    status, out = run_batch(tmp_path / "train.sbatch", env | {"CKPT_DIR": str(ckpts)},
                            signal_after=ckpts, sig=signal.SIGUSR1)  # fmt: skip
    assert status == 0 and "torchrun exited 0" in out, out
    stops = dict(re.findall(r"rank (\d) stopped at update (\d+): SIGUSR1", out))
    assert stops.keys() == {"0", "1"} and stops["0"] == stops["1"], out
    assert 50 <= int(stops["0"]) < 600
    assert sorted(ckpts.glob("ckpt-*.pt"))[-1].name == f"ckpt-{int(stops['0']):010d}.pt"
    assert (tmp_path / "scontrol.log").read_text() == f"requeue {env['SLURM_JOB_ID']}\n"
