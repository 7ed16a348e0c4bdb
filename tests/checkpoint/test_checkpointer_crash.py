"""Resume after SIGKILL: kills, each resumed, end at the uninterrupted run's weights.

examples/train_resumable.py is killed at random moments (after a save, so mid-window or at
a boundary) and, every third kill, in the middle of writing a checkpoint (deep tests: 10
kills of each run, under torchrun and FSDP2 too, with LOOPKIT_DEEP=1); each time it is
started again and resumes. The final weights are compared bit for bit with an
uninterrupted run. With --augment the data set draws from python's, numpy's and torch's
RNGs in __getitem__ and the loss is weighted by a random number of valid tokens; the
restarts then alternate the number of loader workers.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers import DEEP, ROOT, deep, kill_tree, launch_env

import loopkit

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
# A save every 2 updates: enough saves to kill 10 times after one; the payload makes saves
# slow enough (tens of ms with fsync) to be caught in the middle.
EXAMPLE = ["examples/train_resumable.py", "--save-every", "2", "--payload-mb", "16"]
# 96 updates: each kill lets a run train on for up to 0.15 s after a save, ~7 updates on a
# fast machine, so 10 kills must not reach the end (at 48 updates one CI run did: 46 at kill 9).
EPOCHS = ["--epochs", "12"]


def _names(directory: Path) -> set[str]:
    """Finished checkpoints: files, or a sharded model's directories."""
    return {p.name for p in directory.glob("ckpt-*")}


def _all_checkpoints_readable(directory: Path) -> None:
    for path in sorted(directory.glob("ckpt-*")):
        loopkit.load_checkpoint(path)  # raises if any finished checkpoint is unreadable
        if path.is_dir():  # every rank's shards and DCP's metadata are there
            assert {".metadata", "__0_0.distcp", "__1_0.distcp"} <= {p.name for p in path.iterdir()}


def _start(cmd: list[str]) -> tuple[subprocess.Popen[str], list[str], threading.Thread]:
    """Start a run; its stdout lines are collected by a thread as they come."""
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=launch_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    lines: list[str] = []

    def read() -> None:
        assert proc.stdout is not None
        lines.extend(iter(proc.stdout.readline, ""))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    return proc, lines, reader


def _run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, cwd=ROOT, env=launch_env(), capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]


# Every test here is deep (LOOPKIT_DEEP=1): 10 kills; 3 when one is run without it.
KILLS = 10 if DEEP else 3


def _kill_ten_times(
    tmp_path: Path, command: Callable[[int], list[str]], seed: str, kills: int = KILLS
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The uninterrupted run's weights, and those of a run killed ``kills`` times and resumed."""
    ref = tmp_path / "ref.pt"
    _run([*command(-1), "--dir", str(tmp_path / "ref_run"), "--out", str(ref)])
    run_dir = tmp_path / "run"
    rng = random.Random(seed)
    mid_save, resumed = 0, 0
    for kill in range(kills):
        known = _names(run_dir)
        # A killed save leaves its temporary until the next run cleans it up: only a new
        # one is this run's save in progress.
        stale = set(run_dir.glob(".ckpt-*.tmp-*"))

        def saving(stale: set[Path] = stale) -> bool:
            return bool(set(run_dir.glob(".ckpt-*.tmp-*")) - stale)

        proc, lines, reader = _start([*command(kill), "--dir", str(run_dir)])
        during_save = kill % 3 == 1  # kills 1, 4, 7: while a save is being written
        # The others: a random moment after the run has made its first save.
        extra = rng.uniform(0.0, 0.15)
        deadline = time.monotonic() + 180
        saved_at = None
        while time.monotonic() < deadline and proc.poll() is None:
            if during_save and saving():
                break
            if not during_save and saved_at is None and _names(run_dir) - known:
                saved_at = time.monotonic()
            if saved_at is not None and time.monotonic() > saved_at + extra:
                break
            time.sleep(0.001)
        if proc.poll() is not None:
            pytest.fail(f"the run finished after only {kill} kills: make it longer")
        kill_tree(proc.pid)
        proc.wait(timeout=60)
        reader.join(timeout=60)  # what the run printed before it died
        mid_save += during_save and saving()
        resumed += any("resumed from" in x for x in lines)
        _all_checkpoints_readable(run_dir)  # never a corrupt checkpoint on disk
    final = tmp_path / "final.pt"
    _run([*command(kills), "--dir", str(run_dir), "--out", str(final)])
    assert mid_save == len(range(1, kills, 3)), "a kill meant for the middle of a save missed it"
    assert resumed == kills - 1  # every run after the first continued from a checkpoint
    assert not list(run_dir.glob(".ckpt-*.tmp*"))  # leftovers of the killed saves are gone
    assert len(list(run_dir.glob("ckpt-*"))) == 2  # keep=2
    return torch.load(ref, weights_only=True), torch.load(final, weights_only=True)


def _async_every_other(cmd: list[str], alternate: bool) -> Callable[[int], list[str]]:
    """The command of each start: with ``alternate``, odd restarts save in the background
    (the uninterrupted reference saves synchronously)."""
    return lambda kill: [*cmd, "--async-save"] if alternate and kill % 2 else cmd


def _bit_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@deep
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_sigkill_at_ten_points_then_resume_is_bit_identical(precision: str, tmp_path: Path) -> None:
    """Killed 10 times (every third mid-save) and resumed each time: the uninterrupted
    weights.

    bf16 runs with an EMA of the weights (validated through swapped()): the average too;
    every other restart of it saves in the background (--async-save), so kills land in the
    middle of background writes too."""
    ema = ["--ema", "0.99"] if precision == "bf16" else []
    cmd = [sys.executable, *EXAMPLE, *EPOCHS, "--precision", precision, *ema]
    ref, final = _kill_ten_times(tmp_path, _async_every_other(cmd, precision == "bf16"),
                                 f"kills-{precision}")  # fmt: skip
    assert _bit_equal(ref, final)
    assert any(k.startswith("ema.") for k in final) == bool(ema)


@deep
@pytest.mark.filterwarnings("ignore:fp16 autocast on a CPU")
def test_random_augmentation_resumes_bit_identically_whatever_the_workers(tmp_path: Path) -> None:
    """fp16, weight= valid tokens, checkpointed dropout blocks, a data set that draws from
    random, numpy and torch; each restart switches between 0 and 2 loader workers."""
    cmd = [sys.executable, *EXAMPLE, *EPOCHS, "--precision", "fp16", "--augment",
           "--checkpointed"]  # fmt: skip

    def command(kill: int) -> list[str]:
        # The uninterrupted run uses 2 workers; the killed one starts with 0 and alternates.
        return [*cmd, "--workers", "2" if kill == -1 or kill % 2 else "0"]

    ref, final = _kill_ten_times(tmp_path, command, "kills-augment")
    assert _bit_equal(ref, final)


@deep
def test_random_augmentation_under_torchrun_resumes_bit_identically(tmp_path: Path) -> None:
    """Two ranks (DistributedSampler shards), augmenting data, 1 worker each, an EMA under
    DDP: the same weights and average."""
    cmd = [*TORCHRUN, *EXAMPLE, *EPOCHS, "--precision", "bf16", "--augment",
           "--workers", "1", "--ema", "0.99"]  # fmt: skip
    ref, final = _kill_ten_times(tmp_path, lambda kill: cmd, "kills-torchrun")
    assert _bit_equal(ref, final)


@deep
def test_a_sharded_model_killed_with_its_whole_job_resumes_bit_identically(tmp_path: Path) -> None:
    """FSDP2 on two ranks, each writing its shards of model, optimizer and EMA: the whole
    process tree killed at random moments (every third mid-save), resumed each time, every
    other restart writing its shards in the background (DCP's async_save): the
    uninterrupted weights and average, gathered."""
    cmd = [*TORCHRUN, *EXAMPLE, *EPOCHS, "--fsdp", "--ema", "0.99"]
    ref, final = _kill_ten_times(tmp_path, _async_every_other(cmd, True), "kills-fsdp",
                                 kills=KILLS - 2)  # fmt: skip
    assert _bit_equal(ref, final)
    assert any(k.startswith("ema.") for k in final)


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (torchrun's: its workers)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry.name))
    return sorted(found)


@deep
def test_a_sharded_job_stopped_by_sigterm_saves_once_and_resumes_bit_identically(
    tmp_path: Path,
) -> None:
    """FSDP2 on two ranks saving in the background; SIGTERM to one worker after the first
    save: torchrun exits 0, both ranks stopped at the same update and wrote one checkpoint
    there (every rank's shards, complete before the job ended); run again, it ends with the
    uninterrupted (synchronously saving) run's weights and average, bit for bit."""
    cmd = [*TORCHRUN, *EXAMPLE, "--epochs", "2", "--fsdp", "--ema", "0.99", "--slow", "0.04"]
    ref = tmp_path / "ref.pt"
    _run([*cmd, "--dir", str(tmp_path / "ref_run"), "--out", str(ref)])
    cmd.append("--async-save")  # the stop's save completes before the process group goes
    run_dir = tmp_path / "run"
    proc, lines, reader = _start([*cmd, "--dir", str(run_dir)])
    deadline = time.monotonic() + 180
    while not _names(run_dir) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.005)
    assert proc.poll() is None, "the run ended before its first save: make it longer"
    time.sleep(0.3)  # a few updates on: the stop falls after the last periodic save
    first = _names(run_dir)
    workers = _children(proc.pid)
    assert len(workers) == 2, workers
    os.kill(workers[1], signal.SIGTERM)  # one worker, as a scheduler preempting one node
    assert proc.wait(timeout=120) == 0
    reader.join(timeout=60)
    stopped = [x for x in lines if "preempted at update" in x]
    assert len(stopped) == 1 and "by SIGTERM: saved" in stopped[0], lines
    update = int(stopped[0].split("preempted at update ")[1].split()[0])
    name = f"ckpt-{update:010d}"
    # The stop's save, unless a periodic save of that update came between.
    assert name in _names(run_dir) and _names(run_dir) - first <= {name}, (first, update)
    _all_checkpoints_readable(run_dir)
    final = tmp_path / "final.pt"
    _run([*cmd, "--dir", str(run_dir), "--out", str(final)])
    assert _bit_equal(torch.load(ref, weights_only=True), torch.load(final, weights_only=True))
