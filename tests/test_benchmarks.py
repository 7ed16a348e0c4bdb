"""The benchmark scripts run from a clean install and report exact (not timed) quantities."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_checkpointing_benchmark_quick() -> None:
    """--quick --json runs and its exact columns order the settings as they must."""
    proc = subprocess.run(
        [sys.executable, "benchmarks/checkpointing.py", "--quick", "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    rows = {r["setting"]: r for r in json.loads(proc.stdout)}
    assert set(rows) == {"none", "full", "every=2", "save_matmuls"}
    assert rows["full"]["saved_ratio"] < rows["every=2"]["saved_ratio"] < 1
    assert rows["full"]["saved_ratio"] < rows["save_matmuls"]["saved_ratio"] < 1
    assert rows["full"]["peak_ratio"] < 1
    assert 1 < rows["full"]["flops_ratio"] <= 1.5
    assert rows["save_matmuls"]["flops_ratio"] < rows["full"]["flops_ratio"]
