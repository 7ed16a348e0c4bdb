"""The recipe of docs/clusters.md for an unattended requeue: a second run of its command
while a frozen one owns the directory is refused naming it; once that one is killed the
command takes over and ends bit-identical to an uninterrupted run; a damaged newest
checkpoint is skipped for the one before, loudly, and the run ends bit-identical again."""

from __future__ import annotations

import multiprocessing
import os
import runpy
import shlex
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from clusters_recipes import recipe
from helpers import deep, launch_env

import loopkit

pytestmark = deep  # LOOPKIT_DEEP=1 runs this file (tests/helpers.py: deep)


def _command(commands: list[str], first: str) -> list[str]:
    """The recipe's launch line that starts with ``first``, as words."""
    (line,) = [ln for c in commands for ln in c.splitlines() if ln.startswith(first)]
    return shlex.split(line)


def _run_here(script: Path, directory: Path) -> None:
    """The recipe's loop in this process, as ``python script directory`` would run it."""
    argv = sys.argv
    sys.argv = [str(script), str(directory)]
    try:
        runpy.run_path(str(script), run_name="__main__")
    finally:
        sys.argv = argv


def _frozen(script: str, directory: str) -> None:
    """Another job: the recipe, stopped for good (SIGSTOP) right after its first save."""
    real = loopkit.Checkpointer.maybe_save

    def then_freeze(self: loopkit.Checkpointer, every: int) -> Any:
        path = real(self, every)
        if path is not None:
            os.kill(os.getpid(), signal.SIGSTOP)
        return path

    loopkit.Checkpointer.maybe_save = then_freeze  # type: ignore[method-assign]
    try:
        _run_here(Path(script), Path(directory))
    finally:
        os._exit(0)


def _weights(directory: Path) -> dict[str, torch.Tensor]:
    return loopkit.export_weights(sorted(directory.glob("ckpt-*"))[-1])


def test_the_requeue_recipe(tmp_path: Path) -> None:
    """Run the recipe's one-process command for the reference, then: a frozen run owns the
    directory, the command is refused naming its pid; killed, the command takes over and
    ends bit-identical; its newest checkpoint cut in half, the command resumes update 35,
    warns naming update 40, and ends bit-identical."""
    found = recipe("Unattended requeue: who owns a checkpoint directory, a damaged newest checkpoint")  # noqa: E501  # fmt: skip
    found.write(tmp_path)
    script = tmp_path / "requeue_safe.py"
    words = _command(found.commands, "python requeue_safe.py")
    assert words[2] == "runs/requeue-safe"
    assert _command(found.commands, "torchrun")[-2:] == ["requeue_safe.py", "runs/requeue-safe"]
    proc = subprocess.run([sys.executable, *words[1:]], cwd=tmp_path, env=launch_env(),
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    reference = _weights(tmp_path / "runs" / "requeue-safe")
    job = tmp_path / "job"
    frozen = multiprocessing.get_context("fork").Process(target=_frozen,
                                                         args=(str(script), str(job)))  # fmt: skip
    frozen.start()
    try:
        assert frozen.pid is not None
        _, status = os.waitpid(frozen.pid, os.WUNTRACED)  # it stops after its first save
        assert os.WIFSTOPPED(status)
        with pytest.raises(loopkit.CheckpointError) as info:
            _run_here(script, job)
        assert f"pid {frozen.pid}," in str(info.value) and "alive" in str(info.value)
        assert [p.name for p in job.glob("ckpt-*")] == ["ckpt-0000000005.pt"]
    finally:
        frozen.kill()
        frozen.join(30)
    _run_here(script, job)  # takes the killed job's directory over, resumes update 5
    names = [p.name for p in job.glob("ckpt-*")]
    assert "ckpt-0000000040.pt" in names and list(job.glob(".loopkit-owner-*")) == []
    assert all(torch.equal(reference[k], v) for k, v in _weights(job).items())
    newest = job / "ckpt-0000000040.pt"
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])
    with pytest.warns(loopkit.ResumeWarning) as warned:
        _run_here(script, job)
    said = [str(w.message) for w in warned if "skip_damaged" in str(w.message)]
    assert len(said) == 1 and "ckpt-0000000035.pt, and repeats" in said[0]
    assert f"skipped {newest} (" in said[0]
    assert all(torch.equal(reference[k], v) for k, v in _weights(job).items())
