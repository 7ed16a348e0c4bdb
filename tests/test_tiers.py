"""The two tiers: CI deselects exactly the tests marked deep; LOOPKIT_DEEP=1 runs them all."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from helpers import ROOT

# A file marked deep as a whole, one with a deep test beside CI ones, one with none, and one
# whose 4-rank launch's readers are deep by the fixture they read (conftest.py).
FILES = ["tests/test_job_rejoin.py", "tests/step/test_misuse.py", "tests/step/test_zero_cost.py",
         "tests/checkpoint/test_sharded_resave.py"]  # fmt: skip


def _collect(deep: bool, *args: str) -> subprocess.Popen[str]:
    """A collection started (the two run at once: each is seconds of imports)."""
    env = {k: v for k, v in os.environ.items() if k != "LOOPKIT_DEEP"}
    if deep:
        env["LOOPKIT_DEEP"] = "1"
    return subprocess.Popen(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-n", "0", *args, *FILES],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip


def _collected(proc: subprocess.Popen[str]) -> tuple[set[str], int]:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-2000:] + err[-2000:]
    ids = {line for line in out.splitlines() if "::" in line}
    found = re.search(r"(\d+) deselected", out)
    return ids, int(found.group(1)) if found else 0


def test_ci_deselects_the_deep_tests_and_only_them() -> None:
    """Without LOOPKIT_DEEP the deep tests are deselected (not skipped: no line each) and
    every other test is collected; with LOOPKIT_DEEP=1 all of them are (two collections:
    the deep ones run, and CI's; together they are the whole, by the deselected count)."""
    ci_run, deep_run = _collect(False), _collect(True, "-m", "deep")
    ci, deselected = _collected(ci_run)
    deep, not_deep = _collected(deep_run)
    assert deep and ci and not ci & deep
    # With LOOPKIT_DEEP=1 nothing is deselected but what -m deep leaves: exactly CI's tests.
    assert deselected == len(deep) and not_deep == len(ci)
    assert any(i.startswith("tests/test_job_rejoin.py") for i in deep)  # the file's pytestmark
    assert any(i.startswith("tests/step/test_misuse.py") for i in deep)  # one decorated test
    assert any(i.startswith("tests/step/test_misuse.py") for i in ci)
    assert not any(i.startswith("tests/test_job_rejoin.py") for i in ci)
    assert any(i.startswith("tests/step/test_zero_cost.py") for i in ci)
    assert not any(i.startswith("tests/step/test_zero_cost.py") for i in deep)
    hsdp = "tests/checkpoint/test_sharded_resave.py::test_an_hsdp_checkpoint_saved_again"
    assert any(i.startswith(hsdp) for i in deep) and not any(i.startswith(hsdp) for i in ci)
