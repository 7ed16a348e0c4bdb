"""The invariant harness: each feature's promise checked against an independent reference.

Hypothesis draws the combinations of features (accumulation, weights, precisions, groups,
DDP comm hooks, resumes, loaders, caches...); each test states one invariant in its
docstring. The 2-rank invariants run in one ``torchrun`` launch for the whole session
(``dist_invariants_worker.py``), whose two ranks draw the same examples themselves; they are
deep tests (``LOOPKIT_DEEP=1``: tests/conftest.py), CI's processes run the top-level launch.

The budget switch (read once, in ``inv_budget.py``):

- ``python -m pytest tests/invariants`` (CI): a few derandomized examples per invariant,
  the same on every run.
- ``LOOPKIT_DEEP=1 python -m pytest tests/invariants``: ten times the examples, random
  ones (``LOOPKIT_DEEP=<n>``: n times); a failure prints ``LOOPKIT_SEED=<seed>``, which
  replays the same examples when set.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import ROOT, launch_env
from inv_budget import DEEP, DEEP_FACTOR, SEED
from inv_dist import DistResults

HERE = Path(__file__).resolve().parent
WORKER = HERE / "dist_invariants_worker.py"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "dist_group(name): the test reads group `name` of the 2-rank worker's results"
    )


@pytest.fixture(scope="session")
def dist_results(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> DistResults:
    """One torchrun launch (2 gloo ranks) running every group the collected tests read."""
    groups = sorted(
        {m.args[0] for item in request.session.items for m in item.iter_markers("dist_group")}
    )
    out = tmp_path_factory.mktemp("invariants")
    env = launch_env()
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT / "tests"), str(HERE), *filter(None, [env.get("PYTHONPATH")])]
    )
    env["LOOPKIT_SEED"] = str(SEED)  # both ranks draw the same deep examples
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    timeout = 420 * (DEEP_FACTOR if DEEP else 1)
    try:
        proc = subprocess.run(
            [*cmd, str(WORKER), str(out), *groups],
            cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env,
        )  # fmt: skip
        output = f"exit status {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    except subprocess.TimeoutExpired as err:
        output = f"timed out after {timeout} s: {str(err.stdout)[-3000:]} {str(err.stderr)[-3000:]}"
    found: dict[str, list[dict[str, Any]]] = {}
    for path in sorted(out.glob("*.rank*.pt")):
        name, _ = path.name.split(".rank")
        found.setdefault(name, []).append(torch.load(path, weights_only=False))
    return DistResults(found, output)
