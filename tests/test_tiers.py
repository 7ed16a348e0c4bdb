"""The two tiers: CI deselects exactly the tests marked deep; LOOPKIT_DEEP=1 runs them all."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from helpers import ROOT

# A file marked deep as a whole, one with a deep test beside CI ones, and one with none.
FILES = ["tests/test_job_rejoin.py", "tests/step/test_misuse.py", "tests/step/test_zero_cost.py"]


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
    every other test is collected; with LOOPKIT_DEEP=1 all of them are."""
    ci, deselected = _collected(False)
    everything, none = _collected(True)
    deep, _ = _collected(True, "-m", "deep")
    assert none == 0 and deep and ci
    assert ci == everything - deep and deselected == len(deep)
    assert any(i.startswith("tests/test_job_rejoin.py") for i in deep)  # the file's pytestmark
    assert any(i.startswith("tests/step/test_misuse.py") for i in deep)  # one decorated test
    assert any(i.startswith("tests/step/test_misuse.py") for i in ci & everything)
    assert not any(i.startswith("tests/test_job_rejoin.py") for i in ci)
    assert all(i in ci for i in everything if i.startswith("tests/step/test_zero_cost.py"))
