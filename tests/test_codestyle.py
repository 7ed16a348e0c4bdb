"""The code base is ruff clean and mypy --strict clean, checked with the tests."""

from __future__ import annotations

import subprocess
import sys

from helpers import ROOT


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=600
    )


def test_ruff_clean() -> None:
    """ruff finds nothing in the package, the tests or the examples."""
    dirs = [d for d in ("loopkit", "tests", "examples", "benchmarks") if (ROOT / d).is_dir()]
    proc = _run("ruff", "check", *dirs)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_mypy_strict_clean() -> None:
    """The package type-checks under mypy --strict."""
    proc = _run("mypy", "--strict", "loopkit")
    assert proc.returncode == 0, proc.stdout + proc.stderr
