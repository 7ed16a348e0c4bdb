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


def _collected(deep: bool, *args: str) -> tuple[set[str], int]:
    env = {k: v for k, v in os.environ.items() if k != "LOOPKIT_DEEP"}
    if deep:
        env["LOOPKIT_DEEP"] = "1"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-n", "0", *args, *FILES],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    ids = {line for line in proc.stdout.splitlines() if "::" in line}
    found = re.search(r"(\d+) deselected", proc.stdout)
    return ids, int(found.group(1)) if found else 0


def test_ci_deselects_the_deep_tests_and_only_them() -> None:
    """Without LOOPKIT_DEEP the deep tests are deselected (not skipped: no line each) and
    every other test is collected; with LOOPKIT_DEEP=1 all of them are (two collections:
    the deep ones run, and CI's; together they are the whole, by the deselected count)."""
    ci, deselected = _collected(False)
    deep, not_deep = _collected(True, "-m", "deep")
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
