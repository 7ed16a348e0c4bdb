"""Shared fixtures: deterministic, single-threaded torch so results compare bit for bit."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from loopkit import distributed

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def dist_out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the 4-rank and the 2-rank workers write (the 4-rank's under ``four/``)."""
    return tmp_path_factory.mktemp("dist")


@pytest.fixture(scope="session")
def dist4_results(dist_out: Path) -> dict[str, Any]:
    """Every scenario of dist4_worker.py (HSDP on a 2x2 mesh), run once by four processes.

    Before it: a 1-process run stopped after a save, whose checkpoints the 4-rank and the
    2-rank workers resume (on another number of processes)."""
    import elastic
    from helpers import launch_scenarios

    elastic.run(dist_out / "one" / "cut", stop=5)
    (dist_out / "four").mkdir()
    return launch_scenarios("tests/dist4_worker.py", dist_out / "four", world=4)


@pytest.fixture(scope="session")
def dist_results(dist_out: Path, dist4_results: dict[str, Any]) -> dict[str, Any]:
    """Every scenario of dist_worker.py, run once by two processes, for every test file.

    Before it: the 4-rank worker, and its 1-process run stopped after a save, whose
    checkpoints the 2-rank worker resumes too (on another number of processes).
    """
    from helpers import launch_scenarios

    return launch_scenarios("tests/dist_worker.py", dist_out)


@pytest.fixture
def process_group(tmp_path: Path) -> Iterator[None]:
    """A one-process gloo group: DDP still runs its all-reduce machinery, so it can be counted.

    The test's DDP models are freed while the group lives, and the group is torn down by
    loopkit.distributed.teardown, which lets gloo's workers drop their finished work (a
    comm hook's Python callback) first: destroying a group whose last reference a DDP
    reducer holds, or while its workers still free Python objects, deadlocks in torch.
    """
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        yield
    finally:
        gc.collect()
        distributed.teardown()
