"""The examples train for real: the loss falls in every precision."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("precision", ["bf16", "fp16", "fp32"])
def test_quickstart_loss_goes_down(precision: str) -> None:
    """examples/quickstart.py ends with a clearly lower loss than it started with."""
    proc = subprocess.run(
        [sys.executable, "examples/quickstart.py", "--precision", precision, "--steps", "200"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    m = re.search(r"loss went from ([\d.]+) to ([\d.]+)", proc.stdout)
    assert m, proc.stdout
    first, last = float(m.group(1)), float(m.group(2))
    assert last < 0.85 * first, proc.stdout
